"""A plain Gym agent's `/run` reply at real sizes through the hand-off's JSON work: ms per reply.

The real Gym's agents answer each model call's token arrays inside the reply, on the call's output
message (`prompt_token_ids`, `generation_token_ids`, `generation_log_probs`, as `token_id_capture`
leaves them); both the participant (for the receipt's digest) and the trainer (to store the reply and
check that digest) write the reply's canonical JSON, and both check its nesting.  The replies here are
the reference agent's (zero work, `--prompt-tokens` / `--gen-tokens` / `--turns`) with those arrays
put back in, their logprobs as the agent draws them (almost none above -1e-4) and, in a second case,
with a share `--confident` of them drawn near certainty (between -1e-9 and -1e-4: the tokens a model
is sure of, which long reasoning holds many of; the share is a setting, not a model's measurement);
each generated token's router choices beside them (`routed_experts`, `--routed-experts` layers of two
expert ids, as a MoE model server answers them and the real-Gym tests' stub model does; 0: none).

Side by side in this process, over the same replies, each checked to give the same answer first:

- canonical JSON: `protocol.digests.canonical_bytes` against the standard library's encoder (what it
  wrote any reply holding a float below 1e-4 with, before orjson's forms of those were rewritten);
- the nesting check of a reply (`protocol.wire.check_depth`) and of a `/run` row (`finite`) against
  the item-by-item walk it replaced (`walked_check_depth`, its reference);
- the trainer's parse of the reply body: pydantic's JSON into Python values (what it used) against
  msgspec's (what `GymClient` uses now, `trainer.gym.runs.run_json`);
- what a mounted participant does with its agent's reply body until the ACK lets it go (parse,
  validate, token records, canonical JSON and its digest, the records' binary form, freed): the router
  choices parsed as lists (what it did) against held as their text (what it does now,
  `participant.mount.agent_body_json`).

CPU time of the one thread, best of `--rounds`.

    python -m benchmarks.gym_reply                                      # 1,000 + 8,000 tokens
    python -m benchmarks.gym_reply --prompt-tokens 32000 --gen-tokens 32000
"""

from __future__ import annotations

import argparse
import json
import math
import random
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import orjson
from pydantic import TypeAdapter
from pydantic_core import from_json

from benchmarks.rollout_sizes import add_size_options, positive
from benchmarks.token_path import agent_episodes
from participant.mount import agent_body_json
from participant.replies import ParsedReply
from protocol.digests import canonical_bytes, json_canonical_bytes, sha256_digest
from protocol.token_codec import encode_entries
from protocol.tokens import token_records_from_reply, with_token_arrays
from protocol.wire import MAX_JSON_DEPTH, RunReply, TokenEntry, check_depth, gym_reply

_INT_RANGE = (-(2**63), 2**64 - 1)


def walked_check_depth(value: dict[str, Any], limit: int, finite: bool) -> str | None:
    """The reference `check_depth` is held to: every child of every container looked at in Python.
    The error's text, or None."""
    level: list[Any] = [value]
    depth = 1
    while level:
        if depth > limit:
            return f"nested deeper than {limit} levels"
        below: list[Any] = []
        for item in level:
            for child in item.values() if isinstance(item, dict) else item:
                if isinstance(child, (dict, list)):
                    below.append(child)
                elif finite and isinstance(child, float) and not math.isfinite(child):
                    return (
                        f"holds the number {child}, which JSON cannot carry (NaN, infinite or out of range)"
                    )
                elif finite and type(child) is int and not _INT_RANGE[0] <= child <= _INT_RANGE[1]:
                    return f"holds an integer of {child.bit_length()} bits, outside the 64-bit range"
        level = below
        depth += 1
    return None


def _float32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def plain_gym_reply(
    reply: RunReply, records: list[TokenEntry], confident: float, rng: random.Random, routed_experts: int = 0
) -> dict[str, Any]:
    """`reply` as a plain Gym agent answers it: each call's token arrays on the output item that
    carried them; a share `confident` of the logprobs redrawn near certainty; with `routed_experts`,
    each generated token's router choices (that many layers of two expert ids of 64)."""
    payload = reply.payload()
    drawn = [
        record.model_copy(
            update={
                "generation_log_probs": [
                    _float32(-(10.0 ** rng.uniform(-9.0, -4.0))) if rng.random() < confident else lp
                    for lp in record.generation_log_probs
                ],
                **(
                    {
                        "routed_experts": [
                            [[rng.randrange(64), rng.randrange(64)] for _ in range(routed_experts)]
                            for _ in record.generation_token_ids
                        ]
                    }
                    if routed_experts
                    else {}
                ),
            }
        )
        for record in records
    ]
    payload["response"]["output"] = with_token_arrays(payload["response"]["output"], drawn)
    return payload


def _best_ms(fn: Callable[[Any], Any], items: list[Any], rounds: int) -> float:
    """The thread's CPU time per item, best of `rounds` (a busy machine's other work is not in it)."""
    best = float("inf")
    for _ in range(rounds):
        started = time.thread_time()
        for item in items:
            fn(item)
        best = min(best, time.thread_time() - started)
    return round(1000 * best / len(items), 3)


_ANY_JSON: TypeAdapter[Any] = TypeAdapter(Any)


