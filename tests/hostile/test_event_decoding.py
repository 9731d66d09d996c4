"""Hostile input to the log: random payloads, versions and types, decoded and appended."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eventstore import (
    EVENT_TYPES,
    EventStoreError,
    InvalidEvent,
    NewEvent,
    RecordedEvent,
    UnknownEventType,
    UnknownSchemaVersion,
    open_store,
)
from eventstore.records import GENESIS_HASH

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
type_names = st.sampled_from(sorted(EVENT_TYPES)) | st.text(max_size=12)


def row(type_: str, version: int, data_json: str) -> RecordedEvent:
    return RecordedEvent(1, "group-x", 0, "e", type_, version, data_json, "{}", 0.0, GENESIS_HASH, "")


@settings(max_examples=300, deadline=None)
@given(
    type_=type_names,
    version=st.integers(-3, 5),
    data=st.dictionaries(st.text(max_size=12), json_values, max_size=6),
)
def test_decoding_random_rows_gives_a_typed_event_or_a_typed_error(
    type_: str, version: int, data: dict[str, Any]
) -> None:
    try:
        event = row(type_, version, json.dumps(data)).decode()
    except (InvalidEvent, UnknownEventType, UnknownSchemaVersion) as exc:
        assert "position 1" in str(exc)  # every decoding error says where
    else:
        assert type(event).__name__ == type_


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60) | st.binary(max_size=60).map(lambda b: b.decode("latin-1")))
def test_truncated_or_garbage_json_is_invalid_event(text: str) -> None:
    for type_ in ("AckOwed", "SiblingSealed", "RunFailed"):
        with pytest.raises(InvalidEvent, match="position 1"):
            row(type_, EVENT_TYPES[type_].schema_version, text).decode()


def test_truncated_real_payload_is_refused_with_its_position() -> None:
    from eventstore.events import AttemptMinted

    good = AttemptMinted(rollout_id="p1_g0", generation_index=0).model_dump_json()
    for cut in range(len(good) - 1):
        try:
            row("AttemptMinted", 1, good[:cut]).decode()
        except InvalidEvent as exc:
            assert "position 1" in str(exc)
        else:  # pragma: no cover - a truncated object never validates
            raise AssertionError(f"truncated payload {good[:cut]!r} decoded")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(type_=type_names, data=st.dictionaries(st.text(max_size=12), json_values, max_size=5))
def test_appending_random_payloads_writes_all_or_nothing(
    sqlite_url: str, type_: str, data: dict[str, Any]
) -> None:
    store = open_store(sqlite_url, migrate_schema=True)
    before = store.head()
    try:
        store.append("group-fuzz", [NewEvent(type_, data)])
    except (EventStoreError, ValueError):
        assert store.head() == before
    else:
        assert store.head() == before + 1
        last = next(iter(store.read_all(before)))
        assert last.decode() == EVENT_TYPES[type_].model_validate(data)
    assert store.verify_chain() is None
    store.close()


def test_a_tampered_claim_is_refused_in_one_line_naming_each_field() -> None:
    from eventstore.events import SiblingSealed

    claim = {"store": "local", "digest": "sha256:zz", "size": -1, "media_type": "application/json"}
    data = {"rollout_id": "p1_g0", "attempt_index": 0, "reward": 1.0, "receipt": {"tokens": claim}}
    with pytest.raises(InvalidEvent) as refused:
        row("SiblingSealed", SiblingSealed.schema_version, json.dumps(data)).decode()
    said = str(refused.value)
    assert "\n" not in said and said.startswith("position 1: SiblingSealed payload does not validate: ")
    assert "receipt.tokens.digest: String should match pattern" in said
    assert "receipt.tokens.size: Input should be greater than or equal to 0" in said
