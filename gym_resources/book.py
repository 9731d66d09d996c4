"""The reference resources server's state: one session per (resource, lineage), every change journaled.

Three resources, one of each class (`protocol.resources`):

    bank        export_restore  a balance; `deposit` / `withdraw` change it (one revision each);
                                exported as its revision, restored to an earlier one (the mutations
                                after it undone, their keys forgotten, so a resumed turn applies them once)
    mailer      restart_only    `send` puts a message in an outbox, which nothing takes back: it
                                exports nothing, and a try that touched it restarts from the prompt
    calculator  stateless       `add` / `mul`: nothing kept

Every mutation carries a `MutationKey`: a key applied before is answered from its record, nothing
changes (`applied: false`).  The journal (`<state dir>/resources.jsonl`, one fsync'd checksummed line
per applied mutation, repeat, restore and release; `participant.records`) is the server's durable evidence: `Book.load` rebuilds the
sessions from it after a restart, and `side_effects` counts from it, in order, what was applied, what
a repeat was answered from the record, what a restore undid, and any key whose effect stands twice.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from participant.records import FileDamaged, RecordReader, cut_torn_tail, parsed_records, seal_json
from protocol import mutants
from protocol.resources import MutationKey, ResourceClass, ResourceInfo, ToolResult

JOURNAL_FILE: Final = "resources.jsonl"


class ToolError(ValueError):
    """A call the resource refuses (unknown tool, bad arguments, not enough balance): nothing changes."""


class ClassError(ValueError):
    """An operation the resource's class does not have (exporting a restart_only resource)."""


Tool = Callable[[dict[str, Any], dict[str, Any]], tuple[Any, dict[str, Any] | None]]


def _amount(args: dict[str, Any]) -> int:
    value = args.get("amount")
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= 10**9:
        raise ToolError("amount must be an integer from 1 to 1e9")
    return value


