"""`LedgerGym` against NeMo RL's own call sites (main 7ea279abf and the recovery branch
`amahishi/partial-rollout-telemetry-v2`), each test naming the file and function it follows.  What
the call site does with the actor's answer is restated here from NeMo RL's code (never imported: NeMo
RL is not installed here); the actor is the real one against real agents on loopback."""

from __future__ import annotations

import base64
import pickle
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from eventstore import EventStore
from payloads.token_arrays import decode_payload
from projections.audit import audit_log
from protocol.token_codec import TOKENS_MEDIA_TYPE, encode_records
from protocol.wire import TokenEntry
from tests.ray.conftest import nemo_rows, plain
from tests.rollout.conftest import MakeAgent
from trainer.gym import GymClient
from trainer.manifest import MANIFEST_NAME, read_manifest
from trainer.ray_gym import (
    CallBudgetSpent,
    LedgerGym,
    LedgerGymConfig,
    RowsDeadLettered,
    RowsLostToInfrastructure,
    split_config,
)
from trainer.ray_gym.results import ResultDataError, ResultRules, full_result, message_log
from trainer.ray_gym.spinup import agents_of, global_config_for


def nemo_gym_config(ledger: dict[str, Any], **gym: Any) -> dict[str, Any]:
    """What `spinup_nemo_gym_actor` (nemo_rl/environments/nemo_gym.py) builds: `env.nemo_gym` minus
    NeMo RL's own knobs becomes `initial_global_config_dict`, the `ledger` section with it."""
    return {
        "model_name": "Qwen/Qwen3-0.6B",
        "base_urls": ["http://10.0.0.7:8000/v1", "http://10.0.0.8:8000/v1"],
        "invalid_tool_call_patterns": None,
        "thinking_tags": None,
        "tokenizer_config": None,
        "require_routed_experts": False,
        "routed_experts_dtype": "int16",
        "use_fastokens": False,
        "initial_global_config_dict": {"ledger": ledger, **gym},
    }


async def drain(
    gym: LedgerGym, rows: list[dict[str, Any]], *args: Any
) -> list[tuple[int, dict[str, Any], Any]]:
    return [item async for item in gym.run_rollouts(rows, *args)]


def tensorize(result: dict[str, Any]) -> None:
    """`_tensorize_nemo_gym_result` (nemo_rl/experience/rollouts.py): `torch.tensor` over the token
    fields, which must already be (or become) tensors of the right kind."""
    for m in result["input_message_log"] + result["message_log"]:
        m["token_ids"] = torch.tensor(m["token_ids"])
    for m in result["message_log"]:
        if m["role"] == "assistant":
            m["generation_logprobs"] = torch.tensor(m["generation_logprobs"])


def mask_flags(results: list[dict[str, Any]]) -> list[bool]:
    """`_extract_mask_sample_flags` (nemo_rl/experience/rollouts.py)."""
    return [bool((r["full_result"].get("instance_config") or {}).get("mask_sample", False)) for r in results]


# --- spin-up ------------------------------------------------------------------------------------


def test_the_ledger_section_rides_in_nemo_gym_config_where_spinup_puts_it() -> None:
    """`spinup_nemo_gym_actor` (nemo_rl/environments/nemo_gym.py): `env.nemo_gym.ledger` reaches the
    actor inside `initial_global_config_dict`; it is taken off before anything goes to Gym."""
    cfg, ledger = split_config(
        nemo_gym_config({"db_url": "sqlite:///x.db", "trainer_id": "t1"}, simple_agent={})
    )
    assert ledger.db_url == "sqlite:///x.db" and ledger.trainer_id == "t1"
    assert (
        "ledger" not in cfg["initial_global_config_dict"]
        and "simple_agent" in cfg["initial_global_config_dict"]
    )
    # At the top level too (a NemoGymConfig built by hand), and a bad section is one line.
    top = {**nemo_gym_config({}), "ledger": {"db_url": "sqlite:///y.db"}}
    assert split_config(top)[1].db_url == "sqlite:///y.db"
    with pytest.raises(ValueError, match=r"^ledger\.max_tries: .*greater than or equal to 1$"):
        split_config(nemo_gym_config({"db_url": "sqlite:///x.db", "max_tries": 0}))
    with pytest.raises(ValueError, match="needs a `ledger` section"):
        split_config({"model_name": "m", "base_urls": [], "initial_global_config_dict": {}})
    with pytest.raises(ValueError, match="turn NeMo RL's token capture off"):
        LedgerGym({**nemo_gym_config({"db_url": "sqlite:///x.db"}), "token_capture": {"enabled": True}})


