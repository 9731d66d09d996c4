"""The ledger's checkpoint bound to the trainer's own: a manifest in the trainer's checkpoint directory.

A trainer saves its state (model, optimizer, replay buffer, dataloader) in a directory of its own,
NeMo RL's `<checkpoint_dir>/step_N`.  The ledger's checkpoint of the same moment is a cut in the
log.  The manifest, `ledger-checkpoint.json` in that directory, names one for the other:

- `checkpoint_id`: the log's checkpoint (`CheckpointCommitted`), `trainer_checkpoint` the trainer's
  name for its own (`step_N`);
- `cut_position` and `cut_hash` (the chain hash of the event at the cut: the log up to it);
- `log_identity`: the chain hash of the log's first event, so another log (or one rebuilt) is told
  apart;
- `trainer_id` and `config_fingerprint` (the settings that decide which groups rows become);
- `digest`: sha256 of the canonical JSON of every other field.

When the trainer comes back on a directory, its manifest names the checkpoint to restore the log to;
any field that does not match the log or the trainer is a refusal, one line (`ManifestMismatch`).
The manifest is written after the commit, before the trainer makes its directory final (NeMo RL
renames `tmp_step_N` to `step_N`), so a directory without one was never bound to a cut.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eventstore import EventStore
from protocol.digests import canonical_bytes, sha256_digest
from protocol.ids import Identifier

MANIFEST_NAME: Final = "ledger-checkpoint.json"
MANIFEST_SCHEMA_VERSION: Final = 1
# NeMo RL's name of a finished checkpoint directory (`CheckpointManager.get_latest_checkpoint_path`).
STEP_DIR: Final = re.compile(r"step_\d+")


class ManifestMismatch(ValueError):
    """A trainer's checkpoint directory whose manifest is missing, unreadable, or not of this log,
    trainer or configuration (one line)."""


class CheckpointManifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = MANIFEST_SCHEMA_VERSION
    checkpoint_id: Identifier
    trainer_checkpoint: str = Field(min_length=1, max_length=400)
    trainer_id: Identifier | None
    cut_position: int = Field(ge=0)
    cut_hash: str
    log_identity: str
    config_fingerprint: str
    digest: str = ""

    def body(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"digest"})

    def sealed(self) -> CheckpointManifest:
        """The manifest with its own digest."""
        return self.model_copy(update={"digest": sha256_digest(canonical_bytes(self.body()))})


def log_identity(store: EventStore) -> str:
    """The chain hash of the log's first event (empty for an empty log)."""
    first = next(iter(store.read_all(0, 1)), None)
    return first.hash if first is not None else ""


def hash_at(store: EventStore, position: int) -> str:
    """The chain hash of the event at `position` (empty at 0)."""
    if position <= 0:
        return ""
    event = next(iter(store.read_all(position - 1, position)), None)
    return event.hash if event is not None else ""


def config_fingerprint(settings: dict[str, Any]) -> str:
    return sha256_digest(canonical_bytes(settings))


def write_manifest(directory: Path, manifest: CheckpointManifest) -> Path:
    """Writes the sealed manifest into `directory` durably (a temporary file, fsync, rename, then the
    directory fsync'd), so a crash leaves either no manifest or the whole of it."""
    if not directory.is_dir():
        raise ManifestMismatch(f"the trainer's checkpoint directory {directory} does not exist")
    path = directory / MANIFEST_NAME
    partial = directory / f".{MANIFEST_NAME}.partial"
    data = json.dumps(manifest.sealed().model_dump(mode="json"), indent=1, sort_keys=True).encode()
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def read_manifest(directory: Path) -> CheckpointManifest:
    """The manifest of a trainer's checkpoint directory, its digest checked.  A damaged one (cut short,
    a flipped bit) is a ManifestMismatch naming the file and the byte where reading it failed (0: the
    file is one record, and its digest does not hold)."""
    path = directory / MANIFEST_NAME

    def damaged(at: int, reason: str) -> ManifestMismatch:
        return ManifestMismatch(f"{path} is not a ledger checkpoint manifest: damaged at byte {at}: {reason}")

    try:
        raw = json.loads(path.read_bytes())
        manifest = CheckpointManifest.model_validate(raw)
    except FileNotFoundError:
        raise ManifestMismatch(
            f"{directory} holds no {MANIFEST_NAME}: the trainer's checkpoint was saved without the ledger's "
            "commit, so no cut of the log is bound to it"
        ) from None
    except json.JSONDecodeError as exc:  # cut short, or a bit flipped in its syntax (ASCII: chars are bytes)
        raise damaged(exc.pos, exc.msg) from None
    except UnicodeDecodeError as exc:
        raise damaged(exc.start, "not UTF-8") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        raise damaged(0, f"{'.'.join(map(str, first['loc'])) or 'the manifest'}: {first['msg']}") from None
    except (OSError, ValueError) as exc:
        raise ManifestMismatch(f"{path} could not be read: {str(exc).splitlines()[0]}") from None
    expected = sha256_digest(canonical_bytes(manifest.body()))
    if manifest.digest != expected:
        raise damaged(0, "it does not match its own digest (changed after it was written)")
    return manifest


def check_manifest(
    manifest: CheckpointManifest,
    *,
    identity: str,
    cut_hash: str,
    trainer_id: str | None,
    fingerprint: str,
    where: Path,
) -> None:
    """Refuses a manifest of another log, trainer, configuration or cut (one line)."""
    if manifest.log_identity != identity:
        raise ManifestMismatch(
            f"{where} was saved against another log (its first event differs from this one's)"
        )
    if manifest.trainer_id != trainer_id:
        raise ManifestMismatch(
            f"{where} was saved by trainer {manifest.trainer_id!r}, and this trainer is {trainer_id!r}"
        )
    if manifest.config_fingerprint != fingerprint:
        raise ManifestMismatch(
            f"{where} was saved with other ledger settings (trainer_id, mode, group_prefix or "
            "num_generations changed): the rows would map to other groups"
        )
    if manifest.cut_hash != cut_hash:
        raise ManifestMismatch(
            f"{where} names cut {manifest.cut_position} of checkpoint {manifest.checkpoint_id}, but the "
            "log's event there is not the one it was saved against"
        )


def latest_step_dir(checkpoint_dir: Path) -> Path | None:
    """The checkpoint NeMo RL loads from `checkpoint_dir`: its `step_N` with the highest N (a
    `tmp_step_N` is a save never finished)."""
    if not checkpoint_dir.is_dir():
        return None
    steps = [p for p in checkpoint_dir.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)]
    return max(steps, key=lambda p: int(p.name.split("_")[1]), default=None)
