"""Bad input against real HTTP: lying agents, garbage, hang-ups, and the database going away.

Every case ends in the log: a RunFailed / AckRejected with its reason (or a clear error raised),
nothing sealed that did not verify, and no debt dropped.  Assertions are on the events.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eventstore import EventStore, RecordedEvent, open_store, upgrade_database
from eventstore.events import RunReplied
from eventstore.payload_stores import payload_plane
from eventstore.testing import PgCluster
from gym_agent.config import AgentConfig
from payloads import LocalDirPayloadStore, PayloadPlane
from payloads.replies import REPLY_APART_MEDIA_TYPE, REPLY_MEDIA_TYPE
from projections.audit import audit_log
from protocol.digests import canonical_bytes, sha256_digest
from protocol.wire import AttemptFault
from tests.rollout.conftest import PAYLOAD, PROMPT, coordinator, gid
from tests.rollout.hostile_agent import Action, Rule, serve_hostile
from trainer import CoordinatorStopped, InvalidRow, RolloutCoordinator
from trainer.gym import GymClient


def _config(tmp_path: Path, name: str = "h", **overrides: Any) -> AgentConfig:
    values: dict[str, Any] = {
        "name": name,
        "state_dir": tmp_path / name,
        "log_level": "warning",
        "turns": (2, 3),
        "delay_s": 0.02,
    }
    values.update(overrides)
    return AgentConfig(**values)


def _events(store: EventStore, group: str) -> list[RecordedEvent]:
    return list(store.read_stream(f"group-{group}"))


def _of(
    events: list[RecordedEvent], type_: str, attempt: int | None = None, rid: str | None = None
) -> list[dict[str, Any]]:
    out = []
    for e in events:
        if e.type != type_:
            continue
        data = e.data
        about = data.get("receipt", data)
        if (attempt is None or about.get("attempt_index") == attempt) and (
            rid is None or about.get("rollout_id") == rid
        ):
            out.append(data)
    return out


def _try0(rid: str) -> Any:
    """Matches answers about try 0 of `rid`: /run replies by body, receipts and token lists by path."""

    def match(path: str, body: Any) -> bool:
        if path == "/run":
            return isinstance(body, dict) and (body.get("_ng_rollout_id"), body.get("_ng_attempt_index")) == (
                rid,
                0,
            )
        return path in (f"/completion_receipt/{rid}/0", f"/token_capture/{rid}")

    return match


class FetchingClient(GymClient):
    """The trainer's client facing an agent that does not carry the receipt and token records in its
    `/run` answer (an older participant): it fetches both, each in a call of its own."""

    @property
    def completion_in_run(self) -> bool:
        return False


async def _play(
    tmp_path: Path,
    store: EventStore,
    rules_for: Any,
    *,
    generations: int = 1,
    client_class: type[GymClient] = GymClient,
    **kwargs: Any,
) -> tuple[str, GymClient, RolloutCoordinator, list[RecordedEvent], int]:
    g = gid("bad")
    with serve_hostile(_config(tmp_path), rules_for(f"{g}_g0")) as agent:
        async with client_class(agent.url, "h") as client:
            coord = coordinator(store, {"h": client}, mode="sibling", **kwargs)
            async with coord:
                await coord.submit(g, PROMPT, "h", generations, PAYLOAD)
                await coord.wait_idle(30)
            unacked = (await client.status()).completed_unacknowledged
    return g, client, coord, _events(store, g), unacked


async def test_a_reply_whose_digest_does_not_match_its_receipt_is_never_sealed(
    sqlite_store: EventStore, tmp_path: Path
) -> None:
    def inflate(reply: dict[str, Any]) -> dict[str, Any]:
        return {**reply, "reward": reply["reward"] + 100.0}

    _, _, coord, events, unacked = await _play(
        tmp_path, sqlite_store, lambda rid: [Rule("/run", _try0(rid), inflate)]
    )
    failed = _of(events, "RunFailed", 0)
    assert [f["kind"] for f in failed] == ["verify"] and "result_digest" in failed[0]["reason"]
    assert not _of(events, "SiblingSealed", 0) and not _of(events, "RunReplied", 0)
    # The agent's own receipt is owed and ACKed: its copy is released, nothing strands.
    assert _of(events, "AckOwed", 0) and _of(events, "AckAccepted", 0)
    assert [r["attempt_index"] for r in _of(events, "ReplacementMinted")] == [1]
    assert [s["attempt_index"] for s in _of(events, "SiblingSealed")] == [1]
    assert all(s["reward"] < 100 for s in _of(events, "SiblingSealed"))
    assert unacked == 0 and not coord.ledger.debts
    _clean(sqlite_store)


@pytest.mark.parametrize("client_class", [GymClient, FetchingClient], ids=["carried", "fetched"])
async def test_a_reply_the_trainer_holds_otherwise_than_its_json_is_never_sealed(
    sqlite_store: EventStore, tmp_path: Path, client_class: type[GymClient]
) -> None:
    """The reply's canonical JSON with an integer reward, under a receipt naming exactly those bytes:
    the reply the trainer validates holds the reward as a float (`7.0`), whose JSON is not the one the
    receipt names, so it is refused as it always was; a completion frame's bytes are not taken for
    the reply's on their digest alone (`RunReply.parsed_from`)."""
    named: dict[str, str] = {}

    def integer_reward(reply: dict[str, Any]) -> bytes:
        body = canonical_bytes({**reply, "reward": 7})
        named["digest"] = sha256_digest(body)
        return body

    def naming_it(receipt: dict[str, Any]) -> dict[str, Any]:
        return {**receipt, "result_digest": named["digest"]}

    _, _, coord, events, unacked = await _play(
        tmp_path,
        sqlite_store,
        lambda rid: [
            Rule("/run", _try0(rid), integer_reward, times=1),
            Rule("/completion_receipt", _try0(rid), naming_it, times=1),
        ],
        client_class=client_class,
    )
    failed = _of(events, "RunFailed", 0)
    # (The receipt re-fetched when its ACK is refused is the agent's own, of another reply: a second
    # verify failure of the same try.)
    assert {f["kind"] for f in failed} == {"verify"} and "result_digest" in failed[0]["reason"]
    assert not _of(events, "SiblingSealed", 0) and not _of(events, "RunReplied", 0)
    assert [s["attempt_index"] for s in _of(events, "SiblingSealed")] == [1]
    assert unacked == 0 and not coord.ledger.debts
    _clean(sqlite_store)


