"""Prometheus export of the log's figures (`projections.figures`), served on `/metrics`.

    server = serve_metrics(store, port, extra=[journal_families])   # a thread; server.close() ends it

Every scrape folds what the log gained since the previous one and reports the figures as they stand,
so the numbers are the log's, not counters a restart resets.  Subscriber lag (log head minus each
subscriber's saved position) is read from the store at scrape time.  `prometheus_client` is the
optional extra `metrics`; it is imported when a server is made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from eventstore import EventStore
from projections.figures import Histogram, LogFigures, Snapshot
from projections.sql import subscriber_positions

PREFIX: Final = "ledger_"
# (metric name, help, the event types it counts) of plain event-count families.
_EVENT_COUNTERS: Final = (
    ("adoptions", "Tries adopted after their reply went missing (AttemptAdopted).", "AttemptAdopted"),
    ("replacements", "Replacement tries minted (ReplacementMinted).", "ReplacementMinted"),
    ("groups_reserved", "Groups reserved (GroupReserved).", "GroupReserved"),
    ("groups_sealed", "Groups sealed (GroupSealed).", "GroupSealed"),
    ("groups_claimed", "Groups claimed for training (GroupClaimedForTraining).", "GroupClaimedForTraining"),
    ("groups_abandoned", "prompt_group rounds abandoned (GroupAbandoned).", "GroupAbandoned"),
    ("acks_accepted", "ACKs the agents accepted (AckAccepted).", "AckAccepted"),
    ("acks_rejected", "ACKs the agents rejected (AckRejected).", "AckRejected"),
)

Families = Callable[[], Iterable[Any]]


def histogram_family(name: str, doc: str, hist: Histogram) -> Any:
    from prometheus_client.core import HistogramMetricFamily

    buckets = [("+Inf" if b == float("inf") else repr(float(b)), n) for b, n in hist.cumulative()]
    return HistogramMetricFamily(PREFIX + name, doc, buckets=buckets, sum_value=hist.total)


def log_families(s: Snapshot, lag: dict[str, int]) -> Iterator[Any]:
    """The metric families of one snapshot of the log's figures."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield GaugeMetricFamily(PREFIX + "log_position", "Position of the last event folded.", value=s.position)
    debts = GaugeMetricFamily(
        PREFIX + "unpaid_ack_debts", "ACK debts recorded and not yet paid, per agent.", labels=["agent"]
    )
    for agent, n in sorted(s.unpaid_debts.items()):
        debts.add_metric([agent], n)
    yield debts
    yield histogram_family(
        "checkpoint_prepare_wait_seconds",
        "Per agent, how long a checkpoint's prepare waited (CheckpointCommitted/Aborted prepare_wait_s).",
        s.prepare_wait,
    )
    checkpoints = CounterMetricFamily(
        PREFIX + "checkpoints",
        "Checkpoints by outcome (started, committed, aborted, resumed).",
        labels=["outcome"],
    )
    for outcome in ("started", "committed", "aborted", "resumed"):
        checkpoints.add_metric([outcome], s.checkpoints.get(outcome, 0))
    yield checkpoints
    yield GaugeMetricFamily(
        PREFIX + "stranded_results",
        "Tries finished at the agent (retire said completed_unacknowledged) never owed an ACK.",
        value=s.stranded,
    )
    yield CounterMetricFamily(
        PREFIX + "duplicate_executions",
        "Extra executions: receipts of one try naming more than one result identity.",
        value=s.duplicate_executions,
    )
    retires = CounterMetricFamily(
        PREFIX + "retires", "Tries retired, by outcome (AttemptRetired).", labels=["outcome"]
    )
    for outcome, n in sorted(s.retires.items()):
        retires.add_metric([outcome], n)
    yield retires
    dead = CounterMetricFamily(
        PREFIX + "retry_budget_exhausted",
        "Groups dead-lettered because a retry budget ran out (GroupDeadLettered), by budget.",
        labels=["budget"],
    )
    for budget, n in sorted(s.dead_letters.items()):
        dead.add_metric([budget], n)
    yield dead
    for name, doc, event_type in _EVENT_COUNTERS:
        yield CounterMetricFamily(PREFIX + name, doc, value=s.events.get(event_type, 0))
    logprobs = CounterMetricFamily(
        PREFIX + "logprob_results", "Logprob results by outcome (computed, refused).", labels=["outcome"]
    )
    for outcome in ("computed", "refused"):
        logprobs.add_metric([outcome], s.logprobs.get(outcome, 0))
    yield logprobs
    lags = GaugeMetricFamily(
        PREFIX + "subscriber_lag_events",
        "Events between the log head and a subscriber's position.",
        labels=["subscriber"],
    )
    for name, n in sorted(lag.items()):
        lags.add_metric([name], n)
    yield lags


def subscriber_lag(store: EventStore, head: int) -> dict[str, int]:
    return {name: max(0, head - position) for name, position in subscriber_positions(store).items()}


class LogCollector:
    """A `prometheus_client` collector: folds the log at each scrape and yields its families."""

    def __init__(self, store: EventStore, extra: Iterable[Families] = ()) -> None:
        self.store = store
        self.figures = LogFigures()
        self.extra = list(extra)

    def collect(self) -> Iterator[Any]:
        snapshot = self.figures.catch_up(self.store)
        yield from log_families(snapshot, subscriber_lag(self.store, self.store.head()))
        for families in self.extra:
            yield from families()


@dataclass
class MetricsServer:
    port: int
    _server: Any
    _thread: Any

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(
    store: EventStore, port: int, extra: Iterable[Families] = (), addr: str = "127.0.0.1"
) -> MetricsServer:
    """Serves `/metrics` on `addr:port` (0: a free port) in a thread until `close()`."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(LogCollector(store, extra))
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(int(server.server_port), server, thread)