def _deposit(state: dict[str, Any], args: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    balance = int(state.get("balance", 0)) + _amount(args)
    return {"balance": balance}, {"balance": balance}


def _withdraw(state: dict[str, Any], args: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    amount, balance = _amount(args), int(state.get("balance", 0))
    if amount > balance:
        return {"balance": balance, "refused": "insufficient funds"}, None
    return {"balance": balance - amount}, {"balance": balance - amount}


def _send(state: dict[str, Any], args: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    to, body = args.get("to"), args.get("body")
    if not isinstance(to, str) or not isinstance(body, str) or not to or len(body) > 10_000:
        raise ToolError("send needs `to` and `body` (strings)")
    outbox = [*state.get("outbox", []), {"to": to, "body": body}]
    return {"sent": len(outbox)}, {"outbox": outbox}


def _number(args: dict[str, Any], name: str) -> float:
    value = args.get(name)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ToolError(f"{name} must be a number")
    return float(value)


def _add(state: dict[str, Any], args: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    return {"value": _number(args, "a") + _number(args, "b")}, None


def _mul(state: dict[str, Any], args: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    return {"value": _number(args, "a") * _number(args, "b")}, None


@dataclass(frozen=True)
class Resource:
    name: str
    resource_class: ResourceClass
    tools: dict[str, Tool]

    def info(self) -> ResourceInfo:
        return ResourceInfo(name=self.name, resource_class=self.resource_class, tools=sorted(self.tools))


RESOURCES: Final[dict[str, Resource]] = {
    r.name: r
    for r in (
        Resource("bank", "export_restore", {"deposit": _deposit, "withdraw": _withdraw}),
        Resource("mailer", "restart_only", {"send": _send}),
        Resource("calculator", "stateless", {"add": _add, "mul": _mul}),
    )
}


@dataclass
class Session:
    """One lineage's state of one resource: the state after each revision (index 0: empty), and the
    keys applied with the revision each made and its answer."""

    states: list[dict[str, Any]] = field(default_factory=lambda: [{}])
    applied: dict[str, tuple[int, Any]] = field(default_factory=dict)

    @property
    def revision(self) -> int:
        return len(self.states) - 1


@dataclass
class SideEffects:
    """What the journal shows, read in order: `applied` mutations, `repeats` answered from the record,
    `reverted` mutations undone by restores, and `twice`: keys whose effect stands twice (applied again
    while their first application was never undone): none, if the protocol holds."""

    applied: int = 0
    repeats: int = 0
    reverted: int = 0
    restores: int = 0
    twice: list[str] = field(default_factory=list)
    by_resource: dict[str, int] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "applied": self.applied,
            "repeats": self.repeats,
            "reverted": self.reverted,
            "restores": self.restores,
            "side_effects_twice": len(self.twice),
            "twice": self.twice[:20],
            "by_resource": dict(sorted(self.by_resource.items())),
        }


class _Line(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    resource: Literal["bank", "mailer", "calculator"]
    session: str


class CallLine(_Line):
    op: Literal["call"]
    key: str
    tool: str
    attempt: int
    output: Any
    state: dict[str, Any]


class RepeatLine(_Line):
    op: Literal["repeat"]
    key: str
    attempt: int


class RestoreLine(_Line):
    op: Literal["restore"]
    revision: int = Field(ge=0)


class ReleaseLine(_Line):
    op: Literal["release"]


# One journal line, as `Book` writes it (checked when it is read back).
_JOURNAL_LINE: Final = TypeAdapter[CallLine | RepeatLine | RestoreLine | ReleaseLine](
    Annotated[CallLine | RepeatLine | RestoreLine | ReleaseLine, Field(discriminator="op")]
)
# How every journal line began before lines carried a checksum (keys sorted): call and repeat lines
# with `attempt`, restore and release lines with `op`.
_LEGACY_STARTS: Final = (b'{"attempt":', b'{"op":"')


def journal_line(line: dict[str, Any]) -> bytes:
    """A change as the journal keeps it: one checksummed line (`participant.records`)."""
    return seal_json(json.dumps(line, separators=(",", ":"), sort_keys=True))


class Book:
    """The sessions of every resource, and the journal lines each change writes (the server makes them
    durable before it answers).  Pure: no I/O but `load`."""

    def __init__(self) -> None:
        self.sessions: dict[tuple[str, str], Session] = {}
        self.effects = SideEffects()
        # (resource, session, key) -> whether its effect stands now (applied and not undone)
        self._standing: set[tuple[str, str, str]] = set()

    @staticmethod
    def resource(name: str) -> Resource:
        found = RESOURCES.get(name)
        if found is None:
            raise KeyError(f"no resource {name!r} (this server has {', '.join(sorted(RESOURCES))})")
        return found

    def session(self, resource: str, session: str) -> Session:
        return self.sessions.setdefault((resource, session), Session())

    def call(
        self, name: str, session: str, key: MutationKey, tool: str, args: dict[str, Any], attempt: int
    ) -> tuple[ToolResult, dict[str, Any] | None]:
        """The answer, and the journal line to make durable first (None: nothing to journal)."""
        resource = self.resource(name)
        fn = resource.tools.get(tool)
        if fn is None:
            raise ToolError(f"{name} has no tool {tool!r} (it has {', '.join(sorted(resource.tools))})")
        if resource.resource_class == "stateless":
            output, _ = fn({}, args)
            return ToolResult(output=output, revision=0, applied=True), None
        s = self.session(name, session)
        text = key.text()
        if text in s.applied and not mutants.active("mutation_key_ignored"):
            _, output = s.applied[text]
            line = {"op": "repeat", "resource": name, "session": session, "key": text, "attempt": attempt}
            self._see(line)
            return ToolResult(output=output, revision=s.revision, applied=False), line
        output, new_state = fn(dict(s.states[-1]), args)
        if new_state is None:  # refused by the tool itself (insufficient funds): recorded, no revision
            new_state = s.states[-1]
        line = {
            "op": "call",
            "resource": name,
            "session": session,
            "key": text,
            "tool": tool,
            "attempt": attempt,
            "output": output,
            "state": new_state,
        }
        self.apply(line)
        return ToolResult(output=output, revision=s.revision, applied=True), line

    def export(self, name: str, session: str) -> int:
        resource = self.resource(name)
        if resource.resource_class == "restart_only":
            raise ClassError(f"{name} is restart_only: its state cannot be exported")
        if resource.resource_class == "stateless":
            return 0
        return self.session(name, session).revision

    def restore(self, name: str, session: str, revision: int) -> tuple[int, dict[str, Any]]:
        """The mutations undone, and the journal line."""
        resource = self.resource(name)
        if resource.resource_class == "restart_only":
            raise ClassError(f"{name} is restart_only: it cannot be restored")
        if resource.resource_class == "stateless":
            return 0, {}
        s = self.session(name, session)
        if revision > s.revision:
            raise ClassError(f"{name}/{session} is at revision {s.revision}, not past it ({revision})")
        line = {"op": "restore", "resource": name, "session": session, "revision": revision}
        reverted = s.revision - revision
        self.apply(line)
        return reverted, line

    def release(self, name: str, session: str) -> dict[str, Any]:
        self.resource(name)
        line = {"op": "release", "resource": name, "session": session}
        self.apply(line)
        return line

    # --- the fold of the journal (the same code applies a live change and a line read back) ---

    def apply(self, line: dict[str, Any]) -> None:
        op, name, session = line["op"], line["resource"], line["session"]
        if op == "call":
            s = self.session(name, session)
            changed = line["state"] != s.states[-1] or RESOURCES[name].resource_class == "restart_only"
            if changed:
                s.states.append(line["state"])
            s.applied[line["key"]] = (s.revision, line["output"])
        elif op == "restore":
            s = self.session(name, session)
            if line["revision"] > s.revision:
                raise IndexError(f"{name}/{session} has no revision {line['revision']} to restore")
            undone = [k for k, (rev, _) in s.applied.items() if rev > line["revision"]]
            for k in undone:
                del s.applied[k]
                self._standing.discard((name, session, k))
            self.effects.reverted += len(s.states) - 1 - line["revision"]
            self.effects.restores += 1
            del s.states[line["revision"] + 1 :]
        elif op == "release":
            self.sessions.pop((name, session), None)
            self._standing = {k for k in self._standing if k[:2] != (name, session)}
        self._see(line)

    def _see(self, line: dict[str, Any]) -> None:
        if line["op"] == "repeat":
            self.effects.repeats += 1
        elif line["op"] == "call":
            standing = (line["resource"], line["session"], line["key"])
            self.effects.applied += 1
            self.effects.by_resource[line["resource"]] = self.effects.by_resource.get(line["resource"], 0) + 1
            if standing in self._standing:
                self.effects.twice.append("/".join(standing))
            self._standing.add(standing)

    @classmethod
    def load(cls, state_dir: Path) -> Book:
        """The book as the journal left it: a torn last line is skipped (it was never answered); a
        damaged record is `FileDamaged` (`participant.records`), never read around."""
        return cls._read(Path(state_dir) / JOURNAL_FILE)[0]

    @classmethod
    def recover(cls, state_dir: Path) -> Book:
        """`load`, as the server does at its start: a torn last line is also cut off the journal, so
        the next line starts a line of its own."""
        book, reader = cls._read(Path(state_dir) / JOURNAL_FILE)
        cut_torn_tail(reader)
        return book

    @classmethod
    def _read(cls, path: Path) -> tuple[Book, RecordReader]:
        book = cls()
        reader = RecordReader(path, _LEGACY_STARTS)
        for record, line in parsed_records(reader, _JOURNAL_LINE.validate_json):
            data = line.model_dump(mode="json")
            try:
                if line.op == "repeat":
                    book._see(data)
                else:
                    book.apply(data)
            except (KeyError, IndexError) as exc:
                raise FileDamaged(path, record.offset, f"a change the book cannot make ({exc!r})") from None
        return book, reader


def side_effects(state_dir: Path) -> SideEffects:
    """What the server's journal shows (durable evidence, read in order)."""
    return Book.load(state_dir).effects
