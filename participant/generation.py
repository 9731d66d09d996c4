"""An agent process's identity: its incarnation (who it is) and its execution generation (where it
falls among the starts of its state directory).

The **incarnation** is a random id minted at every start of the agent process.  It is what the trainer
trusts: two answers come from the same process exactly when their incarnations are equal, so a result
named by a receipt of incarnation X is still held only by incarnation X; any other incarnation that
denies it has lost it with a restart.  Incarnations are compared for equality and never ordered, so
neither a clock stepped back nor a lost state directory can make a new process pass for an old one.

The **execution generation** is a counter that rises by one on every start with the same state
directory (1 on a fresh directory; no clock).  It orders that directory's own records (the execution
evidence names the generation that wrote each line) and shows restarts in status and metrics; nothing
outside the agent orders generations.

Both live in `<state dir>/generation` as one line, `<generation> <incarnation> <CRC-32 of the two>`.  An exclusive `flock`
serialises two processes started at once with the same state dir, and the new line is written to a
temporary file, fsync'd and renamed, so a crash mid-write leaves the old one intact.  Only this
identity survives a restart: stored replies never touch the disk.
"""

from __future__ import annotations

import fcntl
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from participant.durable import replace_file
from participant.records import FileDamaged
from protocol.ids import INCARNATION_RE, mint_incarnation

GENERATION_FILE = "generation"


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    generation: int
    incarnation: str


_COUNTER: Final = re.compile(r"[0-9]{1,18}")


def _line(identity: AgentIdentity) -> bytes:
    """The file's one line: `<generation> <incarnation> <CRC-32 of the two, 8 hex digits>`."""
    text = f"{identity.generation} {identity.incarnation}"
    return f"{text} {zlib.crc32(text.encode()):08x}\n".encode()


def _parse(path: Path, data: bytes) -> AgentIdentity:
    """The identity a generation file holds; FileDamaged when it is not whole.  Files written before
    the checksum hold `<generation> <incarnation>`, or the counter alone (its incarnation is unknown,
    ""); every version ended the line with a newline, so a file cut short never reads as a smaller
    counter."""
    if not data:
        raise FileDamaged(path, 0, "the file is empty")
    if not data.endswith(b"\n"):
        raise FileDamaged(path, 0, f"cut short at byte {len(data)} (no end of line)")
    parts = data[:-1].split(b" ")
    if len(parts) == 3:
        if not re.fullmatch(rb"[0-9a-f]{8}", parts[2]) or int(parts[2], 16) != zlib.crc32(
            b" ".join(parts[:2])
        ):
            raise FileDamaged(path, 0, "its checksum does not match its bytes")
        parts = parts[:2]
    if len(parts) > 2 or not _COUNTER.fullmatch(parts[0].decode("latin-1")):
        raise FileDamaged(path, 0, f"not a generation line: {data[:80]!r}")
    incarnation = parts[1].decode("latin-1") if len(parts) == 2 else ""
    if len(parts) == 2 and not INCARNATION_RE.match(incarnation):
        raise FileDamaged(path, 0, f"not a generation line: {data[:80]!r}")
    return AgentIdentity(int(parts[0]), incarnation)


def next_identity(state_dir: Path) -> AgentIdentity:
    """Takes this start's identity: the counter read, incremented and stored with a fresh incarnation."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / GENERATION_FILE
    with open(state_dir / (GENERATION_FILE + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # A damaged file (FileDamaged) refuses this start: guessing would reuse a generation.
            previous = _parse(path, path.read_bytes()) if path.exists() else None
            current = AgentIdentity(previous.generation + 1 if previous else 1, mint_incarnation())
            replace_file(path, _line(current))
            return current
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_identity(state_dir: Path) -> AgentIdentity | None:
    """The newest identity started with `state_dir` (None before the first start), without taking one."""
    path = state_dir / GENERATION_FILE
    try:
        return _parse(path, path.read_bytes())
    except (FileNotFoundError, FileDamaged):
        return None


def read_generation(state_dir: Path) -> int | None:
    """The newest generation started with `state_dir` (None before the first start)."""
    identity = read_identity(state_dir)
    return identity.generation if identity is not None else None
