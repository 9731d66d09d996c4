"""What a `run_rollouts` call delivers: which occurrence of its rows it runs as (a retried call
resumes its own), and each sealed group claimed for training (durably, before anything is yielded) and
turned into NeMo RL's per-row results, read through the coordinator's payload read."""

from __future__ import annotations

import time
from typing import Any

from protocol.streams import group_stream
from trainer.coordinator import RolloutCoordinator
from trainer.errors import AlreadyClaimed, ClaimWhilePrepared
from trainer.ray_gym.config import LedgerGymConfig
from trainer.ray_gym.results import ResultRules, row_result
from trainer.ray_gym.rows import (
    CallBudgetSpent,
    GroupRecord,
    PlannedGroup,
    RowError,
    RowsDeadLettered,
    RowsLostToInfrastructure,
    group_id,
    read_group,
)


async def _records(coord: RolloutCoordinator, gids: list[str]) -> dict[str, GroupRecord]:
    store = coord.store
    # Through the journal: a database outage is ridden out as the coordinator's own reads are.
    return await coord.read_log(
        lambda: {gid: read_group(gid, store.read_stream(group_stream(gid))) for gid in gids},
        "reading group streams",
    )


def call_id() -> str | None:
    """The Ray task this call runs as: the same on every retry of it (None outside a Ray actor)."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:
        return None
    task_id: str | None = context.get_task_id()
    return task_id


async def occurrence(
    config: LedgerGymConfig, coord: RolloutCoordinator, digest: str, groups: int, call_id: str | None = None
) -> tuple[int, list[str]]:
    """The occurrence of these rows this call runs as, and the groups it delivers again first.

    Claims are read as the ledger stands them (a restore of the trainer rolls claims back; a
    restart of this actor alone does not).  The first occurrence that no other call has a
    standing claim on and that the ledger did not give up on (no group dead-lettered: NeMo RL's
    own retry of such rows is a new request) is resumed: its groups are submitted again
    (idempotent) and delivered, claimed again where a restore rolled their claims back.  One
    whose standing claims are all this very call's (`call_id`, a Ray task id the retries keep)
    is resumed whatever else holds: its first attempt delivered those groups, the retry yields
    them again first, in claim order (Ray drops what its caller has), then the rest."""
    prefix = config.group_prefix
    occurrence = 0
    while True:
        gids = [group_id(prefix, digest, occurrence, k) for k in range(groups)]
        known = [g for g in gids if coord.ledger.knows_group(g)]
        if not known:
            return occurrence, []
        records = await _records(coord, known)
        standing = [
            (position, call, gid)
            for gid, record in records.items()
            for position, call in record.claims
            if position in _standing_claims(coord, gid)
        ]
        mine = call_id is not None and bool(standing) and all(c == call_id for _, c, _ in standing)
        foreign = any(call is None or call != call_id for _, call, _ in standing)
        given_up = any(r.dead_letter_reasons is not None for r in records.values())
        if mine or not (foreign or given_up):
            return occurrence, [gid for _, _, gid in sorted(standing)]
        occurrence += 1


def _standing_claims(coord: RolloutCoordinator, gid: str) -> set[int]:
    group = coord.ledger.groups.get(gid) or coord.ledger.archived.get(gid)
    return {c.position for c in group.claims} if group is not None else set()


def settled(coord: RolloutCoordinator, gid: str) -> bool:
    group = coord.ledger.groups.get(gid)
    return (group.status != "open") if group is not None else gid in coord.ledger.archived


async def deliver(
    config: LedgerGymConfig,
    rules: ResultRules,
    coord: RolloutCoordinator,
    group: PlannedGroup,
    train_step: int | None,
    call_id: str | None,
    tokenizer: Any,
    deadline: float,
) -> list[tuple[int, dict[str, Any]]]:
    """Claims the group (durably, before anything is yielded) and builds its rows' results."""
    [record] = (await _records(coord, [group.group_id])).values()
    if record.dead_letter_reasons is not None:
        detail = (
            f"group {group.group_id} (rows {group.rows}) used up its {record.dead_letter_budget or 'retry'} "
            "budget: " + "; ".join(record.dead_letter_reasons[:5])
        )
        raise (
            RowsDeadLettered(detail)
            if record.dead_letter_budget == "data"
            else RowsLostToInfrastructure(detail)
        )
    if not record.sealed or len(record.seals) != len(group.rows):
        raise RowError(f"group {group.group_id} left play without a seal of every row")
    while True:
        try:
            await coord.claim_for_training(group.group_id, train_step, call_id=call_id)
            break
        except AlreadyClaimed:
            break  # a retry replaying what its first attempt claimed
        except ClaimWhilePrepared:
            # The trainer is saving a checkpoint: the group goes out once it is decided, so that
            # what it saves and the cut hold the same claims.
            left = deadline - time.monotonic()
            if left <= 0 or not await coord.wait_checkpoint_decided(left):
                raise CallBudgetSpent(
                    f"group {group.group_id} waited for checkpoint {coord.active_checkpoint!r} "
                    f"to be decided until the call's budget ({config.call_budget_s:g} s) ran out"
                ) from None

    seals = [record.seals[gi] for gi in range(len(group.rows))]
    for gi, seal in enumerate(seals):
        if seal.reply is None:
            raise RowError(f"group {group.group_id}: sibling {gi}'s reply was not kept")
    read = await coord.read_payloads([(seal.reply, seal.tokens) for seal in seals])
    out = []
    for gi, rowidx in enumerate(group.rows):
        seal = seals[gi]
        reply, arrays = read[gi]
        assert reply is not None and arrays is not None
        result = row_result(
            group.row_dicts[gi],
            reply,
            arrays,
            rollout_id=seal.rollout_id,
            attempt_index=seal.attempt_index,
            mask_sample=seal.mask_sample,
            rules=rules,
            tokenizer=tokenizer,
        )
        out.append((rowidx, result))
    return out
