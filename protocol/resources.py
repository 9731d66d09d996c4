"""The resources participant protocol: what an agent and a resources server (the tools a rollout calls,
with state of their own) say to each other so that a try can resume at a turn boundary.

Every resource is of one class (`participant.states.RESOURCE_RULES` says what each implies):

    export_restore  its state is exported at each turn boundary as a revision, and restored at that
                    revision when a continuation resumes
    restart_only    its state cannot be exported: a try that touched it restarts from the prompt
    stateless       nothing to save or restore

A resource's state lives in a **session**, one per lineage (the chain of tries that share one
conversation; its id is the capture key of the try whose prompt began it), so a try that restarts from
the prompt starts on a fresh session.  Every mutation carries a `MutationKey` (rollout, lineage, turn,
call within the turn): a resources server applies a key once and answers a repeat from its record, so a
resumed turn never applies a side effect twice.

The HTTP routes of the reference resources server (`gym_resources/`) use these shapes:

    GET  /resources                        -> ResourceList
    POST /resources/{name}/call            ToolCall -> ToolResult
    POST /resources/{name}/export          SessionRequest -> Revision
    POST /resources/{name}/restore         RestoreRequest -> Revision
    POST /resources/{name}/release         SessionRequest -> Revision
`ResourceClass` and `ResourceRevision` (what a continuation records of a resource) are in
`protocol.wire`, beside the continuation shapes that carry them.
"""

from __future__ import annotations

from typing import Any, Final, get_args

from pydantic import Field

from protocol.ids import AttemptIndex, Identifier
from protocol.wire import ResourceClass, ResourceRevision, WireModel

__all__ = [
    "KEY_SEPARATOR",
    "RESOURCE_CLASSES",
    "MutationKey",
    "ResourceClass",
    "ResourceInfo",
    "ResourceList",
    "ResourceRevision",
    "RestoreRequest",
    "Revision",
    "SessionRequest",
    "ToolCall",
    "ToolResult",
]

RESOURCE_CLASSES: Final[tuple[ResourceClass, ...]] = get_args(ResourceClass)
# `/` never occurs in an Identifier, so a key's text splits back unambiguously.
KEY_SEPARATOR: Final = "/"


class MutationKey(WireModel):
    """The idempotency key of one mutation: the same (rollout, lineage, turn, call) is applied once."""

    rollout_id: Identifier
    lineage: Identifier
    turn: int = Field(ge=1)
    call: int = Field(default=0, ge=0)

    def text(self) -> str:
        return KEY_SEPARATOR.join((self.rollout_id, self.lineage, str(self.turn), str(self.call)))


class ResourceInfo(WireModel):
    name: Identifier
    resource_class: ResourceClass
    tools: list[str]


class ResourceList(WireModel):
    resources: list[ResourceInfo]


class ToolCall(WireModel):
    session: Identifier
    key: MutationKey
    tool: str = Field(min_length=1, max_length=200)
    arguments: dict[str, Any] = Field(default_factory=dict)
    # The try making the call (for the server's journal; the key alone decides idempotency).
    attempt_index: AttemptIndex = 0


class ToolResult(WireModel):
    output: Any
    # The session's revision after the call (0 for a stateless resource).
    revision: int = Field(ge=0)
    # False when the key was applied before: the answer is the recorded one, nothing changed.
    applied: bool


class SessionRequest(WireModel):
    session: Identifier


class RestoreRequest(WireModel):
    session: Identifier
    revision: int = Field(ge=0)


class Revision(WireModel):
    revision: int = Field(ge=0)
    # restore: mutations undone (they came after the revision); release: always 0.
    reverted: int = Field(default=0, ge=0)
