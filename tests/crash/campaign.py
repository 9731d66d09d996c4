"""The crash campaign's engine: damage one durable file every way a crash (or a flipped bit) can, run
its owner's recovery on each damaged copy, and sort what came back.

A **subject** is one kind of file the project writes with its own code.  It writes the file with the
project's own writer (`build`), then, for each damaged copy, restores the state directory around it
and runs the owner's real recovery path, in-process (`recover`: what a restarted agent, server or
trainer runs when it opens its state), returning the state it recovered or raising its refusal.

Damage: the file truncated at every byte prefix of its last group commit (which covers every prefix
of its last record), and one bit flipped at every bit of its last record.  Each outcome is one of:

- `recovered`: the state equals the fold of exactly the records wholly written before the damage
  (a truncation) or of every record but the damaged last one (a flip), the file now holds exactly
  those records' bytes, and a record appended afterwards is read back (the file is appendable);
- `refused`: the owner's refusal, one line, naming the file and a byte offset inside the damage;
- `silent`: anything else, a traceback included.  The campaign fails on any.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

Outcome = Literal["recovered", "refused", "silent"]


@dataclass(frozen=True)
class Written:
    """A file as its writer left it: its bytes and where each record starts."""

    path: Path  # relative to the state directory
    data: bytes
    starts: list[int]  # every record's first byte, in order
    group_start: int  # where the last group commit begins (a record start)
    appendable: bool  # an append-only file: a recovered prefix must take a new record

    @property
    def records(self) -> int:
        return len(self.starts)

    def ends(self) -> list[int]:
        return [*self.starts[1:], len(self.data)]

    def whole_before(self, cut: int) -> int:
        """How many records end at or before byte `cut` (whole, newline included)."""
        return sum(1 for end in self.ends() if end <= cut)


@dataclass(frozen=True)
class Damage:
    kind: Literal["truncate", "flip"]
    at: int  # the length kept, or the byte flipped
    bit: int = 0

    def apply(self, data: bytes) -> bytes:
        if self.kind == "truncate":
            return data[: self.at]
        damaged = bytearray(data)
        damaged[self.at] ^= 1 << self.bit
        return bytes(damaged)

    def __str__(self) -> str:
        return f"cut at {self.at}" if self.kind == "truncate" else f"bit {self.bit} of byte {self.at} flipped"


class Subject(Protocol):
    """One kind of durable file and its owner."""

    name: str  # the file, as the table names it
    owner: str  # whose recovery path `recover` is
    refusals: tuple[type[Exception], ...]  # what the owner raises to refuse
    names_offset: bool  # whether its refusal can say where (False: a content-addressed file)
    rewrites: tuple[Path, ...]  # other files its recovery or probe writes (not read back by it)

    def build(self, root: Path) -> Written:
        """Writes the state directory `root` with the project's own writer."""

    def reset(self, root: Path, pristine: Path, data: bytes) -> None:
        """Makes `root` the pristine state directory with the subject's file replaced by `data`."""

    def recover(self, root: Path) -> object:
        """The owner's recovery over `root`: the state it recovered (comparable), or a refusal."""

    def append_probe(self, root: Path) -> None:
        """After a recovery: appends one record the way the owner does (append-only files)."""

    def probe_seen(self, state: object) -> bool:
        """Whether a recovered state holds the probe record."""


@dataclass
class Tally:
    file: str
    owner: str
    records_crashed: int  # records of the last group commit
    prefixes: int = 0
    flips: int = 0
    recovered: int = 0
    refused: int = 0
    silent: list[str] = field(default_factory=list)

    def count(self, outcome: Outcome, damage: Damage, detail: str = "") -> None:
        if damage.kind == "truncate":
            self.prefixes += 1
        else:
            self.flips += 1
        if outcome == "silent":
            self.silent.append(f"{self.file}, {damage}: {detail}")
        elif outcome == "recovered":
            self.recovered += 1
        else:
            self.refused += 1

    def row(self) -> str:
        return (
            f"| `{self.file}` | {self.owner} | {self.records_crashed} | {self.prefixes} | {self.flips} | "
            f"{self.recovered} | {self.refused} | {len(self.silent)} |"
        )


TABLE_HEAD = (
    "| file | recovery run | records crashed | prefixes | bit flips | recovered prefix | refused, one line "
    "| silent corruption |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
)


def damages(written: Written, stride: int) -> Iterator[Damage]:
    """Every prefix of the last group commit and every bit of the last record (`stride` 1), or a
    deterministic subset: every `stride`-th prefix and byte, the record boundaries and the last
    bytes always, and at each byte taken every bit (the CI slice)."""
    data = written.data
    last = written.starts[-1]
    always = {written.group_start, last, len(data) - 2, len(data) - 1, *written.starts}
    for cut in range(written.group_start, len(data)):
        if stride == 1 or cut % stride == 0 or cut in always:
            yield Damage("truncate", cut)
    for at in range(last, len(data)):
        if stride == 1 or at % stride == 0 or at in always:
            for bit in range(8):
                yield Damage("flip", at, bit)


