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
from tests.payloads.test_reply_apart import put_apart, two_calls
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
    pruned, claimed_again, never_claimed, pruned_too = json_payloads(plane, 4)
    facts = PayloadFacts()
    facts.see(3, [pruned, claimed_again, pruned_too])
    facts.see_pruned(5, [pruned.digest, claimed_again.digest, never_claimed.digest, pruned_too.digest])
    facts.see(8, [claimed_again])  # the same bytes claimed again after retention deleted them
    for claim in (pruned, claimed_again, pruned_too):
        plane.default.path_of(claim.digest).unlink()  # type: ignore[attr-defined]
    assert facts.is_pruned(pruned.digest) and facts.is_pruned(never_claimed.digest)
    assert not facts.is_pruned(claimed_again.digest)
    assert not facts.is_pruned("sha256:" + "0" * 64)  # never claimed, never pruned
    first = PayloadFacts()
    first.see_pruned(1, [pruned.digest])  # a log that begins with a prune: pruned, never claimed
    assert first.is_pruned(pruned.digest)
    facts.see_pruned(8, [claimed_again.digest])  # named at its last claim's position: still needed
    assert not facts.is_pruned(claimed_again.digest)
    found, summary = check(facts, plane)
    assert [(rule, positions) for rule, positions, _ in found] == [(PAYLOAD_STORED, [3])]
    assert f"the first {claimed_again.digest} (claimed at 3)" in found[0][2]
    assert (summary.pruned, summary.missing) == (2, 1)


def test_claims_in_a_store_the_audit_was_not_given(plane: PayloadPlane) -> None:
    elsewhere = [c.model_copy(update={"store": "elsewhere"}) for c in json_payloads(plane, 22)]
    facts = PayloadFacts()
    for i, claim in enumerate(elsewhere):
        facts.see(50 - i, [claim])
    (lost,) = plane.put([(b'{"lost": true}', "application/json")])
    plane.default.path_of(lost.digest).unlink()  # type: ignore[attr-defined]
    facts.see(60, [lost])  # in the store given, after the one not given: still read
    found, summary = check(facts, plane)
    assert found[1:] == [
        (
            PAYLOAD_STORED,
            [60],
            f"1 claimed payload(s) are not stored in store {plane.default.name!r} ({plane.default.where}), "
            f"the first {lost.digest} (claimed at 60)",
        )
    ]
    assert found[:1] == [
        (
            PAYLOAD_STORED,
            list(range(29, 49)),
            f"22 payload(s) are claimed in store 'elsewhere', which the audit was not given (it has "
            f"{sorted(plane.stores)}): pass it with --payloads",
        )
    ]
    assert (summary.claimed, summary.checked, summary.missing) == (23, 0, 1)


def test_a_store_that_fails_a_read_is_said_at_the_batchs_first_claim_and_the_next_batch_still_read(
    plane: PayloadPlane,
) -> None:
    """A payload file the file system cannot read (a symbolic link to itself) fails the read of its batch
    (256 payloads), said at that batch's first claim; the next batch is read all the same."""
    claims = sorted(json_payloads(plane, 258), key=lambda c: c.digest)
    unreadable = plane.default.path_of(claims[0].digest)  # type: ignore[attr-defined]
    unreadable.unlink()
    unreadable.symlink_to(unreadable)
    plane.default.path_of(claims[-1].digest).unlink()  # type: ignore[attr-defined]
    facts = PayloadFacts()
    for i, claim in enumerate(claims):
        facts.see(1000 - i, [claim])
    found, summary = check(facts, plane)
    assert [(rule, positions) for rule, positions, _ in found] == [
        (PAYLOAD_STORED, [1000]),
        (PAYLOAD_STORED, [1000 - 257]),
    ], found
    assert found[0][2].startswith(f"store {plane.default.name!r}: reading payload {claims[0].digest}: ")
    assert (summary.checked, summary.missing) == (1, 1)


