"""Checkpoint stall: the seeds' prompt_group ACK policy against ours, same workload, one process.

Baseline (the seeds): a prompt_group sibling's ACK debt is recorded only when its whole group
seals; a group abandoned part-way drops its held siblings' debts.  Ours: the debt is recorded in
the same append as the hold.  Prints committed/aborted checkpoints, prepare wait p50/max and the
results stranded in the agents for each.

    python -m benchmarks.checkpoint_stall [--groups 40] [--prepare-timeout 5]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from contextlib import nullcontext
from pathlib import Path

from benchmarks.rollout_sizes import add_size_options, size_settings
from eventstore import open_store
from gym_agent.sizes import DEFAULT_GEN_TOKENS, DEFAULT_PROMPT_TOKENS
from protocol import mutants
from simulation.run import SimConfig, run_simulation


async def main(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, policy in (
            # The seeds' policy is the catalogue's first mutant: enabled in this process for its run.
            ("seeds (debt at seal)", lambda: mutants.enabled("pg_debt_at_group_seal")),
            ("ours (debt on arrival)", nullcontext),
        ):
            store = open_store(f"sqlite:///{Path(tmp) / (name[:4] + '.db')}", migrate_schema=True)
            config = SimConfig(
                groups=args.groups,
                siblings=args.siblings,
                mode="prompt_group",
                faults=args.faults,
                checkpoint_every_s=args.checkpoint_every,
                prepare_timeout_s=args.prepare_timeout,
                rollout_timeout_s=args.rollout_timeout,
                seed=args.seed,
                **size_settings(args),
            )
            try:
                with policy():
                    summary = await run_simulation(store, config)
            finally:
                store.close()
            rows.append((name, summary))
    keys = [
        "checkpoints_committed",
        "checkpoints_aborted",
        "prepare_wait_p50_s",
        "prepare_wait_max_s",
        "stranded",
        "groups_sealed",
        "wall_s",
    ]
    print(f"{'policy':<24}" + "".join(f"{k:>24}" for k in keys))
    for name, summary in rows:
        print(f"{name:<24}" + "".join(f"{summary[k]!s:>24}" for k in keys))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=40)
    parser.add_argument("--siblings", type=int, default=4)
    parser.add_argument("--faults", default="fail=0.1,drop_reply=0.03")
    parser.add_argument("--checkpoint-every", type=float, default=1.0)
    parser.add_argument("--prepare-timeout", type=float, default=5.0)
    parser.add_argument("--rollout-timeout", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    add_size_options(
        parser,
        prompt_tokens=DEFAULT_PROMPT_TOKENS,
        gen_tokens=DEFAULT_GEN_TOKENS,
        turns="1:3",
        zero_work_option=True,
    )
    asyncio.run(main(parser.parse_args()))
