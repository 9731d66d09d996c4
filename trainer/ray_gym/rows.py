"""NeMo RL rows in, ledger groups out: the pure half of the Ray adapter.

NeMo RL hands its Gym actor a list of rows (`nemo_gym_examples`), each with `agent_ref.name`,
`responses_create_params`, the task's own fields and `_rowidx`:

- async GRPO (`run_async_nemo_gym_rollout`): a prompt's `num_generations` rows contiguous, `_rowidx`
  the row's place in the call;
- validation (`run_nemo_gym_rollout_sync`): one mixed batch, one row per prompt, any agents;
- the single controller (`rollout_manager.py`): one prompt's rows per call, `_rowidx` the generation
  index, re-dispatching only the rows that never came back (a subset, their `_rowidx` kept), and on
  the recovery branch each row carrying NeMo RL's own id `_ng_rollout_id`.

A call becomes prompt groups: contiguous rows equal but for their per-row keys (`_rowidx`,
`_ng_rollout_id`, `_ng_rollout_index`) are one prompt's siblings; with `num_generations` set, a run
of such rows that is a whole number of groups of that size is split into them (two equal prompts
next to each other), and any other run (a validation row, a re-dispatched subset) is a group of its
own size.

Group ids are derived from the rows themselves (`<prefix><digest>-<occurrence>-<k>`): a Ray task
retry calls again with the same rows and lands on the same groups (submit is idempotent), so it
resumes instead of resubmitting.  The occurrence counts earlier calls with the very same rows whose
groups were all delivered (or one of which was dead-lettered), so a later epoch over the same
prompts, or NeMo RL's own retry of a prompt the ledger gave up on, gets groups of its own.

Going back, each sealed sibling's reply and token records are read by the claims its group stream
holds (`Seal`): the `RunReplied` claim and the seal receipt's `tokens` claim.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from eventstore import RecordedEvent
from eventstore.events import PromptRef, RolloutReceipt, RunReplied
from payloads import PayloadClaim
from protocol.digests import canonical_json, sha256_digest
from protocol.ids import MAX_ID_LENGTH

ROW_INDEX: Final = "_rowidx"
# Keys that differ between the siblings of one prompt: not part of the prompt, kept on each row's result.
PER_ROW_KEYS: Final = ("_ng_rollout_id", "_ng_rollout_index")
DEFAULT_GROUP_PREFIX: Final = "nrl-"
# Hex characters of the call digest in a group id: 80 bits, far from a collision at any batch count.
_DIGEST_CHARS: Final = 20


class RowError(ValueError):
    """A row NeMo RL would not send (no agent name, no `responses_create_params`, no `_rowidx`)."""


# The errors a call ends with, each of one str (they pickle across the actor boundary) and of a class
# NeMo RL's `classify_rollout_failure` (nemo_rl/experience/failures.py) buckets as it should: anything
# not infrastructure is data, and infrastructure is recognised by builtin classes among others.


class RowsDeadLettered(RuntimeError):
    """A group of the call used up its data budget (deterministic failures): NeMo RL's DATA class,
    which retries the prompt at most `max_data_attempts` and then skips or fails it."""


class RowsLostToInfrastructure(ConnectionError):
    """A group of the call used up its infrastructure budget (agent away, deadlines) or was left
    with an attempt it could not settle: NeMo RL's INFRA class (a `ConnectionError`), which re-dispatches
    the prompt; the re-dispatch gets groups of its own."""


class CallBudgetSpent(TimeoutError):
    """The call waited `call_budget_s` for its groups: NeMo RL's INFRA class (a `TimeoutError`); a
    re-dispatch of the same rows resumes the groups still open."""


@dataclass(frozen=True)
class PlannedGroup:
    group_id: str
    agent_name: str
    prompt_ref: PromptRef
    payload: dict[str, Any]
    rows: list[int]  # `_rowidx` of each sibling, in generation order
    row_dicts: list[dict[str, Any]] = field(default_factory=list)  # the rows themselves


@dataclass(frozen=True)
class Seal:
    """A sibling's sealed attempt, as its group stream names it."""

    rollout_id: str
    attempt_index: int
    # The reply's claim (None: a masked reply that was not kept) and the token records'.
    reply: PayloadClaim | None
    tokens: PayloadClaim
    mask_sample: bool


@dataclass
class GroupRecord:
    """What one group stream says, for the adapter: delivered (claimed) where, and what sealed."""

    group_id: str
    # Every claim of the group as (position, the call that made it when it named itself: a Ray task
    # id), rolled back or not: the ledger says which stand.
    claims: list[tuple[int, str | None]] = field(default_factory=list)
    sealed: bool = False
    dead_letter_reasons: list[str] | None = None
    dead_letter_budget: str | None = None
    # generation index -> the sealed attempt
    seals: dict[int, Seal] = field(default_factory=dict)


