"""The Prometheus export against the log: every exported figure equals the same figure computed from
the events (by other code: type counts, the coordinator's own ledger fold), after a faulty run."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest

from eventstore import EventStore
from eventstore.events import AckOwed
from protocol.wire import CompletionReceipt, FaultRates, RateFaults
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from trainer.gym import GymClient
from trainer.telemetry import JOURNAL_BATCHES

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from projections.exporter import serve_metrics  # noqa: E402
from trainer.telemetry import journal_families  # noqa: E402


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_every_exported_figure_is_the_logs(store: EventStore, make_agent: MakeAgent) -> None:
    agent = make_agent("a")
    before_batches = JOURNAL_BATCHES.copy()[0].count
    async with GymClient(agent.url, "a") as client:
        # Lost replies and failures: retires, adoptions and replacements to count.  Sibling mode and a
        # long lease keep a slow (loaded) machine from turning the run into rounds of timeouts.
        await client.set_faults(RateFaults(rates=FaultRates(drop_reply=0.4, fail=0.2), seed=7))
        coord = coordinator(store, {"a": client}, mode="sibling", max_tries=8, rollout_timeout_s=60.0)
        async with coord:
            # Fixed ids (the log and the agent are this test's own): the seeded faults hit the same
            # tries in every run (drop_reply on metrics-a_g0, metrics-b_g0/g1, metrics-c_g1; fail on
            # metrics-b_g0, metrics-c_g1), whatever ids other tests of the process drew before.
            for name in ("metrics-a", "metrics-b", "metrics-c"):
                await coord.submit(name, PROMPT, "a", 2, PAYLOAD)
            await coord.wait_idle(240)
            for _ in range(2):
                assert (await coord.checkpoint(gid("ck"))).committed
            batches = coord.journal_figures()["batches"]
            # A debt no agent will pay (its agent does not exist): it must show as unpaid.
            receipt = CompletionReceipt(
                rollout_id="orphan_g0",
                attempt_index=0,
                execution_generation=1,
                result_identity="r",
                result_digest="sha256:" + "0" * 64,
                manifest_capture_key="orphan_g0",
                terminal_model_call_id="c",
            )
            store.append("group-orphan", [AckOwed(agent_name="ghost", receipt=receipt)])
            await coord.catch_up()
            ledger_debts = Counter(a for a, _ in coord.ledger.unpaid_debts())
    head = store.head()
    store.save_position("a-subscriber", max(0, head - 5))

    server = serve_metrics(store, 0, [journal_families])
    try:
        samples = _scrape(server.port)
    finally:
        server.close()

    events = list(store.read_all(0))
    types = Counter(e.type for e in events)
    assert types["AttemptAdopted"] + types["ReplacementMinted"] > 0, "the fault mix produced nothing to count"
    p = "ledger_"
    assert _value(samples, p + "log_position") == head
    for name in ("a", "ghost"):
        assert _value(samples, p + "unpaid_ack_debts", agent=name) == ledger_debts.get(name, 0)
    assert _value(samples, p + "unpaid_ack_debts", agent="ghost") == 1
    for outcome, event_type in (
        ("started", "CheckpointPrepareStarted"),
        ("committed", "CheckpointCommitted"),
        ("aborted", "CheckpointAborted"),
    ):
        assert _value(samples, p + "checkpoints_total", outcome=outcome) == types[event_type]
    waits = [
        float(w)
        for e in events
        if e.type in ("CheckpointCommitted", "CheckpointAborted")
        for w in e.data["prepare_wait_s"].values()
    ]
    assert _value(samples, p + "checkpoint_prepare_wait_seconds_count") == len(waits) > 0
    assert _value(samples, p + "checkpoint_prepare_wait_seconds_sum") == pytest.approx(sum(waits))
    for bound in ("0.1", "1.0", "+Inf"):
        limit = float("inf") if bound == "+Inf" else float(bound)
        assert _value(samples, p + "checkpoint_prepare_wait_seconds_bucket", le=bound) == sum(
            w <= limit for w in waits
        )
    retires = Counter(e.data["outcome"] for e in events if e.type == "AttemptRetired")
    for outcome in ("cancelled", "tombstoned", "completed_unacknowledged", "done"):
        assert _value(samples, p + "retires_total", outcome=outcome) == retires[outcome]
    for name, event_type in (
        ("adoptions_total", "AttemptAdopted"),
        ("replacements_total", "ReplacementMinted"),
        ("groups_reserved_total", "GroupReserved"),
        ("groups_sealed_total", "GroupSealed"),
        ("groups_abandoned_total", "GroupAbandoned"),
        ("acks_accepted_total", "AckAccepted"),
    ):
        assert _value(samples, p + name) == types[event_type], name
    dead = Counter(e.data.get("budget") or "none" for e in events if e.type == "GroupDeadLettered")
    for budget in ("infra", "data", "tries", "none"):
        assert _value(samples, p + "retry_budget_exhausted_total", budget=budget) == dead[budget], budget
    # Nothing finished at the agent was left without a debt, and no try ran twice: as the agent says.
    async with GymClient(agent.url, "a") as client:
        runs = await client.debug_runs()
    assert _value(samples, p + "stranded_results") == 0
    assert (
        _value(samples, p + "duplicate_executions_total") == sum(n - 1 for n in runs.values() if n > 1) == 0
    )
    assert _value(samples, p + "subscriber_lag_events", subscriber="a-subscriber") == 5
    assert _value(samples, p + "journal_batch_appends_count") - before_batches == batches


def test_the_agent_exports_what_its_status_says(make_agent: MakeAgent) -> None:
    agent = make_agent("a")
    status = httpx.get(f"{agent.url}/status", timeout=10).json()
    text = httpx.get(f"{agent.url}/metrics", timeout=10).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    a = (("agent", "a"),)
    assert samples[("gym_agent_completed_unacknowledged", a)] == status["completed_unacknowledged"]
    assert samples[("gym_agent_execution_generation", a)] == status["execution_generation"]
    assert samples[("gym_agent_checkpoint_phase", (("agent", "a"), ("phase", status["phase"])))] == 1


async def test_a_stranded_result_and_a_duplicate_execution_are_counted(store: EventStore) -> None:
    """Hand-written evidence: a try retire said finished and nobody owed; a try with two results."""
    from eventstore.events import AttemptRetired, ReceiptFetched

    def receipt(identity: str) -> CompletionReceipt:
        return CompletionReceipt(
            rollout_id="x_g0",
            attempt_index=0,
            execution_generation=1,
            result_identity=identity,
            result_digest="sha256:" + "1" * 64,
            manifest_capture_key="x_g0",
            terminal_model_call_id="c",
        )

    store.append(
        "group-x",
        [
            AttemptRetired(rollout_id="x_g1", attempt_index=0, outcome="completed_unacknowledged"),
            ReceiptFetched(agent_name="a", receipt=receipt("first")),
            ReceiptFetched(agent_name="a", receipt=receipt("second")),
        ],
    )
    server = serve_metrics(store, 0)
    try:
        samples = _scrape(server.port)
    finally:
        server.close()
    assert _value(samples, "ledger_stranded_results") == 1
    assert _value(samples, "ledger_duplicate_executions_total") == 1
