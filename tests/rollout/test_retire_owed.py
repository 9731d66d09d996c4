"""A retire owed after a try declared lost: the agent's finished result is released when it is back.

The agent (real, over loopback) finishes a try whose `/run` reply is broken off; the trainer's retire
is answered `completed_unacknowledged`, and right then the agent goes away (the loopback proxy between
them is cut: every connection closed, new ones refused) for longer than the retire deadline, so the
try is declared lost and its group dead-lettered while the agent still holds the result.  When the
agent is reachable again, the owed retire (folded from the log) is paid: the result is released
through its ACK, never adopted, and the audit finds nothing stranded.  Without the debt the result
stays at the agent for ever and the audit names it stranded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from typer.testing import CliRunner

from cli.main import app
from eventstore import EventStore
from eventstore.events import (
    AckAccepted,
    AckOwed,
    AttemptAdopted,
    GroupSealed,
    RetireOwed,
    RetirePaid,
    RunFailed,
    SiblingSealed,
)
from projections.audit import NO_STRANDED_RESULT, audit_log
from projections.base import decode
from protocol.retry import RetryPolicy
from protocol.wire import AttemptFault
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from trainer import RolloutCoordinator
from trainer.gym import GymClient
from trainer.retires import IDLE_POLL_S

# Short budgets, so "away past the retire deadline" is a second, not half a minute.
RETIRE = RetryPolicy(max_calls=8, deadline_s=1.0, base_s=0.05, cap_s=0.2)
OWED = RetryPolicy(max_calls=4, deadline_s=1.0, base_s=0.05, cap_s=0.2)
# Stuck at the first failure, then called at the cap: five to ten minutes, far past any wait here.
OWED_AT_LENGTH = RetryPolicy(max_calls=1, deadline_s=1.0, base_s=600.0, cap_s=600.0)


class Cuttable:
    """A TCP proxy on loopback in front of an agent that can be cut (every connection aborted, new
    ones refused: the agent is away) and restored on the same port (it is back, its state intact)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self.cut_once = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._open):
            writer.transport.abort()
        self._open.clear()
        self.cut_once.set()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._server is None:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._open |= {writer, up_writer}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        try:
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        finally:
            self._open -= {writer, up_writer}


class AwayAfterRetire(GymClient):
    """The agent goes away right after it answered a retire with `completed_unacknowledged`: the
    proxy is cut as that answer arrives, so the adoption that follows cannot reach it."""

    proxy: ClassVar[Cuttable | None] = None
    calls: ClassVar[int] = 0

    async def retire(self, rollout_id: str, attempt_index: int, checkpoint_id: str | None = None) -> Any:
        type(self).calls += 1
        answer = await super().retire(rollout_id, attempt_index, checkpoint_id)
        proxy = type(self).proxy
        if answer.completed_unacknowledged and proxy is not None and not proxy.cut_once.is_set():
            proxy.cut()
        return answer


def events(store: EventStore, group_id: str) -> list[Any]:
    return [decode(e) for e in store.read_stream(f"group-{group_id}")]


async def lose_a_finished_try(
    store: EventStore, make_agent: MakeAgent, owed_policy: RetryPolicy = OWED
) -> tuple[str, Cuttable, GymClient, RolloutCoordinator, AwayAfterRetire]:
    """Up to the loss: the try finished at the agent, declared lost, its group dead-lettered, the
    agent away and still holding the result.  Returns the group, the proxy, a direct client to the
    agent (the test's own view of it, never cut), the coordinator and its client."""
    agent = make_agent("a")
    direct = GymClient(agent.url, "a")
    proxy = Cuttable(int(agent.url.rsplit(":", 1)[1]))
    await proxy.start()
    AwayAfterRetire.proxy = proxy
    client = AwayAfterRetire(proxy.url, "a", control_timeout_s=1.0)
    g = gid()
    rid = f"{g}_g0"
    await direct.set_faults(AttemptFault(rollout_id=rid, attempt_index=0, drop_reply=True))
    coord = coordinator(store, {"a": client}, retire_policy=RETIRE, retire_owed_policy=owed_policy)
    await coord.start()
    await coord.submit(g, PROMPT, "a", 1, PAYLOAD)
    await coord.wait_idle(60)
    assert proxy.cut_once.is_set()
    group = coord.ledger.groups.get(g) or coord.ledger.archived[g]
    assert group.status == "dead_lettered"
    log = events(store, g)
    lost = [e for e in log if isinstance(e, RunFailed) and e.kind == "agent_lost"]
    assert lost and "declared lost" in lost[-1].reason
    [owed] = [e for e in log if isinstance(e, RetireOwed)]
    assert (owed.agent_name, owed.rollout_id, owed.attempt_index) == ("a", rid, 0)
    assert [d.rollout_id for d in coord.ledger.retires["a"].values()] == [rid]
    # The agent still holds the finished result, and the audit says so, naming the retire owed.
    assert (await direct.status()).completed_unacknowledged == 1
    stranded = [v for v in audit_log(store).violations if v.rule == NO_STRANDED_RESULT]
    assert len(stranded) == 1 and "a retire is owed" in stranded[0].message, stranded
    return g, proxy, direct, coord, client


