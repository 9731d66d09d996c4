"""The NemoGym drop-in's body without Ray: rows to groups, results from the log, a retried call resumes."""

from __future__ import annotations

from typing import Any

import pytest

from eventstore import EventStore, open_store
from protocol.streams import group_stream
from protocol.wire import AttemptFault
from tests.ray.conftest import nemo_rows, plain
from tests.rollout.conftest import MakeAgent
from trainer.gym import GymClient
from trainer.ray_gym import LedgerGym, LedgerGymConfig, RowError
from trainer.ray_gym.rows import call_digest, group_id, split_groups


def test_rows_split_into_contiguous_prompt_groups() -> None:
    rows = nemo_rows(3, 2, ["a", "b"])
    runs = split_groups(rows, None)
    assert [[r["_rowidx"] for r in run] for run in runs] == [[0, 1], [2, 3], [4, 5]]
    one_agent = nemo_rows(3, 2, ["a"])
    assert [[r["_rowidx"] for r in run] for run in split_groups(one_agent, 3)] == [[0, 1], [2, 3], [4, 5]]
    # Two equal prompts side by side are told apart by num_generations only.
    twice = [{**r, "_ng_task_index": 0, "_rowidx": i} for i, r in enumerate(nemo_rows(1, 4, ["a"]))]
    assert [[r["_rowidx"] for r in run] for run in split_groups(twice, 2)] == [[0, 1], [2, 3]]
    assert [[r["_rowidx"] for r in run] for run in split_groups(twice, None)] == [[0, 1, 2, 3]]
    with pytest.raises(RowError, match="agent_ref"):
        split_groups([{**rows[0], "agent_ref": {}}], None)
    with pytest.raises(RowError, match="empty"):
        split_groups([], None)
    with pytest.raises(RowError, match="share"):
        split_groups([rows[0], rows[0]], None)
    # A retry sends the same rows: the same digest, so the same group ids.
    assert call_digest(rows) == call_digest([dict(r) for r in rows])
    assert call_digest(rows) != call_digest(nemo_rows(3, 2, ["a", "b"], tag="x"))


def _config(url: str, agents: dict[str, str], **kw: Any) -> LedgerGymConfig:
    return LedgerGymConfig(db_url=url, agents=agents, rollout_timeout_s=60.0, prepare_timeout_s=60.0, **kw)


class _TaskGym(LedgerGym):
    """The actor as Ray runs it: each call has a task id, the same on every retry of that call."""

    def __init__(self, config: LedgerGymConfig, task_id: str) -> None:
        super().__init__(config)
        self.task_id = task_id

    def _call_id(self) -> str | None:
        return self.task_id


async def _collect(gym: LedgerGym, rows: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any], Any]]:
    return [item async for item in gym.run_rollouts(rows, "timing/rollout")]


async def test_every_row_comes_back_once_with_its_reply_and_tokens(
    sqlite_url: str, make_agent: MakeAgent
) -> None:
    a, b = make_agent("a"), make_agent("b")
    rows = nemo_rows(4, 2, ["a", "b"])
    gym = LedgerGym(_config(sqlite_url, {"a": a.url, "b": b.url}))
    try:
        items = await _collect(gym, rows)
        await gym.wait_idle(120)
    finally:
        await gym.shutdown()
    assert sorted(i for i, _, _ in items) == list(range(8))
    # Rows of a group come together, in generation order.
    for k in range(0, 8, 2):
        pos = [i for i, _, _ in items].index(k)
        assert items[pos + 1][0] == k + 1
    assert items[-1][2] is not None and "timing/rollout/ledger_total_s" in items[-1][2]
    for rowidx, result, _ in items:
        full = result["full_result"]
        assert full["responses_create_params"] == rows[rowidx]["responses_create_params"]
        assert full["_ng_task_index"] == rows[rowidx]["_ng_task_index"]
        assert isinstance(full["reward"], float) and "output" in full["response"]
        log = result["message_log"]
        assert [m["role"] for m in log[:2]] == ["user", "assistant"] and result["input_message_log"] == log[
            :1
        ]
        assistant = [m for m in log if m["role"] == "assistant"]
        assert all(len(m["token_ids"]) == len(m["generation_logprobs"]) > 0 for m in assistant)


