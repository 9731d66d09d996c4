"""`ledger replay | snapshot | audit | show | status | tail`: reading the log back.

Progress bars and tables go to stderr/stdout through rich; JSON output
(`snapshot`, `audit --json`) is plain text on stdout so it can be piped.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.tree import Tree

from cli.common import DbOption, Role, bounded, clear_errors, console, db_url, err_console, error

if TYPE_CHECKING:  # imported by the commands that use them: `ledger --help` stays light
    from eventstore import EventStore, RecordedEvent
    from eventstore.events import AckDeliveryStuck
    from projections.base import ReplayRefused
    from projections.checkpoints import CheckpointsState
    from projections.generation import GenerationFigures
    from projections.ledger import LedgerState
    from projections.runner import (
        Replay,
    )


def register(app: typer.Typer) -> None:
    """Adds this module's commands to the `ledger` app."""
    app.command("replay")(replay)
    app.command("snapshot")(snapshot)
    app.command("audit")(audit)
    app.command("show")(show)
    app.command("status")(status)
    app.command("tail")(tail)


@contextmanager
def _store(db: str | None, role: Role = "auditor") -> Iterator[EventStore]:
    """Read-only commands connect as the auditor role when `$LEDGER_AUDITOR_DB` is set, and open the
    log read-only (a SQLite file that is not there is an error, never created)."""
    from eventstore import open_store

    with clear_errors():
        store = open_store(db_url(db, role), read_only=role == "auditor")
        try:
            yield store
        finally:
            store.close()


