"""Replay benchmark: rebuild every projection over a large log, against the raw read rate of the same log.

    python -m benchmarks.replay [--events 1000000] [--db URL]

Without `--db` the log is a SQLite file in the temp directory, kept between
runs (generating a million events through the store takes a while); with
`--db` an existing log of at least `--events` events is used as it is, and a
shorter one is topped up.  The generated log is a legal history (the auditor
finds nothing): prompt groups in both modes with failures, retires,
replacements, adoptions, masked replies, abandoned rounds, ACKs, claims,
worker results and a checkpoint every 50 groups, appended through the store
with the same atomic groupings as the coordinator.

Measured in one run, on the same log:
- raw read: `EventStore.read_all` over every row (no decoding), and the same
  read with every payload decoded into its typed event (no fold);
- rebuild: all projections from scratch (ledger + checkpoints, then the
  recovery view derived from them);
- restore: from the newest projection checkpoint (stored 5,000 events
  behind the head, as a runner checkpointing every 10,000 would leave it)
  plus the tail;
- audit: the whole log through every rule.

Goals: rebuild >= 100,000 events/s and >= 0.6x the raw read rate; restore
< 2 s; audit < 15 s for 1M events.  Each line gives wall and CPU time: on a
machine shared with other load, CPU time is the work itself.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ParamSpec, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from eventstore import EventStore, open_store
from eventstore.events import (
    AckAccepted,
    AckOwed,
    AttemptAdopted,
    AttemptMinted,
    AttemptRetired,
    CheckpointCommitted,
    CheckpointParticipantFinished,
    CheckpointPrepareStarted,
    CheckpointResumed,
    Event,
    GroupAbandoned,
    GroupClaimedForTraining,
    GroupReserved,
    GroupSealed,
    LogprobsComputed,
    PromptRef,
    ReceiptFetched,
    ReplacementMinted,
    RolloutReceipt,
    RunDispatched,
    RunFailed,
    RunReplied,
    SiblingHeld,
    SiblingSealed,
)
from projections.audit import audit_log
from projections.base import decode
from projections.recovery import RolloutRecoveryState
from projections.runner import read_batches, rebuild, store_checkpoint
from protocol.digests import reply_digest
from protocol.ids import capture_key
from protocol.streams import checkpoint_stream, group_stream, logprobs_stream
from protocol.wire import AttemptRef, CompletionReceipt

AGENTS = ("agent-a", "agent-b")
GENERATIONS = 4
CHECKPOINT_EVERY_GROUPS = 50
RESTORE_TAIL = 5_000

console = Console(width=132)
P = ParamSpec("P")
T = TypeVar("T")

Append = tuple[str, list[Event]]


class HistoryWriter:
    """Generates one legal group history at a time as the coordinator would append it."""

    def __init__(self, seed: int = 7) -> None:
        self.rng = random.Random(seed)

    def group(self, n: int) -> Iterator[Append]:
        rng = self.rng
        gid = f"b{n}"
        agent = AGENTS[n % len(AGENTS)]
        mode = "prompt_group" if rng.random() < 0.3 else "sibling"
        stream = group_stream(gid)
        rids = [f"{gid}_g{i}" for i in range(GENERATIONS)]
        yield (
            stream,
            [
                GroupReserved(
                    group_id=gid,
                    prompt_ref=PromptRef(sample_id=f"sample-{n}", task_name="math"),
                    agent_name=agent,
                    expected_generations=GENERATIONS,
                    mode=mode,
                    max_tries=4,
                    payload={"prompt": f"What is {n} + {n}?"},
                ),
                *(AttemptMinted(rollout_id=r, generation_index=i) for i, r in enumerate(rids)),
            ],
        )
        attempts = dict.fromkeys(range(GENERATIONS), 0)
        if mode == "prompt_group" and rng.random() < 0.15:  # one round lost, then rerun whole
            yield stream, [self._dispatch(r, 0, agent) for r in rids]
            yield from self._finish(stream, rids[0], 0, agent, hold=True)
            yield stream, [RunFailed(rollout_id=rids[1], attempt_index=0, reason="env error", kind="env")]
            retire: list[Event] = [
                AttemptRetired(rollout_id=r, attempt_index=0, outcome="cancelled") for r in rids[1:]
            ]
            refs = [AttemptRef(rollout_id=r, attempt_index=0) for r in rids]
            yield (
                stream,
                [
                    *retire,
                    GroupAbandoned(group_id=gid, reason="a sibling failed", attempts=refs),
                    *(
                        ReplacementMinted(
                            rollout_id=r,
                            generation_index=i,
                            attempt_index=1,
                            replaces=0,
                            reason="group abandoned",
                        )
                        for i, r in enumerate(rids)
                    ),
                ],
            )
            attempts = dict.fromkeys(range(GENERATIONS), 1)
        yield stream, [self._dispatch(r, attempts[i], agent) for i, r in enumerate(rids)]
        for i, rid in enumerate(rids):
            a = attempts[i]
            roll = rng.random()
            if mode == "sibling" and roll < 0.08:  # deadline: retired, replaced
                yield (
                    stream,
                    [RunFailed(rollout_id=rid, attempt_index=a, reason="deadline passed", kind="deadline")],
                )
                yield (
                    stream,
                    [
                        AttemptRetired(rollout_id=rid, attempt_index=a, outcome="cancelled"),
                        ReplacementMinted(
                            rollout_id=rid, generation_index=i, attempt_index=a + 1, replaces=a, reason="x"
                        ),
                    ],
                )
                a += 1
                yield stream, [self._dispatch(rid, a, agent)]
            elif mode == "sibling" and roll < 0.11:  # lost reply: adopted
                yield (
                    stream,
                    [RunFailed(rollout_id=rid, attempt_index=a, reason="deadline passed", kind="deadline")],
                )
                yield (
                    stream,
                    [AttemptRetired(rollout_id=rid, attempt_index=a, outcome="completed_unacknowledged")],
                )
                yield stream, [AttemptAdopted(rollout_id=rid, attempt_index=a)]
            elif mode == "sibling" and roll < 0.15:  # masked: owed, ACKed, replaced
                receipt = self._receipt(rid, a)
                yield (
                    stream,
                    [
                        RunReplied(
                            rollout_id=rid,
                            attempt_index=a,
                            reward=0.0,
                            mask_sample=True,
                            reply_digest=receipt.result_digest,
                        )
                    ],
                )
                yield (
                    stream,
                    [
                        ReceiptFetched(agent_name=agent, receipt=receipt),
                        AckOwed(agent_name=agent, receipt=receipt),
                    ],
                )
                yield stream, [AckAccepted(rollout_id=rid, attempt_index=a, idempotent=False)]
                yield (
                    stream,
                    [
                        ReplacementMinted(
                            rollout_id=rid,
                            generation_index=i,
                            attempt_index=a + 1,
                            replaces=a,
                            reason="masked",
                        )
                    ],
                )
                a += 1
                yield stream, [self._dispatch(rid, a, agent)]
            attempts[i] = a
            yield from self._finish(stream, rid, a, agent, hold=mode == "prompt_group")
        refs = [AttemptRef(rollout_id=r, attempt_index=attempts[i]) for i, r in enumerate(rids)]
        if mode == "prompt_group":
            sealed: list[Event] = [
                SiblingSealed(
                    rollout_id=r, attempt_index=attempts[i], reward=1.0, receipt=self._rollout(r, attempts[i])
                )
                for i, r in enumerate(rids)
            ]
            yield stream, [*sealed, GroupSealed(group_id=gid, attempts=refs)]
        else:
            yield stream, [GroupSealed(group_id=gid, attempts=refs)]
        yield stream, [GroupClaimedForTraining(group_id=gid, train_step=n // 8)]
        yield (
            logprobs_stream(gid),
            [
                LogprobsComputed(
                    rollout_id=r,
                    attempt_index=attempts[i],
                    policy_version="policy-1",
                    token_count=512,
                    logprob_sum=-123.4,
                    max_abs_diff=0.003,
                    mean_abs_diff=0.0004,
                    blob_digest="sha256:" + "5" * 64,
                )
                for i, r in enumerate(rids)
            ],
        )

    def _finish(self, stream: str, rid: str, a: int, agent: str, hold: bool) -> Iterator[Append]:
        receipt = self._receipt(rid, a)
        yield (
            stream,
            [
                RunReplied(
                    rollout_id=rid,
                    attempt_index=a,
                    reward=1.0,
                    mask_sample=False,
                    reply_digest=receipt.result_digest,
                )
            ],
        )
        kept: Event = (
            SiblingHeld(rollout_id=rid, attempt_index=a, receipt=self._rollout(rid, a))
            if hold
            else SiblingSealed(rollout_id=rid, attempt_index=a, reward=1.0, receipt=self._rollout(rid, a))
        )
        yield (
            stream,
            [
                ReceiptFetched(agent_name=agent, receipt=receipt),
                kept,
                AckOwed(agent_name=agent, receipt=receipt),
            ],
        )
        yield stream, [AckAccepted(rollout_id=rid, attempt_index=a, idempotent=False)]

    @staticmethod
    def _dispatch(rid: str, a: int, agent: str) -> RunDispatched:
        return RunDispatched(
            rollout_id=rid,
            attempt_index=a,
            capture_key=capture_key(rid, a),
            agent_name=agent,
            deadline_s=600.0,
        )

    @staticmethod
    def _receipt(rid: str, a: int) -> CompletionReceipt:
        key = capture_key(rid, a)
        return CompletionReceipt(
            rollout_id=rid,
            attempt_index=a,
            execution_generation=1,
            result_identity=f"{key}#1",
            result_digest=reply_digest({"rollout_id": rid, "attempt_index": a}),
            manifest_capture_key=key,
            terminal_model_call_id=f"{key}-call-3",
        )

    @staticmethod
    def _rollout(rid: str, a: int) -> RolloutReceipt:
        key = capture_key(rid, a)
        return RolloutReceipt(
            rollout_id=rid,
            attempt_index=a,
            capture_key=key,
            model_call_ids=[f"{key}-call-{i}" for i in range(1, 4)],
            terminal_model_call_id=f"{key}-call-3",
            token_count=512,
            tokens_digest="sha256:" + "7" * 64,
            reward=1.0,
            mask_sample=False,
        )


def generate(store: EventStore, events: int) -> None:
    """Appends legal history until the log holds at least `events` events."""
    head = store.head()
    if head >= events:
        return
    writer = HistoryWriter()
    n = sum(1 for _ in store.read_all(types=["GroupReserved"]))
    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("generate", total=events, completed=head)
        while head < events:
            with store.transaction() as tx:
                for _ in range(20):
                    for stream, batch in writer.group(n):
                        head = tx.append(stream, batch).positions[-1]
                    n += 1
                    if n % CHECKPOINT_EVERY_GROUPS == 0:
                        cid = f"ckpt-{n}"
                        participants = list(AGENTS)
                        head = tx.append(
                            checkpoint_stream(cid),
                            [CheckpointPrepareStarted(checkpoint_id=cid, participants=participants)],
                        ).positions[-1]
                        head = tx.append(
                            checkpoint_stream(cid),
                            [
                                CheckpointCommitted(
                                    checkpoint_id=cid,
                                    participants=participants,
                                    cut_position=head,
                                    prepare_wait_s=dict.fromkeys(participants, 0.02),
                                ),
                                *(
                                    CheckpointParticipantFinished(
                                        checkpoint_id=cid, agent_name=p, outcome="resumed"
                                    )
                                    for p in participants
                                ),
                                CheckpointResumed(checkpoint_id=cid, participants=participants),
                            ],
                        ).positions[-1]
            bar.update(task, completed=head)


@dataclass(frozen=True)
class Timing:
    wall: float
    cpu: float  # this process's CPU time: the work itself, on a machine shared with other load


def _timed(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> tuple[T, Timing]:
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn(*args, **kwargs)
    return value, Timing(time.perf_counter() - wall, time.process_time() - cpu)


def run(events: int, url: str | None) -> None:
    if url is None:
        url = f"sqlite:///{Path(tempfile.gettempdir()) / f'ledger-replay-bench-{events}.db'}"
    store = open_store(url, migrate_schema=url.startswith("sqlite"))
    console.print(f"log: {store.url}")
    _, made = _timed(generate, store, events)
    head = store.head()
    if made.wall > 1:
        console.print(f"generated up to {head:,} events in {made.wall:.1f} s")

    count, raw = _timed(lambda: sum(1 for _ in store.read_all()))
    typed, typed_t = _timed(lambda: sum(1 for b in read_batches(store) for e in b if decode(e) is not None))
    replay, rebuilt = _timed(rebuild, store, from_checkpoint=False)
    recovery, derived = _timed(
        lambda: RolloutRecoveryState.of(replay.state("ledger"), replay.state("checkpoints"))
    )

    # A projection checkpoint RESTORE_TAIL events behind the head, as a live runner would have left it.
    behind = rebuild(store, to_position=max(head - RESTORE_TAIL, 0), from_checkpoint=False)
    _, saved = _timed(store_checkpoint, store, behind)
    restored, restore_t = _timed(rebuild, store)
    assert restored.hashes() == replay.hashes(), "restore and rebuild disagree"

    report, audited = _timed(audit_log, store)

    table = Table(title=f"replay benchmark: {head:,} events ({store.url}, {os.cpu_count()} CPUs)")
    for column in ("measure", "wall", "cpu", "events/s (wall)", "events/s (cpu)", "vs raw read", "goal"):
        table.add_column(column, justify="left" if column == "measure" else "right")

    def row(name: str, n: int | None, t: Timing, goal: str = "") -> None:
        rates = ("", "", "")
        if n:
            rates = (f"{n / t.wall:,.0f}", f"{n / t.cpu:,.0f}", f"{(n / t.wall) / (count / raw.wall):.2f}x")
        table.add_row(name, f"{t.wall:.2f} s", f"{t.cpu:.2f} s", *rates, goal)

    rebuild_rate = replay.events / rebuilt.wall
    raw_rate = count / raw.wall
    row("raw read (EventStore.read_all)", count, raw)
    row("read + decode (typed events, no fold)", typed, typed_t)
    row(
        "rebuild all projections",
        replay.events,
        rebuilt,
        _verdict(rebuild_rate >= 100_000 and rebuild_rate >= 0.6 * raw_rate, ">= 100k/s and >= 0.6x raw"),
    )
    row("derive the recovery view", None, derived)
    row("store a projection checkpoint", None, saved)
    row(
        f"restore: checkpoint + {head - (restored.from_checkpoint or 0):,}-event tail",
        None,
        restore_t,
        _verdict(restore_t.wall < 2.0, "< 2 s"),
    )
    scaled = audited.wall * 1_000_000 / max(head, 1)
    row(
        "audit the whole log",
        report.events,
        audited,
        _verdict(scaled < 15, f"< 15 s per 1M ({scaled:.1f} s)"),
    )
    console.print(table)
    ledger = replay.state("ledger")
    console.print(
        f"ledger: {len(ledger.groups):,} groups in play, {len(ledger.archived):,} archived; "
        f"recovery view {len(recovery.groups):,} groups; audit: "
        + (
            "clean"
            if report.ok
            else f"{len(report.violations)} violation(s), first: {report.violations[0].message}"
        )
    )
    store.close()


def _verdict(ok: bool, goal: str) -> str:
    return f"[green]{goal}[/green]" if ok else f"[red]{goal}[/red]"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=1_000_000, help="size of the log (default 1,000,000)")
    parser.add_argument(
        "--db", default=None, help="database URL (default: a SQLite file in the temp directory)"
    )
    args = parser.parse_args()
    run(args.events, args.db)


if __name__ == "__main__":
    main()