@pytest.mark.parametrize("times", [1, None], ids=["once", "always"])
async def test_a_receipt_for_another_try_is_never_owed(
    sqlite_store: EventStore, tmp_path: Path, times: int | None
) -> None:
    def other_try(receipt: dict[str, Any]) -> dict[str, Any]:
        return {**receipt, "attempt_index": 7}

    _, _, coord, events, unacked = await _play(
        tmp_path, sqlite_store, lambda rid: [Rule("/completion_receipt", _try0(rid), other_try, times)]
    )
    assert not [
        e
        for e in events
        if e.type in ("AckOwed", "ReceiptFetched") and e.data["receipt"]["attempt_index"] == 7
    ]
    failed = _of(events, "RunFailed", 0)
    assert failed and failed[0]["kind"] == "receipt" and "names" in failed[0]["reason"]
    assert not _of(events, "ReplacementMinted")  # it finished at the agent: adopt, never replace
    _adopted_or_dead_lettered(sqlite_store, events, unacked, times, "does not describe")
    assert not coord.ledger.debts


def _adopted_or_dead_lettered(
    store: EventStore, events: list[RecordedEvent], unacked: int, times: int | None, reason: str
) -> None:
    """What follows an unusable answer about try 0, told once (`times` 1) or always (None).  Once:
    the next answer is the agent's own, and the try is adopted, sealed and ACKed.  Always: nothing
    is sealed and nothing owed that was not verified; the group is dead-lettered naming `reason`,
    and the result honestly stays stranded at the lying agent (the auditor's one violation)."""
    if times == 1:
        assert _of(events, "AttemptAdopted", 0) and _of(events, "SiblingSealed", 0)
        assert _of(events, "AckAccepted", 0) and unacked == 0
        _clean(store)
        return
    assert not _of(events, "SiblingSealed") and not _of(events, "AckOwed")
    dead = _of(events, "GroupDeadLettered")
    assert dead and any(reason in r for r in dead[0]["reasons"]), dead
    assert unacked == 1
    assert {v.rule for v in audit_log(store).violations} == {"no-stranded-result"}