@contextmanager
def _progress(description: str, total: int | None, quiet: bool = False) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr with an events/s column; yields its `advance`."""
    if quiet:
        yield lambda _n: None
        return
    started = time.perf_counter()
    done = [0]
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task(description, total=total, rate="")

        def advance(n: int) -> None:
            done[0] += n
            elapsed = time.perf_counter() - started
            rate = f"{done[0] / elapsed:,.0f} events/s" if elapsed > 0 else ""
            bar.update(task, advance=n, rate=rate)

        yield advance


def _rebuild(
    store: EventStore, to: int | None, from_checkpoint: bool, quiet: bool = False, label: str = "replay"
) -> tuple[Replay, float]:
    from projections.runner import default_projections, latest_common_checkpoint, rebuild

    head = store.head()
    target = head if to is None else min(to, head)
    start = latest_common_checkpoint(store, default_projections(), target) if from_checkpoint else None
    started = time.perf_counter()
    with _progress(label, target - (start or 0), quiet) as advance:
        replay = rebuild(store, to_position=target, from_checkpoint=from_checkpoint, progress=advance)
    return replay, time.perf_counter() - started


def _hashes(replay: Replay) -> dict[str, str]:
    from projections.recovery import RolloutRecoveryState

    hashes = replay.hashes()
    hashes["recovery"] = RolloutRecoveryState.of(
        replay.state("ledger"), replay.state("checkpoints")
    ).state_hash()
    return hashes


def _refused(exc: ReplayRefused) -> typer.Exit:
    err_console.print(f"[red]replay refused:[/red] {escape(str(exc))}")
    return typer.Exit(1)


# --- replay ------------------------------------------------------------------------


def replay(
    db: DbOption = None,
    to: Annotated[
        int | None, typer.Option("--to", min=0, help="Rebuild up to this position (default: the head).")
    ] = None,
    from_checkpoint: Annotated[
        bool,
        typer.Option(
            "--from-checkpoint/--from-scratch",
            help="Start from the nearest stored projection checkpoint, or from 0.",
        ),
    ] = True,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Rebuild from scratch and from the nearest checkpoint, to --to or the head; compare "
            "the state hashes (and with the runner's stored checkpoint there, if any).",
        ),
    ] = False,
    save: Annotated[
        bool, typer.Option("--save", help="Store the rebuilt states as a projection checkpoint.")
    ] = False,
) -> None:
    """Rebuild the projections up to a position and print their state hashes and the rate."""
    from projections.base import ReplayRefused
    from projections.runner import store_checkpoint

    with _store(db, "writer") as store:
        try:
            if verify:
                _verify(store, to)
                return
            result, seconds = _rebuild(store, to, from_checkpoint)
        except ReplayRefused as exc:
            raise _refused(exc) from None
        origin = (
            f"checkpoint at {result.from_checkpoint}" if result.from_checkpoint is not None else "scratch"
        )
        rate = result.events / seconds if seconds > 0 else 0.0
        console.print(
            f"rebuilt to position [bold]{result.position}[/bold] from {origin}: "
            f"{result.events:,} events in {seconds:.2f} s ({rate:,.0f} events/s)"
        )
        table = Table("projection", "state hash")
        for name, digest in _hashes(result).items():
            table.add_row(name, digest)
        console.print(table)
        if save:
            store_checkpoint(store, result)
            console.print(f"stored a projection checkpoint at position {result.position}")


def _verify(store: EventStore, to: int | None) -> None:
    """Scratch vs nearest checkpoint vs the live runner's stored checkpoint, at one position: `to`,
    else the head (a check that stopped at the newest checkpoint would leave the tail unchecked)."""
    from projections.runner import default_projections, latest_common_checkpoint, load_replay, read_batches

    projections = default_projections()
    head = store.head()
    target = head if to is None else min(to, head)
    live_at = latest_common_checkpoint(store, projections, target)
    scratch, _ = _rebuild(store, target, from_checkpoint=False, label="from scratch")
    below = latest_common_checkpoint(store, projections, target - 1) if target > 0 else None
    rows: list[tuple[str, Replay]] = [("from scratch", scratch)]
    if below is not None:
        from_below = load_replay(store, projections, below)
        with _progress(f"from checkpoint {below}", target - below) as advance:
            from_below.apply_batches(read_batches(store, below, target), advance)
        rows.append((f"from checkpoint at {below}", from_below))
    if live_at == target:
        rows.append((f"live (stored at {target})", load_replay(store, projections, target)))
    names = [p.name for p in projections]
    table = Table("rebuild", *names, "position")
    reference = rows[0][1].hashes()
    same = True
    for label, result in rows:
        hashes = result.hashes()
        cells = []
        for name in names:
            ok = hashes[name] == reference[name]
            same &= ok
            cells.append(f"{'[green]' if ok else '[red]'}{hashes[name][:16]}…")
        table.add_row(label, *cells, str(result.position))
    console.print(table)
    if live_at != target:
        console.print(
            f"[yellow]no live projection checkpoint at {target}; compared the rebuilds only[/yellow]"
        )
    if not same:
        console.print("[red]state hashes differ[/red]")
        raise typer.Exit(1)
    console.print(f"[green]{len(rows)} rebuilds agree at position {target}[/green]")


# --- snapshot ----------------------------------------------------------------------


def snapshot(
    db: DbOption = None,
    at: Annotated[int | None, typer.Option("--at", min=0, help="Position (default: the head).")] = None,
) -> None:
    """Print the RolloutRecoveryState as of a position, as JSON."""
    from projections.base import ReplayRefused
    from projections.recovery import RolloutRecoveryState

    with _store(db) as store:
        try:
            result, _ = _rebuild(store, at, from_checkpoint=True, quiet=True)
        except ReplayRefused as exc:
            raise _refused(exc) from None
        state = RolloutRecoveryState.of(result.state("ledger"), result.state("checkpoints"))
        typer.echo(json.dumps(state.model_dump(mode="json"), indent=2, sort_keys=True))


# --- audit -------------------------------------------------------------------------


def audit(
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    payloads: Annotated[
        str | None,
        typer.Option(
            "--payloads",
            help="The payload store the log's writers used (default: $LEDGER_PAYLOADS, else beside the log).",
        ),
    ] = None,
) -> None:
    """Replay the whole log and check every invariant of docs/events.md, read back every payload its
    events claim against its digest, and run the database's own integrity check; exit status 1 on any
    violation."""
    from eventstore.payload_stores import payload_plane
    from projections.audit import audit_log

    with _store(db) as store, clear_errors():
        started = time.perf_counter()
        with _progress("audit", store.head(), quiet=as_json) as advance:
            report = audit_log(store, advance, payload_plane(store, payloads))
        seconds = time.perf_counter() - started
    if as_json:
        typer.echo(json.dumps(report.as_json(), indent=2))
    else:
        for v in report.violations:
            positions = ", ".join(str(p) for p in v.positions)
            console.print(f"[red]{v.rule}[/red] at [bold]{positions}[/bold]: {escape(v.message)}")
        rate = report.events / seconds if seconds > 0 else 0.0
        verdict = "[green]clean[/green]" if report.ok else f"[red]{len(report.violations)} violation(s)[/red]"
        console.print(
            f"{report.events:,} events, {len(report.rules_checked)} rules: {verdict} "
            f"({seconds:.2f} s, {rate:,.0f} events/s)"
        )
        if report.payloads is not None:
            p = report.payloads
            console.print(
                f"payloads: {p.checked:,} of {p.claimed:,} claimed read back ({p.checked_bytes:,} bytes), "
                f"{p.missing} missing, {p.corrupt} altered; {p.log_blobs:,} log blobs; {escape(p.database)}"
            )
    if not report.ok:
        raise typer.Exit(1)


# --- show --------------------------------------------------------------------------


def show(
    rollout_id: Annotated[str, typer.Argument(help="The sibling, e.g. p7_g2.")],
    db: DbOption = None,
    html: Annotated[
        Path | None, typer.Option("--html", help="Also write a swimlane page to this file.")
    ] = None,
) -> None:
    """The whole history of one sibling across its tries."""
    from projections.swimlane import render_html
    from projections.timeline import timeline
    from protocol.ids import ID_RE, MAX_ID_LENGTH

    if len(rollout_id) > MAX_ID_LENGTH or not ID_RE.match(rollout_id):
        error(
            f"{bounded(rollout_id)!r} is not a rollout id (at most {MAX_ID_LENGTH} characters of "
            "A-Z, a-z, 0-9, '.', '_', '-', e.g. p7_g2)"
        )
        raise typer.Exit(2)
    with _store(db) as store:
        tl = timeline(store, rollout_id)
    if not tl.entries:
        err_console.print(f"no events about {escape(rollout_id)}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    tree = Tree(f"[bold]{escape(rollout_id)}[/bold] (group {escape(tl.group_id)})")
    group_branch = tree.add("group")
    branches = {a: tree.add(f"try #{a}") for a in tl.attempts()}
    for e in tl.entries:
        when = time.strftime("%H:%M:%S", time.gmtime(e.recorded_at)) if e.recorded_at else "-"
        line = f"[dim]{e.position:>7}  {when}[/dim]  [bold]{e.type}[/bold]  {escape(e.summary)}"
        (group_branch if e.attempt is None else branches[e.attempt]).add(line)
    for carry in tl.carried:
        branches[carry.attempt].add(f"[green]{escape(carry.text())}[/green]")
    for attempt, (turn, _) in sorted(tl.offered.items()):
        branches[attempt].add(f"[green]offered its boundary after turn {turn} when retired[/green]")
    for attempt, (reason, _) in sorted(tl.declined.items()):
        branches[attempt].add(
            f"[yellow]declined to resume ({escape(reason)}): played from its prompt[/yellow]"
        )
    console.print(tree)
    if html is not None:
        html.write_text(render_html(tl), encoding="utf-8")
        console.print(f"swimlane written to {html}")


# --- status ------------------------------------------------------------------------


def status(
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
) -> None:
    """Groups by status, unpaid debts per agent, the last checkpoint, the log head."""
    from cli.debt import STATUS_DEBTS_SHOWN, debts_table
    from projections.base import ReplayRefused
    from projections.generation import GENERATION_EVENTS, generation_figures
    from projections.runner import RUNNER_NAME
    from projections.sql import list_checkpoints
    from protocol.streams import trainer_stream

    with _store(db) as store:
        try:
            result, _ = _rebuild(store, None, from_checkpoint=True, quiet=True)
        except ReplayRefused as exc:
            raise _refused(exc) from None
        stored = list_checkpoints(store)
        runner_at = store.subscriber_position(RUNNER_NAME)
        head = store.head()
        ledger: LedgerState = result.state("ledger")
        trainer_events = [e for t in trainer_ids(ledger) for e in store.read_stream(trainer_stream(t))]
        generation = generation_figures(store.read_all(0, head, types=GENERATION_EVENTS))
    checkpoints: CheckpointsState = result.state("checkpoints")

    counts: Counter[str] = Counter(g.status for g in ledger.groups.values())
    archived: Counter[str] = Counter(g.status for g in ledger.archived.values())
    if as_json:
        newest_at = max((c.position for c in stored), default=None)
        typer.echo(
            json.dumps(status_json(ledger, checkpoints, generation, head, runner_at, newest_at), indent=2)
        )
        return
    groups = Table("status", "in play", "archived", title="groups")
    for name in ("open", "sealed", "dead_lettered"):
        groups.add_row(name, str(counts[name]), str(archived[name]))
    console.print(groups)

    debts = Table("agent", "unpaid ACK debts", "oldest", title="debts")
    for agent, owed in sorted(ledger.debts.items()):
        debts.add_row(agent, str(len(owed)), next(iter(owed), ""))
    if not ledger.debts:
        debts.add_row("-", "0", "")
    console.print(debts)
    if ledger.debts:
        # What an operator needs to find a debt that can never be paid: `ledger debt drop ROLLOUT ATTEMPT`.
        console.print(debts_table(ledger, STATUS_DEBTS_SHOWN))
        stuck = stuck_deliveries(trainer_events, ledger)
        if stuck:
            table = Table("agent", "unpaid", "failed calls", "last failure", title="ACK delivery stuck")
            for event in stuck:
                table.add_row(
                    escape(event.agent_name),
                    str(len(ledger.debts.get(event.agent_name, {}))),
                    str(event.calls),
                    escape(event.reason[:200]),
                )
            console.print(table)
    if ledger.retires:
        # Tries declared lost whose agent may still hold a result: paid once it answers again.
        retires = Table("agent", "retires owed", "oldest", "since", title="retires owed")
        for agent, owed_retires in sorted(ledger.retires.items()):
            oldest = min(owed_retires.values(), key=lambda d: d.position)
            retires.add_row(
                escape(agent),
                str(len(owed_retires)),
                f"{oldest.rollout_id} #{oldest.attempt_index}",
                str(oldest.position),
            )
        console.print(retires)

    last = checkpoints.last_committed()
    if last is None:
        console.print("last checkpoint: none committed")
    else:
        waits = ", ".join(f"{a} {s:.2f} s" for a, s in last.prepare_wait_s.items()) or "-"
        console.print(
            f"last checkpoint: [bold]{escape(last.checkpoint_id)}[/bold] {last.status}, cut at {last.cut_position}, "
            f"prepare waited {waits}"
        )
    print_generation(generation)
    pending = [c.checkpoint_id for c in checkpoints.in_doubt()]
    if pending:
        console.print(f"checkpoints preparing (undecided): {', '.join(pending)}")
    # A decided step an agent has not confirmed: stuck (still retried) or lost (never will be).
    troubled = [
        (c.checkpoint_id, agent, "lost", "")
        for c in checkpoints.checkpoints.values()
        for agent, outcome in sorted(c.finished.items())
        if outcome == "lost"
    ] + [(cid, agent, "stuck", reason) for cid, agent, reason in checkpoints.stuck()]
    if troubled:
        table = Table(
            "checkpoint", "participant", "state", "why", title="checkpoint participants not finished"
        )
        for cid, agent, state, reason in troubled:
            table.add_row(escape(cid), escape(agent), f"[red]{state}[/red]", escape(reason[:200]))
        console.print(table)
    newest = max((c.position for c in stored), default=None)
    console.print(
        f"log head: [bold]{head}[/bold]; newest projection checkpoint: {newest if newest is not None else 'none'}; "
        f"projection runner at {runner_at}"
    )


def status_json(
    ledger: LedgerState,
    checkpoints: CheckpointsState,
    generation: GenerationFigures,
    head: int,
    runner_at: int,
    newest_checkpoint: int | None,
) -> dict[str, Any]:
    """`ledger status --json`: the figures the tables show, as data."""
    in_play: Counter[str] = Counter(g.status for g in ledger.groups.values())
    archived: Counter[str] = Counter(g.status for g in ledger.archived.values())
    last = checkpoints.last_committed()
    return {
        "head": head,
        "projection_runner": runner_at,
        "newest_projection_checkpoint": newest_checkpoint,
        "groups": {
            name: {"in_play": in_play[name], "archived": archived[name]}
            for name in ("open", "sealed", "dead_lettered")
        },
        "claimed": {
            "in_play": sum(1 for g in ledger.groups.values() if g.claims),
            "archived": sum(1 for g in ledger.archived.values() if g.claims),
        },
        "debts": {
            agent: {"unpaid": len(owed), "oldest": next(iter(owed), None)}
            for agent, owed in sorted(ledger.debts.items())
            if owed
        },
        "retires": {
            agent: {"owed": len(owed), "oldest_position": min(d.position for d in owed.values())}
            for agent, owed in sorted(ledger.retires.items())
            if owed
        },
        "last_checkpoint": None
        if last is None
        else {
            "checkpoint_id": last.checkpoint_id,
            "status": last.status,
            "cut_position": last.cut_position,
            "prepare_wait_s": last.prepare_wait_s,
        },
        "checkpoints": dict(Counter(c.status for c in checkpoints.checkpoints.values())),
        "checkpoints_in_doubt": [c.checkpoint_id for c in checkpoints.in_doubt()],
        "generation": generation.summary(),
    }


# Checkpoints listed by `ledger status` among those that threw generation away (the costliest first).
STATUS_CHECKPOINTS_SHOWN = 10


def print_generation(generation: GenerationFigures) -> None:
    """Model time and tokens the tries spent, what checkpoints threw away of them (per checkpoint,
    the costliest first), and the warning when that is more than WARN_SHARE of the model time."""
    total, thrown = generation.total, generation.thrown
    console.print(
        f"model time: {total.model_s:.1f} s, {total.tokens} tokens generated ({total.tries} tries); "
        f"thrown away by checkpoints: {thrown.model_s:.1f} s ({100 * generation.share:.2f} %), "
        f"{thrown.tokens} tokens, {thrown.tries} tries"
    )
    if generation.by_checkpoint:
        table = Table(
            "checkpoint", "tries", "model s", "tokens", title="generation thrown away by checkpoints"
        )
        for checkpoint_id, work in generation.worst(STATUS_CHECKPOINTS_SHOWN):
            table.add_row(escape(checkpoint_id), str(work.tries), f"{work.model_s:.1f}", str(work.tokens))
        more = len(generation.by_checkpoint) - STATUS_CHECKPOINTS_SHOWN
        if more > 0:
            table.add_row(f"... {more} more", "", "", "")
        console.print(table)
    warning = generation.warning()
    if warning is not None:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")


def trainer_ids(ledger: LedgerState) -> list[str | None]:
    """Every trainer with a group in the log (None: the unnamed trainer)."""
    ids = {g.trainer_id for g in ledger.groups.values()} | {g.trainer_id for g in ledger.archived.values()}
    return sorted(ids, key=lambda t: t or "")


def stuck_deliveries(trainer_events: list[RecordedEvent], ledger: LedgerState) -> list[AckDeliveryStuck]:
    """The newest `AckDeliveryStuck` of each agent the log still owes debts to."""
    from eventstore.errors import EventStoreError
    from eventstore.events import AckDeliveryStuck

    newest: dict[str, AckDeliveryStuck] = {}
    for row in sorted(trainer_events, key=lambda r: r.position):
        if row.type == AckDeliveryStuck.event_type():
            try:
                event = row.decode()
            except EventStoreError:  # unreadable: `ledger audit` reports it (event-readable)
                continue
            if isinstance(event, AckDeliveryStuck):
                newest[event.agent_name] = event
    return [e for agent, e in sorted(newest.items()) if ledger.debts.get(agent)]


# --- tail --------------------------------------------------------------------------


def tail(
    db: DbOption = None,
    from_position: Annotated[
        int | None, typer.Option("--from", min=0, help="Start after this position (default: the head).")
    ] = None,
    idle_exit: Annotated[
        float | None,
        typer.Option("--idle-exit", min=0, help="Stop after this many seconds without a new event."),
    ] = None,
) -> None:
    """One line per event as it is appended (follows the log)."""
    with _store(db) as store:
        start = store.head() if from_position is None else from_position
        subscription = store.subscribe("ledger-tail", from_position=start)
        shown = 0
        try:
            for ev in subscription.follow(idle_timeout_s=idle_exit):
                console.print(_line(ev), highlight=False, soft_wrap=True)
                shown += 1
        except KeyboardInterrupt:
            subscription.stop()
            return
        if not shown and from_position is None:
            # It followed from the head and nothing came: say so, or an empty screen looks like an
            # empty log.
            err_console.print(
                f"nothing appended within {idle_exit:g} s after position {start} (the head: tail follows "
                "new events; --from 0 prints the log from its start)",
                highlight=False,
                soft_wrap=True,
            )


def _line(ev: Any) -> str:
    from eventstore.errors import EventStoreError
    from projections.timeline import describe

    when = time.strftime("%H:%M:%S", time.gmtime(ev.recorded_at))
    try:
        summary = escape(describe(ev.decode()))
    except EventStoreError as exc:
        summary = f"[red]unreadable: {escape(str(exc))}[/red]"
    return (
        f"{ev.position:>8} {when} {escape(ev.stream_id)}@{ev.stream_version} [bold]{ev.type}[/bold] {summary}"
    )
