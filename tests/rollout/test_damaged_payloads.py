"""A sealed group whose payload was damaged in the store (a byte changed, cut short, deleted, the size
column lying) after the seal: the training read refuses with PayloadCorrupt / PayloadMissing in one
line, the audit names the rule, and nothing in the log changes.  On both backends' default stores: a
directory beside a SQLite log, `ledger_payloads` in a PostgreSQL log's database."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sqlalchemy import text

from eventstore import EventStore
from eventstore.payload_stores import payload_plane
from payloads import LocalDirPayloadStore, PayloadCorrupt, PayloadMissing, PayloadStore
from payloads._postgres import TABLE, PostgresPayloadStore
from projections.audit import audit_log
from tests.rollout.conftest import MakeAgent, one_sealed_group


def _sql(target: PayloadStore, statement: str, **params: object) -> None:
    assert isinstance(target, PostgresPayloadStore)
    with target.engine.begin() as conn:
        assert conn.execute(text(statement), params).rowcount == 1


def _flip(target: PayloadStore, digest: str, content: bytes) -> None:
    changed = bytes([content[0] ^ 1]) + content[1:]
    if isinstance(target, LocalDirPayloadStore):
        target.path_of(digest).write_bytes(changed)
    else:
        _sql(target, f"UPDATE {TABLE} SET content = :c WHERE digest = :d", c=changed, d=digest)


def _cut(target: PayloadStore, digest: str, content: bytes) -> None:
    if isinstance(target, LocalDirPayloadStore):
        target.path_of(digest).write_bytes(content[:-7])
    else:
        _sql(target, f"UPDATE {TABLE} SET content = :c WHERE digest = :d", c=content[:-7], d=digest)


def _delete(target: PayloadStore, digest: str, content: bytes) -> None:
    assert target.delete([digest]) == 1


Damage = Callable[[PayloadStore, str, bytes], None]


@pytest.mark.parametrize(
    ("damage", "refused", "says", "rule"),
    [
        (_flip, PayloadCorrupt, "is corrupt: the stored bytes hash to sha256:", "payload-intact"),
        (_cut, PayloadCorrupt, "is corrupt: ", "payload-intact"),
        (_delete, PayloadMissing, "is not stored in payload store", "payload-stored"),
    ],
    ids=["byte-changed", "cut-short", "deleted"],
)
async def test_a_damaged_payload_is_refused_in_one_line_and_the_log_is_untouched(
    store: EventStore,
    make_agent: MakeAgent,
    damage: Damage,
    refused: type[Exception],
    says: str,
    rule: str,
) -> None:
    async with one_sealed_group(store, make_agent, "prompt_group", 2) as (coord, sealed):
        target = payload_plane(store).default
        claim = sealed.token_claims[1]
        assert claim is not None
        damage(target, claim.digest, target.get(claim.digest))
        before = [(e.position, e.event_id) for e in store.read_all()]
        with pytest.raises(refused) as caught:
            await coord.with_payloads(sealed)
        message = str(caught.value)
        assert claim.digest in message and says in message and "\n" not in message, message
        assert [(e.position, e.event_id) for e in store.read_all()] == before
        # The group is still there to be read once the payload is put back; nothing was claimed.
        assert [s.group_id for s in coord.sealed_unclaimed()] == [sealed.group_id]
    report = audit_log(store, payloads=payload_plane(store))
    assert [v.rule for v in report.violations] == [rule], report.as_json()
    assert claim.digest in report.violations[0].message


# The size column is PostgreSQL's alone (a local directory's size is the file's own): one backend.
@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
async def test_a_size_column_that_lies_changes_no_read(store: EventStore, make_agent: MakeAgent) -> None:
    """PostgreSQL's `size` column is the listing's (collection, retention), never the read's: a read
    is held to the claim's size and digest by the bytes themselves."""
    async with one_sealed_group(store, make_agent, "prompt_group", 1) as (coord, sealed):
        target = payload_plane(store).default
        claim = sealed.token_claims[0]
        assert claim is not None
        _sql(target, f"UPDATE {TABLE} SET size = size + 1000 WHERE digest = :d", d=claim.digest)
        again = await coord.with_payloads(sealed)
        first, second = sealed.tokens[0], again.tokens[0]
        assert first is not None and second is not None and again.replies == sealed.replies
        assert second.records == first.records and second.token_count == first.token_count > 0
    assert audit_log(store, payloads=payload_plane(store)).ok
