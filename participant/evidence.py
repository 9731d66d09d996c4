"""Durable execution evidence: one JSON line per thing that happens to a try, fsync'd before it counts.

Group commit: records appended while a write is in flight go out together in the next write (one
`write` and one `fsync` in a worker thread), so many tries starting or finishing at once cost one
fsync, and the event loop never blocks on the disk.

The participant appends to `<state dir>/executions.jsonl` when a try starts executing (before it
runs), completes, fails, is acknowledged, or is retired (cancelled while running, or tombstoned).  The
file outlives restarts, so "executed twice" and "stranded" are counted from it across every process
generation, not from a process's memory.  `read_evidence` is the one reader (tests, `ledger simulate`).

Only whole lines count: a crash mid-write leaves a torn last line, which the reader skips and reports.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from participant.generation import read_generation
from protocol.ids import AttemptIndex, Identifier

EVIDENCE_FILE: Final = "executions.jsonl"

EvidenceKind = Literal["started", "completed", "failed", "acknowledged", "cancelled", "tombstoned"]


class EvidenceRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: EvidenceKind
    rollout_id: Identifier
    attempt_index: AttemptIndex
    capture_key: Identifier
    execution_generation: int
    at: float


class EvidenceLog:
    """The append side.  `commit` returns once its records are on disk."""

    def __init__(self, state_dir: Path, generation: int) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / EVIDENCE_FILE
        self.generation = generation
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._pending: list[tuple[bytes, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None

    def lines(self, kind: EvidenceKind, tries: list[tuple[str, int, str]]) -> bytes:
        now = time.time()
        return "".join(
            EvidenceRecord(
                kind=kind,
                rollout_id=rid,
                attempt_index=n,
                capture_key=key,
                execution_generation=self.generation,
                at=now,
            ).model_dump_json()
            + "\n"
            for rid, n, key in tries
        ).encode()

    def append(self, kind: EvidenceKind, tries: list[tuple[str, int, str]]) -> asyncio.Future[None]:
        """Queues one `kind` line per (rollout id, try, capture key), in call order; the future is
        done once they are durable (or failed with the OSError that kept them off the disk)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not tries:
            done.set_result(None)
            return done
        self._pending.append((self.lines(kind, tries), done))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return done

    async def commit(self, kind: EvidenceKind, tries: list[tuple[str, int, str]]) -> None:
        """`append`, then wait until the lines are durable (raises OSError when they could not be)."""
        await asyncio.shield(self.append(kind, tries))  # a cancelled caller does not cancel the write

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                await asyncio.to_thread(self._write, b"".join(data for data, _ in batch))
            except BaseException as exc:
                for _, done in batch:
                    if not done.done():
                        done.set_exception(exc if isinstance(exc, Exception) else OSError(str(exc)))
                if not isinstance(exc, Exception):
                    raise
            else:
                for _, done in batch:
                    if not done.done():
                        done.set_result(None)

    def _write(self, data: bytes) -> None:
        with self._lock:
            os.write(self._fd, data)
            os.fsync(self._fd)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


@dataclass
class TryEvidence:
    rollout_id: str
    attempt_index: int
    capture_key: str
    # Generations that started executing this try, in order (more than one: it was executed twice).
    started: list[int] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)
    acknowledged: bool = False
    retired: bool = False
    failed: bool = False

    @property
    def executions(self) -> int:
        return len(self.started)

    @property
    def outstanding(self) -> bool:
        """Finished, and neither acknowledged nor retired: a result nobody has released."""
        return bool(self.completed) and not self.acknowledged and not self.retired


@dataclass
class Evidence:
    tries: dict[tuple[str, int], TryEvidence]
    # Generations that wrote a record, and the newest that started (from the generation counter).
    generations: list[int]
    newest_generation: int | None = None
    torn_lines: int = 0

    @property
    def executed_twice(self) -> list[TryEvidence]:
        return [t for t in self.tries.values() if t.executions > 1]

    @property
    def duplicate_executions(self) -> int:
        return sum(t.executions - 1 for t in self.tries.values() if t.executions > 1)

    @property
    def stranded(self) -> list[TryEvidence]:
        """Finished results the newest generation still holds, never acknowledged nor retired."""
        return [t for t in self.tries.values() if t.outstanding and t.completed[-1] == self.newest_generation]

    @property
    def lost_in_restart(self) -> list[TryEvidence]:
        """Finished results an older generation held unreleased when it ended (its memory went with
        it); the trainer has them only if it sealed them before the restart."""
        return [t for t in self.tries.values() if t.outstanding and t.completed[-1] != self.newest_generation]

    def counts(self) -> Counter[str]:
        return Counter(
            {
                "tries": len(self.tries),
                "executions": sum(t.executions for t in self.tries.values()),
                "duplicate_executions": self.duplicate_executions,
                "stranded": len(self.stranded),
                "lost_in_restart": len(self.lost_in_restart),
                "acknowledged": sum(t.acknowledged for t in self.tries.values()),
                "retired": sum(t.retired for t in self.tries.values()),
                "failed": sum(t.failed for t in self.tries.values()),
            }
        )


def read_evidence(state_dir: Path) -> Evidence:
    """Folds `<state dir>/executions.jsonl` (an absent file is no evidence: nothing ran)."""
    path = Path(state_dir) / EVIDENCE_FILE
    tries: dict[tuple[str, int], TryEvidence] = {}
    generations: set[int] = set()
    torn = 0
    newest = read_generation(Path(state_dir))
    if not path.exists():
        return Evidence(tries, [], newest)
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                torn += 1  # the last write of a process that died mid-line
                continue
            try:
                rec = EvidenceRecord.model_validate(json.loads(raw))
            except (ValueError, ValidationError):
                torn += 1
                continue
            generations.add(rec.execution_generation)
            t = tries.setdefault(
                (rec.rollout_id, rec.attempt_index),
                TryEvidence(rec.rollout_id, rec.attempt_index, rec.capture_key),
            )
            if rec.kind == "started":
                t.started.append(rec.execution_generation)
            elif rec.kind == "completed":
                t.completed.append(rec.execution_generation)
            elif rec.kind == "acknowledged":
                t.acknowledged = True
            elif rec.kind == "failed":
                t.failed = True
            else:
                t.retired = True
    if newest is None and generations:
        newest = max(generations)
    return Evidence(tries, sorted(generations), newest, torn)
