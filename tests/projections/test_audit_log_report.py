"""`audit_log` over a log, its payloads and its subscribers: the event rules' violations and the payload
checks' in one report, in log order (one that names no position first), its head and count, its progress."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from eventstore import EventStore
from eventstore.events import GroupSealed
from eventstore.payload_stores import payload_plane
from payloads import LOG_BLOBS_STORE, LocalDirPayloadStore
from projections.audit import GROUP_SEAL_COMPLETE, HASH_CHAIN, RULES, audit_log
from projections.payload_audit import PAYLOAD_INTACT, PAYLOAD_RULES, PAYLOAD_STORED
from tests.projections.builder import TOKENS_DIGEST, LogBuilder
from tests.projections.test_payload_audit import claimed_at


def test_one_report_of_the_events_the_payloads_and_the_subscribers(
    store: EventStore, db_url: str, tmp_path: Path
) -> None:
    plane = payload_plane(store, (tmp_path / "payloads").as_uri())
    log = LogBuilder(store, payloads=plane)
    (ghost,) = log.group("ghost", [GroupSealed(group_id="ghost", attempts=[])])
    log.clean_sibling_group("a")
    lost_at, lost = claimed_at(store, "a_g1")
    local = plane.stores[next(n for n in plane.stores if n != LOG_BLOBS_STORE)]
    assert isinstance(local, LocalDirPayloadStore)
    local.path_of(lost).unlink()
    tokens_at = next(e.position for e in store.read_all() if e.type == "SiblingSealed")
    unclaimed = store.put_blob(b'{"never": "claimed"}')
    head = store.head()
    with sqlite3.connect(db_url.removeprefix("sqlite:///")) as conn:
        conn.execute("UPDATE blobs SET content = ? WHERE digest = ?", (b"{}", unclaimed))
        conn.execute("DELETE FROM blobs WHERE digest = ?", (TOKENS_DIGEST,))  # every seal's token records
        conn.execute(
            "INSERT INTO subscriptions (name, position, updated_at) VALUES (?, ?, 0)", ("exporter", head + 2)
        )
    told: list[int] = []
    report = audit_log(store, progress=told.append, payloads=plane)
    assert [(v.rule, v.positions) for v in report.violations] == [
        (PAYLOAD_INTACT, []),  # the unclaimed blob: no position, first
        (GROUP_SEAL_COMPLETE, [ghost]),
        (PAYLOAD_STORED, [tokens_at, lost_at]),
        (HASH_CHAIN, [head, head + 2]),
    ], report.as_json()
    missing = next(v.message for v in report.violations if v.rule == PAYLOAD_STORED)
    assert missing.startswith(
        f"2 claimed payload(s) are not stored in store {local.name!r} ({local.where}), 'log' ("
    ), missing
    assert ghost == 1 and GROUP_SEAL_COMPLETE < PAYLOAD_INTACT < PAYLOAD_STORED
    assert (report.events, report.head, told) == (head, head, [head])
    assert report.rules_checked == [*RULES, *PAYLOAD_RULES]
    assert report.payloads is not None and (report.payloads.missing, report.payloads.corrupt) == (2, 1)


def test_a_payload_violation_at_the_first_position_names_it(store: EventStore, tmp_path: Path) -> None:
    plane = payload_plane(store, (tmp_path / "payloads").as_uri())
    log = LogBuilder(store, payloads=plane)
    (replied,) = log.reply("x_g0")  # the log's first row claims the reply
    lost_at, lost = claimed_at(store, "x_g0")
    local = plane.stores[next(n for n in plane.stores if n != LOG_BLOBS_STORE)]
    assert isinstance(local, LocalDirPayloadStore)
    local.path_of(lost).unlink()
    report = audit_log(store, payloads=plane)
    assert [(v.rule, v.positions) for v in report.violations] == [(PAYLOAD_STORED, [1])]
    assert replied == lost_at == 1
