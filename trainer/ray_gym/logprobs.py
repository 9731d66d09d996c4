"""Logprob workers as Ray actors: the same `LogprobWorker`, placed by Ray (one GPU each when there is one).

    actors = start_logprob_workers(url, count=2)
    stats = ray.get([a.run.remote(once=True) for a in actors])

Each actor opens its own connection to the log and leases its own claims (`work_leases`), so any
number of them share one PostgreSQL log; an actor Ray restarts simply claims again (an unfinished
lease returns to the queue when it expires).  Use one worker per SQLite file.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from eventstore import EventStore, open_store
from workers.logprobs import LogprobWorker, WorkerConfig
from workers.policy import DEFAULT_POLICY_SPEC, load_policy


class LogprobWorkerActor:
    def __init__(
        self, db_url: str, policy: str = DEFAULT_POLICY_SPEC, config: dict[str, Any] | None = None
    ) -> None:
        import torch

        values = dict(config or {})
        values.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        self.store: EventStore = open_store(db_url, migrate_schema=True)
        self.worker = LogprobWorker(self.store, load_policy(policy), WorkerConfig(**values))

    def run(self, once: bool = True) -> dict[str, Any]:
        """Scores until stopped (with `once`: until the queue is drained); returns the worker's stats."""
        stats = self.worker.run(once=once)
        return {
            **dataclasses.asdict(stats),
            "worker": self.worker.worker_id,
            "device": self.worker.config.device,
        }

    def stop(self) -> None:
        self.worker.stop()

    def close(self) -> None:
        self.store.close()


def start_logprob_workers(
    db_url: str,
    count: int = 1,
    *,
    policy: str = DEFAULT_POLICY_SPEC,
    config: dict[str, Any] | None = None,
    num_gpus: float | None = None,
) -> list[Any]:
    """`count` worker actors; each asks Ray for one GPU when the driver sees one (or `num_gpus`)."""
    import ray
    import torch

    gpus = num_gpus if num_gpus is not None else (1.0 if torch.cuda.is_available() else 0.0)
    # A threaded actor so `stop` reaches a worker that is inside `run`.
    cls = ray.remote(max_restarts=-1)(LogprobWorkerActor).options(num_gpus=gpus, max_concurrency=2)
    return [cls.remote(db_url, policy, config) for _ in range(count)]
