"""Token data from the payload store into a NeMo RL row's tensors: GB/s on one core, side by side.

The token records are the reference agent's (zero work, at `--prompt-tokens` / `--gen-tokens` /
`--turns`), stored in a payload store (a local directory by default, or `--payloads URL`) as the
trainer stores them: the binary form beside the reply, the records' output items referring to the
reply's (form version 2), and the reply as its canonical JSON; and once in the JSON reference form.
Each path is timed over the same rollouts, read back from the store by claim (each read checked
against its digest):

- `row, JSON records`: the JSON reference form, parsed into `TokenEntry`s, then NeMo RL's message
  log built by the adapter's own `message_log` (which takes them to arrays through the binary form).
- `row, binary records`: the reply and the binary form read, the records' output items put back
  from the reply, the arrays decoded (views of the payload), then the same `message_log` over them:
  what `LedgerGym` does (one vectorised copy per tensor, no per-token Python object).
- `tensors, header re-checked`: the binary form decoded to views of the payload, each array a
  tensor over them (`torch.from_numpy`, no copy, no per-token Python object), its header re-encoded
  and compared on every read.
- `tensors, binary arrays`: the same without that re-check, as the trainer reads now: the payload
  was checked against its claim's digest, and the trainer checked it canonical before claiming it.
  The floor a row builder reading arrays reaches.

GB/s is the token data a path delivers (the arrays' bytes as stored: 4 per id, 4 per log
probability, the same numerator for every path) per second of its work, the store's read included:
per second of wall time, and per second of the thread's own CPU time (`cpu GB/s`: what one core
does, the figure a busy machine does not distort).  One thread (torch too).

    python -m benchmarks.token_path                                    # 32,000 + 32,000 tokens
    python -m benchmarks.token_path --prompt-tokens 1000 --gen-tokens 8000
    python -m benchmarks.token_path --payloads postgresql+psycopg://...  # PostgreSQL large values
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import torch

from benchmarks.rollout_sizes import add_size_options, positive
from gym_agent.episode import Environment
from gym_agent.faults import NO_FAULT
from payloads import PayloadClaim, PayloadPlane, PayloadStore, PayloadStoreError, open_payload_store
from payloads.replies import reply_to_store
from payloads.token_arrays import decode_arrays, decode_payload
from protocol.digests import canonical_bytes, sha256_digest
from protocol.token_codec import (
    ITEM_SIZE,
    TOKENS_JSON_MEDIA_TYPE,
    encode_entries,
    encode_json,
    read_layout,
    refer_to_reply,
    reply_output_of,
)
from protocol.wire import RunReply, RunRequest, TokenEntry
from trainer.ray_gym.results import ResultRules, message_log
from workers.policy import load_policy

PATHS = (
    "row, JSON records",
    "row, binary records",
    "tensors, header re-checked",
    "tensors, binary arrays",
)


def agent_episodes(
    n: int, prompt_tokens: int, gen_tokens: int, turns: tuple[int, int]
) -> list[tuple[RunReply, list[TokenEntry]]]:
    """`n` rollouts' replies and token records as the reference agent makes them in zero-work mode."""
    policy = load_policy("tiny")

    async def noop() -> None:
        return None

    async def play(env: Environment) -> list[tuple[RunReply, list[TokenEntry]]]:
        out = []
        for i in range(n):
            records: list[TokenEntry] = []
            request = RunRequest(rollout_id=f"b{i}_g0", attempt_index=0, sample_id=f"b{i}")
            reply = await env.play(request, fault=NO_FAULT, at_boundary=noop, record=records.append)
            out.append((reply, records))
        return out

    with ThreadPoolExecutor(max_workers=1) as executor:
        env = Environment(
            policy,
            executor,
            seed=0,
            turns=turns,
            zero_work=True,
            prompt_tokens=prompt_tokens,
            gen_tokens=gen_tokens,
        )
        return asyncio.run(play(env))


def stored_as_trainer(
    reply: RunReply, records: list[TokenEntry]
) -> tuple[tuple[bytes, str], tuple[bytes, str]]:
    """A rollout's two payloads as the trainer stores them (trainer.attempts), with their media types:
    the records beside the reply (their output items referring to the reply's), and the reply's
    canonical JSON (whole: the reference agent's carries no arrays)."""
    payload = reply.payload()
    tokens, media_type = refer_to_reply(encode_entries(records), reply_output_of(payload))
    return (tokens, media_type), reply_to_store(payload, canonical_bytes(payload), tokens, media_type)


