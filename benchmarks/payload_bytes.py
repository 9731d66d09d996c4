"""Payload bytes per token: a rollout's payloads as stored, beside the floors other forms would reach.

The reference agent's rollouts (zero work at `--prompt-tokens` / `--gen-tokens` / `--turns`: ids of a
151,936-token vocabulary by rank-frequency, a float32 log probability a generated token, about 4
bytes of output text a token) are stored as the trainer stores them
(`benchmarks.token_path.stored_as_trainer`).  Every row is bytes per token (prompt and generated, of
every model call), over all the rollouts:

- `stored`: both payloads as the trainer stores them (what the soak reports as
  `payload_bytes_per_token`), then its two parts: the token records (their arrays and header) and
  the reply (the output text, held once).
- `arrays`: the token arrays alone, lossless as stored (u4 ids, f4 log probabilities), no header and
  no text: the floor of any lossless form that keeps the arrays as they are.
- `+ prompt once a group`: the first call's prompt ids counted once for a group of `--siblings`
  tries (each try's records hold the group's prompt today).
- `+ ids bit-packed`: every id at the vocabulary's width (18 bits) instead of 32.
- `+ 16-bit logprobs (lossy)`: log probabilities rounded to 16 bits.  A model server gives float32
  and the trainer checks them against its own: shown as what a figure below it would take.
- `stored, zlib 1` / `stored, lzma 1`: both payloads as stored, compressed by the standard library's
  codecs (zstd and lz4 are no dependencies of the project), with the CPU it cost a rollout.

    python -m benchmarks.payload_bytes                                  # 1,000 + 8,000 tokens
    python -m benchmarks.payload_bytes --prompt-tokens 32000 --gen-tokens 32000
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.rollout_sizes import add_size_options, positive
from benchmarks.token_path import agent_episodes, array_bytes, stored_as_trainer
from gym_agent.episode import ZERO_WORK_VOCAB

ROWS = (
    "stored",
    "  token records",
    "  reply",
    "arrays",
    "+ prompt once a group",
    "+ ids bit-packed",
    "+ 16-bit logprobs (lossy)",
    "stored, zlib 1",
    "stored, lzma 1",
)
CODECS: dict[str, Callable[[bytes], bytes]] = {
    "stored, zlib 1": lambda b: zlib.compress(b, 1),
    "stored, lzma 1": lambda b: lzma.compress(b, preset=1),
}


def run(
    *,
    rollouts: int = 8,
    prompt_tokens: int = 1000,
    gen_tokens: int = 8000,
    turns: tuple[int, int] = (1, 1),
    siblings: int = 8,
) -> dict[str, Any]:
    id_bits = math.ceil(math.log2(ZERO_WORK_VOCAB))
    sizes = dict.fromkeys(ROWS, 0.0)
    codec_cpu = dict.fromkeys(CODECS, 0.0)
    tokens = 0
    for reply, records in agent_episodes(rollouts, prompt_tokens, gen_tokens, turns):
        (records_bytes, _), (reply_bytes, _) = stored_as_trainer(reply, records)
        ids = sum(len(r.prompt_token_ids) + len(r.generation_token_ids) for r in records)
        logprobs = sum(len(r.generation_log_probs) for r in records)
        shared = len(records[0].prompt_token_ids) * (1 - 1 / siblings)  # the prompt's other copies
        arrays = array_bytes(records_bytes)
        tokens += ids
        sizes["stored"] += len(records_bytes) + len(reply_bytes)
        sizes["  token records"] += len(records_bytes)
        sizes["  reply"] += len(reply_bytes)
        sizes["arrays"] += arrays
        sizes["+ prompt once a group"] += arrays - 4 * shared
        sizes["+ ids bit-packed"] += (ids - shared) * id_bits / 8 + 4 * logprobs
        sizes["+ 16-bit logprobs (lossy)"] += (ids - shared) * id_bits / 8 + 2 * logprobs
        for name, codec in CODECS.items():
            started = time.thread_time()
            sizes[name] += len(codec(records_bytes)) + len(codec(reply_bytes))
            codec_cpu[name] += time.thread_time() - started
    return {
        "rollouts": rollouts,
        "siblings": siblings,
        "id_bits": id_bits,
        "tokens_per_rollout": round(tokens / rollouts, 1),
        "bytes_per_token": {name: round(size / tokens, 3) for name, size in sizes.items()},
        "codec_cpu_ms_per_rollout": {
            name: round(1000 * cpu / rollouts, 3) for name, cpu in codec_cpu.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rollouts", type=positive, default=8)
    parser.add_argument("--siblings", type=positive, default=8, help="Tries a group's prompt is shared by.")
    add_size_options(parser, prompt_tokens=1000, gen_tokens=8000, turns="1")
    parser.add_argument("--json", dest="as_json", default=None, help="Also write the result as JSON here.")
    args = parser.parse_args(argv)
    result = run(
        rollouts=args.rollouts,
        prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens,
        turns=args.turns,
        siblings=args.siblings,
    )
    print(
        f"{result['rollouts']} rollouts of {result['tokens_per_rollout']:,.0f} tokens, "
        f"groups of {result['siblings']}, ids of {result['id_bits']} bits"
    )
    stored = result["bytes_per_token"]["stored"]
    print(f"{'form':<28} {'B/token':>8} {'of stored':>10}")
    for name, per_token in result["bytes_per_token"].items():
        cpu = result["codec_cpu_ms_per_rollout"].get(name)
        extra = f"   {cpu:.2f} ms CPU a rollout" if cpu is not None else ""
        print(f"{name:<28} {per_token:>8.2f} {per_token / stored:>9.2f}x{extra}")
    if args.as_json:
        Path(args.as_json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
