"""The plane's writes by claim: a payload hashed once by whoever needed its digest first."""

from __future__ import annotations

import pytest

from payloads import InMemoryPayloadStore, PayloadClaim, PayloadPlane, PayloadStoreError


def test_a_payload_claimed_first_is_stored_under_that_claim_and_read_back_by_it() -> None:
    plane = PayloadPlane(InMemoryPayloadStore("one"))
    claim = plane.claim(b"x" * 1000, "application/octet-stream")
    assert not plane.default.contains([claim.digest])  # claiming is no I/O
    plane.put_claimed([(claim, b"x" * 1000)])
    assert plane.get(claim) == b"x" * 1000
    assert claim == plane.put([(b"x" * 1000, "application/octet-stream")])[0]


@pytest.mark.parametrize(
    ("claim", "why"),
    [
        (PayloadClaim.of(b"abc", "a/b", "other"), "claimed for store 'other'"),
        (PayloadClaim.of(b"abcd", "a/b", "one"), "with 4 bytes.*given 3 bytes"),
    ],
)
def test_a_claim_for_another_store_or_size_stores_nothing(claim: PayloadClaim, why: str) -> None:
    plane = PayloadPlane(InMemoryPayloadStore("one"))
    with pytest.raises(PayloadStoreError, match=why):
        plane.put_claimed([(claim, b"abc")])
    assert list(plane.default.scan()) == []
