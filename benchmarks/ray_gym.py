"""The coordinator inside a Ray actor (`LedgerGym`, streamed like NeMo RL's NemoGym) against the
coordinator in the driver's own process: same workload, same agents' settings, one process.

Baseline: `run_simulation` (the coordinator in this process).  Ours: `run_ray_simulation` (the
coordinator in a Ray actor, rows in, `run_rollouts` streamed back).  No faults and no checkpoints by
default, so the difference is the actor hop and the row building.  Ray's own start-up is not timed.

    python -m benchmarks.ray_gym [--groups 48] [--siblings 4] [--faults ""]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.rollout_sizes import add_size_options, size_settings
from eventstore import open_store
from gym_agent.sizes import DEFAULT_GEN_TOKENS, DEFAULT_PROMPT_TOKENS
from simulation.ray_run import run_ray_simulation
from simulation.run import SimConfig, run_simulation


async def main(args: argparse.Namespace) -> None:
    from trainer.ray_gym.local import init_local_ray

    init_local_ray(num_cpus=2, log_to_driver=False)
    import ray

    rows: list[tuple[str, dict[str, Any]]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in ("in-process coordinator (baseline)", "LedgerGym Ray actor, streamed"):
                url = f"sqlite:///{Path(tmp) / (name[:8].strip() + '.db')}"
                store = open_store(url, migrate_schema=True)
                config = SimConfig(
                    groups=args.groups,
                    siblings=args.siblings,
                    faults=args.faults,
                    checkpoint_every_s=0,
                    **size_settings(args),
                )
                try:
                    if name.startswith("in-process"):
                        summary = await run_simulation(store, config)
                    else:
                        summary = await run_ray_simulation(store, url, config)
                finally:
                    store.close()
                rows.append((name, summary))
    finally:
        ray.shutdown()
    print(f"{'path':<36} {'wall_s':>7} {'rows/s':>8} {'sealed':>7} {'stranded':>9} {'dup':>4} {'audit':>6}")
    for name, s in rows:
        rate = s["groups"] * s["siblings"] / s["wall_s"]
        print(
            f"{name:<36} {s['wall_s']:>7.2f} {rate:>8.1f} {s['groups_sealed']:>7} {s['stranded']:>9} "
            f"{s['duplicate_executions']:>4} {s['audit_violations']!s:>6}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--groups", type=int, default=48)
    parser.add_argument("--siblings", type=int, default=4)
    parser.add_argument("--faults", default="")
    add_size_options(
        parser,
        prompt_tokens=DEFAULT_PROMPT_TOKENS,
        gen_tokens=DEFAULT_GEN_TOKENS,
        turns="1:3",
        zero_work_option=True,
    )
    asyncio.run(main(parser.parse_args()))
