"""Durable execution evidence: one JSON line per thing that happens to a try, fsync'd before it counts.

Group commit: records appended while a write is in flight go out together in the next write (one
`write` and one `fsync` in a worker thread), so many tries starting or finishing at once cost one
fsync, and the event loop never blocks on the disk.

The participant appends to `<state dir>/executions.jsonl` when a try starts executing (before it
runs), completes, fails, is acknowledged, or is retired (cancelled while running, or tombstoned).  The
file outlives restarts, so "executed twice" and "stranded" are counted from it across every process
generation, not from a process's memory, and a new process refuses every try an earlier one recorded
(`EvidenceLog.earlier`).  `read_evidence` is the one reader (tests, `ledger simulate`, the exploration
checker); it judges each try by its records in order: what the last one says is what holds.

Compaction: as the file grows (past `COMPACT_MIN_BYTES`, then past twice its size after the last
compaction) and at a start that finds it at least twice as long as one line per try, it is rewritten
with one `summary` line per try, the fold of every record of that try so far (`TryEvidence`), in the
order the tries first appeared; records written afterwards follow.  The new file is written beside the
old one, fsync'd and renamed over it (`participant.durable.replace_file`): a crash at any point leaves
the old file or the new one, each whole, and both read the same.

Each line is a checksummed record (`participant.records`): a crash mid-write leaves a torn last line,
which the reader skips and reports and the next start cuts off (so the next record starts a line of its
own); a whole line that fails its checksum is damage, and the file is refused (`FileDamaged`, naming
the file and the byte), never read around.  Lines written before records carried a checksum are read
as they were.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from participant.durable import GroupCommitFile, replace_file
from participant.generation import read_generation
from participant.records import FileDamaged, RecordReader, cut_torn_tail, parsed_records, seal_json
from protocol.ids import AttemptIndex, Identifier

log = logging.getLogger("participant.evidence")

EVIDENCE_FILE: Final = "executions.jsonl"
# The file is compacted once it reaches this size, then each time it doubles after a compaction.
COMPACT_MIN_BYTES: Final = 4 * 1024 * 1024

EvidenceKind = Literal["started", "completed", "failed", "acknowledged", "cancelled", "tombstoned"]
RETIRED_KINDS: Final = frozenset({"cancelled", "tombstoned"})


class EvidenceRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: EvidenceKind
    rollout_id: Identifier
    attempt_index: AttemptIndex
    capture_key: Identifier
    execution_generation: int
    at: float


class EvidenceSummary(BaseModel):
    """A compacted try: every record of it up to the compaction, folded (`TryEvidence`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["summary"] = "summary"
    rollout_id: Identifier
    attempt_index: AttemptIndex
    capture_key: Identifier
    started: list[int]
    completed: list[int]
    generations: list[int]
    last: EvidenceKind
    last_generation: int
    at: float
    retired_in: list[int] = []  # absent from summaries written before it was kept


_LINE: Final = TypeAdapter[EvidenceRecord | EvidenceSummary](
    Annotated[EvidenceRecord | EvidenceSummary, Field(discriminator="kind")]
)


@dataclass
class TryEvidence:
    """One try as its records say, in order.  What holds is what the last record says."""

    rollout_id: str
    attempt_index: int
    capture_key: str
    # Generations that started executing this try, in order (more than one: it was executed twice).
    started: list[int] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)
    # Every generation that wrote a record of it.
    generations: list[int] = field(default_factory=list)
    # Generations that retired it (cancelled or tombstoned), in order.
    retired_in: list[int] = field(default_factory=list)
    last: EvidenceKind = "started"
    last_generation: int = 0
    at: float = 0.0

    def see(self, line: EvidenceRecord | EvidenceSummary) -> None:
        if isinstance(line, EvidenceSummary):
            self.started += line.started
            self.completed += line.completed
            self.generations += [g for g in line.generations if g not in self.generations]
            self.retired_in += line.retired_in
            self.last, self.last_generation, self.at = line.last, line.last_generation, line.at
            return
        generation = line.execution_generation
        if line.kind == "started":
            self.started.append(generation)
        elif line.kind == "completed":
            self.completed.append(generation)
        elif line.kind in RETIRED_KINDS:
            self.retired_in.append(generation)
        if generation not in self.generations:
            self.generations.append(generation)
        self.last, self.last_generation, self.at = line.kind, generation, line.at

    @property
    def executions(self) -> int:
        return len(self.started)

    @property
    def run_after_retired(self) -> bool:
        """A later process started it after an earlier one had retired it: what a new process must
        refuse (a stale owner's late /run for a try the log replaced)."""
        return bool(self.retired_in) and any(g > self.retired_in[0] for g in self.started)

    @property
    def acknowledged(self) -> bool:
        return self.last == "acknowledged"

    @property
    def retired(self) -> bool:
        return self.last in RETIRED_KINDS

    @property
    def failed(self) -> bool:
        return self.last == "failed"

    @property
    def outstanding(self) -> bool:
        """Its last record is a completion: a finished result nobody has released since."""
        return self.last == "completed"

    def summary(self) -> EvidenceSummary:
        return EvidenceSummary(
            rollout_id=self.rollout_id,
            attempt_index=self.attempt_index,
            capture_key=self.capture_key,
            started=self.started,
            completed=self.completed,
            generations=self.generations,
            last=self.last,
            last_generation=self.last_generation,
            at=self.at,
            retired_in=self.retired_in,
        )


