"""The trainer's work on one finished try's payloads, from the HTTP bodies to the claims: ms per try.

A try's `/run` reply and `/token_capture` records (the reference agent's, zero work, at
`--prompt-tokens` / `--gen-tokens` / `--turns`) are taken as the trainer gets them and turned into
what it stores: token arrays over their canonical binary form, the reply's canonical JSON, and one
claim (digest) for each.  Three ways side by side, in this process, over the same bodies:

- `JSON capture, hashed twice`: the records as JSON (`list[TokenEntry]` parsed by pydantic, then
  encoded to the binary form), each payload hashed for its digest and again for its claim.  What
  the trainer did with every capture while the agent answered JSON to its Accept header.
- `binary, re-encoded, hashed twice`: the binary form, checked canonical by decoding it and
  encoding it again; hashed twice.  The binary path as it was first written.
- `binary, checked in place, hashed once`: what the trainer does now
  (`trainer.gym.completed.binary_token_records`: the header checked, each array's dtype by one
  vectorised pass, nothing re-encoded; one claim per payload, its digest the one the receipt names).

Every way parses the reply (`RunReply`) and writes its canonical JSON: that cost is the same in all
three and is shown apart.  One thread.

    python -m benchmarks.token_intake                                   # 1,000 + 8,000 tokens
    python -m benchmarks.token_intake --prompt-tokens 32000 --gen-tokens 32000
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from pydantic import TypeAdapter

from benchmarks.rollout_sizes import add_size_options
from benchmarks.token_path import agent_episodes
from payloads import InMemoryPayloadStore, PayloadPlane
from payloads.replies import REPLY_MEDIA_TYPE
from payloads.token_arrays import TokenArrays, decode_arrays, encode_arrays
from protocol.digests import canonical_bytes, sha256_digest
from protocol.token_codec import TOKENS_MEDIA_TYPE, encode_entries, encode_records
from protocol.wire import RunReply, TokenEntry
from trainer.gym.completed import binary_token_records

WAYS = (
    "JSON capture, hashed twice",
    "binary, re-encoded, hashed twice",
    "binary, checked in place, hashed once",
)
_TOKEN_LIST = TypeAdapter(list[TokenEntry])


def reencoded(content: bytes) -> TokenArrays:
    """The first binary path's check: decode, encode again, compare (and decode the result again)."""
    arrays = decode_arrays(content)
    again = encode_arrays(
        arrays.records,
        [arrays.prompt(r) for r in range(len(arrays))],
        [arrays.generation(r) for r in range(len(arrays))],
        [arrays.logprobs(r) for r in range(len(arrays))],
    )
    return decode_arrays(content if again == content else again)


def reply_bytes(body: bytes) -> bytes:
    """The reply as every way reads it: parsed, then its canonical JSON (what is stored and hashed)."""
    return canonical_bytes(RunReply.model_validate_json(body).payload())


Way = Callable[[bytes, bytes, PayloadPlane], Any]


def json_twice(reply: bytes, tokens: bytes, plane: PayloadPlane) -> Any:
    arrays = decode_arrays(encode_entries(_TOKEN_LIST.validate_json(tokens)))
    content = reply_bytes(reply)
    sha256_digest(bytes(arrays.buffer))  # the receipt's digest
    sha256_digest(content)  # the reply's digest
    return plane.claim(bytes(arrays.buffer), TOKENS_MEDIA_TYPE), plane.claim(content, REPLY_MEDIA_TYPE)


def reencoded_twice(reply: bytes, tokens: bytes, plane: PayloadPlane) -> Any:
    arrays = reencoded(tokens)
    content = reply_bytes(reply)
    sha256_digest(bytes(arrays.buffer))
    sha256_digest(content)
    return plane.claim(bytes(arrays.buffer), TOKENS_MEDIA_TYPE), plane.claim(content, REPLY_MEDIA_TYPE)


def in_place_once(reply: bytes, tokens: bytes, plane: PayloadPlane) -> Any:
    arrays = binary_token_records(tokens)
    content = reply_bytes(reply)
    return plane.claim(bytes(arrays.buffer), TOKENS_MEDIA_TYPE), plane.claim(content, REPLY_MEDIA_TYPE)


def reply_only(reply: bytes, tokens: bytes, plane: PayloadPlane) -> Any:
    return plane.claim(reply_bytes(reply), REPLY_MEDIA_TYPE)


def best_seconds(
    way: Way, bodies: list[tuple[bytes, bytes, bytes]], plane: PayloadPlane, rounds: int
) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for reply, json_tokens, binary_tokens in bodies:
            way(reply, json_tokens if way is json_twice else binary_tokens, plane)
        best = min(best, time.perf_counter() - started)
    return best


def run(
    *, rollouts: int = 16, prompt_tokens: int = 1000, gen_tokens: int = 8000, turns: tuple[int, int] = (1, 1),
    rounds: int = 5,
) -> dict[str, Any]:  # fmt: skip
    episodes = agent_episodes(rollouts, prompt_tokens, gen_tokens, turns)
    bodies = []
    for reply, records in episodes:
        dumps = [r.record() for r in records]
        bodies.append(
            (orjson.dumps(reply.model_dump(mode="json")), orjson.dumps(dumps), encode_records(dumps))
        )
    plane = PayloadPlane(InMemoryPayloadStore())
    # Every way gives the same claims (checked on the first try before anything is timed).
    first = {
        name: way(bodies[0][0], bodies[0][1 if way is json_twice else 2], plane)
        for name, way in zip(WAYS, (json_twice, reencoded_twice, in_place_once), strict=True)
    }
    if len(set(first.values())) != 1:
        raise AssertionError(f"the ways disagree on the first try's claims: {first}")
    ways: dict[str, Any] = {}
    for name, way in zip(WAYS, (json_twice, reencoded_twice, in_place_once), strict=True):
        ways[name] = round(1000 * best_seconds(way, bodies, plane, rounds) / rollouts, 3)
    tokens = sum(len(r.prompt_token_ids) + len(r.generation_token_ids) for _, rs in episodes for r in rs)
    return {
        "rollouts": rollouts,
        "tokens_per_rollout": round(tokens / rollouts, 1),
        "token_bytes_per_rollout": round(sum(len(b[2]) for b in bodies) / rollouts, 1),
        "reply_bytes_per_rollout": round(sum(len(b[0]) for b in bodies) / rollouts, 1),
        "ms_per_try": ways,
        "reply_alone_ms_per_try": round(1000 * best_seconds(reply_only, bodies, plane, rounds) / rollouts, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=16)
    add_size_options(parser, prompt_tokens=1000, gen_tokens=8000, turns="1")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", dest="as_json", default=None, help="Also write the result as JSON here.")
    args = parser.parse_args(argv)
    result = run(
        rollouts=args.rollouts,
        prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens,
        turns=args.turns,
        rounds=args.rounds,
    )
    print(
        f"{result['rollouts']} tries of {result['tokens_per_rollout']:,.0f} tokens "
        f"({result['token_bytes_per_rollout'] / 1024:,.0f} KiB token records, "
        f"{result['reply_bytes_per_rollout'] / 1024:,.0f} KiB reply), one thread"
    )
    print(f"{'way':<40} {'ms/try':>8}")
    base = result["ms_per_try"][WAYS[0]]
    for name, ms in result["ms_per_try"].items():
        print(f"{name:<40} {ms:>8.3f}   x{base / ms:.1f} faster than the first")
    print(f"{'(the reply alone, in every way)':<40} {result['reply_alone_ms_per_try']:>8.3f}")
    if args.as_json:
        Path(args.as_json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