async def paid(coord: RolloutCoordinator, direct: GymClient) -> None:
    """The gate: the log shows the retire paid and every ACK accepted, and the agent holds nothing."""
    async with asyncio.timeout(30):
        while coord.ledger.retires or coord.ledger.unpaid_debts():
            await asyncio.sleep(0.02)
        while (await direct.status()).completed_unacknowledged:
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def stuck_after_losing(
    store: EventStore, make_agent: MakeAgent, owed_policy: RetryPolicy = OWED
) -> AsyncIterator[tuple[str, Cuttable, GymClient, RolloutCoordinator]]:
    """`lose_a_finished_try`, then the agent away until the relay has spent its budget (stuck, called
    on at the cap); everything closed on the way out."""
    g, proxy, direct, coord, client = await lose_a_finished_try(store, make_agent, owed_policy)
    try:
        async with asyncio.timeout(30):
            while not coord._retires.stuck:
                await asyncio.sleep(0.02)
        yield g, proxy, direct, coord
    finally:
        await coord.close()
        await client.aclose()
        await direct.aclose()
        proxy.cut()


def assert_released_not_adopted(store: EventStore, g: str) -> None:
    log = events(store, g)
    [retire_paid] = [e for e in log if isinstance(e, RetirePaid)]
    assert retire_paid.outcome == "released"
    assert [e.receipt.rollout_id for e in log if isinstance(e, AckOwed)] == [f"{g}_g0"]
    assert [e.rollout_id for e in log if isinstance(e, AckAccepted)] == [f"{g}_g0"]
    # Released, never taken into training: no adoption, no seal.
    assert not [e for e in log if isinstance(e, AttemptAdopted | SiblingSealed | GroupSealed)]
    report = audit_log(store)
    assert report.ok, report.as_json()


async def test_a_try_lost_while_its_agent_was_away_is_released_when_it_comes_back(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    # Away for a while: the relay keeps calling (within its budget, then at the cap).
    async with stuck_after_losing(sqlite_store, make_agent) as (g, proxy, direct, coord):
        assert (await direct.status()).completed_unacknowledged == 1
        await proxy.start()
        await paid(coord, direct)
        assert coord._retires.paid == 1 and coord._retires.released == 1
        group = coord.ledger.groups.get(g) or coord.ledger.archived[g]
        assert group.status == "dead_lettered"
    assert_released_not_adopted(sqlite_store, g)


async def test_an_agent_that_answers_again_has_its_owed_retires_called_at_once(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """Back, the agent answers the reconcile's `/health` (every 5 s): that lifts the wait of its owed retires
    (`Context.answered`), so the retire is paid now, not at the cap's five to ten minutes."""
    async with stuck_after_losing(sqlite_store, make_agent, OWED_AT_LENGTH) as (g, proxy, direct, coord):
        await proxy.start()
        await paid(coord, direct)
        assert coord._retires.paid == 1 and coord._retires.released == 1
    assert_released_not_adopted(sqlite_store, g)


async def test_an_operator_drops_the_retire_owed_to_an_agent_gone_for_good(
    sqlite_store: EventStore, sqlite_url: str, make_agent: MakeAgent
) -> None:
    """The agent never comes back: `ledger debt drop` pays the owed retire by the operator's word, the
    live trainer sees it at its next read of the log (any append of its own makes one) and owes nothing."""
    async with stuck_after_losing(sqlite_store, make_agent) as (g, _proxy, _direct, coord):
        drop = ["debt", "drop", f"{g}_g0", "0", "--reason", "agent host decommissioned", "--db", sqlite_url]
        result = CliRunner().invoke(app, drop)
        assert result.exit_code == 0 and "dropped the retire owed" in result.output, result.output
        await coord.catch_up()  # what its next append does: the log has another writer's row
        assert coord.owed_retire_agents() == [] and coord.ledger.retires == {}
        called = AwayAfterRetire.calls
        # Three passes of the relay, each of which called the stuck agent (at OWED's cap) while owed.
        await asyncio.sleep(3 * IDLE_POLL_S)
        assert AwayAfterRetire.calls == called
        assert coord._retires.paid == 0  # paid by the operator, not by a retire the agent answered
    assert not [e for e in events(sqlite_store, g) if isinstance(e, RetirePaid)]  # the operator's stream
    report = audit_log(sqlite_store)
    assert report.ok, report.as_json()


async def test_a_trainer_restarted_before_the_agent_is_back_still_pays_the_retire(
    sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    g, proxy, direct, coord, client = await lose_a_finished_try(sqlite_store, make_agent)
    await coord.close()
    await client.aclose()
    # A new trainer process knows the debt from the log alone.
    again = GymClient(proxy.url, "a", control_timeout_s=1.0)
    recovered = await RolloutCoordinator.recover(
        sqlite_store, {"a": again}, retire_policy=RETIRE, retire_owed_policy=OWED
    )
    try:
        assert [d.rollout_id for d in recovered.ledger.retires["a"].values()] == [f"{g}_g0"]
        await proxy.start()
        await paid(recovered, direct)
        assert recovered._retires.paid == 1
    finally:
        await recovered.close()
        await again.aclose()
        await direct.aclose()
        proxy.cut()
    assert_released_not_adopted(sqlite_store, g)