@dataclass
class _Fold:
    tries: dict[tuple[str, int], TryEvidence] = field(default_factory=dict)
    lines: int = 0
    torn: int = 0


# How every record of this file begins, before the checksum: what a torn line an older version ended
# with a newline began with.
_LEGACY_STARTS: Final = (b'{"kind"',)


def _reader(path: Path) -> RecordReader:
    return RecordReader(path, _LEGACY_STARTS)


def _lines(reader: RecordReader) -> Iterator[EvidenceRecord | EvidenceSummary | None]:
    """Every record of the file in order, parsed (FileDamaged on damage); None for each torn line
    (one an older version ended with a newline, and a torn tail)."""
    for _, line in parsed_records(reader, _LINE.validate_json):
        yield line
    yield from (None for _ in reader.legacy_torn)
    if reader.torn_tail:
        yield None  # the last write of a process that died mid-line


def _fold(lines: Iterable[EvidenceRecord | EvidenceSummary | None]) -> _Fold:
    fold = _Fold()
    for line in lines:
        fold.lines += 1
        if line is None:
            fold.torn += 1
            continue
        key = (line.rollout_id, line.attempt_index)
        t = fold.tries.get(key)
        if t is None:
            t = fold.tries[key] = TryEvidence(line.rollout_id, line.attempt_index, line.capture_key)
        t.see(line)
    return fold


def _summary_line(t: TryEvidence) -> bytes:
    # `retired_in` is left out when empty (most tries): the compacted file stays as small as it was.
    return seal_json(t.summary().model_dump_json(exclude=None if t.retired_in else {"retired_in"}))


def try_digest(rollout_id: str, attempt_index: int) -> int:
    """A try as 64 bits (`EarlierTries`): a collision only ever refuses a new try (the safe way)."""
    raw = hashlib.blake2b(f"{rollout_id}\x1f{attempt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(raw, "big")


class EarlierTries:
    """Every try an earlier process of this state directory recorded, 8 bytes each (a sorted array of
    `try_digest`s): a new process refuses them all, however long the agent has lived."""

    def __init__(self, digests: Iterable[int] = ()) -> None:
        self._sorted = array("Q", sorted(set(digests)))

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple) or len(key) != 2:
            return False
        digest = try_digest(*key)
        i = bisect.bisect_left(self._sorted, digest)
        return i < len(self._sorted) and self._sorted[i] == digest

    def __len__(self) -> int:
        return len(self._sorted)


def compact(path: Path) -> int:
    """Rewrites `path` as one summary line per try (crash-safe: `replace_file`); returns its new size."""
    fold = _fold(_lines(_reader(path)))
    data = b"".join(_summary_line(t) for t in fold.tries.values())
    replace_file(path, data)
    return len(data)


