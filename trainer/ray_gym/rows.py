"""NeMo RL rows in, ledger groups out, and back: the pure half of the Ray adapter.

NeMo RL hands its Gym actor a list of rows (`nemo_gym_examples`): one per generation, the
`num_generations` rows of a prompt contiguous, each with `agent_ref.name`, `responses_create_params`,
the task's own fields and `_rowidx`.  Here a call becomes prompt groups:

- a group is a contiguous run of rows (of `num_generations` rows when the actor is told, else of rows
  identical but for `_rowidx`), one sibling per row;
- group ids are derived from the rows themselves (`<prefix><digest>-<occurrence>-<k>`): a Ray task
  retry calls again with the same rows and lands on the same groups (submit is idempotent), so it
  resumes instead of resubmitting.  The occurrence counts earlier calls with the very same rows whose
  groups were all delivered, so a later epoch over the same prompts gets groups of its own.

Going back, each sealed sibling becomes NeMo RL's per-row result (`message_log`, `input_message_log`,
`full_result`) built from what the log holds: the reply (blob table, under the `RunReplied` digest)
and the token records (blob table, under the seal's `tokens_digest`).  Token fields are plain lists;
NeMo RL's caller turns them into tensors (`_tensorize_nemo_gym_result`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from eventstore import RecordedEvent
from eventstore.events import PromptRef
from protocol.digests import canonical_json, sha256_digest
from protocol.ids import MAX_ID_LENGTH
from protocol.wire import TokenEntry

ROW_INDEX: Final = "_rowidx"
DEFAULT_GROUP_PREFIX: Final = "nrl-"
# Hex characters of the call digest in a group id: 80 bits, far from a collision at any batch count.
_DIGEST_CHARS: Final = 20


class RowError(ValueError):
    """A row NeMo RL would not send (no agent name, no `responses_create_params`, no `_rowidx`)."""


class RowsDeadLettered(RuntimeError):
    """A group of the call used up its retry budget: its rows have no result (picklable: one str)."""


@dataclass(frozen=True)
class PlannedGroup:
    group_id: str
    agent_name: str
    prompt_ref: PromptRef
    payload: dict[str, Any]
    rows: list[int]  # `_rowidx` of each sibling, in generation order


@dataclass
class GroupRecord:
    """What one group stream says, for the adapter: delivered (claimed) where, and what sealed."""

    group_id: str
    claim_position: int | None = None
    # The call that made the first claim, when it named itself (a Ray task id).
    claim_call: str | None = None
    sealed: bool = False
    dead_letter_reasons: list[str] | None = None
    # generation index -> (reply digest, tokens digest) of the sealed try
    seals: dict[int, tuple[str, str]] = field(default_factory=dict)


def _agent_name(row: dict[str, Any]) -> str:
    ref = row.get("agent_ref")
    name = ref.get("name") if isinstance(ref, dict) else None
    if not isinstance(name, str) or not name:
        raise RowError(f"row {row.get(ROW_INDEX)!r} has no agent_ref.name")
    return name


def _content(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != ROW_INDEX}


def call_digest(rows: Sequence[dict[str, Any]]) -> str:
    """The hex digest naming a call's rows (what a Ray retry sends again unchanged)."""
    return sha256_digest(canonical_json(list(rows)).encode()).partition(":")[2][:_DIGEST_CHARS]


def group_id(prefix: str, digest: str, occurrence: int, k: int) -> str:
    gid = f"{prefix}{digest}-{occurrence}-{k}"
    if len(gid) + 12 > MAX_ID_LENGTH:  # room for the sibling and try suffixes
        raise RowError(f"group prefix {prefix!r} is too long")
    return gid