def _other_key(tokens: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**t, "rollout_id": "someone-else"} for t in tokens]


def _short_logprobs(tokens: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**t, "generation_log_probs": t["generation_log_probs"][:-1]} for t in tokens]


@pytest.mark.parametrize("client_class", [GymClient, FetchingClient], ids=["carried", "fetched"])
@pytest.mark.parametrize("action", [_other_key, _short_logprobs], ids=["other_capture_key", "lengths_differ"])
async def test_a_token_list_that_does_not_match_the_receipt_is_never_sealed(
    sqlite_store: EventStore, tmp_path: Path, action: Action, client_class: type[GymClient]
) -> None:
    _, _, coord, events, unacked = await _play(
        tmp_path,
        sqlite_store,
        lambda rid: [Rule("/token_capture", _try0(rid), action)],
        client_class=client_class,
    )
    failed = _of(events, "RunFailed", 0)
    assert [f["kind"] for f in failed] == ["verify"] and "token capture" in failed[0]["reason"]
    assert "500" not in failed[0]["reason"]  # the lie reached the trainer (not the tamperer failing)
    assert not _of(events, "SiblingSealed", 0)
    assert _of(events, "AckOwed", 0) and _of(events, "AckAccepted", 0)  # the verified receipt releases it
    assert [s["attempt_index"] for s in _of(events, "SiblingSealed")] == [1]
    assert unacked == 0 and not coord.ledger.debts
    _clean(sqlite_store)


@pytest.mark.parametrize("times", [1, None], ids=["once", "always"])
async def test_garbage_json_from_run(sqlite_store: EventStore, tmp_path: Path, times: int | None) -> None:
    _, _, coord, events, unacked = await _play(
        tmp_path, sqlite_store, lambda rid: [Rule("/run", _try0(rid), "garbage", times)]
    )
    failed = _of(events, "RunFailed", 0)
    assert failed[0]["kind"] == "http" and "not JSON" in failed[0]["reason"]
    assert _of(events, "AttemptRetired", 0)[0]["outcome"] == "completed_unacknowledged"
    assert not _of(events, "ReplacementMinted")
    _adopted_or_dead_lettered(sqlite_store, events, unacked, times, "not JSON")
    assert not coord.ledger.debts


def _reward(value: float) -> Action:
    return lambda reply: {**reply, "reward": value}


def _work_seconds(value: float) -> Action:
    return lambda receipt: {**receipt, "work": {**(receipt.get("work") or {}), "model_s": value}}


def _in_response(value: Any) -> Action:
    return lambda reply: {**reply, "response": {**reply["response"], "meta": [value]}}


# A number JSON cannot carry, where the agent's answer names one: Python's json writes `NaN`,
# `Infinity` and integers past 64 bits, and a parser reads each (and `1e999`) as a value no canonical
# JSON, digest or echo can write the same.
_UNCARRIABLE = [
    ("/run", _reward(float("nan")), "http", "finite number"),
    ("/run", _reward(float("inf")), "http", "finite number"),
    ("/run", _reward(float("-inf")), "http", "finite number"),
    ("/run", _in_response(float("nan")), "http", "JSON cannot carry"),
    ("/run", _in_response(2**70), "http", "outside the 64-bit range"),
    ("/completion_receipt", _work_seconds(float("inf")), "receipt", "finite number"),
]


