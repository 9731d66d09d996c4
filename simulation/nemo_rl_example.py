"""A NeMo RL-shaped run on `LedgerGym`, end to end, on a local Ray (docs/nemo-rl.md, A runnable example).

    python -m simulation.nemo_rl_example --dir /tmp/nemo-rl-example [--steps 3] [--prompts 2]

It does what NeMo RL's async GRPO does around its Gym actor, with two reference agents in place of
the Gym servers and a sum of rewards in place of a model update:

- setup (`spinup_nemo_gym_actor`): the actor made from NeMo RL's own `NemoGymConfig`, its `ledger`
  section inside `initial_global_config_dict` (where `env.nemo_gym.ledger` lands), `_spinup`, then
  `set_tokenizer`; the run starts from the checkpoint NeMo RL loads (its newest `step_N`);
- each step: rows as `_prepare_nemo_gym_rows` stamps them, streamed as `run_async_nemo_gym_rollout`
  consumes them (grouped by `rowidx // num_generations`), then the save block of `grpo.py`:
  `tmp_step_N` made, the actor's checkpoint prepared, the trainer's state saved, the checkpoint
  committed with the manifest written into `tmp_step_N`, and the directory renamed `step_N`;
- the first run dies after the log's commit of its last step and before the rename (the window in
  which NeMo RL comes back on the step before); the second run starts from what NeMo RL loads and
  the log is restored to the same checkpoint.

It prints (and `main` returns) what each run trained, what the agents ran, and the audit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

from gym_agent.launcher import AgentProcess
from projections.audit import audit_log
from trainer.gym import GymClient
from trainer.manifest import latest_step_dir
from trainer.ray_gym import ledger_gym_actor

GENERATIONS = 2
TRAINER_ID = "grpo-example"


class Crash(Exception):
    """The trainer died (the example's own, after the log's commit and before the rename)."""


def nemo_gym_config(db_url: str, results: Path, agents: dict[str, str]) -> dict[str, Any]:
    """`spinup_nemo_gym_actor`'s `NemoGymConfig`, the ledger section where `env.nemo_gym` puts it."""
    return {
        "model_name": "policy",
        "base_urls": ["http://127.0.0.1:8000/v1"],  # the generation servers (unused: agents given)
        "invalid_tool_call_patterns": None,
        "thinking_tags": None,
        "require_routed_experts": False,
        "routed_experts_dtype": "int16",
        "initial_global_config_dict": {
            "ledger": {
                "db_url": db_url,
                "trainer_id": TRAINER_ID,
                "agents": agents,
                "num_generations": GENERATIONS,
                "checkpoint_dir": str(results),  # NeMo RL's checkpointing.checkpoint_dir
                "rollout_timeout_s": 120.0,
                "prepare_timeout_s": 120.0,
            },
        },
    }


def rows_of(step: int, prompts: int, agents: list[str]) -> list[dict[str, Any]]:
    """`_prepare_nemo_gym_rows`: a prompt's `num_generations` rows side by side, `_rowidx` in order."""
    rows: list[dict[str, Any]] = []
    for p in range(prompts):
        task = step * prompts + p
        for _ in range(GENERATIONS):
            rows.append(
                {
                    "agent_ref": {"name": agents[task % len(agents)]},
                    "responses_create_params": {
                        "input": [{"role": "user", "content": f"{task} + {task} = ?"}],
                        "temperature": 1.0,
                    },
                    "_ng_task_index": task,
                    "_rowidx": len(rows),
                }
            )
    return rows


