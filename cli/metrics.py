"""`--metrics-port`: the Prometheus endpoint a command serves while it runs (the `metrics` extra)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import typer

from cli.common import require_extra
from eventstore import EventStore
from projections.exporter import PREFIX, Families, MetricsServer
from projections.exporter import serve_metrics as serve_log_metrics
from trainer.telemetry import journal_families

if TYPE_CHECKING:  # the trainer's metrics need no torch
    from workers.logprobs import LogprobWorker


def _queue_families(worker: LogprobWorker) -> Families:
    def families() -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        counts = worker.counts()  # the lease table: durable, shared by every worker of the policy
        queue = GaugeMetricFamily(
            PREFIX + "logprob_queue_tries",
            "Tries in the logprob work queue of this worker's policy version, by state.",
            labels=["policy_version", "state"],
        )
        queue.add_metric([worker.policy_version, "open"], counts.open)
        queue.add_metric([worker.policy_version, "done"], counts.done)
        yield queue

    return families


def serve_metrics(
    store: EventStore, port: int, role: Literal["trainer", "worker"], worker: LogprobWorker | None = None
) -> MetricsServer:
    require_extra("metrics", "--metrics-port", "prometheus_client")
    extra: list[Families] = [journal_families] if role == "trainer" else []
    if worker is not None:
        extra.append(_queue_families(worker))
    server = serve_log_metrics(store, port, extra)
    typer.echo(f"metrics on http://127.0.0.1:{server.port}/metrics", err=True)
    return server