_OFFSET = re.compile(r"\bbyte (\d+)\b")


def _names_file_and_offset(exc: Exception, path: Path, lowest: int | None) -> str:
    """'' when the refusal is one line naming `path` and a byte at or after `lowest` (None: no byte
    asked for); else what is wrong with it."""
    text = str(exc)
    if "\n" in text or not text:
        return f"not one line: {text!r}"
    if str(path) not in text and path.name not in text:
        return f"does not name {path}: {text!r}"
    offsets = [int(m) for m in _OFFSET.findall(text)]
    if lowest is not None and not any(lowest <= o for o in offsets):
        return f"names no byte at or after {lowest}: {text!r}"
    return ""


def run(subject: Subject, workdir: Path, stride: int = 1) -> Tally:
    pristine = workdir / "pristine"
    pristine.mkdir(parents=True)
    written = subject.build(pristine)
    root = workdir / "restarted"
    # The states of every whole-record prefix (what a recovery may come back with), each distinct.
    prefix_states: list[object] = []
    for k in range(written.records + 1):
        subject.reset(root, pristine, written.data[: ([0, *written.ends()])[k]])
        prefix_states.append(_state_or_none(subject, root))
    assert prefix_states[-1] is not None, f"{subject.name} as written is refused"
    for k in range(written.records):
        assert prefix_states[k] != prefix_states[k + 1], f"records {k} and {k + 1} read the same"
    group_records = written.records - written.starts.index(written.group_start)
    tally = Tally(subject.name, subject.owner, group_records)
    target = root / written.path
    for damage in damages(written, stride):
        outcome, detail = classify(subject, written, root, pristine, target, prefix_states, damage)
        tally.count(outcome, damage, detail)
    # The cases share one state directory and only the subject's file is reset between them: the
    # recoveries must have left every other file as the writer did (a temporary file aside).
    unchanged = {p.relative_to(pristine): p.read_bytes() for p in pristine.rglob("*") if p.is_file()}
    now = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    for rel in {*unchanged, *now} - {written.path, *subject.rewrites}:
        assert unchanged.get(rel) == now.get(rel), f"{rel} was changed by a recovery of {written.path}"
    return tally


def _state_or_none(subject: Subject, root: Path) -> object:
    try:
        return subject.recover(root)
    except subject.refusals:
        return None  # a whole file of one record, cut before its end: no state, only a refusal


def classify(
    subject: Subject,
    written: Written,
    root: Path,
    pristine: Path,
    target: Path,
    prefix_states: list[object],
    damage: Damage,
) -> tuple[Outcome, str]:
    damaged = damage.apply(written.data)
    subject.reset(root, pristine, damaged)
    kept = written.whole_before(damage.at) if damage.kind == "truncate" else written.records - 1
    lowest = written.starts[min(kept, written.records - 1)] if written.appendable else 0
    try:
        state = subject.recover(root)
    except subject.refusals as exc:
        wrong = _names_file_and_offset(exc, target, lowest if subject.names_offset else None)
        return ("silent", f"refused badly: {wrong}") if wrong else ("refused", "")
    except Exception:
        return "silent", "traceback: " + traceback.format_exc(limit=3).replace("\n", " | ")
    if not written.appendable:
        # One record, replaced whole: anything but a refusal must be the record as written.
        return ("recovered", "") if state == prefix_states[-1] else ("silent", f"read as {state!r}"[:400])
    if state != prefix_states[kept]:
        return "silent", f"recovered {state!r} instead of the first {kept} records"[:400]
    prefix = written.data[: ([0, *written.ends()])[kept]]
    if target.read_bytes() != prefix:
        return "silent", "the file does not hold exactly the recovered records"
    return _appendable(subject, root)


def _appendable(subject: Subject, root: Path) -> tuple[Outcome, str]:
    try:
        subject.append_probe(root)
        again = subject.recover(root)
    except Exception:
        return "silent", "after recovery, appending failed: " + traceback.format_exc(limit=3).replace(
            "\n", " | "
        )
    if not subject.probe_seen(again):
        return "silent", "a record appended after the recovery was lost"
    return "recovered", ""


def check(tally: Tally, expect: Callable[[Tally], None] | None = None) -> None:
    """The campaign's verdict: no silent corruption, every case counted."""
    assert not tally.silent, "\n".join([tally.row(), *tally.silent[:20]])
    assert tally.recovered + tally.refused == tally.prefixes + tally.flips, tally.row()
    if expect is not None:
        expect(tally)
