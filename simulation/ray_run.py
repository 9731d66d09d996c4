"""`ledger simulate --ray`: the same workload, with the coordinator inside a Ray actor (`LedgerGym`)
driven the way NeMo RL drives its Gym actor: rows in, `run_rollouts(...)` with
`num_returns="streaming"`, results in completion order.

The prompts go out in calls of `window_per_agent x agents` prompts, two calls in flight (NeMo RL's async
GRPO keeps several); checkpoints run through the actor beside them.  With `kill_after`, the actor is
killed once after that many rows came back: Ray restarts it (it recovers from the log) and retries the
calls in flight (they resume), and the summary shows whether anything was lost or delivered twice.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import Counter
from typing import Any

from eventstore import EventStore
from protocol.ids import MAX_ID_LENGTH
from simulation.run import Agents, RunFacts, SimConfig, summarize_run, workload_payload
from trainer.eventloop import wait_at_most
from trainer.journal import Journal
from trainer.settings import log


def workload_rows(config: SimConfig, names: list[str]) -> list[list[dict[str, Any]]]:
    """The workload as NeMo RL rows, one list per call (a prompt's `siblings` rows contiguous)."""
    per_call = max(1, config.window_per_agent * len(names))
    calls: list[list[dict[str, Any]]] = []
    for first in range(0, config.groups, per_call):
        rows: list[dict[str, Any]] = []
        for i in range(first, min(first + per_call, config.groups)):
            for _ in range(config.siblings):
                rows.append(
                    {
                        "agent_ref": {"name": names[i % len(names)]},
                        **workload_payload(i),
                        "_ng_task_index": i,
                        "_rowidx": len(rows),
                    }
                )
        calls.append(rows)
    return calls


async def run_ray_simulation(
    store: EventStore,
    db_url: str,
    config: SimConfig,
    *,
    kill_after: int | None = None,
    calls_in_flight: int = 2,
) -> dict[str, Any]:
    from trainer.ray_gym.local import init_local_ray, prepare_loopback

    prepare_loopback()
    import ray

    if config.run_id and len(config.run_id) > MAX_ID_LENGTH // 4:
        raise ValueError(f"run id {config.run_id!r} is too long")
    own_ray = not ray.is_initialized()
    if own_ray:
        env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
        # Loopback only: Ray's daemons would otherwise listen on every interface.
        init_local_ray(log_to_driver=False, runtime_env={"env_vars": env})
    try:
        return await _run(store, db_url, config, kill_after, calls_in_flight)
    finally:
        if own_ray:
            ray.shutdown()  # also ends Ray's thread that prints task errors to stdout


async def _run(
    store: EventStore, db_url: str, config: SimConfig, kill_after: int | None, calls_in_flight: int
) -> dict[str, Any]:
    import ray

    from trainer.ray_gym import LedgerGymConfig, ledger_gym_actor

    run_id = config.run_id or f"s{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    delivered: Counter[tuple[int, int]] = Counter()
    waits: list[float] = []
    kills = 0
    async with Agents(config) as agents:
        names = sorted(agents.clients)
        gym = ledger_gym_actor().remote(
            LedgerGymConfig(
                db_url=db_url,
                agents={n: c.base_url for n, c in agents.clients.items()},
                agent_token=config.agent_token,
                mode=config.mode,
                num_generations=config.siblings,
                group_prefix=f"{run_id}-",
                rollout_timeout_s=config.rollout_timeout_s,
                prepare_timeout_s=config.prepare_timeout_s,
                park_grace_s=config.park_grace_s,
                max_tries=config.max_tries,
            )
        )
        await gym._spinup.remote()
        gate = asyncio.Semaphore(calls_in_flight)

        async def call(k: int, rows: list[dict[str, Any]]) -> None:
            nonlocal kills
            async with gate:
                stream = gym.run_rollouts.options(num_returns="streaming").remote(rows, "timing/rollout")
                async for ref in stream:
                    rowidx, _result, _timing = await ref
                    delivered[(k, rowidx)] += 1
                    if kill_after is not None and not kills and delivered.total() >= kill_after:
                        kills += 1
                        log.warning("killing the coordinator's actor after %d rows", delivered.total())
                        ray.kill(gym, no_restart=False)

        stop = asyncio.Event()

        async def checkpoints() -> None:
            k = 0
            while not stop.is_set():
                await wait_at_most(stop.wait(), config.checkpoint_every_s)
                if stop.is_set():
                    return
                try:
                    outcome = await gym.checkpoint.remote(f"{run_id}-ckpt-{k}")
                    waits.extend(outcome["prepare_wait_s"].values())
                except ray.exceptions.RayError as exc:
                    # A checkpoint in flight when the actor died: recovery presumed it aborted.
                    log.warning("checkpoint %s-ckpt-%d did not finish: %s", run_id, k, exc)
                k += 1

        calls = workload_rows(config, names)
        checkpointer = asyncio.create_task(checkpoints()) if config.checkpoint_every_s > 0 else None
        try:
            await asyncio.gather(*(call(k, rows) for k, rows in enumerate(calls)))
        finally:
            stop.set()
            if checkpointer is not None:
                await checkpointer
        await gym.wait_idle.remote(60)
        figures = await gym.metrics.remote()
        elapsed = time.monotonic() - started
        stranded, duplicates = await agents.final_counts()
        await gym.shutdown.remote()
        ray.kill(gym, no_restart=True)
        await agents.stop_supervising()

    journal = Journal(store)
    await journal.load()
    rows_expected = sum(len(rows) for rows in calls)
    summary = await summarize_run(
        store,
        config,
        run_id,
        agents,
        RunFacts(
            wall_s=elapsed,
            groups_claimed=len({(k, i // config.siblings) for k, i in delivered}),
            prepare_waits=waits,
            stranded=stranded,
            duplicate_executions=duplicates,
            debts_outstanding=sum(
                1
                for a, r in journal.ledger.unpaid_debts()
                if r.rollout_id.startswith(run_id) and a in agents.clients
            ),
            journal_appends=int(figures.get("journal/appends", 0)),
            journal_batches=int(figures.get("journal/batches", 0)),
            payload_puts=int(figures.get("payloads/puts", 0)),
            payload_store_calls=int(figures.get("payloads/store_calls", 0)),
        ),
    )
    summary.update(
        {
            "ray": True,
            "rows": rows_expected,
            "rows_delivered": len(delivered),
            "rows_delivered_twice": sum(1 for n in delivered.values() if n > 1),
            "actor_kills": kills,
        }
    )
    return summary


def ray_failed(summary: dict[str, Any]) -> bool:
    """Beyond `failed`: a row never delivered, or delivered twice."""
    return bool(summary["rows_delivered"] != summary["rows"] or summary["rows_delivered_twice"])