def _agent_name(row: dict[str, Any]) -> str:
    ref = row.get("agent_ref")
    name = ref.get("name") if isinstance(ref, dict) else None
    if not isinstance(name, str) or not name:
        raise RowError(f"row {row.get(ROW_INDEX)!r} has no agent_ref.name")
    return name


def _content(row: dict[str, Any]) -> dict[str, Any]:
    """The prompt a row asks for: the row without its per-row keys."""
    return {k: v for k, v in row.items() if k != ROW_INDEX and k not in PER_ROW_KEYS}


def call_digest(rows: Sequence[dict[str, Any]]) -> str:
    """The hex digest naming a call's rows (what a Ray retry sends again unchanged)."""
    return sha256_digest(canonical_json(list(rows)).encode()).partition(":")[2][:_DIGEST_CHARS]


def group_id(prefix: str, digest: str, occurrence: int, k: int) -> str:
    gid = f"{prefix}{digest}-{occurrence}-{k}"
    if len(gid) + 12 > MAX_ID_LENGTH:  # room for the sibling and attempt suffixes
        raise RowError(f"group prefix {prefix!r} is too long")
    return gid


def split_groups(rows: Sequence[dict[str, Any]], num_generations: int | None) -> list[list[dict[str, Any]]]:
    """Contiguous runs of rows equal but for their per-row keys; with `num_generations`, a run of a
    multiple of that size is split into groups of it (see the module doc)."""
    if not rows:
        raise RowError("a rollout batch must not be empty")
    for row in rows:
        if not isinstance(row, dict) or not isinstance(row.get("responses_create_params"), dict):
            raise RowError("each row must be a dict with a responses_create_params dict")
        if not isinstance(row.get(ROW_INDEX), int):
            raise RowError(f"each row needs an integer {ROW_INDEX}")
        _agent_name(row)
    if len({row[ROW_INDEX] for row in rows}) != len(rows):
        raise RowError(f"two rows of one call share a {ROW_INDEX}")
    runs: list[list[dict[str, Any]]] = []
    for row in rows:
        if runs and _content(runs[-1][0]) == _content(row):
            runs[-1].append(row)
        else:
            runs.append([row])
    if num_generations is None:
        return runs
    split: list[list[dict[str, Any]]] = []
    for run in runs:
        if len(run) > num_generations and len(run) % num_generations == 0:
            split += [run[i : i + num_generations] for i in range(0, len(run), num_generations)]
        else:
            split.append(run)
    return split


def row_payload(row: dict[str, Any]) -> dict[str, Any]:
    """The group payload of a prompt's row: its `responses_create_params`, and the rest as its task."""
    task = _content(row)
    return {"responses_create_params": task.pop("responses_create_params"), "task": task}


def plan_call(
    runs: Sequence[Sequence[dict[str, Any]]], digest: str, occurrence: int, prefix: str = DEFAULT_GROUP_PREFIX
) -> list[PlannedGroup]:
    planned = []
    for k, run in enumerate(runs):
        payload = row_payload(run[0])
        agent = _agent_name(run[0])
        sample = payload["task"].get("_ng_task_index", payload["task"].get("task_index", k))
        planned.append(
            PlannedGroup(
                group_id=group_id(prefix, digest, occurrence, k),
                agent_name=agent,
                prompt_ref=PromptRef(sample_id=str(sample), task_name=agent),
                payload=payload,
                rows=[r[ROW_INDEX] for r in run],
                row_dicts=list(run),
            )
        )
    return planned


def read_group(group_id: str, events: Iterable[RecordedEvent]) -> GroupRecord:
    """Folds one group stream into what the adapter needs (raw data: claims a restore rolled back
    are listed too)."""
    record = GroupRecord(group_id)
    replies: dict[tuple[str, int], PayloadClaim | None] = {}
    for event in events:
        data = event.data
        if event.type == "RunReplied":
            replies[(data["rollout_id"], data["attempt_index"])] = RunReplied.model_validate(
                data
            ).reply_claim()
        elif event.type == "SiblingSealed":
            rid, n = data["rollout_id"], data["attempt_index"]
            receipt = RolloutReceipt.model_validate(data["receipt"])
            record.seals[int(rid.rpartition("_g")[2])] = Seal(
                rid, n, replies.get((rid, n)), receipt.tokens_claim(), receipt.mask_sample
            )
        elif event.type == "GroupSealed":
            record.sealed = True
        elif event.type == "GroupDeadLettered":
            record.dead_letter_reasons = list(data.get("reasons") or [])
            record.dead_letter_budget = data.get("budget")
        elif event.type == "GroupClaimedForTraining":
            record.claims.append((event.position, data.get("call_id")))
    return record