async def test_a_row_no_agent_takes_refuses_the_call_before_any_group_is_reserved(
    sqlite_url: str, make_agent: MakeAgent
) -> None:
    """One row with a NaN temperature (a dataset's blank read as NaN) among good ones: the whole call
    is refused in one line naming the row (NeMo RL's data class), and the log holds none of its
    groups.  Before, the groups before it were reserved and ran, and its own was reserved and never
    dispatched: open for ever."""
    a = make_agent("a")
    rows = nemo_rows(3, 2, ["a"])
    bad = 2 * 1  # the second prompt's first row
    rows[bad] = {
        **rows[bad],
        "responses_create_params": {**rows[bad]["responses_create_params"], "temperature": float("nan")},
    }
    gym = LedgerGym(_config(sqlite_url, {"a": a.url}))
    try:
        with pytest.raises(
            RowError, match=rf"^row {bad}: its payload is no /run row: .*JSON cannot carry"
        ) as refused:
            await _collect(gym, rows)
        assert "\n" not in str(refused.value)
    finally:
        await gym.shutdown()
    store = open_store(sqlite_url)
    try:
        assert not [e for e in store.read_all() if e.type == "GroupReserved"]
    finally:
        store.close()


async def test_a_retried_call_resumes_and_replays_in_claim_order(
    sqlite_url: str, make_agent: MakeAgent
) -> None:
    """The first attempt dies after two rows (one group) went out; the retry yields that group first
    (Ray drops the items its caller has by index), then the rest, and nothing is reserved or run twice."""
    agent = make_agent("a")
    rows = nemo_rows(3, 2, ["a"])
    digest = call_digest(rows)
    first = _TaskGym(_config(sqlite_url, {"a": agent.url}), "task-1")
    stream = first.run_rollouts(rows, "t")
    got = [await anext(stream), await anext(stream)]
    await stream.aclose()
    await first.shutdown()  # the actor died with the call in flight
    # Whichever group sealed first went out first, both of its rows.
    assert got[0][0] % 2 == 0 and got[1][0] == got[0][0] + 1

    second = _TaskGym(_config(sqlite_url, {"a": agent.url}), "task-1")  # Ray's retry: the same task
    try:
        retried = await _collect(second, rows)
        await second.wait_idle(120)
    finally:
        await second.shutdown()
    assert [i for i, _, _ in retried[:2]] == [i for i, _, _ in got]
    assert sorted(i for i, _, _ in retried) == list(range(6))
    assert plain(retried[0][1]) == plain(got[0][1])
    store = open_store(sqlite_url)
    try:
        for k in range(3):
            types = [e.type for e in store.read_stream(group_stream(group_id("nrl-", digest, 0, k)))]
            # Tries in flight when the first one died were retired (or adopted) and replaced, once.
            assert types.count("GroupReserved") == 1 and types.count("GroupSealed") == 1
        assert not list(store.read_stream(group_stream(group_id("nrl-", digest, 1, 0))))
    finally:
        store.close()
    async with GymClient(agent.url, "a") as client:
        assert all(n == 1 for n in (await client.debug_runs()).values())
        assert (await client.status()).completed_unacknowledged == 0


