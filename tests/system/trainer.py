"""One trainer process of the multi-process system test (`python -m tests.system.trainer ...`).

    python -m tests.system.trainer --db URL --trainer-id A --agent agent-1=http://... --agent agent-2=...
           --groups 16 --siblings 4 --mode prompt_group [--stop-file PATH] [--resume]

Drives groups `<trainer-id>-p0, -p1, ...` through its own agents only (a checkpoint is a cut across
one trainer and the agents it drives: two trainers never checkpoint the same agent), checkpoints
every `--checkpoint-every` seconds, claims sealed groups for training, and prints `DONE <json>` once
every group of its own is sealed or dead-lettered and every debt is paid.

It submits `--groups` groups, or, with `--stop-file`, keeps submitting until that file exists: a test
then decides when the workload ends, so a phase that needs the trainer busy (a database restart, a
crash) never finds it already done, however fast or slow this process runs next to the others.

With `--resume` it first recovers from the log (`RolloutCoordinator.recover`, which takes over this
trainer's open groups and fences any stale owner), then submits whatever groups of the workload the
log does not know yet, and finishes like a fresh run.  Group ids are deterministic, so a resumed
trainer never submits a group twice.

Database outages are ridden out by the coordinator's journal (retried with backoff); this process
says so on stderr each time the journal's retry counter moves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import json
import logging
import signal
import sys
import time
import uuid
from itertools import count
from pathlib import Path

from eventstore import EventStore, open_store
from eventstore.events import PromptRef
from simulation.run import CheckpointLoop, claim_as_sealed
from trainer import RolloutCoordinator
from trainer.checkpoints import CheckpointOutcome
from trainer.eventloop import run_async
from trainer.gym import GymClient

log = logging.getLogger("trainer")


class Backlog:
    """Sealed attempts that no logprob worker has scored yet, counted from the log as it grows (every
    trainer's and every worker's), so that a workload fed for as long as a test needs stays within what
    the workers can score, however slowly they run next to everything else."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.position = 0
        self.unscored = 0

    def refresh(self) -> int:
        for e in self.store.read_all(self.position, types=["SiblingSealed", "LogprobsComputed"]):
            self.unscored += 1 if e.type == "SiblingSealed" else -1
            self.position = e.position
        return self.position


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.system.trainer")
    p.add_argument("--db", required=True)
    p.add_argument("--trainer-id", required=True)
    p.add_argument("--agent", action="append", required=True, help="NAME=URL (repeatable)")
    p.add_argument("--groups", type=int, default=16, help="how many groups (without --stop-file)")
    p.add_argument("--stop-file", type=Path, help="submit groups until this file exists")
    p.add_argument("--siblings", type=int, default=4)
    p.add_argument("--mode", choices=["sibling", "prompt_group"], default="prompt_group")
    p.add_argument("--window", type=int, default=6, help="groups open at once")
    p.add_argument(
        "--max-unscored",
        type=int,
        default=0,
        help="hold new groups back while more sealed attempts than this wait for a logprob worker (0: no limit)",
    )
    p.add_argument("--checkpoint-every", type=float, default=1.0)
    p.add_argument("--rollout-timeout", type=float, default=8.0)
    p.add_argument("--prepare-timeout", type=float, default=20.0)
    p.add_argument("--outage-budget", type=float, default=60.0)
    p.add_argument("--resume", action="store_true", help="recover this trainer's groups from the log first")
    return p.parse_args(argv)