def test_the_global_config_is_nemo_gyms() -> None:
    """`NemoGym._spinup` (nemo_rl/environments/nemo_gym.py): the policy model's name, a dummy key and
    the generation servers' URLs; NeMo RL's knobs off; a head server on a free port of the Gym range;
    the default host; the connection limits; the Ray cluster to join."""
    cfg, _ = split_config(
        nemo_gym_config(
            {"db_url": "sqlite:///x.db"}, effort_levels={"low": 1}, simple_agent={"x": 1}, default_host="h"
        )
    )
    config = global_config_for(cfg, host="10.0.0.1", bind_host="127.0.0.1", ray_address="10.0.0.1:6379")
    assert config["policy_model_name"] == "Qwen/Qwen3-0.6B" and config["policy_api_key"] == "dummy_key"
    assert config["policy_base_url"] == cfg["base_urls"]
    assert "effort_levels" not in config and "ledger" not in config and config["simple_agent"] == {"x": 1}
    assert config["default_host"] == "h"  # the user's, as NemoGym's setdefault keeps it
    assert (config["port_range_low"], config["port_range_high"]) == (5000, 5999)
    assert config["head_server"]["host"] == "127.0.0.1" and 5000 <= config["head_server"]["port"] < 5999
    assert config["global_aiohttp_connector_limit_per_host"] == 16_384
    assert config["ray_head_node_address"] == "10.0.0.1:6379"


def test_agents_are_found_in_the_head_servers_global_config() -> None:
    """Gym's `ServerClient.load_from_global_config` (what `RolloutCollectionHelper.run_examples` uses):
    a row's `agent_ref.name` is the top-level name of a `responses_api_agents` server."""
    resolved = {
        "head_server": {"host": "127.0.0.1", "port": 5000},
        "policy_model": {"responses_api_models": {"vllm_model": {"host": "127.0.0.1", "port": 5001}}},
        "math_agent": {"responses_api_agents": {"simple_agent": {"host": "10.0.0.1", "port": 5003}}},
        "policy_base_url": ["http://x"],
    }
    assert agents_of(resolved) == {"math_agent": "http://10.0.0.1:5003"}


# --- the stream -----------------------------------------------------------------------------------


