"""The reference resources server (gym_resources), one resource of each class, over real HTTP, and the
reference agent calling it across a resume:

- a key is applied once (a repeat is answered from the record), also after a restart with the state
  directory kept; a restore undoes the mutations after its revision and forgets their keys;
- export_restore (bank): a try retired mid-episode is resumed by its replacement, the bank restored to
  the boundary's revision: every turn's deposit stands exactly once, as in an uninterrupted lineage;
- restart_only (mailer): a resume is declined and the replacement plays from its prompt on a fresh
  session; no message is sent twice on one session;
- stateless (calculator): nothing kept, nothing exported.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from gym_agent.server import serve_in_thread as serve_agent
from gym_resources.book import side_effects
from gym_resources.server import serve_in_thread as serve_resources
from protocol.ids import capture_key
from protocol.resources import MutationKey, ToolCall
from tests.gym.conftest import fresh_id, run_request
from tests.gym.test_turn_resume import _config, _interrupt
from trainer.gym import GymClient


def _call(session: str, turn: int, tool: str, **arguments: Any) -> dict[str, Any]:
    key = MutationKey(rollout_id="r1_g0", lineage=session, turn=turn)
    return ToolCall(session=session, key=key, tool=tool, arguments=arguments).model_dump(mode="json")


def test_each_class_over_http_and_a_restart(tmp_path: Path) -> None:
    with serve_resources(tmp_path / "res") as res, httpx.Client(base_url=res.url) as http:
        listed = {r["name"]: r["resource_class"] for r in http.get("/resources").json()["resources"]}
        assert listed == {"bank": "export_restore", "mailer": "restart_only", "calculator": "stateless"}
        first = http.post("/resources/bank/call", json=_call("s1", 1, "deposit", amount=30)).json()
        again = http.post("/resources/bank/call", json=_call("s1", 1, "deposit", amount=30)).json()
        assert first == {"output": {"balance": 30}, "revision": 1, "applied": True}
        assert again == {"output": {"balance": 30}, "revision": 1, "applied": False}  # from the record
        http.post("/resources/bank/call", json=_call("s1", 2, "deposit", amount=5))
        assert http.post("/resources/bank/export", json={"session": "s1"}).json()["revision"] == 2
        undone = http.post("/resources/bank/restore", json={"session": "s1", "revision": 1}).json()
        assert undone == {"revision": 1, "reverted": 1}
        redo = http.post("/resources/bank/call", json=_call("s1", 2, "deposit", amount=5)).json()
        assert redo == {"output": {"balance": 35}, "revision": 2, "applied": True}  # applies once again
        refused = http.post("/resources/mailer/export", json={"session": "s1"})
        assert refused.status_code == 409 and refused.json()["error"] == "resource_class"
        sent = http.post("/resources/mailer/call", json=_call("s1", 1, "send", to="u", body="hi")).json()
        assert sent["applied"] and sent["output"] == {"sent": 1}
        calc = http.post("/resources/calculator/call", json=_call("s1", 1, "mul", a=6, b=7)).json()
        assert calc == {"output": {"value": 42.0}, "revision": 0, "applied": True}
        bad = http.post("/resources/bank/call", json=_call("s1", 3, "deposit", amount=-1))
        assert bad.status_code == 422 and "amount" in bad.json()["message"]
        assert http.post("/resources/nope/call", json=_call("s1", 1, "x")).status_code == 404
    # Restarted with its journal: the repeat of an applied key is still answered from the record.
    with serve_resources(tmp_path / "res") as res, httpx.Client(base_url=res.url) as http:
        repeat = http.post("/resources/mailer/call", json=_call("s1", 1, "send", to="u", body="hi")).json()
        assert repeat == {"output": {"sent": 1}, "revision": 1, "applied": False}
        assert http.post("/resources/bank/export", json={"session": "s1"}).json()["revision"] == 2
    effects = side_effects(tmp_path / "res")
    assert (effects.applied, effects.repeats, effects.reverted, effects.twice) == (4, 2, 1, [])


async def _resume_with(tmp_path: Path, resources: str) -> tuple[Any, Any, Path]:
    rid = fresh_id("rs") + "_g0"
    request = run_request(rid)
    state = tmp_path / "res"
    with serve_resources(state) as res:
        config = _config(
            tmp_path / "a", "a", delay_s=0.05, resources_url=res.url, resources=tuple(resources.split(","))
        )
        with serve_agent(config) as agent:
            async with GymClient(agent.url, "a") as client:
                offer = await _interrupt(client, request, after_calls=2)
                await client.run(request.model_copy(update={"attempt_index": 1}), continue_from=offer.digest)
                receipt = await client.completion_receipt(rid, 1)
    return offer, receipt, state


async def test_an_export_restore_resource_is_restored_and_each_deposit_stands_once(tmp_path: Path) -> None:
    offer, receipt, state = await _resume_with(tmp_path, "bank,calculator")
    assert {r.name: r.resource_class for r in offer.resources} == {
        "bank": "export_restore",
        "calculator": "stateless",
    }
    bank = next(r for r in offer.resources if r.name == "bank")
    assert bank.revision == offer.turn and bank.session == offer.lineage  # one deposit per turn done
    assert receipt.resume is not None and receipt.resume.outcome == "resumed"
    assert [(r.name, r.revision) for r in receipt.resume.restored] == [("bank", offer.turn)]
    effects = side_effects(state)
    # Five turns, a deposit after each but the last: each stands once on the lineage's session (a turn
    # the retire cut short after its deposit was undone by the restore, then applied once again).
    assert effects.twice == [] and effects.applied - effects.reverted == 4
    assert effects.by_resource.get("calculator", 0) == 0  # stateless: nothing journaled


async def test_a_restart_only_resource_declines_the_resume_and_the_replacement_starts_afresh(
    tmp_path: Path,
) -> None:
    offer, receipt, state = await _resume_with(tmp_path, "mailer")
    assert [(r.name, r.resource_class, r.revision) for r in offer.resources] == [
        ("mailer", "restart_only", 0)
    ]
    assert receipt.resume is not None and receipt.resume.outcome == "declined"
    assert receipt.resume.reason == "restart_only_resource"
    effects = side_effects(state)
    # The replacement played from its prompt on a lineage (a session) of its own: all its sends are
    # new, none repeats one of the first try's, and no key's effect stands twice.
    assert effects.twice == [] and effects.repeats == 0
    assert effects.applied == offer.turn + 4
    assert capture_key(offer.rollout_id, 1) != offer.lineage


class HoldExport:
    """A gate around the resources server: the `hold`-th export of the bank is held (the agent's try
    stuck after that turn's deposit, before its boundary) until the test releases it."""

    def __init__(self, app: ASGIApp, hold: int) -> None:
        self.app, self.hold, self.seen = app, hold, 0
        self.reached = threading.Event()
        self.release = threading.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/resources/bank/export":
            self.seen += 1
            if self.seen == self.hold:
                self.reached.set()
                while not self.release.is_set():
                    await asyncio.sleep(0.01)
        await self.app(scope, receive, send)


async def test_a_turn_cut_short_after_its_deposit_is_undone_and_applied_once_across_an_agent_restart(
    tmp_path: Path,
) -> None:
    """Try 0 is retired after turn 2's deposit and before its boundary (the gate holds turn 2's
    export); the agent restarts with its state directory kept and the replacement resumes turn 1's
    boundary: the restore undoes turn 2's deposit, and the resumed turn 2 applies it once again."""
    rid = fresh_id("cut") + "_g0"
    request = run_request(rid)
    state = tmp_path / "res"
    gates: list[HoldExport] = []

    def wrap(app: ASGIApp) -> ASGIApp:
        gates.append(HoldExport(app, hold=2))
        return gates[-1]

    with serve_resources(state, wrap=wrap) as res:
        bank = {"resources_url": res.url, "resources": ("bank",)}
        with serve_agent(_config(tmp_path / "a", "a", **bank)) as agent:
            async with GymClient(agent.url, "a") as client:
                run = asyncio.create_task(client.run(request))
                assert await asyncio.to_thread(gates[0].reached.wait, 60)
                answer = await client.retire(rid, 0)
                run.cancel()
        offer = answer.continuation
        assert answer.retired and offer is not None and offer.turn == 1
        assert [(r.name, r.revision) for r in offer.resources] == [("bank", 1)]
        gates[0].release.set()
        with serve_agent(_config(tmp_path / "a", "a", **bank)) as agent:  # restarted, state kept
            async with GymClient(agent.url, "a") as client:
                await client.run(request.model_copy(update={"attempt_index": 1}), continue_from=offer.digest)
                receipt = await client.completion_receipt(rid, 1)
    assert receipt.resume is not None and receipt.resume.outcome == "resumed" and receipt.resume.turn == 1
    effects = side_effects(state)
    # Deposits of turns 1 and 2 by try 0, turn 2's undone by the restore, turns 2-4 by try 1.
    assert (effects.applied, effects.reverted, effects.restores, effects.twice) == (5, 1, 1, [])
    assert effects.applied - effects.reverted == 4  # each turn's deposit stands once