@pytest.mark.parametrize("times", [1, None], ids=["once", "always"])
@pytest.mark.parametrize(
    ("route", "action", "kind", "needle"),
    _UNCARRIABLE,
    ids=[
        "NaN-reward",
        "Infinity-reward",
        "-Infinity-reward",
        "NaN-in-response",
        "big-int-in-response",
        "Infinity-work",
    ],
)
async def test_a_number_json_cannot_carry_is_refused_at_the_parse(
    sqlite_store: EventStore,
    tmp_path: Path,
    route: str,
    action: Action,
    kind: str,
    needle: str,
    times: int | None,
) -> None:
    """The answer is no answer: the try fails with the reason and is adopted like any unreadable
    answer.  Before, a NaN reward failed the whole group with a traceback, a NaN inside the response
    was kept as `null` (another reply than the agent's), and an infinite work figure was kept in the
    receipt, so every ACK echoing it was a 422, retried for ever."""
    _, _, coord, events, unacked = await _play(
        tmp_path, sqlite_store, lambda rid: [Rule(route, _try0(rid), action, times)]
    )
    failed = _of(events, "RunFailed", 0)
    assert failed[0]["kind"] == kind and needle in failed[0]["reason"]
    assert all(math.isfinite(s["reward"]) for s in _of(events, "SiblingSealed"))
    _adopted_or_dead_lettered(sqlite_store, events, unacked, times, needle)
    assert not coord.ledger.debts


_DEEP: Any = 1
for _ in range(80):
    _DEEP = [_DEEP]


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ({"responses_create_params": {"input": "x", "temperature": float("nan")}}, "JSON cannot carry"),
        ({"responses_create_params": {"input": "x"}, "seed": 2**70}, "outside the 64-bit range"),
        ({"responses_create_params": {"input": "x"}, "meta": _DEEP}, "nested deeper than"),
        ({"responses_create_params": {"input": "a lone \ud800 surrogate"}}, "surrogates not allowed"),
    ],
    ids=["NaN", "integer-past-64-bits", "80-deep", "lone-surrogate"],
)
async def test_a_payload_no_agent_takes_is_refused_at_submit_and_records_nothing(
    sqlite_store: EventStore, tmp_path: Path, payload: dict[str, Any], needle: str
) -> None:
    """Before, such a group was reserved, its first try minted, and then its driving task failed with
    a traceback: the group open for ever, never dispatched.  Now `submit` refuses it in one line and
    the coordinator goes on (a good group after it seals)."""
    g, good = gid("row"), gid("row")
    with serve_hostile(_config(tmp_path), []) as agent:
        async with GymClient(agent.url, "h") as client:
            coord = coordinator(sqlite_store, {"h": client}, mode="sibling")
            async with coord:
                with pytest.raises(InvalidRow, match=f"group '{g}': its payload is no /run row") as refused:
                    await coord.submit(g, PROMPT, "h", 1, payload)
                await coord.submit(good, PROMPT, "h", 1, PAYLOAD)
                await coord.wait_idle(30)
    assert needle in str(refused.value) and "\n" not in str(refused.value)
    assert not _events(sqlite_store, g)
    assert _of(_events(sqlite_store, good), "GroupSealed")
    _clean(sqlite_store)


@pytest.mark.parametrize("route", ["/run", "/completion_receipt"])
async def test_an_agent_hanging_up_mid_body_loses_nothing(
    sqlite_store: EventStore, tmp_path: Path, route: str
) -> None:
    # A receipt's own call can break off only where it is fetched on its own: from an agent that does
    # not carry it in the `/run` answer (a hang-up of that answer is the `/run` case).
    _, _, coord, events, unacked = await _play(
        tmp_path,
        sqlite_store,
        lambda rid: [Rule(route, _try0(rid), "hang_up", 1)],
        client_class=GymClient if route == "/run" else FetchingClient,
    )
    failed = _of(events, "RunFailed", 0)
    assert failed[0]["kind"] == ("stream_closed" if route == "/run" else "receipt")
    assert "connection lost" in failed[0]["reason"]
    assert _of(events, "AttemptAdopted", 0) and _of(events, "SiblingSealed", 0)
    assert not _of(events, "ReplacementMinted") and _of(events, "AckAccepted", 0)
    assert unacked == 0 and not coord.ledger.debts
    _clean(sqlite_store)


