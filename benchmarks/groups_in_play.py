"""The trainer loop's per-batch questions with many groups in play, against a scan of every group.

Groups stay in the ledger (in play) until a checkpoint archives them: between two checkpoints of a
NeMo RL run that is every group of the steps since (50 steps x 512 prompts: 25,600), and without
checkpoints every group of the run.  At every batch the journal records, `sealed_groups` asks which
groups are sealed and unclaimed and which are open.  Two ways side by side, in this process, over
the same ledger:

- groups by status: a scan of every group in play (what the loop did) against the ledger's index
  (`LedgerState.open_group_ids`, `sealed_unclaimed_ids`, kept by the fold);
- a wake of `sealed_groups` while a training step collects its batch (K groups handed out and not
  yet claimed): a `SealedGroup` built for each of them again (what the loop did) against one built
  only for a group not handed out yet (`RolloutCoordinator._unclaimed`).

The groups are real folds of `benchmarks.replay`'s legal histories (4 generations each), copied
under new ids up to the count in play.

    python -m benchmarks.groups_in_play [--in-play 2000 20000 50000] [--handed-out 512]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import tempfile
import timeit
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.replay import HistoryWriter
from benchmarks.rollout_sizes import positive
from eventstore import open_store
from projections.base import fold
from projections.ledger import GroupState, LedgerProjection, LedgerState
from trainer.sealed import sealed_of as _sealed

console = Console(width=120)
SAMPLE_GROUPS = 200


def sample_groups() -> list[GroupState]:
    """Folded groups of legal histories: their statuses and claims as the trainer's log leaves them."""
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(f"sqlite:///{Path(tmp) / 'log.db'}", migrate_schema=True)
        try:
            writer = HistoryWriter()
            with store.transaction() as tx:
                for n in range(SAMPLE_GROUPS):
                    for stream, batch in writer.group(n):
                        tx.append(stream, batch)
            ledger: LedgerState = fold(LedgerProjection(), store.read_all())
        finally:
            store.close()
    return list(ledger.groups.values())


def ledger_of(samples: list[GroupState], in_play: int, handed_out: int) -> LedgerState:
    """`in_play` groups: `handed_out` sealed and unclaimed, the others as sampled but claimed when
    sealed (trained, waiting for a checkpoint), a few open."""
    sealed = [g for g in samples if g.status == "sealed"]
    state = LedgerState()
    pool = itertools.cycle(samples)
    for i in range(in_play):
        g = copy.deepcopy(next(pool) if i >= handed_out else sealed[i % len(sealed)])
        g.group_id, g.reserved_position = f"g{i}", i
        if i < handed_out:
            g.claims = []
        if i >= handed_out and g.status == "sealed" and not g.claims:
            g.claims = copy.deepcopy(next(s for s in sealed if s.claims).claims)
        state.groups[g.group_id] = g
    return state


def best_us(fn: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def measure(state: LedgerState) -> tuple[int, float, float, float, float]:
    """Handed out, then us per call: scan, index, a wake rebuilding them, a wake building none."""
    groups = state.groups

    def scan() -> tuple[list[str], list[str]]:
        values = list(groups.values())
        return (
            [g.group_id for g in values if g.status == "open"],
            [g.group_id for g in values if g.status == "sealed" and not g.claims],
        )

    def index() -> tuple[list[str], list[str]]:
        return state.open_group_ids(), state.sealed_unclaimed_ids()

    assert scan() == index()
    seen = set(state.sealed_unclaimed_ids())

    def rebuilt() -> list[object]:
        built = [_sealed(groups[g]) for g in state.sealed_unclaimed_ids()]
        return [s for s in built if s.group_id not in seen]

    def once() -> list[object]:
        return [_sealed(groups[g]) for g in state.sealed_unclaimed_ids() if g not in seen]

    return len(seen), best_us(scan, 10), best_us(index, 200), best_us(rebuilt, 5), best_us(once, 200)


def run(in_play: list[int], handed_out: int) -> None:
    samples = sample_groups()
    table = Table(
        "groups in play",
        "sealed, unclaimed",
        "by status: scan, us",
        "index, us",
        "ratio",
        f"a wake, {handed_out} handed out: rebuilt, us",
        "built once, us",
        "ratio",
        title="the trainer loop's questions at every batch (best of 5)",
    )
    for n in in_play:
        k, a, b, c, d = measure(ledger_of(samples, n, handed_out))
        table.add_row(
            f"{n:,}",
            str(k),
            f"{a:,.0f}",
            f"{b:,.1f}",
            f"{a / b:,.0f}x",
            f"{c:,.0f}",
            f"{d:,.1f}",
            f"{c / d:,.0f}x",
        )
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-play", type=positive, nargs="+", default=[2000, 20000, 50000])
    parser.add_argument("--handed-out", type=positive, default=512)
    args = parser.parse_args(argv)
    if any(n < args.handed_out for n in args.in_play):
        parser.error("--in-play counts must be at least --handed-out")
    run(args.in_play, args.handed_out)


if __name__ == "__main__":
    main()
