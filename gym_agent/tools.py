"""The reference agent's tools: one call per resource of a resources server at each turn, keyed by
(rollout, lineage, turn, call) so a repeat is never applied twice, the session being the lineage's
(docs/turns.md, Resources).  At a boundary the belt exports what the lineage's resources are at; on a
resume it restores the export/restore ones to the revisions the continuation recorded."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from protocol.resources import (
    MutationKey,
    ResourceList,
    ResourceRevision,
    RestoreRequest,
    Revision,
    SessionRequest,
    ToolCall,
    ToolResult,
)
from protocol.wire import ResourceClass


def _call_of(name: str, turn: int) -> tuple[str, dict[str, Any]]:
    """The tool a turn calls on each reference resource, and its arguments (a pure function of the turn)."""
    if name == "bank":
        return "deposit", {"amount": 10 * turn}
    if name == "mailer":
        return "send", {"to": "user", "body": f"the result of turn {turn}"}
    return "add", {"a": turn, "b": 1}


class ToolBelt:
    """A client of one resources server, calling `names` (all of its resources when empty)."""

    def __init__(self, url: str, names: Sequence[str] = (), timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.names = list(names)
        self.classes: dict[str, ResourceClass] = {}
        self._client = httpx.AsyncClient(base_url=self.url, timeout=timeout_s)

    async def _post(self, path: str, body: Any) -> dict[str, Any]:
        response = await self._client.post(path, json=body.model_dump(mode="json"))
        if response.status_code != 200:
            raise RuntimeError(
                f"resources server: POST {path} answered {response.status_code}: {response.text[:200]}"
            )
        answer: dict[str, Any] = response.json()
        return answer

    async def connect(self) -> None:
        response = await self._client.get("/resources")
        response.raise_for_status()
        listed = {r.name: r.resource_class for r in ResourceList.model_validate(response.json()).resources}
        missing = [n for n in self.names if n not in listed]
        if missing:
            raise RuntimeError(f"the resources server has no {', '.join(missing)}")
        self.classes = {n: listed[n] for n in (self.names or sorted(listed))}

    async def turn(
        self, rollout_id: str, lineage: str, turn: int, attempt_index: int
    ) -> list[dict[str, Any]]:
        """This turn's tool calls, one per resource: each answer as the tool's output item."""
        if not self.classes:
            await self.connect()
        items = []
        for i, name in enumerate(self.classes):
            tool, args = _call_of(name, turn)
            call = ToolCall(
                session=lineage,
                key=MutationKey(rollout_id=rollout_id, lineage=lineage, turn=turn, call=i),
                tool=tool,
                arguments=args,
                attempt_index=attempt_index,
            )
            result = ToolResult.model_validate(await self._post(f"/resources/{name}/call", call))
            items.append(
                {"type": "function_call_output", "call_id": f"tool-{turn}-{name}", "output": result.output}
            )
        return items

    async def export(self, lineage: str) -> list[ResourceRevision]:
        """What each resource the lineage touched is at now (export/restore: its revision; others: 0)."""
        out = []
        for name, cls in self.classes.items():
            revision = 0
            if cls == "export_restore":
                revision = Revision.model_validate(
                    await self._post(f"/resources/{name}/export", SessionRequest(session=lineage))
                ).revision
            out.append(ResourceRevision(name=name, resource_class=cls, session=lineage, revision=revision))
        return out

    async def restore(self, revisions: Sequence[ResourceRevision]) -> None:
        """The participant's restorer: each export/restore resource back at its recorded revision."""
        for r in revisions:
            await self._post(
                f"/resources/{r.name}/restore", RestoreRequest(session=r.session, revision=r.revision)
            )

    async def close(self) -> None:
        await self._client.aclose()
