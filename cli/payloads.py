"""`ledger payloads prune | collect`: retention of done groups' payloads and collection of unclaimed ones.

The decisions are `projections.retention`'s (pure, over the log's claims and the store's listing); this
module reads, decides and performs.  `prune` appends `PayloadsPruned` to the `retention` stream before
it deletes (fenced on that stream's version as read before the decision, so two prunes never both
record), so a claimed payload is absent only once the log says it was pruned.  `collect` deletes only
what no event claims, and writes nothing to the log.  Both delete from the store the log's writers
put to (`--payloads URL`, default `$LEDGER_PAYLOADS`, else the store beside the log); the log's own
`blobs` table (older logs) is append-only and never deleted from.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from cli.common import DbOption, clear_errors, console, db_url, err_console, error, mask_url

if TYPE_CHECKING:
    from eventstore import EventStore
    from payloads import PayloadStore
    from projections.retention import PayloadRefs

app = typer.Typer(
    help="Retention and collection of the payload store (token records, replies, logprobs).",
    no_args_is_help=True,
)

PayloadsOption = Annotated[
    str | None,
    typer.Option(
        "--payloads",
        help="The payload store the log's writers use (default: $LEDGER_PAYLOADS, else beside the log).",
    ),
]
GraceOption = Annotated[
    float | None,
    typer.Option(
        "--grace-s",
        min=0.0,
        help="Spare every payload put within this many seconds, as it may be claimed a moment later "
        "(default: projections.retention.DEFAULT_GRACE_S, an hour).",
    ),
]
DryRunOption = Annotated[bool, typer.Option("--dry-run", help="Say what would go; change nothing.")]
OnlyThisLogOption = Annotated[
    bool,
    typer.Option(
        "--only-this-log",
        help="The store named is written by this log's processes alone (needed when it is not the "
        "store beside the log: another log's payloads would be deleted with this one's).",
    ),
]
# Digests per delete call: bounded requests and memory.
_DELETE_BATCH = 500


def _read(store: EventStore, url: str | None) -> tuple[PayloadStore, PayloadRefs]:
    from eventstore.payload_stores import payload_plane
    from projections.retention import fold_refs

    return payload_plane(store, url).default, fold_refs(store.read_all())


def _delete(target: PayloadStore, digests: list[str]) -> int:
    removed = 0
    for start in range(0, len(digests), _DELETE_BATCH):
        removed += target.delete(digests[start : start + _DELETE_BATCH])
    return removed


@app.command("prune")
def prune(
    db: DbOption = None,
    payloads: PayloadsOption = None,
    keep_newest: Annotated[
        int, typer.Option("--keep-newest", min=0, help="Keep the payloads of this many newest done groups.")
    ] = 0,
    grace_s: GraceOption = None,
    unscored: Annotated[
        bool,
        typer.Option(
            "--unscored",
            help="Prune done groups whose sealed tries have no logprob result too (a log no logprob "
            "worker scores); by default they are kept until the queue has scored them.",
        ),
    ] = False,
    dry_run: DryRunOption = False,
    only_this_log: OnlyThisLogOption = False,
) -> None:
    """Delete the payloads of groups done for good (trained and behind a committed checkpoint, or
    dead-lettered; every debt paid; every sealed try scored), recording them in the log first as
    `PayloadsPruned`."""
    from eventstore import open_store
    from eventstore.errors import WrongExpectedVersion
    from projections.base import ReplayRefused
    from projections.ledger import LedgerState
    from projections.retention import DEFAULT_GRACE_S, prune_plan, pruned_events
    from projections.runner import rebuild
    from protocol.streams import RETENTION_STREAM

    with clear_errors():
        store = open_store(db_url(db, "writer"))
        try:
            # Content-addressed: a payload of this log's done groups is another log's too when their
            # bytes are the same, and its claim there would be left without it.
            _refuse_a_shared_store(store, payloads, only_this_log or dry_run, "this log prunes")
            seen = store.stream_version(RETENTION_STREAM)
            try:
                ledger: LedgerState = rebuild(store).state("ledger")
            except ReplayRefused as exc:
                err_console.print(f"[red]replay refused:[/red] {escape(str(exc))}")
                raise typer.Exit(1) from None
            target, refs = _read(store, payloads)
            stored = {p.digest: p for p in target.scan()}
            done = {g: a.last_position for g, a in ledger.archived.items()}
            plan = prune_plan(
                refs,
                done,
                stored,
                target.name,
                time.time(),
                grace_s=DEFAULT_GRACE_S if grace_s is None else grace_s,
                keep_newest=keep_newest,
                unscored_too=unscored,
            )
            summary = (
                f"{len(plan.groups)} done group(s), {len(plan.digests)} payload(s), {plan.bytes:,} bytes "
                f"in store {escape(target.name)}"
                + (
                    f"; {len(plan.deferred)} group(s) deferred (a payload put within the grace)"
                    if plan.deferred
                    else ""
                )
                + (
                    f"; {len(plan.awaiting_scoring)} group(s) kept (a sealed try not scored yet: "
                    "ledger worker logprobs, or --unscored)"
                    if plan.awaiting_scoring
                    else ""
                )
            )
            if dry_run or not plan.groups:
                console.print(("would prune " if dry_run else "nothing to prune: ") + summary)
                return
            try:
                result = store.append(
                    RETENTION_STREAM,
                    list(pruned_events(plan, target.name)),
                    seen,
                    metadata={"writer": "retention"},
                )
            except WrongExpectedVersion:
                err_console.print(
                    "[red]error:[/red] another prune recorded meanwhile; nothing was deleted, run it again"
                )
                raise typer.Exit(2) from None
            removed = _delete(target, plan.digests)
            console.print(f"pruned {summary} (recorded at position {result.positions[0]}; {removed} deleted)")
        finally:
            store.close()


def _named_store(store: EventStore, payloads: str | None) -> str | None:
    """The store `--payloads` or `$LEDGER_PAYLOADS` names when it is not the one beside the log (a
    directory beside a SQLite file, a PostgreSQL log's own database), else None."""
    import os
    from pathlib import Path
    from urllib.parse import unquote, urlsplit

    from payloads import PAYLOADS_ENV, payload_url_beside

    named = payloads or os.environ.get(PAYLOADS_ENV)
    if not named:
        return None

    def where(url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme in ("", "file"):
            return str(Path(unquote(parts.path) if parts.scheme else url).resolve())
        return url

    return None if where(named) == where(payload_url_beside(store.url)) else named


def _refuse_a_shared_store(store: EventStore, payloads: str | None, allowed: bool, because: str) -> None:
    """Ends the command (exit status 2, nothing deleted) when the store named is not the one beside
    the log and the caller did not say this log alone writes there: another log's payloads it holds
    would be deleted, as those that `because`."""
    named = _named_store(store, payloads)
    if named is not None and not allowed:
        error(
            f"payload store {mask_url(named)} is not the one beside this log: another log's payloads in it "
            f"would be deleted with those that {because}; nothing was deleted. Pass --only-this-log if "
            "this log's processes alone write to it"
        )
        raise typer.Exit(2)


@app.command("collect")
def collect(
    db: DbOption = None,
    payloads: PayloadsOption = None,
    grace_s: GraceOption = None,
    dry_run: DryRunOption = False,
    only_this_log: OnlyThisLogOption = False,
) -> None:
    """Delete the payloads no event needs: put but never claimed (the process died before its append),
    or pruned and left behind by an interrupted prune."""
    from eventstore import open_store
    from projections.retention import DEFAULT_GRACE_S, collectable

    with clear_errors():
        store = open_store(db_url(db, "writer"))
        try:
            _refuse_a_shared_store(store, payloads, only_this_log or dry_run, "look unclaimed to this log")
            target, refs = _read(store, payloads)
            listed = list(target.scan())
            digests = collectable(refs, listed, time.time(), DEFAULT_GRACE_S if grace_s is None else grace_s)
            size = {p.digest: p.size for p in listed}
            what = f"{len(digests)} of {len(listed)} payload(s), {sum(size[d] for d in digests):,} bytes"
            if dry_run:
                console.print(f"would collect {what} in store {escape(target.name)}")
                return
            removed = _delete(target, digests)
            console.print(f"collected {what} in store {escape(target.name)} ({removed} deleted)")
        finally:
            store.close()