def split_groups(rows: Sequence[dict[str, Any]], num_generations: int | None) -> list[list[dict[str, Any]]]:
    """Contiguous runs: of `num_generations` rows, or (None) of rows equal but for `_rowidx`."""
    if not rows:
        raise RowError("a rollout batch must not be empty")
    for row in rows:
        if not isinstance(row, dict) or not isinstance(row.get("responses_create_params"), dict):
            raise RowError("each row must be a dict with a responses_create_params dict")
        if not isinstance(row.get(ROW_INDEX), int):
            raise RowError(f"each row needs an integer {ROW_INDEX}")
        _agent_name(row)
    if num_generations is not None:
        if num_generations < 1 or len(rows) % num_generations:
            raise RowError(f"{len(rows)} rows do not split into groups of {num_generations}")
        runs = [list(rows[i : i + num_generations]) for i in range(0, len(rows), num_generations)]
    else:
        runs = []
        for row in rows:
            if runs and _content(runs[-1][0]) == _content(row):
                runs[-1].append(row)
            else:
                runs.append([row])
    for run in runs:
        if len({_agent_name(r) for r in run}) != 1:
            raise RowError(f"rows {[r[ROW_INDEX] for r in run]} of one prompt group name different agents")
    return runs


def plan_call(
    runs: Sequence[Sequence[dict[str, Any]]], digest: str, occurrence: int, prefix: str = DEFAULT_GROUP_PREFIX
) -> list[PlannedGroup]:
    planned = []
    for k, run in enumerate(runs):
        first = _content(run[0])
        params = first.pop("responses_create_params")
        agent = _agent_name(run[0])
        sample = first.get("_ng_task_index", first.get("task_index", k))
        planned.append(
            PlannedGroup(
                group_id=group_id(prefix, digest, occurrence, k),
                agent_name=agent,
                prompt_ref=PromptRef(sample_id=str(sample), task_name=agent),
                payload={"responses_create_params": params, "task": first},
                rows=[r[ROW_INDEX] for r in run],
            )
        )
    return planned


def read_group(group_id: str, events: Iterable[RecordedEvent]) -> GroupRecord:
    """Folds one group stream into what the adapter needs (raw data: claims a restore rolled back
    still show where the group was delivered first)."""
    record = GroupRecord(group_id)
    replies: dict[tuple[str, int], str] = {}
    for event in events:
        data = event.data
        if event.type == "RunReplied":
            replies[(data["rollout_id"], data["attempt_index"])] = data["reply_digest"]
        elif event.type == "SiblingSealed":
            rid, n = data["rollout_id"], data["attempt_index"]
            gi = int(rid.rpartition("_g")[2])
            record.seals[gi] = (replies.get((rid, n), ""), data["receipt"]["tokens_digest"])
        elif event.type == "GroupSealed":
            record.sealed = True
        elif event.type == "GroupDeadLettered":
            record.dead_letter_reasons = list(data.get("reasons") or [])
        elif event.type == "GroupClaimedForTraining" and record.claim_position is None:
            record.claim_position = event.position
            record.claim_call = data.get("call_id")
    return record


def message_log(tokens: Sequence[TokenEntry]) -> list[dict[str, Any]]:
    """NeMo RL's message log of a try: per model call the prompt tokens not seen before (user) and the
    generated tokens with their logprobs (assistant)."""
    seen: list[int] = []
    log: list[dict[str, Any]] = []
    for entry in tokens:
        prompt = list(entry.prompt_token_ids)
        # A multi-turn prompt extends what came before; one that does not is given whole.
        new = prompt[len(seen) :] if prompt[: len(seen)] == seen else prompt
        log.append({"role": "user", "content": "", "token_ids": new})
        log.append(
            {
                "role": "assistant",
                "content": "",
                "token_ids": list(entry.generation_token_ids),
                "generation_logprobs": list(entry.generation_log_probs),
            }
        )
        seen = prompt + list(entry.generation_token_ids)
    return log


def row_result(reply: dict[str, Any], tokens_blob: bytes) -> dict[str, Any]:
    """One row's result in NeMo RL's shape; `full_result` is the Gym reply, task fields at the top
    (as a Gym server echoes the row back)."""
    tokens = [TokenEntry.model_validate(t) for t in json.loads(tokens_blob)]
    log = message_log(tokens)
    task = reply.get("task") or {}
    full = {**task, **{k: v for k, v in reply.items() if k != "task"}}
    return {"message_log": log, "input_message_log": log[:1], "full_result": full}