async def main(args: argparse.Namespace) -> dict[str, object]:
    agents: dict[str, str] = {}
    for item in args.agent:
        name, _, url = item.partition("=")
        agents[name] = url
    tid = args.trainer_id
    store = open_store(args.db)
    clients = {name: GymClient(url, name) for name, url in agents.items()}
    kwargs = {
        "mode": args.mode,
        "trainer_id": tid,
        "rollout_timeout_s": args.rollout_timeout,
        "prepare_timeout_s": args.prepare_timeout,
        "outage_budget_s": args.outage_budget,
    }
    started = time.monotonic()
    try:
        if args.resume:
            coord = await RolloutCoordinator.recover(store, clients, **kwargs)
            log.info("trainer %s recovered; open groups: %s", tid, coord.open_groups())
        else:
            coord = RolloutCoordinator(store, clients, **kwargs)
            await coord.start()
        print(f"READY {tid}", flush=True)

        def dump() -> None:
            # `kill -USR1 <pid>`: what every task waits on, and what this trainer believes.
            for task in asyncio.all_tasks():
                print(f"--- task {task.get_name()}", file=sys.stderr)
                task.print_stack(limit=12, file=sys.stderr)
            print(
                f"open groups {coord.open_groups()} active checkpoint {coord.active_checkpoint} "
                f"owed {coord.owed_ack_agents()} position {coord.position} errors {coord.errors}",
                file=sys.stderr,
                flush=True,
            )

        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)
        names = sorted(clients)
        nonce = uuid.uuid4().hex[:6]
        claimed: list[str] = []
        checkpoints: list[CheckpointOutcome] = []

        async def watch_outages() -> None:
            # The journal retries DatabaseUnavailable silently; surface each retry burst here.
            seen = 0
            while True:
                n = coord.journal_figures()["outage_retries"]
                if n != seen:
                    log.warning(
                        "trainer %s: the log is unavailable, retrying with backoff (%d retries)", tid, n
                    )
                    seen = n
                await asyncio.sleep(0.1)

        def stopped() -> bool:
            return args.stop_file is not None and args.stop_file.exists()

        backlog = Backlog(store)

        async def held_back() -> bool:
            if len(coord.open_groups()) >= args.window:
                return True
            if args.max_unscored <= 0:
                return False
            await coord.read_log(backlog.refresh, "the logprob backlog")
            return bool(backlog.unscored > args.max_unscored)

        async def feed() -> None:
            for i in count() if args.stop_file is not None else range(args.groups):
                group_id = f"{tid}-p{i}"
                if coord.ledger.knows_group(group_id):
                    continue  # submitted before a crash: recovery drives it
                while not stopped() and await held_back():
                    await asyncio.sleep(0.05)
                if stopped():
                    return
                await coord.submit(
                    group_id,
                    PromptRef(sample_id=f"{tid}-s{i}", task_name="arith"),
                    names[i % len(names)],
                    args.siblings,
                    {"responses_create_params": {"input": [{"role": "user", "content": f"{i}+{i}?"}]}},
                )

        watcher = asyncio.create_task(watch_outages())
        checkpointing = CheckpointLoop(
            coord, args.checkpoint_every, lambda k: f"{tid}-{nonce}-ck{k}", checkpoints
        )
        trainer = asyncio.create_task(claim_as_sealed(coord, claimed))
        await feed()
        while coord.open_groups():
            if coord.errors:
                raise coord.errors[0]
            await asyncio.sleep(0.1)
        await checkpointing.finish()
        await coord.wait_idle(60)
        await asyncio.sleep(0.3)
        for task in (trainer, watcher):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await coord.close()
        return {
            "trainer_id": tid,
            "resumed": args.resume,
            "claimed": len(claimed),
            "checkpoints_committed": sum(o.outcome == "committed" for o in checkpoints),
            "checkpoints_aborted": sum(o.outcome == "aborted" for o in checkpoints),
            "outage_retries": coord.journal_figures()["outage_retries"],
            "wall_s": round(time.monotonic() - started, 2),
        }
    finally:
        for client in clients.values():
            await client.aclose()
        store.close()


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("trainer").setLevel(logging.INFO)
    # `kill -QUIT <pid>` prints every thread's stack; USR1 every asyncio task's (see main).
    faulthandler.register(signal.SIGQUIT, file=sys.stderr, all_threads=True)
    logging.getLogger("trainer").setLevel(logging.INFO)
    summary = run_async(main(parse_args()))
    print("DONE " + json.dumps(summary), flush=True)