class EvidenceLog:
    """The append side.  `commit` returns once its records are on disk.  Opening it reads what earlier
    processes recorded (`earlier`), and compacts the file when that pays."""

    def __init__(
        self, state_dir: Path, generation: int, *, compact_min_bytes: int = COMPACT_MIN_BYTES
    ) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / EVIDENCE_FILE
        self.generation = generation
        # The wall clock each record's `at` is read from (shown to people, never judged: records are
        # judged in file order, so a clock stepped back changes nothing; the exploration steps it back).
        self.clock: Callable[[], float] = time.time
        self.compactions = 0
        self._compact_min = compact_min_bytes
        reader = _reader(self.path)
        lines = 0
        digests: list[int] = []
        for line in _lines(reader):  # FileDamaged: this start is refused, the file left as it is
            lines += 1
            if line is not None:
                digests.append(try_digest(line.rollout_id, line.attempt_index))
        self.earlier = EarlierTries(digests)
        del digests
        cut_torn_tail(reader)
        size = reader.end
        if size >= self._compact_min and lines >= 2 * len(self.earlier):
            size = compact(self.path)
            self.compactions += 1
        self._compact_at = max(self._compact_min, 2 * size)
        self._file = GroupCommitFile(self.path, after_write=self._compact_if_due)

    def lines(self, kind: EvidenceKind, tries: list[tuple[str, int, str]]) -> bytes:
        now = self.clock()
        return b"".join(
            seal_json(
                EvidenceRecord(
                    kind=kind,
                    rollout_id=rid,
                    attempt_index=n,
                    capture_key=key,
                    execution_generation=self.generation,
                    at=now,
                ).model_dump_json()
            )
            for rid, n, key in tries
        )

    def append(self, kind: EvidenceKind, tries: list[tuple[str, int, str]]) -> asyncio.Future[None]:
        """Queues one `kind` line per (rollout id, try, capture key), in call order; the future is
        done once they are durable (or failed with the OSError that kept them off the disk)."""
        return self._file.append(self.lines(kind, tries))

    async def commit(self, kind: EvidenceKind, tries: list[tuple[str, int, str]]) -> None:
        """`append`, then wait until the lines are durable (raises OSError when they could not be)."""
        await self._file.commit(self.lines(kind, tries))

    def _compact_if_due(self, size: int) -> bool:
        """After a durable write, with no other in flight: compacts once the file has doubled.  The
        records just written are durable already, so a failure here costs nothing but the
        compaction."""
        if size < self._compact_at:
            return False
        try:
            size = compact(self.path)
            self.compactions += 1
            self._compact_at = max(self._compact_min, 2 * size)
        except (OSError, FileDamaged) as exc:
            log.warning("%s: not compacted (%s)", self.path, exc)
            self._compact_at *= 2  # tried again once the file has doubled
        return True

    def close(self) -> None:
        self._file.close()


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
    def run_after_retired(self) -> list[TryEvidence]:
        return [t for t in self.tries.values() if t.run_after_retired]

    @property
    def stranded(self) -> list[TryEvidence]:
        """Finished results the newest generation still holds: the try's last record is the newest
        generation's completion (nothing acknowledged or retired it since)."""
        return [
            t for t in self.tries.values() if t.outstanding and t.last_generation == self.newest_generation
        ]

    @property
    def lost_in_restart(self) -> list[TryEvidence]:
        """Finished results an older generation held unreleased when it ended (its memory went with
        it); the trainer has them only if it sealed them before the restart."""
        return [
            t for t in self.tries.values() if t.outstanding and t.last_generation != self.newest_generation
        ]

    def counts(self) -> Counter[str]:
        return Counter(
            {
                "tries": len(self.tries),
                "executions": sum(t.executions for t in self.tries.values()),
                "duplicate_executions": self.duplicate_executions,
                "run_after_retired": len(self.run_after_retired),
                "stranded": len(self.stranded),
                "lost_in_restart": len(self.lost_in_restart),
                "acknowledged": sum(t.acknowledged for t in self.tries.values()),
                "retired": sum(t.retired for t in self.tries.values()),
                "failed": sum(t.failed for t in self.tries.values()),
            }
        )


def read_evidence(state_dir: Path) -> Evidence:
    """Folds `<state dir>/executions.jsonl` in order (an absent file is no evidence: nothing ran)."""
    fold = _fold(_lines(_reader(Path(state_dir) / EVIDENCE_FILE)))
    generations = sorted({g for t in fold.tries.values() for g in t.generations})
    newest = read_generation(Path(state_dir))
    if newest is None and generations:
        newest = max(generations)
    return Evidence(fold.tries, generations, newest, fold.torn)
