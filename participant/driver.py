"""The one trainer that drives this agent: bound at the trainer's `start()`, checked on every call
that changes what the agent holds (docs/gym.md, One trainer per agent).

An agent has one checkpoint phase and one admission gate, and it knows its tries only by the ids a
trainer minted: two trainers driving one agent would prepare, retire, adopt and ACK each other's work
(one trainer's checkpoint adopting the other's tries, its ACKs releasing results the other still owes).
Sharing it safely would need a phase, a gate and a namespace of executions per trainer; one trainer
per agent needs none of that, and a second trainer is told so at its `start()`, before it does
anything.  So the agent is bound to one trainer id at a time:

- `POST /driver {trainer_id}` binds an unbound agent, or answers for the trainer already bound; any
  other trainer gets `409 trainer_conflict` naming the bound one (the trainer raises `AgentShared`).
- every `/run`, `/acknowledge`, `/retire` and `/checkpoint/*` call of a coordinator names its trainer in
  the `x-ledger-trainer` header (empty: the unnamed trainer); another trainer's call is refused the same
  way, and a call that finds the agent unbound binds it (an agent that lost its state directory is
  bound again by the first call that reaches it).  A call without the header is not checked.
- `POST /driver/release {trainer_id}` (the bound trainer's `close()`) unbinds the agent only when it
  holds nothing of that trainer: no live or unacknowledged try, no checkpoint in progress; otherwise
  the binding stays, for that trainer's recovery.

The binding is kept in `<state dir>/driver.json` (one checksummed record, `participant.records`,
written aside and renamed), so it survives a restart with the state directory; a lost directory loses
it with the results it guarded, and a damaged one refuses the start (`FileDamaged`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Final

from participant.durable import replace_file
from participant.errors import AgentError, InvalidRequestError
from participant.records import FileDamaged, read_document, seal_json
from protocol.errors import TRAINER_CONFLICT
from protocol.ids import ID_PATTERN
from protocol.wire import AgentStatus, DriverResponse

DRIVER_FILE: Final = "driver.json"


class TrainerConflictError(AgentError):
    status_code = 409
    error = TRAINER_CONFLICT


def _label(trainer_id: str | None) -> str:
    return "the unnamed trainer" if trainer_id is None else f"trainer {trainer_id!r}"


def trainer_of_header(value: str) -> str | None:
    """The trainer a `x-ledger-trainer` header names ("" is the unnamed trainer)."""
    if value == "":
        return None
    if not re.fullmatch(ID_PATTERN, value):
        raise InvalidRequestError(f"x-ledger-trainer {value[:80]!r} is not a trainer id")
    return value


class DriverBinding:
    """Which trainer drives this agent (None: unbound), as kept in `<state dir>/driver.json`."""

    def __init__(self, agent_name: str, state_dir: Path) -> None:
        self.agent_name = agent_name
        self.path = state_dir / DRIVER_FILE
        self.bound = False
        self.trainer_id: str | None = None
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        self.bound, self.trainer_id = True, _read(self.path, data)

    def answer(self) -> DriverResponse:
        return DriverResponse(agent_name=self.agent_name, bound=self.bound, trainer_id=self.trainer_id)

    def check(self, trainer_id: str | None) -> None:
        """Refuses a call of another trainer than the bound one; an unbound agent binds to the caller."""
        if not self.bound:
            self._write(trainer_id)
        elif trainer_id != self.trainer_id:
            raise TrainerConflictError(
                f"agent {self.agent_name!r} is driven by {_label(self.trainer_id)}, not by "
                f"{_label(trainer_id)}: one trainer per agent (close that trainer first, or give this "
                "one agents of its own)"
            )

    def bind(self, trainer_id: str | None) -> DriverResponse:
        self.check(trainer_id)
        return self.answer()

    def release(self, trainer_id: str | None, status: AgentStatus) -> DriverResponse:
        """Unbinds if `trainer_id` is the bound trainer and the agent holds nothing of it."""
        if not self.bound:
            return self.answer()
        self.check(trainer_id)
        held = status.running + status.parked + status.park_requested + status.completed_unacknowledged
        if held or status.active_checkpoint_id is not None:
            return self.answer()  # kept: that trainer's recovery comes back for what it holds
        self.path.unlink(missing_ok=True)
        self.bound, self.trainer_id = False, None
        return self.answer()

    def _write(self, trainer_id: str | None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(self.path, seal_json(json.dumps({"trainer_id": trainer_id})))
        self.bound, self.trainer_id = True, trainer_id


def _read(path: Path, data: bytes) -> str | None:
    """The trainer a binding names; FileDamaged when the file is not one whole binding (a file
    written before bindings carried a checksum, `{"trainer_id": ...}`, is read as it was)."""
    record, _ = read_document(path, data)
    try:
        saved = json.loads(record)
        if not isinstance(saved, dict) or set(saved) != {"trainer_id"}:
            raise TypeError(saved)
        tid = saved["trainer_id"]
        if tid is not None and (not isinstance(tid, str) or not re.fullmatch(ID_PATTERN, tid)):
            raise TypeError(tid)
    except json.JSONDecodeError as exc:
        raise FileDamaged(path, exc.pos, f"not a driver binding ({exc.msg})") from None
    except (ValueError, TypeError):
        raise FileDamaged(path, 0, f"not a driver binding: {data[:80]!r}") from None
    return tid
