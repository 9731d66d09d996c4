"""An operator drops a debt no evidence will ever pay, and the checkpoint it blocked commits.

The agent behind the client accepts every ACK for real but answers `unknown_execution` from its own
generation (a broken proxy, say): the trainer has no evidence the agent lost the result, so the debt
stays owed and every checkpoint aborts on it until `ledger debt drop` says otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from cli.main import app
from eventstore import EventStore
from gym_agent.config import AgentConfig
from projections.audit import audit_log
from tests.rollout.conftest import PAYLOAD, PROMPT, coordinator, gid
from tests.rollout.hostile_agent import Rule, serve_hostile
from trainer.gym import GymClient


def _denies_every_ack(body: Any) -> Any:
    return {
        "results": [
            {**r, "acknowledged": False, "idempotent": False, "error": "unknown_execution"}
            for r in body["results"]
        ]
    }


async def test_a_kept_debt_blocks_checkpoints_until_the_operator_drops_it(
    store: EventStore, store_url: str, tmp_path: Path
) -> None:
    config = AgentConfig(name="h", state_dir=tmp_path / "h", log_level="warning", turns=(2, 2), delay_s=0.01)
    g = gid("op")
    with serve_hostile(config, [Rule("/acknowledge", lambda _p, _b: True, _denies_every_ack)]) as agent:
        async with GymClient(agent.url, "h") as client:
            coord = coordinator(store, {"h": client}, mode="sibling")
            async with coord:
                await coord.submit(g, PROMPT, "h", 1, PAYLOAD)
                await coord.wait_idle(30)
                # The gate: one ACK pass has run and left the debt kept (owed, not resent).
                assert await coord._acks.flush("h", 10)
                assert [r.rollout_id for _, r in coord.ledger.unpaid_debts("h")] == [f"{g}_g0"]
                blocked = await coord.checkpoint("c1")
                assert not blocked.committed and "unpaid" in (blocked.reason or ""), blocked

                result = CliRunner().invoke(
                    app, ["debt", "drop", f"{g}_g0", "0", "--reason", "the proxy lies", "--db", store_url]
                )
                assert result.exit_code == 0, result.output

                outcome = await coord.checkpoint("c2")
                assert outcome.committed, outcome
                assert coord.ledger.unpaid_debts("h") == []
    report = audit_log(store)
    assert report.ok, report.as_json()
