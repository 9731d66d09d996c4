"""The auditor's checks of the stored rows themselves (`RowChecker`): positions missing or out of order,
a stream's versions jumping, a row's link to its stream's previous hash, a row's hash against its content.
The rows are the log's own, read back and then altered as a tamperer with write access would leave them."""

from __future__ import annotations

from eventstore import EventStore, RecordedEvent
from eventstore.events import TrainerEpochTaken
from projections.audit import HASH_CHAIN, audit_events


def rows_of(store: EventStore) -> list[RecordedEvent]:
    """Eight rows on two streams, alternating, that break no rule."""
    for i in range(4):
        for stream in ("trainer", "other"):
            store.append(stream, [TrainerEpochTaken(trainer_id=None, reason="start", writer=f"{stream}-{i}")])
    return list(store.read_all())


def chain(rows: list[RecordedEvent]) -> list[tuple[str, list[int], str]]:
    return [(v.rule, v.positions, v.message) for v in audit_events(rows).violations]


def test_the_rows_as_written_are_clean(store: EventStore) -> None:
    assert chain(rows_of(store)) == []


def test_rows_deleted_from_the_middle_are_missing_positions_and_a_stream_jumping_versions(
    store: EventStore,
) -> None:
    rows = rows_of(store)
    assert [(r.stream_id, r.stream_version) for r in rows[2:6]] == [
        ("trainer", 1),
        ("other", 1),
        ("trainer", 2),
        ("other", 2),
    ]
    assert chain(rows[:2] + rows[4:]) == [  # positions 3 and 4 (each stream's version 1) deleted
        (HASH_CHAIN, [2, 5], "positions 3..4 are missing: rows were deleted"),
        (HASH_CHAIN, [5], "stream 'trainer' jumps from version 0 to 2: rows were deleted"),
        (HASH_CHAIN, [6], "stream 'other' jumps from version 0 to 2: rows were deleted"),
    ]


def test_a_row_moved_back_is_out_of_order(store: EventStore) -> None:
    rows = rows_of(store)
    moved = rows[0]._replace(position=3)
    found = chain([rows[1], rows[2], moved])
    assert found[0] == (HASH_CHAIN, [2], "positions 1..1 are missing: rows were deleted")
    assert (HASH_CHAIN, [3], "position 3 is out of order") in found


def test_a_row_linked_to_another_previous_hash_or_edited_is_reported(store: EventStore) -> None:
    rows = rows_of(store)
    relinked = rows[2]._replace(prev_hash=rows[1].hash)  # the other stream's hash
    assert relinked.hash != relinked.expected_hash()  # the link is part of what the hash covers
    assert chain([*rows[:2], relinked, *rows[3:]]) == [
        (HASH_CHAIN, [3], "prev_hash of position 3 does not match the hash of 'trainer' v0"),
        (HASH_CHAIN, [3], "the hash of position 3 does not match its content: edited"),
    ]  # the next row links to the hash stored, which is unchanged
    edited = rows[4]._replace(data_json=rows[4].data_json.replace("trainer-2", "trainer-9"))
    assert chain([*rows[:4], edited, *rows[5:]]) == [
        (HASH_CHAIN, [5], "the hash of position 5 does not match its content: edited"),
    ]