async def test_the_same_rows_again_after_delivery_are_a_new_call(
    sqlite_url: str, sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    agent = make_agent("a")
    rows = nemo_rows(1, 2, ["a"])
    gym = LedgerGym(_config(sqlite_url, {"a": agent.url}))
    try:
        await _collect(gym, rows)
        await _collect(gym, rows)
        await gym.wait_idle(120)
    finally:
        await gym.shutdown()
    digest = call_digest(rows)
    for occurrence in (0, 1):
        types = [
            e.type for e in sqlite_store.read_stream(group_stream(group_id("nrl-", digest, occurrence, 0)))
        ]
        assert types.count("GroupSealed") == 1 and types.count("GroupClaimedForTraining") == 1


async def test_a_retried_task_whose_groups_were_all_claimed_replays_them_not_new_ones(
    sqlite_url: str, sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """The first attempt claimed every group and died before its caller had every item (a kill
    while the items were on their way): the retry, the same task, replays the same groups in claim
    order (Ray drops what the caller has) and reserves nothing new.  Another task with the same rows
    is another call, with groups of its own."""
    agent = make_agent("a")
    rows = nemo_rows(3, 2, ["a"])
    first = _TaskGym(_config(sqlite_url, {"a": agent.url}), "task-1")
    try:
        delivered = await _collect(first, rows)  # every group claimed, the last items not received
    finally:
        await first.shutdown()
    again = _TaskGym(_config(sqlite_url, {"a": agent.url}), "task-1")
    try:
        replayed = await _collect(again, rows)
    finally:
        await again.shutdown()
    other = _TaskGym(_config(sqlite_url, {"a": agent.url}), "task-2")
    try:
        fresh = await _collect(other, rows)
        await other.wait_idle(120)
    finally:
        await other.shutdown()
    assert [i for i, _, _ in replayed] == [i for i, _, _ in delivered]
    assert plain([r for _, r, _ in replayed]) == plain([r for _, r, _ in delivered])
    assert sorted(i for i, _, _ in fresh) == list(range(6))
    # task-1's groups (occurrence 0): claimed once, and the claims stood through the actor's restart
    # (the trainer kept its state), so the replay claimed nothing again; task-2's are the next
    # occurrence of the same rows.
    digest = call_digest(rows)
    for occurrence, task, claims in ((0, "task-1", 1), (1, "task-2", 1)):
        for k in range(3):
            events = list(sqlite_store.read_stream(group_stream(group_id("nrl-", digest, occurrence, k))))
            assert [e.type for e in events].count("GroupReserved") == 1
            claimed = [e.data["call_id"] for e in events if e.type == "GroupClaimedForTraining"]
            assert claimed == [task] * claims
    assert not list(sqlite_store.read_stream(group_stream(group_id("nrl-", digest, 2, 0))))
    async with GymClient(agent.url, "a") as client:
        assert sum((await client.debug_runs()).values()) == 12  # 3 groups x 2, per task: none twice


async def test_the_actor_serves_the_logs_figures(sqlite_url: str, make_agent: MakeAgent) -> None:
    pytest.importorskip("prometheus_client")
    import httpx

    agent = make_agent("a")
    gym = LedgerGym(_config(sqlite_url, {"a": agent.url}, metrics_port=0))
    try:
        await _collect(gym, nemo_rows(2, 2, ["a"]))
        port = gym.metrics_port()
        assert port is not None
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        figures = await gym.metrics()
    finally:
        await gym.shutdown()
    assert "ledger_groups_sealed_total 2.0" in text and "ledger_groups_claimed_total 2.0" in text
    assert figures["ledger/groups_sealed"] == 2


async def test_split_phase_checkpoint_through_the_actor(sqlite_url: str, make_agent: MakeAgent) -> None:
    """prepare -> (the trainer saves) -> commit, and prepare -> abort, as NeMo RL would call the actor."""
    agent = make_agent("a")
    gym = LedgerGym(_config(sqlite_url, {"a": agent.url}))
    try:
        await _collect(gym, nemo_rows(1, 2, ["a"]))
        prepared = await gym.prepare_checkpoint("ck-split-1")
        assert prepared["prepared"] is True and set(prepared["prepare_wait_s"]) == {"a"}
        async with GymClient(agent.url, "a") as client:
            assert (await client.status()).phase == "prepared"
            committed = await gym.commit_checkpoint("ck-split-1")
            assert committed["committed"] is True
            assert (await client.status()).phase == "idle"
            assert (await gym.prepare_checkpoint("ck-split-2"))["prepared"] is True
            aborted = await gym.abort_checkpoint("ck-split-2", "the trainer's save failed")
            assert aborted["committed"] is False and "save failed" in aborted["reason"]
            assert (await client.status()).phase == "idle"
    finally:
        await gym.shutdown()
    store = open_store(sqlite_url)
    try:
        types = [e.type for e in store.read_all(0) if e.stream_id.startswith("checkpoint-ck-split")]
    finally:
        store.close()
    assert types.count("CheckpointCommitted") == 1 and types.count("CheckpointAborted") == 1


async def test_a_call_whose_groups_never_seal_gives_up_at_its_budget(
    sqlite_url: str, make_agent: MakeAgent
) -> None:
    """No wait is unbounded: a group hung at its agent (and a long try deadline) ends the call with a
    TimeoutError naming what is still open once `call_budget_s` is spent."""
    agent = make_agent("a")
    rows = nemo_rows(1, 2, ["a"])
    hung = f"{group_id('nrl-', call_digest(rows), 0, 0)}_g0"
    async with GymClient(agent.url, "a") as client:
        await client.set_faults(AttemptFault(rollout_id=hung, attempt_index=0, hang=True))
    gym = LedgerGym(_config(sqlite_url, {"a": agent.url}, call_budget_s=0.5))
    try:
        with pytest.raises(TimeoutError, match=r"1 group\(s\) of this call still open after 0\.5 s"):
            await _collect(gym, rows)
    finally:
        await gym.shutdown()
