"""`ledger worker logprobs --metrics-port`: the queue (the lease table) and the results (the log)."""

from __future__ import annotations

import httpx
import pytest

from eventstore import EventStore
from tests.workers.tries import seal_group
from workers.logprobs import LogprobWorker, WorkerConfig
from workers.policy import Policy

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families

from cli.metrics import serve_metrics


def _samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_worker_exports_its_queue_and_the_logs_results(store: EventStore, policy: Policy) -> None:
    seal_group(store, policy, "m1", 3)
    worker = LogprobWorker(store, policy, WorkerConfig(claim_size=2, poll_interval_s=0.05, backend="torch"))
    server = serve_metrics(store, 0, "worker", worker)
    try:
        worker.board.enqueue()
        before = _samples(server.port)
        worker.run(once=True)
        after = _samples(server.port)
    finally:
        server.close()
    version = worker.policy_version
    open_, done = (
        ("ledger_logprob_queue_tries", (("policy_version", version), ("state", "open"))),
        (
            "ledger_logprob_queue_tries",
            (("policy_version", version), ("state", "done")),
        ),
    )
    assert before[open_] == 3 and before[done] == 0
    assert after[open_] == 0 and after[done] == 3
    computed = sum(1 for e in store.read_all(0) if e.type == "LogprobsComputed")
    assert after[("ledger_logprob_results_total", (("outcome", "computed"),))] == computed == 3
    assert "ledger_journal_batch_appends_count" not in {name for name, _ in after}  # no journal here