# NeMo RL's own `torch.tensor` over the tensors its actor yields warns the same way there.
@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
async def test_streamed_as_run_async_nemo_gym_rollout_consumes_it(
    sqlite_url: str, sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """`run_async_nemo_gym_rollout` (nemo_rl/experience/rollouts.py, main): rows stamped by
    `_prepare_nemo_gym_rows`, `run_rollouts(rows, timer_prefix, dedup)`, each item `(rowidx, result,
    timing)`; `_NemoGymStreamAccumulator` groups by `rowidx // num_generations` and refuses an index out
    of range or twice; `_tensorize_nemo_gym_result`; `_postprocess_single_nemo_gym_group` reads token
    counts, rewards, `agent_ref`, the mask and `_ng_task_index`; the timing of the last item is merged."""
    a, b = make_agent("a"), make_agent("b")
    num_generations = 3
    rows = nemo_rows(4, num_generations, ["a", "b"])
    for i, row in enumerate(rows):  # _prepare_nemo_gym_rows
        row["responses_create_params"].update(temperature=0.7, top_p=0.9, max_output_tokens=64)
        row["_rowidx"] = i
    gym = LedgerGym(LedgerGymConfig(db_url=sqlite_url, agents={"a": a.url, "b": b.url}, num_generations=3))
    try:
        items = await drain(gym, rows, "timing/rollout", False)
        await gym.wait_idle(120)
    finally:
        await gym.shutdown()
    received: set[int] = set()
    groups: dict[int, dict[int, dict[str, Any]]] = {}
    for rowidx, result, _ in items:
        assert isinstance(rowidx, int) and 0 <= rowidx < len(rows) and rowidx not in received
        received.add(rowidx)
        tensorize(result)
        groups.setdefault(rowidx // num_generations, {})[rowidx] = result
    assert received == set(range(len(rows))) and all(len(g) == num_generations for g in groups.values())
    for k, group in groups.items():
        results = [group[i] for i in sorted(group)]
        task = {r["full_result"]["_ng_task_index"] for r in results}
        assert task == {rows[k * num_generations]["_ng_task_index"]}  # one _ng_task_index per group
        assert mask_flags(results) == [False] * num_generations
        assert torch.tensor([r["full_result"]["reward"] for r in results]).dtype == torch.float32
        for r in results:
            assert sum(len(m["token_ids"]) for m in r["message_log"] if m["role"] == "assistant") > 0
            assert r["input_message_log"][0]["token_ids"].dtype == torch.int64
            assert r["full_result"]["agent_ref"] == rows[0 if k % 2 == 0 else num_generations]["agent_ref"]
    timing = items[-1][2]
    assert {"timing/rollout/await_results", "timing/rollout/postprocess_results"} <= set(timing)
    assert all(t is None for _, _, t in items[:-1])


async def test_results_are_tensors_as_nemo_gym_yields_them(sqlite_url: str, make_agent: MakeAgent) -> None:
    """`NemoGym._postprocess_nemo_gym_to_nemo_rl_result` (nemo_rl/environments/nemo_gym.py, both
    versions): `token_ids` int64 tensors, `generation_logprobs` float tensors, the two penalty flags on
    every assistant message; the row's own `_ng_rollout_id` kept, the ledger's try beside it."""
    agent = make_agent("a")
    rows = nemo_rows(1, 2, ["a"])
    for i, row in enumerate(rows):
        row["_ng_rollout_id"] = f"grp-7_g{i}_a0123"  # the recovery branch's per-row id
    gym = LedgerGym(LedgerGymConfig(db_url=sqlite_url, agents={"a": agent.url}))
    try:
        items = await drain(gym, rows, "timing/rollout")
        await gym.wait_idle(120)
    finally:
        await gym.shutdown()
    assert len(items) == 2  # one group: the per-row ids do not split it
    for rowidx, result, _ in items:
        for m in result["message_log"]:
            assert isinstance(m["token_ids"], torch.Tensor) and m["token_ids"].dtype == torch.int64
            if m["role"] == "assistant":
                assert m["generation_logprobs"].dtype == torch.float32
                assert m["is_invalid_tool_call"] is False and m["has_malformed_thinking"] is False
        full = result["full_result"]
        assert full["_ng_rollout_id"] == rows[rowidx]["_ng_rollout_id"] == result["rollout_id"]
        assert full["_ledger_rollout_id"].endswith(f"_g{rowidx}") and full["_ledger_attempt_index"] >= 0
        assert "_rowidx" not in full and "receipt" not in result  # receipt mode is NeMo RL's capture
        for item in full["response"]["output"]:
            assert "generation_token_ids" not in item


def _entry(
    call: str, prompt: list[int], gen: list[int], item: dict[str, Any], routes: Any = None
) -> TokenEntry:
    return TokenEntry(
        rollout_id="k",
        model_call_id=call,
        model="m",
        prompt_token_ids=prompt,
        generation_token_ids=gen,
        generation_log_probs=[-0.5] * len(gen),
        routed_experts=routes,
        output_items=[item],
        token_item_index=0,
        created_at=0.0,
    )


def _text(text: str) -> dict[str, Any]:
    return {"type": "message", "id": text[:8], "content": [{"type": "output_text", "text": text}]}


def test_the_penalty_flags_grpo_reads() -> None:
    """`_detect_invalid_tool_call_and_malformed_thinking` (nemo_rl/environments/nemo_gym.py), read by
    `apply_reward_penalties` (nemo_rl/experience/rollouts.py): a tool-call pattern in the final text is
    an invalid tool call; a thinking tag in a final answer, or twice in a reasoning summary, is
    malformed thinking; the patterns and tags come from NemoGymConfig."""
    rules = ResultRules.of({})
    reasoning = {
        "type": "reasoning",
        "id": "r",
        "summary": [{"type": "summary_text", "text": "<think>a</think><think>"}],
    }
    log = message_log(
        [
            _entry("c1", [1, 2], [3], _text("<tool_call>{}</tool_call>")),
            _entry("c2", [1, 2, 3, 4], [5], _text("<think>x</think> 42")),
            _entry("c3", [1, 2, 3, 4, 5, 6], [7], reasoning),
            _entry("c4", [1, 2, 3, 4, 5, 6, 7], [8], _text("plain 42")),
        ],
        rules,
    )
    assistant = [
        (m["is_invalid_tool_call"], m["has_malformed_thinking"]) for m in log if m["role"] == "assistant"
    ]
    assert assistant == [(True, False), (False, True), (False, True), (False, False)]
    assert [m["token_ids"].tolist() for m in log if m["role"] == "user"] == [[1, 2], [4], [6], []]
    custom = ResultRules.of({"invalid_tool_call_patterns": ["CALL("], "thinking_tags": ["<r>"]})
    [_, flagged] = message_log([_entry("c", [1], [2], _text("CALL(x) <r>"))], custom)
    assert (flagged["is_invalid_tool_call"], flagged["has_malformed_thinking"]) == (True, True)


def _envelope(array: np.ndarray) -> str:
    """NeMo RL's router-replay wire format (nemo_rl/utils/routed_experts_codec.py)."""
    s, layers, k = array.shape
    return f"nrlre1:{array.dtype.name}:{s}x{layers}x{k}:{base64.b64encode(array.tobytes()).decode()}"


def test_routed_experts_are_sliced_per_message_for_router_replay() -> None:
    """`NemoGym._postprocess_nemo_gym_to_nemo_rl_result` with routes: `[tokens, layers, topk]` per
    call, the user message gets the new prompt tokens' rows, the assistant its generated tokens', and
    the previous turn's last row is taken from the next call's prefill."""
    first = np.arange(3 * 2 * 2, dtype=np.int16).reshape(3, 2, 2)  # prompt [1, 2] + generated [3]
    second = (100 + np.arange(5 * 2 * 2, dtype=np.int16)).reshape(5, 2, 2)  # [1, 2, 3, 4] + [5]
    log = message_log(
        [
            _entry("c1", [1, 2], [3], _text("a"), _envelope(first)),
            _entry("c2", [1, 2, 3, 4], [5], _text("b"), _envelope(second)),
        ],
        ResultRules.of({"routed_experts_dtype": "int32", "require_routed_experts": True}),
    )
    routes = [m["routed_experts"] for m in log]
    assert [tuple(r.shape) for r in routes] == [(2, 2, 2), (1, 2, 2), (1, 2, 2), (1, 2, 2)]
    assert all(r.dtype == torch.int32 for r in routes)
    assert routes[0].tolist() == first[:2].tolist()
    assert routes[1].tolist() == second[2:3].tolist()  # patched from the next prefill
    assert routes[2].tolist() == second[3:4].tolist() and routes[3].tolist() == second[4:5].tolist()
    with pytest.raises(ResultDataError, match="routed_experts rows"):
        message_log([_entry("c", [1, 2], [3], _text("a"), _envelope(first[:2]))], ResultRules.of({}))


def test_rows_are_built_straight_from_the_stored_arrays() -> None:
    """`LedgerGym` reads a sealed try's token records as arrays (views of the stored payload) and
    builds NeMo RL's tensors from them at real sizes: int64 ids and float32 logprobs (a float64 log
    probability rounded as `torch.tensor` rounds it), each call's user message the prompt tokens not
    seen before, and no tensor sharing the payload's buffer; the same rows as records built in memory."""
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 151_936, 3000).tolist()
    first_gen = rng.integers(0, 151_936, 6000).tolist()
    wide = (-rng.exponential(0.6, 6000)).tolist()  # float64 values: stored as f8
    second_prompt = prompt + first_gen + [11, 12]
    second_gen = rng.integers(2**16, 151_936, 5000).tolist()
    narrow = torch.tensor(-rng.exponential(0.6, 5000), dtype=torch.float32).tolist()  # exact float32: f4
    entries = [
        _entry("c1", prompt, first_gen, _text("first")),
        _entry("c2", second_prompt, second_gen, _text("<think>x</think>")),
    ]
    entries[0].generation_log_probs = wide
    entries[1].generation_log_probs = narrow
    buffer = bytearray(encode_records([e.record() for e in entries]))
    arrays = decode_payload(buffer, TOKENS_MEDIA_TYPE)
    assert [s.dtype for s in arrays.layout.spans] == ["u4", "u4", "f8", "u4", "u4", "f4"]
    rules = ResultRules.of({})
    log = message_log(arrays, rules)
    buffer[:] = bytes(len(buffer))  # the payload's buffer gone: the rows are their own
    user1, assistant1, user2, assistant2 = log
    assert user1["token_ids"].dtype == assistant1["token_ids"].dtype == torch.int64
    assert assistant1["generation_logprobs"].dtype == assistant2["generation_logprobs"].dtype == torch.float32
    assert user1["token_ids"].tolist() == prompt and assistant1["token_ids"].tolist() == first_gen
    assert user2["token_ids"].tolist() == [11, 12] and assistant2["token_ids"].tolist() == second_gen
    assert torch.equal(assistant1["generation_logprobs"], torch.tensor(wide))
    assert assistant2["generation_logprobs"].tolist() == narrow
    assert (assistant2["is_invalid_tool_call"], assistant2["has_malformed_thinking"]) == (False, True)
    from_records = message_log(entries, rules)
    assert all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        for a, b in zip(log, from_records, strict=True)
        for k in a
    )