async def rollout(gym: Any, rows: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """`run_async_nemo_gym_rollout`: stream `(rowidx, result, timing)`, group by rowidx // G."""
    groups: dict[int, dict[int, dict[str, Any]]] = {}
    stream = gym.run_rollouts.options(num_returns="streaming").remote(rows, "timing/rollout", False)
    async for ref in stream:
        rowidx, result, _timing = await ref
        groups.setdefault(rowidx // GENERATIONS, {})[rowidx] = result
    return {k: [g[i] for i in sorted(g)] for k, g in groups.items()}


async def save(gym: Any, results: Path, step: int, state: dict[str, Any], crash: bool) -> None:
    """`grpo.py`'s save block, the actor's checkpoint around the trainer's own save."""
    tmp = results / f"tmp_step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)  # init_tmp_checkpoint drops a stale one
    tmp.mkdir(parents=True)
    prepared = await gym.prepare_checkpoint.remote(f"step_{step}")
    if not prepared["prepared"]:
        raise RuntimeError(f"checkpoint step_{step} aborted: {prepared['reason']}")
    (tmp / "trainer_state.json").write_text(json.dumps(state))  # policy, buffer, dataloader
    committed = await gym.commit_checkpoint.remote(f"step_{step}", checkpoint_dir=str(tmp))
    if not committed["committed"]:
        raise RuntimeError(f"checkpoint step_{step} aborted: {committed['reason']}")
    if crash:
        raise Crash(f"died after the log's commit of step_{step}, before its rename")
    tmp.rename(results / f"step_{step}")  # begin_finalization


async def train(
    db_url: str, results: Path, agents: dict[str, str], steps: int, prompts: int, crash_at: int | None
) -> dict[str, Any]:
    """One trainer run: from the checkpoint NeMo RL loads to `steps` (or the crash)."""
    loaded = latest_step_dir(results)
    state: dict[str, Any] = (
        json.loads((loaded / "trainer_state.json").read_text()) if loaded else {"step": 0, "trained": []}
    )
    gym = ledger_gym_actor().remote(nemo_gym_config(db_url, results, agents))
    await gym._spinup.remote()  # restores the log to the checkpoint loaded above
    await gym.set_tokenizer.remote(None)
    try:
        for step in range(state["step"] + 1, steps + 1):
            groups = await rollout(gym, rows_of(step - 1, prompts, sorted(agents)))
            for results_of_prompt in groups.values():  # "training": the rows' tries, once each
                state["trained"] += [r["full_result"]["_ledger_rollout_id"] for r in results_of_prompt]
            state["step"] = step
            await save(gym, results, step, state, crash=step == crash_at)
    finally:
        await gym.shutdown.remote()
    return state


async def run(directory: Path, steps: int = 3, prompts: int = 2) -> dict[str, Any]:
    from trainer.ray_gym.local import init_local_ray, prepare_loopback

    prepare_loopback()  # before Ray's import: it settles there which address its daemons take
    import ray

    directory.mkdir(parents=True, exist_ok=True)
    db_url = f"sqlite:///{directory / 'ledger.db'}"
    results = directory / "results"
    processes = [AgentProcess(f"agent-{i}").start() for i in range(2)]
    agents = {p.name: p.url for p in processes}
    started_ray = not ray.is_initialized()
    if started_ray:
        init_local_ray(num_cpus=2, log_to_driver=False)
    try:
        try:
            await train(db_url, results, agents, steps, prompts, crash_at=steps)
        except Crash as crash:
            print(f"first run: {crash}")
        final = await train(db_url, results, agents, steps, prompts, crash_at=None)
        ran: dict[str, int] = {}
        for p in processes:
            async with GymClient(p.url, p.name) as client:
                ran.update((await client.debug_runs()).items())
    finally:
        if started_ray:
            ray.shutdown()
        for p in processes:
            p.close()
    from eventstore import open_store
    from eventstore.payload_stores import payload_plane

    store = open_store(db_url)
    try:
        report = audit_log(store, payloads=payload_plane(store))  # `ledger audit`'s, payloads included
    finally:
        store.close()
    summary = {
        "steps": final["step"],
        "rows_trained": len(final["trained"]),
        "rows_trained_twice": len(final["trained"]) - len(set(final["trained"])),
        "tries_run_twice": sum(1 for n in ran.values() if n > 1),
        "checkpoints": sorted(p.name for p in results.iterdir()),
        "audit_violations": len(report.violations),
    }
    print(json.dumps(summary))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dir", type=Path, required=True, help="where the log and checkpoints go")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    args = parser.parse_args()
    from trainer.ray_gym.local import RayNotLoopback

    try:
        asyncio.run(run(args.dir, args.steps, args.prompts))
    except RayNotLoopback as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
