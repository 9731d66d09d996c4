"""`ledger debt list | drop`: the ACK debts the log holds unpaid, and an operator's drop of one (or of
a retire owed to an agent gone for good).

A debt leaves the ledger only on evidence: the agent accepted the ACK, an agent process other than
the one that made the receipt (another incarnation) denies it (it restarted and lost the result), or
an operator says so.
`drop` is the last: it appends `AckRejected` of kind `dropped_by_operator` carrying the operator's
mark (who, and the reason given), which the ledger folds as the debt dropped and the auditor accepts.
A try with no ACK debt but a retire owed (declared lost while its agent was away, the agent never
back) has the retire dropped the same way: `RetirePaid` of outcome `dropped_by_operator`, so the trainer
stops calling the agent and the auditor no longer names the result stranded.

The operator is not a trainer, so it neither takes a trainer's owner epoch (that would stop the live
coordinator) nor carries one: it writes to its own stream (`operator-<agent>`), never to a trainer's,
so no trainer is ever fenced off by it.  Its append is fenced on the version of the debt's group
stream as read before the decision: if the trainer wrote to that group meanwhile (paid the debt,
owed a re-fetched receipt), nothing is written and the decision is made again on the log as it now
is, within `DROP_POLICY` (a few tries, a deadline, a jittered pause between them).
"""

from __future__ import annotations

import getpass
import random
import socket
import time
from typing import TYPE_CHECKING, Annotated, Final

import typer
from rich.markup import escape
from rich.table import Column, Table

from cli.common import DbOption, bounded, clear_errors, console, db_url, err_console, error
from protocol.retry import RetryPolicy, RetryState, next_step

if TYPE_CHECKING:  # imported by the commands that use them: `ledger --help` stays light
    from eventstore import EventStore
    from projections.ledger import LedgerState

# Decisions made again when the trainer writes to the debt's group between the read and the append.
DROP_POLICY: Final = RetryPolicy(max_calls=3, deadline_s=30.0, base_s=0.05, cap_s=0.5)
# Debts listed by `ledger status` (all of them: `ledger debt list`).
STATUS_DEBTS_SHOWN: Final = 20

app = typer.Typer(help="The unpaid ACK debts, and an operator's drop of one.", no_args_is_help=True)