def test_a_try_nemo_rl_could_not_train_on_is_refused_as_data() -> None:
    """NemoGym's own refusals: turns that do not extend one another, NaN logprobs, no generation."""
    rules = ResultRules.of({})
    with pytest.raises(ResultDataError, match="does not extend"):
        message_log([_entry("c1", [1, 2], [3], _text("a")), _entry("c2", [9, 9, 9], [4], _text("b"))], rules)
    nan = _entry("c1", [1], [2], _text("a"))
    nan.generation_log_probs[0] = float("nan")
    with pytest.raises(ResultDataError, match="NaN"):
        message_log([nan], rules)
    with pytest.raises(ResultDataError, match="no generated tokens"):
        message_log([_entry("c1", [1], [], _text("a"))], rules)


def test_mask_sample_is_where_nemo_rl_reads_it() -> None:
    """`_extract_mask_sample_flags` (nemo_rl/experience/rollouts.py) and the single controller's
    `_result_to_completion` (rollout_manager.py) read `full_result.instance_config.mask_sample`."""
    row = {"agent_ref": {"name": "a"}, "_rowidx": 0, "_ng_task_index": 3}
    reply = {"_ng_rollout_id": "x_g0", "response": {"output": []}, "reward": 0.0, "instance_config": {"k": 1}}
    masked = full_result(row, reply, "x_g0", 1, mask_sample=True)
    assert mask_flags([{"full_result": masked}]) == [True] and masked["instance_config"]["k"] == 1
    plain = full_result(row, {**reply, "instance_config": None}, "x_g0", 1, mask_sample=False)
    assert mask_flags([{"full_result": plain}]) == [False]
    echoed = full_result(
        row, {**reply, "instance_config": {"mask_sample": True}}, "x_g0", 1, mask_sample=False
    )
    assert mask_flags([{"full_result": echoed}]) == [True]  # the agent's own flag is kept


