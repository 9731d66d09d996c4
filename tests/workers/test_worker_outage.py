"""A logprob worker rides out a database outage within its budget, and stops (typed, named) past it."""

from __future__ import annotations

import pytest

from eventstore import open_store, upgrade_database
from eventstore.testing import PgCluster
from workers.logprobs import LogprobWorker, WorkerConfig, WorkerStopped
from workers.policy import Policy


def test_a_database_gone_past_the_outage_budget_stops_the_worker(policy: Policy) -> None:
    with PgCluster() as cluster:
        url = cluster.url(cluster.create_database())
        upgrade_database(url)
        store = open_store(url)
        try:
            config = WorkerConfig(poll_interval_s=0.05, backend="torch", outage_budget_s=0.5)
            worker = LogprobWorker(store, policy, config, worker_id="w-outage")
            cluster.pg_ctl("stop", "-m", "immediate")
            with pytest.raises(WorkerStopped, match=r"unavailable for more than 0\.5 s \(\d+ rounds\)"):
                worker.run()
            cluster.pg_ctl("start")
            assert worker.run(once=True).scored == 0  # back, with nothing to score: it finishes
        finally:
            store.close()


def test_an_unusable_outage_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="outage_budget_s"):
        WorkerConfig(outage_budget_s=0)
