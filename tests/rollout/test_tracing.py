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
        mine = {s.name: s for s in spans if s.context is not None and s.context.trace_id == trace_id_of(rid)}
        assert set(mine) == {"attempt", "run", "receipt", "seal", "ack"}
        root = mine["attempt"]
        assert root.context is not None
        attributes = {name: dict(span.attributes or {}) for name, span in mine.items()}
        assert (
            attributes["attempt"]["ledger.rollout_id"] == rid
            and attributes["attempt"]["ledger.outcome"] == "sealed"
        )
        for name in ("run", "receipt", "seal", "ack"):
            parent = mine[name].parent
            assert parent is not None and parent.span_id == root.context.span_id
        # The hand-off in order, on the log's clock (every finished span has both ends).
        start, end = {}, {}
        for name, span in mine.items():
            assert span.start_time is not None and span.end_time is not None
            start[name], end[name] = span.start_time, span.end_time
        assert start["run"] <= end["run"] <= end["receipt"]
        assert end["receipt"] <= end["seal"] <= end["ack"] <= end["attempt"]
        # Every span names its service and run, and each step says what it recorded.
        for span in mine.values():
            assert span.resource.attributes["service.name"] == SERVICE_NAME
            assert span.resource.attributes["ledger.run_id"] == "run-7"
        for name in ("run", "receipt", "seal", "ack"):
            assert attributes[name]["ledger.rollout_id"] == rid and attributes[name]["ledger.agent"] == "a"
        assert isinstance(attributes["run"]["ledger.reward"], float)
        assert attributes["run"]["ledger.capture_key"]
        generation = attributes["receipt"]["ledger.execution_generation"]
        assert isinstance(generation, int) and generation >= 1
        assert attributes["seal"]["ledger.seal"] == "sealed"
        token_count = attributes["seal"]["ledger.token_count"]
        assert isinstance(token_count, int) and token_count > 0
        assert attributes["ack"]["ledger.ack"] == "accepted"