# --- other callers ------------------------------------------------------------------------------------


async def test_a_validation_batch_is_one_mixed_call(sqlite_url: str, make_agent: MakeAgent) -> None:
    """`run_nemo_gym_rollout_sync` (nemo_rl/experience/rollouts.py): validation drains the stream with
    the whole batch as one group of mixed agents (`returns_entire_batch`), one row per prompt; the
    actor's `num_generations` (set for training) must not refuse it."""
    a, b = make_agent("a"), make_agent("b")
    rows = nemo_rows(5, 1, ["a", "b"], tag="val")
    gym = LedgerGym(LedgerGymConfig(db_url=sqlite_url, agents={"a": a.url, "b": b.url}, num_generations=4))
    try:
        items = await drain(gym, rows, "timing/validation", False)
        await gym.wait_idle(120)
    finally:
        await gym.shutdown()
    assert sorted(i for i, _, _ in items) == list(range(5))
    for rowidx, result, _ in items:
        assert result["full_result"]["agent_ref"] == rows[rowidx]["agent_ref"]


async def test_the_single_controllers_redispatch_of_a_subset(
    sqlite_url: str, sqlite_store: EventStore, make_agent: MakeAgent
) -> None:
    """`NemoGymRolloutRunner._run_rollouts` / `_stream_rows` (nemo_rl/experience/rollout_manager.py,
    recovery branch): one prompt's rows per call with the tokenizer positional, `_rowidx` the
    generation index; the rows that never came back are sent again alone, keeping their `_rowidx`;
    each row carries its own `_ng_rollout_id`; results are checked against the dispatched indices."""

    class Tokenizer:  # the one method NemoGym calls on it for results that carry tokens
        def batch_decode(self, batch: list[list[int]]) -> list[str]:
            return [" ".join(f"<{t}>" for t in ids) for ids in batch]

    agent = make_agent("a")
    template = nemo_rows(1, 1, ["a"], tag="sc")[0]
    group = [{**template, "_rowidx": i, "_ng_rollout_id": f"g1_g{i}_a{i}"} for i in range(4)]
    gym = LedgerGym(LedgerGymConfig(db_url=sqlite_url, agents={"a": agent.url}, num_generations=4))
    try:
        whole = await drain(gym, group, Tokenizer(), "timing/rollout")
        subset = [group[1], group[3]]
        again = await drain(gym, subset, Tokenizer(), "timing/rollout")
        await gym.wait_idle(120)
    finally:
        await gym.shutdown()
    assert sorted(i for i, _, _ in whole) == [0, 1, 2, 3]
    assert sorted(i for i, _, _ in again) == [1, 3]
    for rowidx, result, _ in again:
        assert result["rollout_id"] == group[rowidx]["_ng_rollout_id"]
        strings = [o for o in result["full_result"]["response"]["output"] if "generation_str" in o]
        assert strings and strings[0]["generation_str"].startswith("<")
    reserved = [e.data for e in sqlite_store.read_all(0) if e.type == "GroupReserved"]
    assert sorted(r["expected_generations"] for r in reserved) == [2, 4]


