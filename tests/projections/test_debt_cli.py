"""`ledger debt list | drop` and the debts `ledger status` shows, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from cli import debt as debt_cli
from cli.main import app
from eventstore import EventStore, open_store
from eventstore.events import AckDeliveryStuck, AckRejected, OperatorMark
from projections.audit import CHECKPOINT_CLEAN, audit_log
from projections.base import decode
from projections.ledger import LedgerState
from projections.runner import rebuild
from protocol.streams import operator_stream, trainer_stream
from tests.projections.builder import AGENT, LogBuilder
from tests.projections.tamper import append_raw
from trainer.core import debt as debt_core

cli = CliRunner()


@pytest.fixture
def owed(store_url: str) -> Iterator[EventStore]:
    """p1 finished and ACKed; p2_g0 finished, its debt owed and never paid."""
    store = open_store(store_url)
    log = LogBuilder(store)
    log.clean_sibling_group("p1", 1)
    log.reserve("p2", 1)
    log.mint("p2", 1)
    log.dispatch("p2_g0")
    log.reply("p2_g0")
    log.seal("p2_g0")
    try:
        yield store
    finally:
        store.close()


def run(*args: str) -> tuple[int, str]:
    result = cli.invoke(app, list(args))
    return result.exit_code, result.output


def ledger_of(store: EventStore) -> LedgerState:
    state: LedgerState = rebuild(store, from_checkpoint=False).state("ledger")
    return state


def test_status_shows_the_debt_and_the_operator_drops_it(owed: EventStore, store_url: str) -> None:
    code, out = run("status", "--db", store_url)
    assert code == 0 and "unpaid ACK debts" in out and "p2_g0" in out, out
    code, out = run("debt", "list", "--db", store_url)
    assert code == 0 and "p2_g0" in out and "p1_g0" not in out, out
    code, out = run("debt", "list", "--agent", "agent-b", "--db", store_url)
    assert code == 0 and "p2_g0" not in out, out

    code, out = run(
        "debt",
        "drop",
        "p2_g0",
        "0",
        "--reason",
        "agent disk lost",
        "--operator",
        "ops@host",
        "--db",
        store_url,
    )
    assert code == 0 and "dropped the ACK debt of p2_g0#0 owed to agent-a" in out, out
    assert ledger_of(owed).unpaid_debts() == []
    rows = list(owed.read_stream(operator_stream(AGENT)))
    assert len(rows) == 1 and rows[0].schema_version == AckRejected.schema_version == 4
    assert rows[0].metadata.get("writer") == "operator:ops@host"
    assert decode(rows[0]) == AckRejected(
        rollout_id="p2_g0",
        attempt_index=0,
        error="dropped_by_operator",
        operator=OperatorMark(operator="ops@host", reason="agent disk lost"),
    )
    # The auditor accepts the operator's drop, and a checkpoint after it is clean.
    log = LogBuilder(owed)
    log.seal_group("p2", {0: 0})
    log.checkpoint("c1")
    report = audit_log(owed)
    assert report.ok, report.as_json()
    code, out = run("status", "--db", store_url)
    assert code == 0 and "p2_g0" not in out, out


def test_a_debt_still_owed_blocks_a_clean_checkpoint(owed: EventStore) -> None:
    """The contrast: without the drop, a commit over that debt breaks checkpoint-clean."""
    LogBuilder(owed).checkpoint("c1")
    assert CHECKPOINT_CLEAN in {v.rule for v in audit_log(owed).violations}


@pytest.mark.parametrize(
    "args",
    [
        ("p2_g0", "1"),  # another attempt
        ("p1_g0", "0"),  # paid already
        ("nope", "0"),  # never heard of
        ("p2_g0", "0", "--agent", "agent-b"),  # owed to another agent
    ],
)
def test_an_unknown_debt_is_refused_with_exit_2_and_nothing_appended(
    owed: EventStore, store_url: str, args: tuple[str, ...]
) -> None:
    head = owed.head()
    code, out = run("debt", "drop", *args, "--reason", "why not", "--db", store_url)
    assert code == 2 and "no unpaid ACK debt" in out and "nothing was written" in out, out
    assert owed.head() == head
    assert [d.rollout_id for _, d in ledger_of(owed).unpaid_debts()] == ["p2_g0"]


def test_a_drop_needs_a_reason(owed: EventStore, store_url: str) -> None:
    head = owed.head()
    code, _ = run("debt", "drop", "p2_g0", "0", "--db", store_url)
    assert code == 2  # --reason is required
    code, out = run("debt", "drop", "p2_g0", "0", "--reason", "   ", "--db", store_url)
    assert code == 2 and "--reason" in out, out
    assert owed.head() == head


def test_the_operators_mark_goes_with_an_operator_drop_only() -> None:
    with pytest.raises(ValueError, match="operator's mark"):
        AckRejected(rollout_id="p_g0", attempt_index=0, error="dropped_by_operator")
    with pytest.raises(ValueError, match="operator's mark"):
        AckRejected(
            rollout_id="p_g0",
            attempt_index=0,
            error="unknown_execution",
            operator=OperatorMark(operator="ops", reason="r"),
        )


def test_a_v2_rejection_reads_as_v4_without_a_mark_or_an_incarnation(
    owed: EventStore, store_url: str
) -> None:
    """Stored rows are never rewritten: a v2 row is upcast on read, its meaning unchanged (kept owed,
    from the agent's own generation)."""
    data = '{"rollout_id": "p2_g0", "attempt_index": 0, "error": "unknown_execution", "agent_generation": 1}'
    position = append_raw(owed, store_url, "group-p2", "AckRejected", 2, data)
    row = next(r for r in owed.read_all(position - 1) if r.position == position)
    assert decode(row) == AckRejected(
        rollout_id="p2_g0",
        attempt_index=0,
        error="unknown_execution",
        agent_generation=1,
        operator=None,
        agent_incarnation=None,
    )
    assert [d.rollout_id for _, d in ledger_of(owed).unpaid_debts()] == ["p2_g0"]


def test_a_trainer_paying_the_debt_between_the_read_and_the_append_wins(
    owed: EventStore, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's relay pays the debt after the command read the log and before it appends: the
    append is fenced on the group's version, nothing is written, and the decision made again finds
    nothing to drop (exit 2).  The trainer's own stream was never touched, so it is not fenced off."""
    decide = debt_core.on_operator_drop
    calls: list[object] = []

    def paid_meanwhile(*args: object, **kwargs: object) -> object:
        decision = decide(*args, **kwargs)  # type: ignore[arg-type]
        if not calls:
            LogBuilder(owed).ack("p2_g0")  # the trainer, between this read and the append
        calls.append(decision)
        return decision

    monkeypatch.setattr(debt_core, "on_operator_drop", paid_meanwhile)
    code, out = run("debt", "drop", "p2_g0", "0", "--reason", "agent disk lost", "--db", store_url)
    assert code == 2 and "no unpaid ACK debt" in out, out
    assert len(calls) == 2
    assert not list(owed.read_stream(operator_stream(AGENT)))
    assert ledger_of(owed).unpaid_debts() == [] and audit_log(owed).ok


def test_a_trainer_that_keeps_writing_to_the_group_outlasts_the_drop_budget(
    owed: EventStore, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer writes to the debt's group between every read and append: each decision is fenced
    off, and after `DROP_POLICY`'s tries the command gives up with nothing written (exit 2)."""
    decide = debt_core.on_operator_drop
    calls = []

    def written_meanwhile(*args: object, **kwargs: object) -> object:
        calls.append(decide(*args, **kwargs))  # type: ignore[arg-type]
        LogBuilder(owed).claim("p2", len(calls))  # a write to group-p2 that leaves the debt owed
        return calls[-1]

    monkeypatch.setattr(debt_core, "on_operator_drop", written_meanwhile)
    code, out = run("debt", "drop", "p2_g0", "0", "--reason", "agent disk lost", "--db", store_url)
    tries = debt_cli.DROP_POLICY.max_calls
    assert code == 2 and f"kept writing to group p2 ({tries} tries)" in out, out
    assert len(calls) == tries
    assert not list(owed.read_stream(operator_stream(AGENT)))
    assert [d.rollout_id for _, d in ledger_of(owed).unpaid_debts()] == ["p2_g0"]


def test_status_shows_an_agent_whose_ack_delivery_is_stuck_while_it_is_owed(
    owed: EventStore, store_url: str
) -> None:
    stuck = AckDeliveryStuck(
        agent_name=AGENT, debts=1, calls=16, reason="16 calls failed: connection refused"
    )
    owed.append(trainer_stream(None), [stuck])
    code, out = run("status", "--db", store_url)
    assert code == 0 and "ACK delivery stuck" in out and "connection refused" in out, out
    LogBuilder(owed).ack("p2_g0")  # the agent answered again: paid, no longer shown
    code, out = run("status", "--db", store_url)
    assert code == 0 and "ACK delivery stuck" not in out, out


def test_debt_list_shows_rollout_ids_whole_on_a_narrow_terminal(store_url: str) -> None:
    """`ledger debt drop` takes the rollout id: the list never cuts it, even 60 columns wide."""
    store = open_store(store_url)
    try:
        log = LogBuilder(store)
        group = "prompt-0000123456789-with-a-long-name"
        log.reserve(group, 1)
        log.mint(group, 1)
        log.dispatch(f"{group}_g0")
        log.reply(f"{group}_g0")
        log.seal(f"{group}_g0")
    finally:
        store.close()
    result = cli.invoke(app, ["debt", "list", "--db", store_url], env={"COLUMNS": "60"})
    assert result.exit_code == 0 and f"{group}_g0" in result.output, result.output