def agent_records(
    n: int, prompt_tokens: int, gen_tokens: int, turns: tuple[int, int]
) -> list[list[TokenEntry]]:
    """`n` rollouts' token records as the reference agent captures them in zero-work mode."""
    return [records for _, records in agent_episodes(n, prompt_tokens, gen_tokens, turns)]


# What a path is given: the claims of one rollout's payloads (tokens, and the reply where it has one).
Claims = tuple[PayloadClaim, PayloadClaim | None]


def rows_from_json(plane: PayloadPlane, claims: Claims, rules: ResultRules) -> list[dict[str, Any]]:
    content = plane.get(claims[0])
    return message_log([TokenEntry.model_validate(r) for r in orjson.loads(content)], rules)


def rows_from_binary(plane: PayloadPlane, claims: Claims, rules: ResultRules) -> list[dict[str, Any]]:
    """What `LedgerGym` does: the reply and the records read by their claims (one store call), the
    records' output items put back from the reply, NeMo RL's message log over the arrays."""
    tokens, reply_claim = claims
    assert reply_claim is not None
    found = plane.get_many([tokens, reply_claim])
    reply = orjson.loads(found[reply_claim.digest])
    arrays = decode_payload(found[tokens.digest], tokens.media_type, check_canonical=False, reply=reply)
    return message_log(arrays, rules)


def tensors_from_arrays(
    plane: PayloadPlane, claims: Claims, rules: ResultRules, *, check_canonical: bool = False
) -> list[dict[str, Any]]:
    """Every record's three arrays as tensors over the payload's buffer (a bytearray: writable, so
    torch shares it instead of warning).  The payload was read by its claim and checked against the
    digest, so its header is not re-encoded (`check_canonical=False`, what the trainer does)."""
    arrays = decode_arrays(bytearray(plane.get(claims[0])), check_canonical=check_canonical)
    return [
        {
            "prompt": torch.from_numpy(arrays.prompt(r)),
            "token_ids": torch.from_numpy(arrays.generation(r)),
            "generation_logprobs": torch.from_numpy(arrays.logprobs(r)),
        }
        for r in range(len(arrays))
    ]


def tensors_header_rechecked(plane: PayloadPlane, claims: Claims, rules: ResultRules) -> list[dict[str, Any]]:
    """The same, with the header re-encoded and compared on every read (as readers did before)."""
    return tensors_from_arrays(plane, claims, rules, check_canonical=True)


Build = Callable[[PayloadPlane, Claims, ResultRules], list[dict[str, Any]]]


def timed(
    plane: PayloadPlane, claims: Sequence[Claims], build: Build, rules: ResultRules, rounds: int
) -> tuple[float, float]:
    """The best round's (wall, CPU) seconds of reading every rollout from the store and building its
    tensors."""
    walls, cpus = [], []
    for _ in range(rounds):
        started, cpu = time.perf_counter(), time.thread_time()
        for claim in claims:
            build(plane, claim, rules)
        walls.append(time.perf_counter() - started)
        cpus.append(time.thread_time() - cpu)
    return min(walls), min(cpus)


def generated_ids(rows: list[dict[str, Any]]) -> list[int]:
    """The generated token ids of a path's output, in order (every path must give the same)."""
    return [int(t) for row in rows if "generation_logprobs" in row for t in row["token_ids"].tolist()]


def _figure(value: float) -> float:
    """Four significant digits (a tiny run's GB/s is not rounded to zero)."""
    return float(f"{value:.4g}")


def array_bytes(content: bytes) -> int:
    """The bytes of a binary payload's arrays as stored (the token data, without the header)."""
    return sum(s.count * ITEM_SIZE[s.dtype] for s in read_layout(content, check_canonical=False).spans)


