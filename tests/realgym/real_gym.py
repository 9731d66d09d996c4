"""The real Gym's token capture, run in its own environment (nemo-gym 0.7.0, Python 3.13.0) on what
the tests hand it: a JSON file in, one JSON document out on stdout.

    python real_gym.py consume IN     every rollout's records through the real reader and consumer
    python real_gym.py read IN        the real reader's verdict on each of a list of records
    python real_gym.py hashes IN      the real lineage hashes of token lists and conversations
    python real_gym.py write IN       records written by the real Gym's own capture path

`consume`: IN is `[{"rollout_id", "records", "response"}]`.  Each record is validated by the real
`TokenEntry` (refusals listed), its real dump compared with what was given (differences listed: a
record must come through whole), then the rollout's records are put in a real `TokenCaptureStore`
and handed to `trajectories_for_rollout` with the reply's `response` as the verified response.  Per
rollout: `mask_sample`, the build's metrics, and the full prompt of every call of the delivered
chain (`prompts`, by model call id).

`write`: IN is `[{"rollout_id", "calls": [{"request", "response"}]}]`, one model call's request items
(the list) and served response (token arrays on its output item) each.  The calls go through the real capture
path a 0.7.0 model server runs (`CaptureContext`, `resolve_parent`, `capture_tokens`, with a real
`FileLineageStore` and `TokenCaptureStore`, delta records on), and the records are read back from the
store's files as the Gym wrote them.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from nemo_gym.token_id_capture import (
    CaptureContext,
    FileLineageStore,
    TokenCaptureStore,
    TokenEntry,
    capture_tokens,
    compute_digest,
    reset_token_sink,
    resolve_parent,
    set_token_sink,
    trajectories_for_rollout,
)
from nemo_gym.token_id_capture.fingerprint import assistant_fingerprint, conversation_digest
from pydantic import ValidationError


def consume(rollouts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"records": 0, "refused": [], "changed": [], "rollouts": {}}
    with tempfile.TemporaryDirectory() as root:
        store = TokenCaptureStore(Path(root))
        for rollout in rollouts:
            rid = rollout["rollout_id"]
            for raw in rollout["records"]:
                out["records"] += 1
                try:
                    entry = TokenEntry.model_validate(raw)
                except ValidationError as exc:
                    out["refused"].append(f"{rid}/{raw.get('model_call_id')}: {exc}"[:600])
                    continue
                if entry.model_dump(mode="json", exclude_unset=True) != raw:
                    out["changed"].append(f"{rid}/{raw.get('model_call_id')}")
                store.append(entry)
            built = trajectories_for_rollout(rid, [Path(root)], verified_response=rollout.get("response"))
            assert built is not None
            response = built.get("rebuilt_response") or {}
            prompts: dict[int, Any] = {}
            for item in response.get("output", []):
                if item.get("generation_token_ids") is not None:
                    prompts[len(prompts)] = item["prompt_token_ids"]
            out["rollouts"][rid] = {
                "mask_sample": built["mask_sample"],
                "error": built.get("error"),
                "metrics": built.get("metrics", {}),
                "prompts": list(prompts.values()),
            }
    return out


def read(records: list[Any]) -> list[dict[str, Any]]:
    verdicts = []
    for raw in records:
        try:
            entry = TokenEntry.model_validate(raw)
        except ValidationError as exc:
            verdicts.append({"ok": False, "error": str(exc).splitlines()[0]})
        else:
            verdicts.append({"ok": True, "dump": entry.model_dump(mode="json", exclude_unset=True)})
    return verdicts


def hashes(given: dict[str, Any]) -> dict[str, Any]:
    def safely(fn: Any, value: Any) -> str | None:
        try:
            return str(fn(value))
        except (TypeError, ValueError):
            return None

    return {
        "tokens": [compute_digest(ids) for ids in given["tokens"]],
        "fingerprints": [safely(assistant_fingerprint, c) for c in given["conversations"]],
        "contexts": [safely(conversation_digest, c) for c in given["conversations"]],
    }


async def write(rollouts: list[dict[str, Any]]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        sink = TokenCaptureStore(Path(root))
        lineage = FileLineageStore(Path(root))
        out: dict[str, Any] = {}
        for rollout in rollouts:
            rid = rollout["rollout_id"]
            for n, call in enumerate(rollout["calls"]):
                context = CaptureContext(
                    rollout_id=rid,
                    model_call_id=f"{rid}-call-{n + 1}",
                    token_sink=sink,
                    lineage_store=lineage,
                    delta_records=True,
                )
                token = set_token_sink(context)
                try:
                    await resolve_parent(call["request"])
                    await capture_tokens(call["response"], call["request"])
                finally:
                    reset_token_sink(token)
            if sink.is_incomplete(rid):
                raise RuntimeError(f"the real capture marked {rid} incomplete")
            lines = sink.path_for(rid).read_text().splitlines()
            out[rid] = [json.loads(line) for line in lines if line.strip()]
        await lineage.close()
        return out


if __name__ == "__main__":
    command, path = sys.argv[1], sys.argv[2]
    given = json.loads(Path(path).read_text())
    if command == "consume":
        result: Any = consume(given)
    elif command == "read":
        result = read(given)
    elif command == "hashes":
        result = hashes(given)
    elif command == "write":
        result = asyncio.run(write(given))
    else:
        raise SystemExit(f"unknown command {command!r}")
    print(json.dumps(result))
