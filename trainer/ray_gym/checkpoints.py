"""The trainer's checkpoints bound to the log's: the log's id for a trainer's `step_N`, the manifest
written into the trainer's checkpoint directory once it committed, and the log's checkpoint the trainer
loaded at its start (its restore point), checked against this log, trainer and settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eventstore import EventStore
from projections.base import fold
from projections.checkpoints import CheckpointsProjection, CheckpointState
from trainer.checkpoints import CheckpointOutcome
from trainer.coordinator import RolloutCoordinator
from trainer.manifest import (
    CheckpointManifest,
    ManifestMismatch,
    check_manifest,
    hash_at,
    latest_step_dir,
    log_identity,
    read_manifest,
    write_manifest,
)
from trainer.ray_gym.config import LedgerGymConfig

# Checkpoints are named by the trainer (NeMo RL: `step_N`); the log's id is that name under the
# trainer id (`<trainer_id>.step_N`), `.rK` added when the name was used before (a trainer that
# restored to an older step saves the same step again): log ids are never reused.


def restore_point(config: LedgerGymConfig, store: EventStore) -> str | None:
    """The log's checkpoint the trainer loaded: from the manifest of the directory named by
    `restore_checkpoint`, or of the one NeMo RL loads from `checkpoint_dir` (its newest
    `step_N`), checked against this log, trainer and settings; a name the log knows; or None (the
    trainer's newest cut in the log).  `ManifestMismatch` for what does not fit (one line)."""
    c = config
    projection = CheckpointsProjection()
    kinds = sorted(t.__name__ for t in projection.handles or ())
    checkpoints = fold(projection, store.read_all(0, types=kinds))
    mine = [k for k in checkpoints.checkpoints.values() if k.trainer_id == c.trainer_id]
    directory: Path | None = None
    if c.restore_checkpoint is not None:
        named = Path(c.restore_checkpoint)
        if not named.is_dir():
            return named_checkpoint(config, c.restore_checkpoint, mine)
        directory = named
    elif c.checkpoint_dir is not None:
        directory = latest_step_dir(Path(c.checkpoint_dir))
        if directory is None:
            committed = [k.checkpoint_id for k in mine if k.status in ("committed", "resumed")]
            if committed:
                raise ManifestMismatch(
                    f"the trainer loaded no checkpoint ({c.checkpoint_dir} has no step_N), but the log "
                    f"holds {len(committed)} committed checkpoint(s) of trainer {c.trainer_id!r} "
                    f"(newest {committed[-1]}): a fresh run takes a new ledger.trainer_id or log"
                )
            return None
    if directory is None:
        return None
    manifest = read_manifest(directory)
    check_manifest(
        manifest,
        identity=log_identity(store),
        cut_hash=hash_at(store, manifest.cut_position),
        trainer_id=c.trainer_id,
        fingerprint=c.fingerprint(),
        where=directory,
    )
    known = checkpoints.checkpoints.get(manifest.checkpoint_id)
    if known is not None and known.cut_position not in (None, manifest.cut_position):
        raise ManifestMismatch(
            f"{directory} names cut {manifest.cut_position} for checkpoint {manifest.checkpoint_id}, "
            f"the log's cut of it is {known.cut_position}"
        )
    return manifest.checkpoint_id


def named_checkpoint(config: LedgerGymConfig, name: str, mine: list[CheckpointState]) -> str:
    """The log's checkpoint a trainer's name (or the log's own id) stands for: its newest
    committed use."""
    base = _base_id(config, name)
    uses = [k for k in mine if k.checkpoint_id in (name, base) or k.checkpoint_id.startswith(f"{base}.r")]
    committed = [k for k in uses if k.status in ("committed", "resumed") and k.cut_position is not None]
    if not committed:
        raise ManifestMismatch(
            f"ledger.restore_checkpoint {name!r} is no committed checkpoint of trainer "
            f"{config.trainer_id!r} in the log"
        )
    return max(committed, key=lambda k: k.cut_position or 0).checkpoint_id


def _base_id(config: LedgerGymConfig, name: str) -> str:
    stem = Path(name).name.removeprefix("tmp_")
    trainer = config.trainer_id
    return f"{trainer}.{stem}" if trainer else stem


def log_checkpoint_id(config: LedgerGymConfig, coord: RolloutCoordinator, name: str) -> str:
    base = _base_id(config, name)
    known = coord.checkpoints.checkpoints
    log_id, k = base, 0
    while log_id in known:
        k += 1
        log_id = f"{base}.r{k}"
    return log_id


async def bound(
    config: LedgerGymConfig,
    coord: RolloutCoordinator,
    log_id: str,
    name: str,
    outcome: CheckpointOutcome,
    checkpoint_dir: str | None,
) -> dict[str, Any]:
    """The outcome, with the manifest written into the trainer's directory when it committed."""
    answer = {**outcome_of(outcome), "checkpoint_id": log_id}
    if not outcome.committed or checkpoint_dir is None or outcome.cut_position is None:
        return answer
    store = coord.store
    cut = outcome.cut_position

    def write() -> str:
        manifest = CheckpointManifest(
            checkpoint_id=log_id,
            trainer_checkpoint=Path(name).name.removeprefix("tmp_"),
            trainer_id=config.trainer_id,
            cut_position=cut,
            cut_hash=hash_at(store, cut),
            log_identity=log_identity(store),
            config_fingerprint=config.fingerprint(),
        )
        return str(write_manifest(Path(checkpoint_dir), manifest))

    answer["manifest"] = await coord.read_log(write, "binding the checkpoint to the trainer's")
    return answer


def outcome_of(outcome: CheckpointOutcome) -> dict[str, Any]:
    """A decided checkpoint as the actor answers it (plain data across the Ray boundary)."""
    return {
        "committed": outcome.committed,
        "reason": outcome.reason,
        "prepare_wait_s": outcome.prepare_wait_s,
        "cut_position": outcome.cut_position,
    }
