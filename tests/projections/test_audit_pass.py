"""The auditor's one pass over the log (`audit_events`): the running digest of the log against the digests
stored checkpoints recorded, a log cut short behind a checkpoint or a subscriber, its progress, the
payload claims it gathers for the payload checks, and the order of its report."""

from __future__ import annotations

import itertools
from pathlib import Path

from eventstore import EventStore, RecordedEvent
from eventstore.events import PayloadsPruned, ReceiptFetched, RunReplied, TrainerEpochTaken
from eventstore.payload_stores import payload_plane
from projections.audit import HASH_CHAIN, SEAL_BEFORE_ACK, AuditReport, audit_events
from projections.digest import BLOCK, LogDigest, StoredDigest
from projections.payload_audit import PayloadFacts
from projections.sql import StoredCheckpoint
from protocol.streams import RETENTION_STREAM
from tests.payloads.test_reply_apart import put_apart
from tests.projections.builder import LogBuilder, completion_receipt


def epochs(store: EventStore, count: int) -> list[RecordedEvent]:
    """`count` events that break no rule, in one append; the log's rows."""
    store.append(
        "trainer", [TrainerEpochTaken(trainer_id=None, reason="start", writer=f"w{i}") for i in range(count)]
    )
    return list(store.read_all())


def digest_at(rows: list[RecordedEvent], position: int, altered: int | None = None) -> StoredDigest:
    """The digest a checkpoint at `position` records (with the row at `altered` as if edited)."""
    digest = LogDigest()
    for row in rows[:position]:
        digest.add(row.position, "f" * 64 if row.position == altered else row.hash)
    return digest.stored()


def checkpoint(projection: str, position: int, digest: str) -> StoredCheckpoint:
    return StoredCheckpoint(
        projection=projection,
        version=1,
        position=position,
        state_hash="0" * 64,
        log_digest=digest,
        created_at=0.0,
    )


def chain(report: AuditReport) -> list[tuple[list[int], str]]:
    return [(v.positions, v.message) for v in report.violations if v.rule == HASH_CHAIN]


def test_checkpoint_digests_that_match_the_log_are_clean_inside_a_block_at_its_end_and_after_it(
    store: EventStore,
) -> None:
    rows = epochs(store, BLOCK + 6)
    head = BLOCK + 6
    found = audit_events(
        rows,
        [
            checkpoint("ledger", 1000, digest_at(rows, 1000).encode()),
            checkpoint("ledger", BLOCK, digest_at(rows, BLOCK).encode()),
            checkpoint("ledger", head, digest_at(rows, head).encode()),
            checkpoint("checkpoints", head, digest_at(rows, head).encode()),
        ],
    )
    assert digest_at(rows, head).block_position == BLOCK  # the last one resumes from the closed block
    assert found.ok, found.as_json()
    assert (found.events, found.head) == (head, head)


def test_a_digest_the_log_no_longer_matches_is_reported_at_its_checkpoint(store: EventStore) -> None:
    rows = epochs(store, BLOCK + 6)
    head = BLOCK + 6
    good = digest_at(rows, head)
    edited_in_block = digest_at(rows, head, altered=10)  # both the closed block and the digest differ
    block_only = StoredDigest(BLOCK, BLOCK, "e" * 64, good.digest)
    digest_only = StoredDigest(BLOCK, BLOCK, good.block_digest, "e" * 64)
    edited_after = digest_at(rows, 20, altered=15)
    assert edited_in_block.block_digest != good.block_digest
    for stored, at in ((edited_in_block, head), (block_only, head), (digest_only, head), (edited_after, 20)):
        found = audit_events(rows, [checkpoint("ledger", at, stored.encode())])
        assert chain(found) == [
            (
                [at],
                f"the log up to position {at} no longer matches the digest its ledger checkpoint recorded: "
                "a row before it was removed or altered",
            )
        ]