def _ledger(store: EventStore) -> LedgerState:
    from projections.base import ReplayRefused
    from projections.runner import rebuild

    try:
        state: LedgerState = rebuild(store).state("ledger")
    except ReplayRefused as exc:
        err_console.print(f"[red]replay refused:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None
    return state


def debts_table(ledger: LedgerState, limit: int | None = None, agent: str | None = None) -> Table:
    """Every unpaid debt (to `agent`, if given), oldest first per agent, with what `ledger debt drop`
    needs to name it."""
    rows = ledger.unpaid_debts(agent)
    shown = rows if limit is None else rows[:limit]
    # The rollout id is what `ledger debt drop` takes: never cut, whatever the width (the others fold).
    longest = max((len(receipt.rollout_id) for _, receipt in shown), default=len("rollout"))
    table = Table(
        Column("agent", overflow="fold"),
        Column("rollout", no_wrap=True, min_width=longest),
        "attempt",
        "generation",
        Column("group", overflow="fold"),
        Column("trainer", overflow="fold"),
        title="unpaid ACK debts",
    )
    for owed_to, receipt in shown:
        group = ledger.group_of(receipt.rollout_id)
        table.add_row(
            escape(owed_to),
            escape(receipt.rollout_id),
            str(receipt.attempt_index),
            str(receipt.execution_generation),
            escape(group.group_id) if group is not None else "-",
            escape(group.trainer_id or "(unnamed)") if group is not None else "-",
        )
    if limit is not None and len(rows) > limit:
        table.caption = f"{len(rows) - limit} more: ledger debt list"
    return table


@app.command("list")
def list_debts(
    db: DbOption = None,
    agent: Annotated[str | None, typer.Option("--agent", help="Only the debts owed to this agent.")] = None,
) -> None:
    """Every unpaid ACK debt: the agent, the try (rollout id and attempt) and the receipt's generation."""
    from eventstore import open_store

    with clear_errors():
        store = open_store(db_url(db, "auditor"), read_only=True)
        try:
            ledger = _ledger(store)
        finally:
            store.close()
    console.print(debts_table(ledger, agent=agent))


def default_operator() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment (no $USER, no passwd entry)
        user = "operator"
    return f"{user}@{socket.gethostname()}"


@app.command("drop")
def drop(
    rollout_id: Annotated[str, typer.Argument(help="The try's rollout id, e.g. p7_g2.")],
    attempt: Annotated[int, typer.Argument(min=0, help="The try's attempt index.")],
    reason: Annotated[
        str, typer.Option("--reason", help="Why the debt can never be paid (kept in the log).")
    ],
    agent: Annotated[
        str | None, typer.Option("--agent", help="The agent it is owed to (checked when given).")
    ] = None,
    operator: Annotated[
        str | None, typer.Option("--operator", help="Who drops it (default: user@host).")
    ] = None,
    db: DbOption = None,
) -> None:
    """Drop one unpaid ACK debt by hand, or the retire owed for the try if it has no ACK debt; exit
    status 2 (nothing written) if the log holds neither."""
    from pydantic import ValidationError

    from eventstore import open_store
    from eventstore.errors import Fenced
    from eventstore.events import OperatorMark
    from eventstore.records import ExpectedVersion, Fence
    from protocol.ids import ID_RE, MAX_ID_LENGTH, group_id_of
    from protocol.streams import group_stream, operator_stream
    from trainer.core.debt import on_operator_drop

    if len(rollout_id) > MAX_ID_LENGTH or not ID_RE.match(rollout_id):
        error(f"{bounded(rollout_id)!r} is not a rollout id (at most {MAX_ID_LENGTH} characters of "
              "A-Z, a-z, 0-9, '.', '_', '-', e.g. p7_g2); nothing was written")  # fmt: skip
        raise typer.Exit(2)
    try:
        mark = OperatorMark(operator=operator or default_operator(), reason=reason.strip())
    except ValidationError as exc:
        error(f"{exc.errors()[0]['msg']} (--reason, --operator)")
        raise typer.Exit(2) from None
    group_id = group_id_of(rollout_id) or rollout_id
    with clear_errors():
        store = open_store(db_url(db, "writer"))
        try:
            fenced = RetryState()
            while True:
                # The group's version before the fold: the append is refused if the trainer wrote since.
                seen = store.stream_version(group_stream(group_id))
                ledger = _ledger(store)
                decided = on_operator_drop(ledger.debts, rollout_id, attempt, agent, mark, ledger.retires)
                if decided.agent_name is None:
                    error(f"{decided.step.reason}; nothing was written")
                    raise typer.Exit(2)
                try:
                    result = store.append(
                        operator_stream(decided.agent_name),
                        list(decided.step.events),
                        ExpectedVersion.ANY,
                        metadata={"writer": f"operator:{mark.operator}"},
                        fence=Fence(group_stream(group_id), seen),
                    )
                except Fenced as exc:  # the trainer wrote to the group meanwhile: decide again on the log
                    now = time.monotonic()
                    fenced = fenced.failed(now, str(exc))
                    verdict = next_step(DROP_POLICY, fenced, now, random.random())
                    if verdict.kind == "give_up":
                        break
                    time.sleep(verdict.delay_s)
                    continue
                what = "ACK debt" if decided.receipt is not None else "retire owed"
                console.print(
                    f"dropped the {what} of {escape(rollout_id)}#{attempt} owed to "
                    f"{escape(decided.agent_name)} at position {result.positions[0]}: {escape(mark.reason)}",
                    highlight=False,
                )
                return
        finally:
            store.close()
    error(
        f"the trainer kept writing to group {group_id} ({fenced.calls} tries); nothing was written, run it again"
    )
    raise typer.Exit(2)