async def test_a_receipt_mismatch_ack_is_refetched_and_paid(sqlite_store: EventStore, tmp_path: Path) -> None:
    """Our record of the receipt was off (the first answer carried a wrong execution generation): the
    ACK is refused with receipt_mismatch, the agent's receipt for the same reply is fetched, owed and
    ACKed; the debt does not block the next checkpoint."""

    def wrong_generation(receipt: dict[str, Any]) -> dict[str, Any]:
        return {**receipt, "execution_generation": receipt["execution_generation"] + 5}

    g = gid("bad")
    with serve_hostile(
        _config(tmp_path), [Rule("/completion_receipt", _try0(f"{g}_g0"), wrong_generation, 1)]
    ) as agent:
        async with GymClient(agent.url, "h") as client:
            coord = coordinator(store := sqlite_store, {"h": client}, mode="sibling", prepare_timeout_s=10)
            async with coord:
                await coord.submit(g, PROMPT, "h", 2, PAYLOAD)
                await coord.wait_idle(30)
                outcome = await coord.checkpoint(gid("ck"))
                assert outcome.committed, outcome.reason
            assert (await client.status()).completed_unacknowledged == 0
    events = _events(store, g)
    assert [r["error"] for r in _of(events, "AckRejected", 0)] == ["receipt_mismatch"]
    owed = _of(events, "AckOwed", 0, f"{g}_g0")
    assert (
        len(owed) == 2
        and owed[1]["receipt"]["execution_generation"] == owed[0]["receipt"]["execution_generation"] - 5
    )
    assert owed[1]["receipt"]["result_digest"] == owed[0]["receipt"]["result_digest"]
    assert _of(events, "AckAccepted", 0) and _of(events, "SiblingSealed", 0)
    assert not _of(events, "RunFailed", 0) and not coord.ledger.debts
    _clean(store)


async def test_a_refetched_receipt_for_another_reply_is_a_verify_failure(
    sqlite_store: EventStore, tmp_path: Path
) -> None:
    """After the refused ACK the agent describes another reply: recorded as a verify failure, owed only
    to release the agent's copy; the auditor names the receipt that does not match the sealed reply."""

    def wrong_generation(receipt: dict[str, Any]) -> dict[str, Any]:
        return {**receipt, "execution_generation": receipt["execution_generation"] + 5}

    def other_reply(receipt: dict[str, Any]) -> dict[str, Any]:
        return {**receipt, "result_digest": "sha256:" + "0" * 64}

    g = gid("bad")
    rules = [
        Rule("/completion_receipt", _try0(f"{g}_g0"), wrong_generation, 1),
        Rule("/completion_receipt", _try0(f"{g}_g0"), other_reply, 1),
    ]
    with serve_hostile(_config(tmp_path), rules) as agent:
        async with GymClient(agent.url, "h") as client:
            coord = coordinator(sqlite_store, {"h": client}, mode="sibling")
            async with coord:
                await coord.submit(g, PROMPT, "h", 1, PAYLOAD)
                await coord.wait_idle(30)
            assert (await client.status()).completed_unacknowledged == 0
    events = _events(sqlite_store, g)
    failed = _of(events, "RunFailed", 0)
    assert [f["kind"] for f in failed] == ["verify"] and "now describes reply" in failed[0]["reason"]
    assert [r["error"] for r in _of(events, "AckRejected", 0)] == ["receipt_mismatch"] * 2
    assert [o["receipt"]["result_digest"] == "sha256:" + "0" * 64 for o in _of(events, "AckOwed", 0)] == [
        False,
        True,
        False,
    ]
    assert _of(events, "AckAccepted", 0) and not coord.ledger.debts
    assert {v.rule for v in audit_log(sqlite_store).violations} == {"receipt-matches"}


async def test_an_agent_going_away_mid_call_is_retired_at_its_successor(
    sqlite_store: EventStore, tmp_path: Path
) -> None:
    """The agent stops while try 0 runs and a new one (next execution generation) takes its port:
    try 0 is recorded failed, the new agent answers its retire `done` (an earlier process of its state
    directory started it: the new one never runs it), and try 1 is sealed there."""
    g = gid("gone")
    config = _config(tmp_path)
    with serve_hostile(config, []) as first:
        config = config.model_copy(update={"port": first.port})
        async with GymClient(first.url, "h") as client:
            await client.set_faults(AttemptFault(rollout_id=f"{g}_g0", attempt_index=0, hang=True))
            coord = coordinator(sqlite_store, {"h": client}, mode="sibling")
            async with coord:
                await coord.submit(g, PROMPT, "h", 1, PAYLOAD)
                while (await client.status()).running == 0:
                    await asyncio.sleep(0.02)
                await asyncio.to_thread(first.stop)
                with serve_hostile(config, []):
                    await coord.wait_idle(30)
                    assert (await client.status()).completed_unacknowledged == 0
    events = _events(sqlite_store, g)
    failed = _of(events, "RunFailed", 0)
    assert failed and failed[0]["kind"] in ("env", "stream_closed", "agent_lost"), failed
    assert [r["outcome"] for r in _of(events, "AttemptRetired", 0)] == ["done"]
    assert [s["attempt_index"] for s in _of(events, "SiblingSealed")] == [1]
    assert not coord.ledger.debts
    _clean(sqlite_store)