def participant_keep(body: bytes, routes_as_text: bool = True) -> tuple[bytes, bytes]:
    """A mounted participant's work on its agent's `/run` body (`participant.mount.AsgiRunner`, then
    `participant.executions.ExecutionRegistry._execute`): the reply's canonical JSON and its records'
    binary form; `routes_as_text=False`: the router choices parsed as lists, as before."""
    payload = agent_body_json(body) if routes_as_text else from_json(body)
    reply = gym_reply(payload, "bench_g0", 0, as_type=ParsedReply)
    tokens = token_records_from_reply(reply, "bench", 0.0)
    reply_json = canonical_bytes(reply.parsed_payload(), finite=True)
    sha256_digest(reply_json)
    return reply_json, encode_entries(tokens)


def measure(replies: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """Every way over `replies`, after checking each gives its reference's answer."""
    for reply in replies:
        if canonical_bytes(reply) != json_canonical_bytes(reply):
            raise AssertionError("canonical_bytes and json disagree on a reply")
        for finite in (False, True):
            check_depth(reply, finite=finite)  # raises where the reference names an error
            if walked_check_depth(reply, MAX_JSON_DEPTH, finite) is not None:
                raise AssertionError("the reference refuses a reply check_depth took")
    bodies = [orjson.dumps(r) for r in replies]
    for body in bodies:
        if participant_keep(body, routes_as_text=False) != participant_keep(body):
            raise AssertionError("the participant's keep differs with the router choices held as text")
    small = sum(
        0.0 < -lp < 1e-4
        for r in replies
        for item in r["response"]["output"]
        if isinstance(item, dict)
        for lp in item.get("generation_log_probs", ())
    )
    logprobs = sum(
        len(item.get("generation_log_probs", ()))
        for r in replies
        for item in r["response"]["output"]
        if isinstance(item, dict)
    )
    return {
        "reply_bytes": round(sum(map(len, bodies)) / len(bodies)),
        "logprobs_above_minus_1e-4": round(small / max(logprobs, 1), 4),
        "canonical_json_ms": {
            "json (the standard library)": _best_ms(json_canonical_bytes, replies, rounds),
            "canonical_bytes": _best_ms(canonical_bytes, replies, rounds),
        },
        "nesting_check_ms": {
            "walked, reply": _best_ms(
                lambda r: walked_check_depth(r, MAX_JSON_DEPTH, False), replies, rounds
            ),
            "check_depth, reply": _best_ms(check_depth, replies, rounds),
            "walked, finite": _best_ms(
                lambda r: walked_check_depth(r, MAX_JSON_DEPTH, True), replies, rounds
            ),
            "check_depth, finite": _best_ms(lambda r: check_depth(r, finite=True), replies, rounds),
        },
        "parse_ms": {
            "pydantic": _best_ms(_ANY_JSON.validate_json, bodies, rounds),
            "msgspec": _best_ms(msgspec.json.decode, bodies, rounds),
        },
        "participant_ms": {
            "participant, routes as lists": _best_ms(
                lambda b: participant_keep(b, routes_as_text=False), bodies, rounds
            ),
            "routes as text": _best_ms(participant_keep, bodies, rounds),
        },
    }


def run(
    *, rollouts: int = 8, prompt_tokens: int = 1000, gen_tokens: int = 8000, turns: tuple[int, int] = (1, 1),
    confident: float = 0.3, rounds: int = 5, seed: int = 0, routed_experts: int = 1,
) -> dict[str, Any]:  # fmt: skip
    episodes = agent_episodes(rollouts, prompt_tokens, gen_tokens, turns)
    cases: dict[str, Any] = {}
    for name, share in (("as drawn", 0.0), (f"{confident:.0%} confident", confident)):
        rng = random.Random(seed)
        replies = [plain_gym_reply(reply, records, share, rng, routed_experts) for reply, records in episodes]
        cases[name] = measure(replies, rounds)
    tokens = sum(len(r.prompt_token_ids) + len(r.generation_token_ids) for _, rs in episodes for r in rs)
    return {"rollouts": rollouts, "tokens_per_rollout": round(tokens / rollouts, 1), "cases": cases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rollouts", type=positive, default=8)
    add_size_options(parser, prompt_tokens=1000, gen_tokens=8000, turns="1")
    parser.add_argument(
        "--confident", type=float, default=0.3, help="Share of logprobs redrawn near certainty (default 0.3)."
    )
    parser.add_argument(
        "--routed-experts",
        type=int,
        default=1,
        help="Layers of router choices (two expert ids) per generated token (default 1; 0: none).",
    )
    parser.add_argument("--rounds", type=positive, default=5)
    parser.add_argument("--json", dest="as_json", default=None, help="Also write the result as JSON here.")
    args = parser.parse_args(argv)
    if not 0.0 <= args.confident <= 1.0:
        parser.error(f"--confident {args.confident} is not a share between 0 and 1")
    result = run(
        rollouts=args.rollouts,
        prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens,
        turns=args.turns,
        confident=args.confident,
        rounds=args.rounds,
        routed_experts=args.routed_experts,
    )
    print(f"{result['rollouts']} plain Gym replies of {result['tokens_per_rollout']:,.0f} tokens, one thread")
    for name, case in result["cases"].items():
        print(
            f"\n{name}: {case['reply_bytes'] / 1024:,.0f} KiB a reply, "
            f"{case['logprobs_above_minus_1e-4']:.2%} of logprobs above -1e-4"
        )
        for group in ("canonical_json_ms", "nesting_check_ms", "parse_ms", "participant_ms"):
            rows = list(case[group].items())
            for (base_name, base), (ours_name, ours) in zip(rows[::2], rows[1::2], strict=True):
                print(
                    f"  {base_name:<28} {base:>8.3f} ms   {ours_name:<20} {ours:>8.3f} ms   x{base / ours:.1f}"
                )
    if args.as_json:
        Path(args.as_json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