def test_errors_are_the_classes_nemo_rl_handles_for_them() -> None:
    """`classify_rollout_failure` (nemo_rl/experience/failures.py): an exception is INFRA when it is
    (or is caused by) a `TimeoutError`, a `ConnectionError` or one of NeMo RL's infra classes, else
    DATA; the actor's errors cross the Ray boundary pickled, so each takes one str."""

    def bucket(exc: BaseException) -> str:
        return "infra" if isinstance(exc, (TimeoutError, ConnectionError)) else "data"

    for exc, expected in (
        (RowsDeadLettered("g used up its data budget"), "data"),
        (RowsLostToInfrastructure("g used up its infra budget"), "infra"),
        (CallBudgetSpent("2 group(s) still open"), "infra"),
        (ResultDataError("NaN"), "data"),
    ):
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is type(exc) and str(again) == str(exc) and bucket(again) == expected


# --- checkpoints ----------------------------------------------------------------------------------


async def test_checkpoints_bound_to_the_trainers_checkpoint_directory(
    sqlite_url: str, sqlite_store: EventStore, make_agent: MakeAgent, tmp_path: Path
) -> None:
    """`grpo.py`'s save block (`async_grpo_train`): `CheckpointManager.init_tmp_checkpoint` makes
    `tmp_step_N`, the policy, optimizer, replay buffer and dataloader are saved into it, and
    `begin_finalization` renames it `step_N`; at the next start `setup` loads
    `get_latest_checkpoint_path()` (nemo_rl/utils/checkpoint.py).  The actor's split checkpoint goes
    around the save and its manifest into `tmp_step_N`.  The trainer dies after the log's commit of
    step 2 and before the rename: NeMo RL comes back on step_1, and so does the log: the groups
    delivered since step_1 are delivered again (not run again), and step_2, saved again, is a new id."""
    agent = make_agent("a")
    results = tmp_path / "results"
    config = LedgerGymConfig(
        db_url=sqlite_url, agents={"a": agent.url}, trainer_id="grpo-1", checkpoint_dir=str(results)
    )
    batch_1, batch_2 = nemo_rows(2, 2, ["a"], tag="s1"), nemo_rows(2, 2, ["a"], tag="s2")

    async def save(gym: LedgerGym, step: int, *, finalize: bool) -> dict[str, Any]:
        tmp = results / f"tmp_step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)  # init_tmp_checkpoint: a stale one left by a crash goes
        tmp.mkdir(parents=True)
        prepared = await gym.prepare_checkpoint(f"step_{step}")
        assert prepared["prepared"], prepared
        (tmp / "replay_buffer.pt").write_bytes(b"the trainer's own state")  # policy.save_checkpoint, ...
        committed = await gym.commit_checkpoint(f"step_{step}", checkpoint_dir=str(tmp))
        if finalize:
            tmp.rename(results / f"step_{step}")  # begin_finalization
        return committed

    gym = LedgerGym(config)
    try:
        await gym._spinup()  # a fresh run: no step_N, no checkpoint of grpo-1 in the log
        await drain(gym, batch_1)
        first = await save(gym, 1, finalize=True)
        delivered = await drain(gym, batch_2)
        second = await save(gym, 2, finalize=False)  # killed before the rename
        await gym.wait_idle(120)
    finally:
        await gym.shutdown()
    assert (first["checkpoint_id"], second["checkpoint_id"]) == ("grpo-1.step_1", "grpo-1.step_2")
    assert first["committed"] and second["committed"]
    manifest = read_manifest(results / "step_1")
    assert (manifest.checkpoint_id, manifest.trainer_checkpoint) == ("grpo-1.step_1", "step_1")
    assert manifest.cut_position == first["cut_position"] and manifest.trainer_id == "grpo-1"

    again = LedgerGym(config)
    try:
        await again._spinup()  # restored to grpo-1.step_1, the checkpoint NeMo RL loads
        redelivered = await drain(again, batch_2)
        third = await save(again, 2, finalize=True)
        await again.wait_idle(120)
    finally:
        await again.shutdown()
    assert sorted(i for i, _, _ in redelivered) == sorted(i for i, _, _ in delivered)
    # The same sealed tries, row for row (the timings of the last item aside).
    assert plain(sorted((i, r) for i, r, _ in redelivered)) == plain(sorted((i, r) for i, r, _ in delivered))
    assert third["checkpoint_id"] == "grpo-1.step_2.r1" and third["committed"]
    restored = [e.data for e in sqlite_store.read_all(0) if e.type == "TrainerRestored"]
    assert [(r["checkpoint_id"], r["claims_kept"]) for r in restored] == [
        (None, False),
        ("grpo-1.step_1", False),
    ]
    assert restored[1]["plan"]["claims_to_roll_back"] == 2  # batch 2's two groups
    async with GymClient(agent.url, "a") as client:
        assert all(n == 1 for n in (await client.debug_runs()).values())  # nothing ran twice
    report = audit_log(sqlite_store)
    assert report.ok, report.as_json()["violations"]


