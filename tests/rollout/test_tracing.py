"""OpenTelemetry spans per try, made from the log: one trace per rollout, /run -> receipt -> seal -> ACK."""

from __future__ import annotations

import pytest

from eventstore import EventStore
from tests.rollout.conftest import PAYLOAD, PROMPT, MakeAgent, coordinator, gid
from trainer.gym import GymClient
from trainer.tracing import SERVICE_NAME, emit_try_spans, trace_id_of, tracer_resource

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


async def test_each_try_is_a_trace_of_its_rollout(sqlite_store: EventStore, make_agent: MakeAgent) -> None:
    store = sqlite_store
    agent = make_agent("a")
    async with GymClient(agent.url, "a") as client:
        coord = coordinator(store, {"a": client}, mode="prompt_group", rollout_timeout_s=60.0)
        async with coord:
            g = gid()
            await coord.submit(g, PROMPT, "a", 2, PAYLOAD)
            await coord.wait_idle(120)
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=tracer_resource("run-7"))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert emit_try_spans(store.read_all(0), provider.get_tracer("test")) == 2
    spans = exporter.get_finished_spans()
    for i in range(2):
        rid = f"{g}_g{i}"
        mine = {s.name: s for s in spans if s.context.trace_id == trace_id_of(rid)}
        assert set(mine) == {"try", "run", "receipt", "seal", "ack"}
        root = mine["try"]
        assert root.attributes["ledger.rollout_id"] == rid and root.attributes["ledger.outcome"] == "sealed"
        for name in ("run", "receipt", "seal", "ack"):
            assert mine[name].parent is not None and mine[name].parent.span_id == root.context.span_id
        # The hand-off in order, on the log's clock.
        assert mine["run"].start_time <= mine["run"].end_time <= mine["receipt"].end_time
        assert mine["receipt"].end_time <= mine["seal"].end_time <= mine["ack"].end_time <= root.end_time
        # Every span names its service and run, and each step says what it recorded.
        for span in mine.values():
            assert span.resource.attributes["service.name"] == SERVICE_NAME
            assert span.resource.attributes["ledger.run_id"] == "run-7"
        for name in ("run", "receipt", "seal", "ack"):
            attributes = mine[name].attributes
            assert attributes["ledger.rollout_id"] == rid and attributes["ledger.agent"] == "a"
        assert isinstance(mine["run"].attributes["ledger.reward"], float)
        assert mine["run"].attributes["ledger.capture_key"]
        assert mine["receipt"].attributes["ledger.execution_generation"] >= 1
        assert mine["seal"].attributes["ledger.seal"] == "sealed"
        assert mine["seal"].attributes["ledger.token_count"] > 0
        assert mine["ack"].attributes["ledger.ack"] == "accepted"
