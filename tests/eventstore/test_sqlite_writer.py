"""The SQLite log's appends on the writer connection (`eventstore.sqlite_writer`): every decision the
pool path's `_append_one` makes (versions, fences, ids recorded with the same or other content, in the
log or earlier in the same batch), the same rows and hashes, each append on its own or the batch as
one; and a batch SIGKILLed at each step, reached by a gate, is all or nothing, acknowledged only once
committed."""

from __future__ import annotations

import textwrap
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eventstore import EventStore, open_store, sqlite_writer, upgrade_database
from eventstore.events import AttemptMinted
from eventstore.records import AppendResult, ExpectedVersion, Fence, NewEvent
from eventstore.store import _checked
from protocol.digests import sha256_digest
from tests.gates import killed_at

_STREAMS = ["s-a", "s-b", "s-c"]
_IDS = [str(uuid.UUID(int=i)) for i in range(1, 9)]


def _event(i: int, chosen: str | None) -> NewEvent:
    return NewEvent.of(AttemptMinted(rollout_id=f"r{i}_g0", generation_index=i), event_id=chosen)


_append = st.tuples(
    st.sampled_from(_STREAMS),
    st.lists(st.tuples(st.integers(0, 3), st.none() | st.sampled_from(_IDS)), min_size=1, max_size=3),
    st.sampled_from([ExpectedVersion.ANY, ExpectedVersion.NO_STREAM, 0, 1, 2, 3]),
    st.none() | st.tuples(st.sampled_from(_STREAMS), st.integers(-1, 3)),
)
_batches = st.lists(
    st.tuples(st.lists(_append, min_size=1, max_size=5), st.booleans()), min_size=1, max_size=6
)


def _stores(tmp: Path) -> tuple[EventStore, EventStore]:
    out = []
    for name in ("writer", "pool"):
        url = f"sqlite:///{tmp / uuid.uuid4().hex}-{name}.db"
        upgrade_database(url)
        out.append(open_store(url))
    return out[0], out[1]


def _answer(store: EventStore, checked: Any, each: bool) -> Any:
    """What the store answers for one batch, its errors as the store says them (`_database_errors`)."""
    results: Sequence[AppendResult | Exception]
    try:
        with store._database_errors():
            if each:
                results = store.recorder.append_each(store._writer, checked)
            else:
                results = store.recorder.append_committed(store._writer, checked, [b"blob"])
    except Exception as exc:
        return (type(exc).__name__, str(exc))
    return [
        (type(r).__name__, str(r))
        if isinstance(r, Exception)
        else (r.positions, r.stream_version, r.idempotent, list(r.records))
        for r in results
    ]


def _rows(store: EventStore) -> list[Any]:
    return [tuple(r) for r in store.read_all()]


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(batches=_batches)
def test_the_writer_connection_decides_every_append_as_the_pool_path_does(
    tmp_path: Path, batches: Any
) -> None:
    writer, pool = _stores(tmp_path)
    # The pool path: the writer connection busy (as with another batch in flight), so each batch
    # goes through a pooled connection, each append in its savepoint.
    assert pool.recorder._batches._lock.acquire(blocking=False)  # type: ignore[attr-defined]
    try:
        for appends, each in batches:
            checked = [
                _checked(
                    stream,
                    [_event(i, chosen) for i, chosen in events],
                    expected,
                    None,
                    Fence(*fence) if fence is not None else None,
                )
                for stream, events, expected, fence in appends
            ]
            got = [_answer(store, checked, each) for store in (writer, pool)]
            assert got[0] == got[1]
        assert _rows(writer) == _rows(pool)
        assert writer.verify_chain() is None
    finally:
        pool.recorder._batches._lock.release()  # type: ignore[attr-defined]
        writer.close()
        pool.close()


# A writer process that appends one batch of three appends, stopping at each step of the batch
# (`sqlite_writer.at_step`) until told to go on, and says when the append returned (its ACK).
_GATED_WRITER = textwrap.dedent(
    """
    import sys
    from eventstore import open_store, sqlite_writer
    from eventstore.events import AttemptMinted
    from eventstore.records import ExpectedVersion

    def gate(step):
        print(step, flush=True)
        assert sys.stdin.readline().strip() == "go"

    store = open_store(sys.argv[1])
    sqlite_writer.at_step = gate
    appends = [(f"crash-{k}", [AttemptMinted(rollout_id=f"c{k}_g{i}", generation_index=i) for i in range(3)],
                ExpectedVersion.NO_STREAM) for k in range(3)]
    store.append_batch(appends, blobs=[b"crash-blob"])
    print("acked", flush=True)
    sys.stdin.readline()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [*sqlite_writer.STEPS, "acked"])
def test_a_batch_killed_at_each_step_is_all_or_nothing_and_acked_only_once_committed(
    tmp_path: Path, kill_at: str
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade_database(url)
    before = open_store(url)
    before.append("earlier", [AttemptMinted(rollout_id="e_g0", generation_index=0)])
    before.close()
    seen = killed_at(_GATED_WRITER, url, kill_at)
    # The ACK comes only after the commit, and every step before it was reached in order.
    assert seen == [*sqlite_writer.STEPS, "acked"][: len(seen)]
    store = open_store(url)
    try:
        streams = {r.stream_id for r in store.read_all()}
        committed = "committed" in seen
        assert streams == ({"earlier", "crash-0", "crash-1", "crash-2"} if committed else {"earlier"})
        assert store.head() == (10 if committed else 1)
        assert (store.get_blob(sha256_digest(b"crash-blob")) is not None) == committed
        assert store.verify_chain() is None
        # The log takes the next append where the killed writer left it.
        assert store.append("after", [AttemptMinted(rollout_id="a_g0", generation_index=0)]).positions == [
            store.head()
        ]
    finally:
        store.close()