async def test_a_checkpoint_that_does_not_fit_the_log_is_refused_in_one_line(
    sqlite_url: str, make_agent: MakeAgent, tmp_path: Path
) -> None:
    """What NeMo RL would load but the log cannot restore to: a changed manifest, other ledger
    settings, a fresh run on a trainer id whose checkpoints the log holds; each refused at
    `_spinup` with one line, nothing left open, and the right configuration then starts."""
    agent = make_agent("a")
    results = tmp_path / "results"
    config = LedgerGymConfig(
        db_url=sqlite_url, agents={"a": agent.url}, trainer_id="grpo-1", checkpoint_dir=str(results)
    )
    gym = LedgerGym(config)
    try:
        await gym._spinup()
        await drain(gym, nemo_rows(1, 2, ["a"]))
        (results / "tmp_step_1").mkdir(parents=True)
        assert (await gym.prepare_checkpoint("step_1"))["prepared"]
        await gym.commit_checkpoint("step_1", checkpoint_dir=str(results / "tmp_step_1"))
        (results / "tmp_step_1").rename(results / "step_1")
        await gym.wait_idle(120)
    finally:
        await gym.shutdown()
    path = results / "step_1" / MANIFEST_NAME
    good = path.read_text()

    async def refused(cfg: LedgerGymConfig, says: str) -> None:
        other = LedgerGym(cfg)
        try:
            with pytest.raises(ValueError, match=says) as caught:
                await other._spinup()
            assert "\n" not in str(caught.value) and other.store is None and other.coord is None
        finally:
            await other.shutdown()

    path.write_text(good.replace('"cut_position": ', '"cut_position": 1'))
    await refused(config, "does not match its own digest")
    path.write_text(good)
    await refused(config.model_copy(update={"num_generations": 2}), "other ledger settings")
    await refused(config.model_copy(update={"trainer_id": "grpo-2"}), "saved by trainer 'grpo-1'")
    fresh = config.model_copy(update={"checkpoint_dir": str(tmp_path / "empty")})
    await refused(fresh, "the trainer loaded no checkpoint .* a fresh run takes a new ledger.trainer_id")
    named = config.model_copy(update={"checkpoint_dir": None, "restore_checkpoint": "step_9"})
    await refused(named, "'step_9' is no committed checkpoint of trainer 'grpo-1'")
    ok = LedgerGym(config.model_copy(update={"checkpoint_dir": None, "restore_checkpoint": "step_1"}))
    try:
        await ok._spinup()
    finally:
        await ok.shutdown()


