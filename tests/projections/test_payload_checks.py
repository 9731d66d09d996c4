"""The payload checks of `ledger audit` (`check_payloads`), on the claims a pass over the log gathers
(`PayloadFacts`) and a real local payload store: each violation with its message, the summary's counts,
retention's prunes, the token records read back with their try's reply and the replies stored apart made
whole, a batch at a time (more than one batch here)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from eventstore import EventStore
from eventstore.events import RunReplied, SiblingSealed
from payloads import PayloadClaim, PayloadPlane, open_payload_store
from payloads.replies import REPLY_APART_MEDIA_TYPE, take_arrays_off
from projections.payload_audit import (
    PAYLOAD_INTACT,
    PAYLOAD_STORED,
    PayloadAuditSummary,
    PayloadFacts,
    check_log_blobs,
    check_payloads,
)
from protocol.digests import canonical_bytes, sha256_digest
from protocol.token_codec import TOKENS_REPLY_MEDIA_TYPE
from tests.payloads.test_reply_apart import _two_calls
from tests.projections.builder import rollout_receipt

Found = list[tuple[str, list[int], str]]


@pytest.fixture
def plane(tmp_path: Path) -> PayloadPlane:
    return PayloadPlane(open_payload_store((tmp_path / "payloads").as_uri()))


def check(facts: PayloadFacts, plane: PayloadPlane) -> tuple[Found, PayloadAuditSummary]:
    found: Found = []
    summary = PayloadAuditSummary()
    check_payloads(
        facts, plane, lambda rule, positions, message: found.append((rule, positions, message)), summary
    )
    return found, summary


def json_payloads(plane: PayloadPlane, count: int) -> list[PayloadClaim]:
    return plane.put([(b'{"n": %d}' % i, "application/json") for i in range(count)])


def test_every_claim_read_back_intact_is_counted_with_its_bytes(plane: PayloadPlane) -> None:
    claims = json_payloads(plane, 3)
    facts = PayloadFacts()
    for position, claim in enumerate(claims, start=10):
        facts.see(position, [claim])
    found, summary = check(facts, plane)
    assert found == []
    sizes = [len(b'{"n": %d}' % i) for i in range(3)]
    assert (summary.claimed, summary.checked, summary.checked_bytes) == (3, 3, sum(sizes))
    assert (summary.missing, summary.corrupt, summary.pruned) == (0, 0, 0)


def test_a_payload_of_another_size_than_its_claim_or_another_hash(
    plane: PayloadPlane, tmp_path: Path
) -> None:
    short, edited = json_payloads(plane, 2)
    claimed_longer = short.model_copy(update={"size": short.size + 1 if short.size is not None else 0})
    local = plane.default
    path = local.path_of(edited.digest)  # type: ignore[attr-defined]
    edited_bytes = b'{"n": 7}'
    path.write_bytes(edited_bytes)
    facts = PayloadFacts()
    facts.see(4, [claimed_longer])
    facts.see(9, [edited])
    found, summary = check(facts, plane)
    where = f"application/json, store {local.name!r}"
    assert found == [
        (
            PAYLOAD_INTACT,
            [4],
            f"the payload {short.digest} claimed at 4 ({where}) was altered: its stored bytes are {short.size} "
            f"bytes, not {claimed_longer.size}",
        ),
        (
            PAYLOAD_INTACT,
            [9],
            f"the payload {edited.digest} claimed at 9 ({where}) was altered: its stored bytes hash to "
            f"{sha256_digest(edited_bytes)}",
        ),
    ]
    assert (summary.checked, summary.corrupt) == (2, 2)


def test_payloads_missing_are_listed_in_log_order_with_where_they_were_looked_for(
    plane: PayloadPlane,
) -> None:
    claims = json_payloads(plane, 25)
    local = plane.default
    facts = PayloadFacts()
    for i, claim in enumerate(claims):
        facts.see(100 - i, [claim])  # the later claims at the earlier positions
        local.path_of(claim.digest).unlink()  # type: ignore[attr-defined]
    found, summary = check(facts, plane)
    first = claims[-1]
    assert found == [
        (
            PAYLOAD_STORED,
            list(range(76, 96)),  # the first 20 positions
            f"25 claimed payload(s) are not stored in store {local.name!r} ({local.where}), the first "
            f"{first.digest} (claimed at 76)",
        )
    ]
    assert (summary.missing, summary.checked, summary.claimed) == (25, 0, 25)


def test_a_payload_pruned_after_its_last_claim_is_not_missing_one_claimed_again_is(
    plane: PayloadPlane,
) -> None:
    pruned, claimed_again, never_claimed = json_payloads(plane, 3)
    facts = PayloadFacts()
    facts.see(3, [pruned, claimed_again])
    facts.see_pruned(5, [pruned.digest, claimed_again.digest, never_claimed.digest])
    facts.see(8, [claimed_again])  # the same bytes claimed again after retention deleted them
    for claim in (pruned, claimed_again):
        plane.default.path_of(claim.digest).unlink()  # type: ignore[attr-defined]
    assert facts.is_pruned(pruned.digest) and facts.is_pruned(never_claimed.digest)
    assert not facts.is_pruned(claimed_again.digest)
    facts.see_pruned(8, [claimed_again.digest])  # named at its last claim's position: still needed
    assert not facts.is_pruned(claimed_again.digest)
    found, summary = check(facts, plane)
    assert [(rule, positions) for rule, positions, _ in found] == [(PAYLOAD_STORED, [3])]
    assert f"the first {claimed_again.digest} (claimed at 3)" in found[0][2]
    assert (summary.pruned, summary.missing) == (1, 1)


def test_claims_in_a_store_the_audit_was_not_given(plane: PayloadPlane) -> None:
    elsewhere = [c.model_copy(update={"store": "elsewhere"}) for c in json_payloads(plane, 22)]
    facts = PayloadFacts()
    for i, claim in enumerate(elsewhere):
        facts.see(50 - i, [claim])
    found, summary = check(facts, plane)
    assert found == [
        (
            PAYLOAD_STORED,
            list(range(29, 49)),
            f"22 payload(s) are claimed in store 'elsewhere', which the audit was not given (it has "
            f"{sorted(plane.stores)}): pass it with --payloads",
        )
    ]
    assert (summary.claimed, summary.checked, summary.missing) == (22, 0, 0)


def records_beside(
    plane: PayloadPlane, count: int
) -> list[tuple[PayloadClaim, PayloadClaim, dict[str, Any]]]:
    """`count` tries' replies and their token records stored beside them (each generation its own)."""
    tries = []
    for i in range(count):
        reply, tokens = _two_calls(generated=(4, 100 + i))
        tokens_claim, reply_claim = plane.put(
            [(tokens, TOKENS_REPLY_MEDIA_TYPE), (canonical_bytes(reply), "application/json")]
        )
        tries.append((tokens_claim, reply_claim, reply))
    return tries


