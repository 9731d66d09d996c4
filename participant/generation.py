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

Both live in `<state dir>/generation` as one line, `<generation> <incarnation>`.  An exclusive `flock`
serialises two processes started at once with the same state dir, and the new line is written to a
temporary file, fsync'd and renamed, so a crash mid-write leaves the old one intact.  Only this
identity survives a restart: stored replies never touch the disk.
"""

from __future__ import annotations

import fcntl
from dataclasses import dataclass
from pathlib import Path

from participant.durable import replace_file
from protocol.ids import INCARNATION_RE, mint_incarnation

GENERATION_FILE = "generation"


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    generation: int
    incarnation: str


def _parse(path: Path, text: str) -> AgentIdentity | None:
    """The identity a generation file holds (a file written before incarnations existed holds the
    counter alone: its incarnation is unknown, "")."""
    if not text:
        return None
    counter, _, incarnation = text.partition(" ")
    try:
        generation = int(counter)
    except ValueError:
        raise RuntimeError(f"corrupt generation file {path}: {text[:80]!r}") from None
    if incarnation and not INCARNATION_RE.match(incarnation):
        raise RuntimeError(f"corrupt generation file {path}: {text[:80]!r}")
    return AgentIdentity(generation, incarnation)


def next_identity(state_dir: Path) -> AgentIdentity:
    """Takes this start's identity: the counter read, incremented and stored with a fresh incarnation."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / GENERATION_FILE
    with open(state_dir / (GENERATION_FILE + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            previous = _parse(path, path.read_text().strip() if path.exists() else "")
            current = AgentIdentity(previous.generation + 1 if previous else 1, mint_incarnation())
            replace_file(path, f"{current.generation} {current.incarnation}\n".encode())
            return current
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_identity(state_dir: Path) -> AgentIdentity | None:
    """The newest identity started with `state_dir` (None before the first start), without taking one."""
    path = state_dir / GENERATION_FILE
    try:
        return _parse(path, path.read_text().strip())
    except (FileNotFoundError, RuntimeError):
        return None


def read_generation(state_dir: Path) -> int | None:
    """The newest generation started with `state_dir` (None before the first start)."""
    identity = read_identity(state_dir)
    return identity.generation if identity is not None else None