async def test_a_checkpoint_on_a_branch_a_restore_abandoned_is_refused(
    sqlite_url: str, sqlite_store: EventStore, make_agent: MakeAgent, tmp_path: Path
) -> None:
    """Steps 1-4 saved as `grpo.py` does; `step_4` removed, so NeMo RL loads `step_3`: the log
    restores there (step 4's claims roll back), the rerun step 4 is delivered the same groups and
    saved again (a new `step_4`).  The old `step_4` directory, named by `restore_checkpoint`, is a
    state that trained step 4's groups on the branch that restore abandoned: it is refused in one line
    naming it and that restore, nothing left open, and the run goes on from the new `step_4` with
    nothing of step 4 delivered again."""
    agent = make_agent("a")
    results = tmp_path / "results"
    config = LedgerGymConfig(
        db_url=sqlite_url, agents={"a": agent.url}, trainer_id="grpo-1", checkpoint_dir=str(results)
    )
    batches = [nemo_rows(2, 2, ["a"], tag=f"s{step}") for step in range(1, 6)]

    async def save(gym: LedgerGym, step: int) -> dict[str, Any]:
        tmp = results / f"tmp_step_{step}"
        tmp.mkdir(parents=True)
        assert (await gym.prepare_checkpoint(f"step_{step}"))["prepared"]
        committed = await gym.commit_checkpoint(f"step_{step}", checkpoint_dir=str(tmp))
        assert committed["committed"], committed
        tmp.rename(results / f"step_{step}")
        return committed

    def tries(delivered: list[tuple[int, dict[str, Any], Any]]) -> set[str]:
        return {r["full_result"]["_ledger_rollout_id"] for _, r, _ in delivered}

    gym = LedgerGym(config)
    try:
        await gym._spinup()
        trained = []
        for step in range(1, 5):
            trained.append(tries(await drain(gym, batches[step - 1])))
            await save(gym, step)
        await gym.wait_idle(120)
    finally:
        await gym.shutdown()
    old_step_4 = tmp_path / "kept" / "step_4"
    old_step_4.parent.mkdir()
    (results / "step_4").rename(old_step_4)  # NeMo RL now loads step_3

    again = LedgerGym(config)
    try:
        await again._spinup()
        assert tries(await drain(again, batches[3])) == trained[3]  # the same tries, delivered again
        assert (await save(again, 4))["checkpoint_id"] == "grpo-1.step_4.r1"
        await again.wait_idle(120)
    finally:
        await again.shutdown()

    restored = [e.data for e in sqlite_store.read_all(0) if e.type == "TrainerRestored"]
    stale = LedgerGym(
        config.model_copy(update={"checkpoint_dir": None, "restore_checkpoint": str(old_step_4)})
    )
    try:
        with pytest.raises(ValueError) as refused:
            await stale._spinup()
        line = str(refused.value)
        assert "\n" not in line and stale.store is None and stale.coord is None
        assert "'grpo-1.step_4'" in line and "abandoned" in line, line
        assert "restore to grpo-1.step_3" in line and "grpo-1.step_4.r1" in line, line
    finally:
        await stale.shutdown()
    # The refused restore rolled nothing back.
    assert [e.data for e in sqlite_store.read_all(0) if e.type == "TrainerRestored"] == restored

    going_on = LedgerGym(config)  # the new step_4, the one NeMo RL loads
    try:
        await going_on._spinup()
        # The same rows again are the next epoch's: new tries, none of step 4's delivered again.
        assert not tries(await drain(going_on, batches[3])) & set().union(*trained)
        assert not tries(await drain(going_on, batches[4])) & set().union(*trained)
        await going_on.wait_idle(120)
    finally:
        await going_on.shutdown()
    async with GymClient(agent.url, "a") as client:
        assert all(n == 1 for n in (await client.debug_runs()).values())  # nothing ran twice
    report = audit_log(sqlite_store)
    assert report.ok, report.as_json()["violations"]