# --- the database going away ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def own_cluster() -> Iterator[PgCluster]:
    """A cluster of this module's own, so stopping it disturbs no other test."""
    with PgCluster() as cluster:
        yield cluster


def _fresh_db(cluster: PgCluster) -> str:
    url = cluster.url(cluster.create_database())
    upgrade_database(url)
    return url


def _clean(store: EventStore) -> None:
    report = audit_log(store)
    assert report.ok, report.as_json()["violations"]


async def test_a_database_restart_mid_append_is_ridden_out(own_cluster: PgCluster, tmp_path: Path) -> None:
    """The database stops while two groups run; a third group is submitted into the outage, so the
    coordinator has an append to ride out whatever the speed of the rest (the gate: the journal has
    retried it).  The database comes back, and every group seals with nothing owed."""
    url = _fresh_db(own_cluster)
    store = open_store(url)
    groups = [gid("db"), gid("db"), gid("db")]
    try:
        with serve_hostile(_config(tmp_path, delay_s=0.1), []) as agent:
            async with GymClient(agent.url, "h") as client:
                # The budgets are not what is tested here: far from anything a slow machine reaches.
                coord = coordinator(
                    store, {"h": client}, mode="sibling", rollout_timeout_s=120, outage_budget_s=300
                )
                async with coord:
                    for g in groups[:2]:
                        await coord.submit(g, PROMPT, "h", 3, PAYLOAD)
                    await asyncio.to_thread(own_cluster.pg_ctl, "stop", "-m", "immediate")
                    into_the_outage = asyncio.create_task(coord.submit(groups[2], PROMPT, "h", 3, PAYLOAD))
                    async with asyncio.timeout(120):  # a bound, not a speed: the retry comes at once
                        while coord.journal_figures()["outage_retries"] == 0:
                            assert not into_the_outage.done(), "an append succeeded with the database down"
                            await asyncio.sleep(0.05)
                    await asyncio.to_thread(own_cluster.pg_ctl, "start")
                    await into_the_outage
                    await coord.wait_idle(120)
                    assert not coord.errors and not coord.ledger.debts
                assert (await client.status()).completed_unacknowledged == 0
        for g in groups:
            events = _events(store, g)
            assert len(_of(events, "SiblingSealed")) == 3 and _of(events, "GroupSealed")
        _clean(store)
    finally:
        store.close()


async def test_a_database_gone_for_too_long_stops_the_coordinator_and_recovery_pays_every_debt(
    own_cluster: PgCluster, tmp_path: Path
) -> None:
    url = _fresh_db(own_cluster)
    store = open_store(url)
    g = gid("db")
    try:
        with serve_hostile(_config(tmp_path, delay_s=0.1), []) as agent:
            async with GymClient(agent.url, "h") as client:
                coord = coordinator(store, {"h": client}, mode="sibling", outage_budget_s=0.5)
                await coord.start()
                await coord.submit(g, PROMPT, "h", 3, PAYLOAD)
                await asyncio.sleep(0.2)
                await asyncio.to_thread(own_cluster.pg_ctl, "stop", "-m", "immediate")
                try:
                    with pytest.raises(CoordinatorStopped, match=r"unavailable for more than 0\.5 s"):
                        await coord.wait_idle(30)
                    with pytest.raises(CoordinatorStopped):
                        await coord.claim_for_training(g, 0)
                finally:
                    await coord.close()
                    await asyncio.to_thread(own_cluster.pg_ctl, "start")
                # The finished results wait at the agent; a coordinator recovered from the log adopts
                # and ACKs them: nothing was decided that the log does not hold.
                again = open_store(url)
                try:
                    coord2 = await RolloutCoordinator.recover(
                        again, {"h": client}, mode="sibling", rollout_timeout_s=10
                    )
                    await coord2.wait_idle(60)
                    assert not coord2.ledger.debts and g not in coord2.open_groups()
                    await coord2.close()
                    assert (await client.status()).completed_unacknowledged == 0
                    assert len(_of(_events(again, g), "SiblingSealed")) == 3
                    _clean(again)
                finally:
                    again.close()
    finally:
        store.close()