def test_token_records_read_back_with_their_trys_reply_in_batches(plane: PayloadPlane) -> None:
    """130 tries (two batches of reads): the last one's records paired with a reply lacking their items; a pair
    whose records were altered, and one whose try has no reply claimed, are not read together."""
    tries = records_beside(plane, 132)
    facts = PayloadFacts()
    for i, (tokens, reply, _) in enumerate(tries[:130]):
        facts.see(1000 + i, [tokens, reply])
        facts.beside_reply[tokens.digest] = (f"r{i}", 0)
        facts.replies[(f"r{i}", 0)] = reply
    last = tries[129][2]
    (fewer_items,) = plane.put(
        [(canonical_bytes({"response": {"output": last["response"]["output"][:1]}}), "application/json")]
    )
    facts.see(1500, [fewer_items])
    facts.replies[("r129", 0)] = (
        fewer_items  # the last try's reply claimed again: not the one its records refer to
    )
    altered, _, _ = tries[130]
    plane.default.path_of(altered.digest).write_bytes(b"x")  # type: ignore[attr-defined]
    facts.see(2000, [altered])
    facts.beside_reply[altered.digest] = ("r0", 0)
    no_reply, _, _ = tries[131]
    facts.see(2001, [no_reply])
    facts.beside_reply[no_reply.digest] = ("nobody", 0)
    found, _ = check(facts, plane)
    assert [(rule, positions) for rule, positions, _ in found] == [
        (PAYLOAD_INTACT, [2000]),  # altered: said by the first check, not read with a reply
        (PAYLOAD_INTACT, [1129]),
    ]
    assert found[1][2].startswith(
        f"the token records {tries[129][0].digest} claimed at 1129 do not read back with their try's reply "
        f"{fewer_items.digest}: "
    )


def test_a_pair_the_plane_refuses_on_its_second_read_is_said_where_it_is_read(plane: PayloadPlane) -> None:
    """The try's reply claimed again under another size than the claim first read back intact."""
    (tokens, reply, _) = records_beside(plane, 1)[0]
    facts = PayloadFacts()
    facts.see(7, [tokens, reply])
    facts.beside_reply[tokens.digest] = ("r", 0)
    facts.replies[("r", 0)] = reply.model_copy(update={"size": 1})
    found, _ = check(facts, plane)
    assert len(found) == 1 and found[0][:2] == (PAYLOAD_INTACT, [7]), found
    assert found[0][2].startswith(f"token records beside replies: payload {reply.digest} is corrupt")