def test_an_unreadable_digest_or_one_of_other_blocks_is_reported_and_the_others_still_checked(
    store: EventStore,
) -> None:
    rows = epochs(store, 30)
    good = digest_at(rows, 20)
    other_size = StoredDigest(BLOCK // 2, 0, good.block_digest, good.digest)
    other_start = StoredDigest(BLOCK, 7, good.block_digest, good.digest)
    wrong = StoredDigest(BLOCK, 0, good.block_digest, "e" * 64)
    found = audit_events(
        rows,
        [
            checkpoint("timeline", 20, wrong.encode()),
            checkpoint("swimlane", 20, wrong.encode()),  # checkpointed together: one digest, said once
            checkpoint("ledger", 20, "not:a digest"),
            checkpoint("checkpoints", 20, other_size.encode()),
            checkpoint("status", 20, other_start.encode()),
        ],
    )
    assert chain(found) == [
        (
            [20],
            "the log up to position 20 no longer matches the digest its timeline checkpoint recorded: "
            "a row before it was removed or altered",
        ),
        ([20], "the ledger checkpoint at 20 has no readable digest"),
        (
            [20],
            f"the checkpoints checkpoint at 20 used digest blocks of {BLOCK // 2}; this auditor uses {BLOCK}",
        ),
        ([20], f"the status checkpoint at 20 used digest blocks of {BLOCK}; this auditor uses {BLOCK}"),
    ]


def test_a_checkpoint_or_a_subscriber_past_the_end_says_events_were_removed_from_it(
    store: EventStore,
) -> None:
    rows = epochs(store, 12)
    found = audit_events(
        rows,
        [
            checkpoint("ledger", 12, digest_at(rows, 12).encode()),
            checkpoint("ledger", 17, "x"),
            checkpoint("checkpoints", 17, "x"),
            checkpoint("ledger", 15, "x"),
        ],
        {"b": 13, "a": 14, "c": 12, "d": 3},
    )
    removed = "events were removed from its end"
    assert chain(found) == [
        ([12, 15], f"a ledger checkpoint was stored at position 15 but the log ends at 12: {removed}"),
        ([12, 17], f"a ledger checkpoint was stored at position 17 but the log ends at 12: {removed}"),
        ([12, 14], f"subscriber 'a' processed up to position 14 but the log ends at 12: {removed}"),
        ([12, 13], f"subscriber 'b' processed up to position 13 but the log ends at 12: {removed}"),
    ]


def test_an_empty_log_ends_at_zero(store: EventStore) -> None:
    found = audit_events([], [checkpoint("ledger", 3, "x")], {"s": 2, "t": 0})
    assert (found.events, found.head) == (0, 0)
    assert chain(found) == [  # in log order: the subscriber's position first
        (
            [2],
            "subscriber 's' processed up to position 2 but the log ends at 0: events were removed from its end",
        ),
        (
            [3],
            "a ledger checkpoint was stored at position 3 but the log ends at 0: events were removed from its end",
        ),
    ]


def test_progress_is_told_every_10_000_events_and_the_rest_at_the_end(store: EventStore) -> None:
    rows = epochs(store, 3)
    told: list[int] = []
    found = audit_events(itertools.islice(itertools.cycle(rows), 20_001), progress=told.append)
    assert told == [10_000, 10_000, 1]
    assert (found.events, found.head) == (20_001, rows[(20_001 - 1) % 3].position)
    assert audit_events(itertools.islice(itertools.cycle(rows), 10_000)).events == 10_000  # no one told


def test_the_report_is_in_log_order_then_by_rule(store: EventStore, log: LogBuilder) -> None:
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    log.reply("p_g0")
    (fetched,) = log.group("p", [ReceiptFetched(agent_name="agent-a", receipt=completion_receipt("p_g0", 0))])
    acked = log.ack("p_g0")
    head = store.head()
    found = audit_events(list(store.read_all()), subscribers={"s": head + 1})
    assert [(v.rule, v.positions) for v in found.violations] == [
        (SEAL_BEFORE_ACK, [fetched, *acked]),
        (HASH_CHAIN, [head, head + 1]),  # "hash-chain" sorts before "seal-before-ack", its position after
    ]


def test_a_checkpoint_at_position_0_of_an_empty_log_is_reported_with_no_position() -> None:
    found = audit_events([], [checkpoint("ledger", 0, "x")])
    assert [(v.rule, v.positions, v.message) for v in found.violations] == [
        (
            HASH_CHAIN,
            [],
            "a ledger checkpoint was stored at position 0 but the log ends at 0: events were removed from its end",
        )
    ]


def test_the_pass_gathers_each_payload_claim_the_tries_replies_and_what_retention_pruned(
    store: EventStore, tmp_path: Path
) -> None:
    plane = payload_plane(store, (tmp_path / "payloads").as_uri())
    log = LogBuilder(store, payloads=plane)
    log.clean_sibling_group("a")
    replied = {
        (r.rollout_id, r.attempt_index): (e.position, r.reply_claim())
        for e in store.read_all()
        if e.type == "RunReplied" and (r := RunReplied.model_validate_json(e.data_json))
    }
    at, claim = replied[("a_g0", 0)]
    assert claim is not None
    (pruned_at,) = store.append(
        RETENTION_STREAM, [PayloadsPruned(store=claim.store, digests=[claim.digest])]
    ).positions
    facts = PayloadFacts()
    audit_events(list(store.read_all()), payloads=facts)
    assert facts.replies == {key: c for key, (_, c) in replied.items()}
    assert (facts.claimed[claim.digest].position, facts.last_claimed[claim.digest]) == (at, at)
    assert facts.pruned == {claim.digest: pruned_at} and facts.is_pruned(claim.digest)
    assert audit_events(list(store.read_all())).ok  # without facts: the events' rules alone


def test_the_pass_notes_where_a_reply_stored_apart_is_claimed(store: EventStore, tmp_path: Path) -> None:
    plane = payload_plane(store, (tmp_path / "payloads").as_uri())
    apart_claim, tokens_claim, digest = put_apart(plane)
    log = LogBuilder(store, payloads=plane)
    log.reserve("p", 1)
    log.mint("p", 1)
    log.dispatch("p_g0")
    (replied,) = log.group(
        "p",
        [
            RunReplied(
                rollout_id="p_g0",
                attempt_index=0,
                reward=1.0,
                mask_sample=False,
                reply_digest=digest,
                reply=apart_claim,
                apart_from=tokens_claim,
            )
        ],
    )
    facts = PayloadFacts()
    audit_events(list(store.read_all()), payloads=facts)
    assert facts.apart == [(apart_claim, tokens_claim, digest, replied)]