async def test_a_log_database_dropped_mid_run_stops_the_coordinator_at_once_not_after_its_budget(
    own_cluster: PgCluster, tmp_path: Path
) -> None:
    """Dropped, the database refuses every new connection ("does not exist"): no outage to ride out.
    The budget is far longer than the wait allowed, so only a stop at the first refusal passes.  The
    log and its payload table are one database: whichever of them meets the refusal first says it."""
    name = own_cluster.create_database()
    url = own_cluster.url(name)
    upgrade_database(url)
    store = open_store(url)
    try:
        with serve_hostile(_config(tmp_path, delay_s=0.1), []) as agent:
            async with GymClient(agent.url, "h") as client:
                plane = PayloadPlane(LocalDirPayloadStore(tmp_path / "payloads"))
                coord = coordinator(
                    store, {"h": client}, mode="sibling", outage_budget_s=600.0, payloads=plane
                )
                await coord.start()
                await coord.submit(gid("dropped"), PROMPT, "h", 3, PAYLOAD)
                await asyncio.to_thread(own_cluster.drop_database, name)  # FORCE: its sessions end too
                try:
                    with pytest.raises(CoordinatorStopped, match=r"refused the connection") as caught:
                        await coord.wait_idle(60)
                    assert f'database "{name}" does not exist' in str(caught.value)
                    assert "\n" not in str(caught.value)
                finally:
                    await coord.close()
    finally:
        store.close()


async def test_records_whose_arrays_are_not_their_replys_leave_that_reply_whole(
    sqlite_store: EventStore, tmp_path: Path
) -> None:
    """A real Gym agent (arrays in its reply) whose token records for one try say other logprobs than
    the reply: the reply's JSON written from the records is not the one the receipt names, so the
    trainer writes the reply's own (which is), seals the try, and stores that reply whole, arrays
    and all; its sibling's reply, whose records agree, is stored apart.  Nothing the agent sent is lost."""

    def shifted(tokens: Any) -> Any:
        return [{**t, "generation_log_probs": [lp - 0.5 for lp in t["generation_log_probs"]]} for t in tokens]

    g = gid("apart")
    rules = [Rule("/token_capture", _try0(f"{g}_g0"), shifted)]
    with serve_hostile(_config(tmp_path, inline_tokens=True), rules) as agent:
        async with GymClient(agent.url, "h") as client:
            coord = coordinator(sqlite_store, {"h": client}, mode="sibling")
            async with coord:
                await coord.submit(g, PROMPT, "h", 2, PAYLOAD)
                await coord.wait_idle(30)
    assert rules[0].hits == 1
    events = _events(sqlite_store, g)
    assert len(_of(events, "SiblingSealed")) == 2
    replied = {e["rollout_id"]: RunReplied.model_validate(e) for e in _of(events, "RunReplied")}
    tampered, honest = replied[f"{g}_g0"].reply, replied[f"{g}_g1"].reply
    assert tampered is not None and honest is not None
    assert tampered.media_type == REPLY_MEDIA_TYPE and replied[f"{g}_g0"].apart_from is None
    assert tampered.digest == replied[f"{g}_g0"].reply_digest
    assert honest.media_type == REPLY_APART_MEDIA_TYPE and replied[f"{g}_g1"].apart_from is not None
    plane = payload_plane(sqlite_store)
    whole = plane.get(tampered)
    assert b"generation_log_probs" in whole and sha256_digest(whole) == tampered.digest
    audit = audit_log(sqlite_store, payloads=plane)
    assert audit.ok, audit.as_json()