def run(
    store: PayloadStore,
    *,
    rollouts: int = 16,
    prompt_tokens: int = 32000,
    gen_tokens: int = 32000,
    turns: tuple[int, int] = (1, 1),
    rounds: int = 3,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    episodes = agent_episodes(rollouts, prompt_tokens, gen_tokens, turns)
    plane = PayloadPlane(store)
    json_claims = plane.put(
        [(encode_json([r.record() for r in e]), TOKENS_JSON_MEDIA_TYPE) for _, e in episodes]
    )
    put = plane.put([part for reply, records in episodes for part in stored_as_trainer(reply, records)])
    binary_claims: list[Claims] = [(put[i], put[i + 1]) for i in range(0, len(put), 2)]
    rules = ResultRules.of({})
    contents = [plane.get(c) for c, _ in binary_claims]
    token_bytes = sum(array_bytes(c) for c in contents)
    tokens_total = sum(len(r.prompt_token_ids) + len(r.generation_token_ids) for _, e in episodes for r in e)
    builders: dict[str, tuple[Build, Sequence[Claims]]] = {
        PATHS[0]: (rows_from_json, [(c, None) for c in json_claims]),
        PATHS[1]: (rows_from_binary, binary_claims),
        PATHS[2]: (tensors_header_rechecked, binary_claims),
        PATHS[3]: (tensors_from_arrays, binary_claims),
    }
    # Every path gives the same tokens (checked on the first rollout before anything is timed).
    first = {
        name: generated_ids(build(plane, claims[0], rules)) for name, (build, claims) in builders.items()
    }
    if len({tuple(ids) for ids in first.values()}) != 1:
        raise AssertionError(f"the paths disagree on the first rollout's generated tokens: {list(first)}")
    results: dict[str, Any] = {}
    for name, (build, claims) in builders.items():
        wall, cpu = timed(plane, claims, build, rules, rounds)
        results[name] = {
            "gb_per_s": _figure(token_bytes / wall / 1e9),
            "cpu_gb_per_s": _figure(token_bytes / cpu / 1e9) if cpu > 0 else 0.0,
            "ms_per_rollout": _figure(1000 * wall / rollouts),
            "mtokens_per_s": _figure(tokens_total / wall / 1e6),
        }
    # The floor of every path: integrity on read hashes each payload whole (sha256, one core).
    hashing = []
    for _ in range(rounds):
        started = time.thread_time()
        for content in contents:
            sha256_digest(content)
        hashing.append(time.thread_time() - started)
    return {
        "rollouts": rollouts,
        "sha256_cpu_gb_per_s": _figure(token_bytes / max(min(hashing), 1e-9) / 1e9),
        "tokens_per_rollout": round(tokens_total / rollouts, 1),
        "token_bytes_per_rollout": round(token_bytes / rollouts, 1),
        "stored_bytes_per_rollout": round(sum(len(c) for c in contents) / rollouts, 1),
        "reply_bytes_per_rollout": round(sum(r.size or 0 for _, r in binary_claims if r) / rollouts, 1),
        "json_bytes_per_rollout": round(sum(c.size or 0 for c in json_claims) / rollouts, 1),
        "store": store.kind,
        "paths": results,
        "first_rollout_generated": len(next(iter(first.values()))),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rollouts", type=positive, default=16)
    add_size_options(parser, prompt_tokens=32000, gen_tokens=32000, turns="1")
    parser.add_argument("--rounds", type=positive, default=3)
    parser.add_argument(
        "--payloads", default=None, help="Payload store URL (default: a temporary directory)."
    )
    parser.add_argument("--json", dest="as_json", default=None, help="Also write the result as JSON here.")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="token-path-") as tmp:
        try:
            store = open_payload_store(args.payloads or Path(tmp).as_uri())
            try:
                result = run(
                    store,
                    rollouts=args.rollouts,
                    prompt_tokens=args.prompt_tokens,
                    gen_tokens=args.gen_tokens,
                    turns=args.turns,
                    rounds=args.rounds,
                )
            finally:
                store.close()
        except PayloadStoreError as exc:  # a bad --payloads, a store away or refusing: one line
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(
        f"{result['rollouts']} rollouts of {result['tokens_per_rollout']:,.0f} tokens "
        f"({result['token_bytes_per_rollout'] / 1024:,.0f} KiB of arrays in "
        f"{result['stored_bytes_per_rollout'] / 1024:,.0f} KiB binary beside a "
        f"{result['reply_bytes_per_rollout'] / 1024:,.0f} KiB reply; "
        f"{result['json_bytes_per_rollout'] / 1024:,.0f} KiB JSON) from a {result['store']} store, one thread"
    )
    print(f"{'path':<26} {'GB/s':>7} {'cpu GB/s':>9} {'ms/rollout':>11} {'Mtokens/s':>10}")
    base = result["paths"][PATHS[0]]["gb_per_s"]
    for name, r in result["paths"].items():
        print(
            f"{name:<26} {r['gb_per_s']:>7.3f} {r['cpu_gb_per_s']:>9.3f} {r['ms_per_rollout']:>11.2f} "
            f"{r['mtokens_per_s']:>10.2f}   x{r['gb_per_s'] / base:.1f}"
        )
    print(
        f"{'(sha256 of the payloads)':<26} {'':>7} {result['sha256_cpu_gb_per_s']:>9.3f}   "
        "the floor of a checked read"
    )
    if args.as_json:
        Path(args.as_json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