def test_replies_stored_apart_made_whole_in_batches(plane: PayloadPlane) -> None:
    """130 replies stored apart: the last made whole with another try's records, one under another
    receipt digest, one with records that are not records; an altered one is not made whole."""
    facts = PayloadFacts()
    kept: list[tuple[PayloadClaim, PayloadClaim, str]] = []
    for i in range(133):
        reply, tokens = _two_calls(generated=(4, 100 + i), arguments=f'{{"city": "c{i}"}}')
        apart = take_arrays_off(reply, tokens)
        assert apart is not None
        apart_claim, tokens_claim = plane.put(
            [(canonical_bytes(apart), REPLY_APART_MEDIA_TYPE), (tokens, TOKENS_REPLY_MEDIA_TYPE)]
        )
        kept.append((apart_claim, tokens_claim, sha256_digest(canonical_bytes(reply))))
    for i, (apart_claim, tokens_claim, digest) in enumerate(kept[:129]):
        facts.see(1000 + i, [apart_claim, tokens_claim])
        facts.apart.append((apart_claim, tokens_claim, digest, 1000 + i))
    last_reply, _, last_digest = kept[129]
    facts.see(1129, [last_reply])
    facts.apart.append((last_reply, kept[0][1], last_digest, 1129))  # another try's records
    wrong_digest = sha256_digest(b"{}")
    facts.see(1130, [kept[130][0], kept[130][1]])
    facts.apart.append((kept[130][0], kept[130][1], wrong_digest, 1130))
    (not_records,) = plane.put([(b'{"not": "records"}', TOKENS_REPLY_MEDIA_TYPE)])
    facts.see(1131, [kept[131][0], not_records])
    facts.apart.append((kept[131][0], not_records, kept[131][2], 1131))
    plane.default.path_of(kept[132][0].digest).write_bytes(b"x")  # type: ignore[attr-defined]
    facts.see(1132, [kept[132][0], kept[132][1]])
    facts.apart.append((kept[132][0], kept[132][1], kept[132][2], 1132))
    found, _ = check(facts, plane)
    assert [(rule, positions) for rule, positions, _ in found] == [
        (PAYLOAD_INTACT, [1132]),  # altered: said once, by the first check
        (PAYLOAD_INTACT, [1129]),
        (PAYLOAD_INTACT, [1130]),
        (PAYLOAD_INTACT, [1131]),
    ]
    assert found[1][2].startswith(
        f"the reply {last_reply.digest} stored apart at 1129, made whole with its token records "
        f"{kept[0][1].digest}, is not the reply its receipt names ({last_digest}): it makes sha256:"
    )
    assert found[2][2] == (
        f"the reply {kept[130][0].digest} stored apart at 1130, made whole with its token records "
        f"{kept[130][1].digest}, is not the reply its receipt names ({wrong_digest}): it makes {kept[130][2]}"
    )
    assert f"({kept[131][2]}): it makes nothing (" in found[3][2]


def test_altered_rows_of_the_log_blob_table_claimed_there_or_not(store: EventStore, db_url: str) -> None:
    """A blob claimed in the table itself is said by `check_payloads` at its claim; one claimed in another
    store, or not at all, here, each counted."""
    in_table, elsewhere, unclaimed = (store.put_blob(b'{"blob": %d}' % i) for i in range(3))
    facts = PayloadFacts()
    facts.see(3, [PayloadClaim.legacy(in_table, "application/json")])
    facts.see(5, [PayloadClaim(store="local", digest=elsewhere, size=11, media_type="application/json")])
    with sqlite3.connect(db_url.removeprefix("sqlite:///")) as conn:
        conn.execute("UPDATE blobs SET content = ?", (b"{}",))
    found: Found = []
    summary = PayloadAuditSummary()
    check_log_blobs(
        store, facts, lambda rule, positions, message: found.append((rule, positions, message)), summary
    )
    altered = f"was altered: its stored bytes hash to {sha256_digest(b'{}')}"
    assert sorted(found) == sorted(
        [
            (PAYLOAD_INTACT, [5], f"the log's blob {elsewhere} {altered}"),
            (PAYLOAD_INTACT, [], f"the log's blob {unclaimed} {altered}"),
        ]
    )
    assert (summary.log_blobs, summary.corrupt) == (3, 2)


def test_the_pass_notes_replies_stored_apart_and_records_stored_beside_their_reply(
    plane: PayloadPlane,
) -> None:
    reply, tokens = _two_calls()
    apart = take_arrays_off(reply, tokens)
    assert apart is not None
    apart_claim, tokens_claim = plane.put(
        [(canonical_bytes(apart), REPLY_APART_MEDIA_TYPE), (tokens, TOKENS_REPLY_MEDIA_TYPE)]
    )
    digest = sha256_digest(canonical_bytes(reply))
    replied = RunReplied(
        rollout_id="p_g0",
        attempt_index=1,
        reward=1.0,
        mask_sample=False,
        reply_digest=digest,
        reply=apart_claim,
        apart_from=tokens_claim,
    )
    sealed = SiblingSealed(
        rollout_id="p_g0",
        attempt_index=1,
        reward=1.0,
        receipt=rollout_receipt("p_g0", 1).model_copy(
            update={"tokens": tokens_claim, "tokens_digest": tokens_claim.digest}
        ),
    )
    facts = PayloadFacts()
    facts.see_try(replied, 7)
    facts.see_try(sealed, 9)
    assert facts.replies == {("p_g0", 1): apart_claim}
    assert facts.apart == [(apart_claim, tokens_claim, digest, 7)]
    assert facts.beside_reply == {tokens_claim.digest: ("p_g0", 1)}
