"""A logprob worker in its own process, for the test that kills one mid-batch.

    python -m tests.workers.worker_proc '{"url": ..., "claim_size": 2, ...}'

Prints `READY` once loaded, `HANG <work key>` when it stops forever inside a result's transaction
(`hang_at`: the 1-based count of results), and a JSON line of its stats when it finishes.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from eventstore import open_store
from workers.logprobs import LogprobWorker, WorkerConfig, WorkerHooks
from workers.policy import load_policy


def main(args: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    store = open_store(args["url"])
    policy = load_policy(args.get("policy", "tiny"))
    commits = 0

    def in_transaction(key: str) -> None:
        nonlocal commits
        commits += 1
        if commits == args.get("hang_at"):
            print(f"HANG {key}", flush=True)
            while True:
                time.sleep(60)

    worker = LogprobWorker(
        store,
        policy,
        WorkerConfig(
            claim_size=int(args.get("claim_size", 4)),
            lease_s=float(args.get("lease_s", 30.0)),
            poll_interval_s=0.05,
            backend=args.get("backend", "torch"),
        ),
        worker_id=args.get("worker_id"),
        hooks=WorkerHooks(in_transaction=in_transaction),
    )
    print("READY", flush=True)
    stats = worker.run(once=True)
    print(
        json.dumps({"scored": stats.scored, "refused": stats.refused, "duplicates": stats.duplicates}),
        flush=True,
    )
    store.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