def records_beside(
    plane: PayloadPlane, count: int
) -> list[tuple[PayloadClaim, PayloadClaim, dict[str, Any]]]:
    """`count` tries' replies and their token records stored beside them (each generation its own)."""
    tries = []
    for i in range(count):
        reply, tokens = two_calls(generated=(4, 100 + i))
        tokens_claim, reply_claim = plane.put(
            [(tokens, TOKENS_REPLY_MEDIA_TYPE), (canonical_bytes(reply), "application/json")]
        )
        tries.append((tokens_claim, reply_claim, reply))
    return tries


def fewer_items(plane: PayloadPlane, reply: dict[str, Any]) -> PayloadClaim:
    """The reply cut to its first output item, stored: not the one a try's records refer to."""
    (claim,) = plane.put(
        [(canonical_bytes({"response": {"output": reply["response"]["output"][:1]}}), "application/json")]
    )
    return claim


def test_token_records_read_back_with_their_trys_reply_in_batches(plane: PayloadPlane) -> None:
    """130 tries (two batches of reads, in the records' digest order): every other one's records paired
    with a reply lacking their items, each said once; a pair whose records were altered, and one whose
    try has no reply claimed, are not read together."""
    tries = records_beside(plane, 132)
    facts = PayloadFacts()
    for i, (tokens, reply, whole) in enumerate(tries[:130]):
        facts.see(1000 + i, [tokens, reply])
        facts.beside_reply[tokens.digest] = (f"r{i}", 0)
        if i % 2:
            facts.replies[(f"r{i}", 0)] = other = fewer_items(plane, whole)
            facts.see(2000 + i, [other])
        else:
            facts.replies[(f"r{i}", 0)] = reply
    altered, _, _ = tries[130]
    plane.default.path_of(altered.digest).write_bytes(b"x")  # type: ignore[attr-defined]
    facts.see(3000, [altered])
    facts.beside_reply[altered.digest] = ("r0", 0)
    no_reply, _, _ = tries[131]
    facts.see(3001, [no_reply])
    facts.beside_reply[no_reply.digest] = ("nobody", 0)
    found, _ = check(facts, plane)
    assert found[0][:2] == (PAYLOAD_INTACT, [3000])  # altered: said by the first check, not read with a reply
    assert sorted(positions for _, positions, _ in found[1:]) == [[1000 + i] for i in range(1, 130, 2)]
    assert {rule for rule, _, _ in found} == {PAYLOAD_INTACT}
    tokens, _, whole = tries[129]
    assert next(m for _, p, m in found if p == [1129]).startswith(
        f"the token records {tokens.digest} claimed at 1129 do not read back with their try's reply "
        f"{fewer_items(plane, whole).digest}: "
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
    receipt digest, one with records that are not records; an altered one is not made whole; the first
    batch's read refused (a claim of another size) does not stop the second."""
    facts = PayloadFacts()
    kept: list[tuple[PayloadClaim, PayloadClaim, str]] = []
    for i in range(133):
        reply, tokens = two_calls(generated=(4, 100 + i), arguments=f'{{"city": "c{i}"}}')
        apart = take_arrays_off(reply, tokens)
        assert apart is not None
        apart_claim, tokens_claim = plane.put(
            [(canonical_bytes(apart), REPLY_APART_MEDIA_TYPE), (tokens, TOKENS_REPLY_MEDIA_TYPE)]
        )
        kept.append((apart_claim, tokens_claim, sha256_digest(canonical_bytes(reply))))
    for i, (apart_claim, tokens_claim, digest) in enumerate(kept[:129]):
        facts.see(1000 + i, [apart_claim, tokens_claim])
        facts.apart.append((apart_claim, tokens_claim, digest, 1000 + i))
    first_reply, first_tokens, first_digest = kept[0]
    resized = first_tokens.model_copy(update={"size": 1})  # claimed again under another size
    facts.apart[0] = (first_reply, resized, first_digest, 1000)  # the plane refuses the first batch's read
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
        (PAYLOAD_INTACT, [1000]),  # the first batch refused, the second still read
        (PAYLOAD_INTACT, [1129]),
        (PAYLOAD_INTACT, [1130]),
        (PAYLOAD_INTACT, [1131]),
    ]
    assert found[1][2].startswith(f"replies stored apart: payload {first_tokens.digest} is corrupt")
    found = found[:1] + found[2:]
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
    apart_claim, tokens_claim, digest = put_apart(plane)
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
