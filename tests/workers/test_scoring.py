"""Scoring: the agent's own model reproduces its generation logprobs; bad shapes fail before a launch."""

from __future__ import annotations

import pytest
import torch

from eventstore.events import RolloutReceipt
from payloads.token_arrays import TokenArrays, decode_arrays
from protocol.ids import capture_key
from protocol.token_codec import TOKENS_JSON_MEDIA_TYPE, TOKENS_MEDIA_TYPE, encode_entries
from protocol.wire import TokenEntry
from tests.workers.tries import agent_records, receipt_for, records_blob
from workers.logprobs import (
    AttemptInput,
    CallInput,
    TokenRecordError,
    decode_logprobs,
    encode_logprobs,
    prepare_attempt,
    score_attempts,
    verify_token_records,
)
from workers.logprobs import scoring as scoring_module
from workers.policy import Policy

CPU = torch.device("cpu")
TRIES = [(f"sc_g{i}", i % 2) for i in range(4)]


def _inputs(policy: Policy, temperature: float = 1.0) -> tuple[list[AttemptInput], list[list[float]]]:
    inputs, generation = [], []
    for (rollout_id, attempt_index), records in zip(
        TRIES, agent_records(policy, TRIES, temperature=temperature), strict=True
    ):
        blob = records_blob(records)
        checked = verify_token_records(
            blob,
            TOKENS_MEDIA_TYPE,
            receipt_for(rollout_id, attempt_index, records, blob),
            rollout_id,
            attempt_index,
        )
        inputs.append(prepare_attempt(checked, policy, rollout_id, attempt_index, CPU))
        generation.append([v for r in records for v in r.generation_log_probs])
    return inputs, generation


def test_own_model_reproduces_generation_logprobs_and_a_changed_policy_does_not(
    policy: Policy, other_policy: Policy
) -> None:
    inputs, generation = _inputs(policy)
    # backend="auto": the Triton kernel (interpreted on the CPU under TRITON_INTERPRET=1).
    scores = score_attempts(inputs, policy, batch_tokens=24)
    for score, expected, attempt in zip(scores, generation, inputs, strict=True):
        assert score.token_count == len(expected) > 0
        assert score.max_abs_diff < 1e-4, score
        assert score.mean_abs_diff <= score.max_abs_diff
        assert bool((score.logprobs <= 0).all())
        reference = torch.cat(
            [
                policy.logprobs(c.ids[: c.prompt_len].tolist(), c.ids[c.prompt_len :].tolist())
                for c in attempt.calls
            ]
        )
        torch.testing.assert_close(score.logprobs, reference, atol=1e-5, rtol=0)
        assert score.logprob_sum == pytest.approx(float(score.logprobs.double().sum()), abs=1e-9)
        assert torch.equal(decode_logprobs(encode_logprobs(score.logprobs)), score.logprobs)

    changed = score_attempts(inputs, other_policy, batch_tokens=24, backend="torch")
    assert min(s.max_abs_diff for s in changed) > 0.5
    assert max(s.max_abs_diff for s in scores) * 1000 < min(s.max_abs_diff for s in changed)


def test_batching_does_not_change_a_bit(policy: Policy) -> None:
    # The Triton kernel is batch-invariant, so how tries share launches changes nothing at all.
    inputs, _ = _inputs(policy)
    whole = score_attempts(inputs, policy, batch_tokens=4096, backend="triton")
    split = score_attempts(inputs, policy, batch_tokens=7, backend="triton")
    alone = [score_attempts([t], policy, backend="triton")[0] for t in inputs]
    for a, b, c in zip(whole, split, alone, strict=True):
        assert torch.equal(a.logprobs, b.logprobs)
        assert torch.equal(a.logprobs, c.logprobs)


def test_scoring_at_the_agents_temperature(policy: Policy) -> None:
    inputs, _ = _inputs(policy, temperature=0.7)
    assert (
        max(s.max_abs_diff for s in score_attempts(inputs, policy, temperature=0.7, backend="torch")) < 1e-4
    )
    assert (
        min(s.max_abs_diff for s in score_attempts(inputs, policy, temperature=1.0, backend="torch")) > 1e-2
    )


@pytest.fixture
def no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> torch.Tensor:
        raise AssertionError("the kernel was launched")

    monkeypatch.setattr(scoring_module, "fused_linear_logprobs", refuse)


def _call(ids: list[int], prompt_len: int, logprobs: list[float]) -> AttemptInput:
    return AttemptInput(
        "bad_g0",
        0,
        [
            CallInput(
                "call-1",
                torch.tensor(ids, dtype=torch.long),
                prompt_len,
                torch.tensor(logprobs, dtype=torch.float64),
            )
        ],
    )


@pytest.mark.usefixtures("no_kernel")
def test_mismatched_shapes_raise_before_any_launch(policy: Policy) -> None:
    good = _call([1, 2, 3, 4], 2, [-1.0, -1.0])
    # More generation logprobs than generated ids, placed after a good try: nothing may launch.
    with pytest.raises(ValueError, match=r"2 hidden rows but \(3,\) generation logprobs"):
        score_attempts([good, _call([1, 2, 3, 4], 2, [-1.0, -1.0, -1.0])], policy)
    with pytest.raises(ValueError, match="prompt length 0"):
        score_attempts([_call([1, 2, 3], 0, [-1.0, -1.0, -1.0])], policy)
    with pytest.raises(ValueError, match="prompt length 3"):
        score_attempts([_call([1, 2, 3], 3, [])], policy)
    with pytest.raises(ValueError, match="hidden size 32 does not match the LM head's 64"):
        scoring_module.check_rows(
            torch.zeros(2, 32), policy.lm_head_weight, torch.zeros(2, dtype=torch.long), torch.zeros(2)
        )
    with pytest.raises(ValueError, match="batch_tokens"):
        score_attempts([good], policy, batch_tokens=0)


def _checked(policy: Policy) -> tuple[bytes, RolloutReceipt, list[int]]:
    records = agent_records(policy, [("vr_g0", 1)], turns=(2, 3))[0]
    blob = records_blob(records)
    return blob, receipt_for("vr_g0", 1, records, blob), [len(r.generation_token_ids) for r in records]


def test_records_that_do_not_match_the_receipt_are_refused(policy: Policy) -> None:
    blob, receipt, _ = _checked(policy)
    assert len(verify_token_records(blob, TOKENS_MEDIA_TYPE, receipt, "vr_g0", 1)) == len(
        receipt.model_call_ids
    )
    # The same records in the JSON list older logs hold read the same.
    records = agent_records(policy, [("vr_g1", 0)], turns=(2, 3))[0]
    new, old = records_blob(records), records_blob(records, legacy=True)
    read = [
        verify_token_records(b, m, receipt_for("vr_g1", 0, records, b), "vr_g1", 0)
        for b, m in ((new, TOKENS_MEDIA_TYPE), (old, TOKENS_JSON_MEDIA_TYPE))
    ]
    assert [TokenEntry.model_validate(r) for r in read[0].to_records()] == records
    assert [TokenEntry.model_validate(r) for r in read[1].to_records()] == records
    cases = {
        "capture key": receipt.model_copy(update={"capture_key": capture_key("vr_g0", 0)}),
        "model calls": receipt.model_copy(update={"model_call_ids": receipt.model_call_ids[:-1]}),
        "generated tokens": receipt.model_copy(update={"token_count": receipt.token_count + 1}),
        "terminal call": receipt.model_copy(update={"terminal_model_call_id": "call-99"}),
    }
    for needle, bad in cases.items():
        with pytest.raises(TokenRecordError, match=needle):
            verify_token_records(blob, TOKENS_MEDIA_TYPE, bad, "vr_g0", 1)
    with pytest.raises(TokenRecordError, match="receipt is for try"):
        verify_token_records(blob, TOKENS_MEDIA_TYPE, receipt, "vr_g0", 2)
    with pytest.raises(TokenRecordError, match="do not decode"):
        verify_token_records(blob[:-8], TOKENS_MEDIA_TYPE, receipt, "vr_g0", 1)
    with pytest.raises(TokenRecordError, match="are not stored"):
        verify_token_records(None, TOKENS_MEDIA_TYPE, receipt, "vr_g0", 1)
    # Records of another try, with a receipt that names them honestly: the capture key still differs.
    other = agent_records(policy, [("vr_g1", 0)])[0]
    other_blob = records_blob(other)
    with pytest.raises(TokenRecordError, match="names capture key 'vr_g1'"):
        verify_token_records(
            other_blob,
            TOKENS_MEDIA_TYPE,
            receipt_for("vr_g1", 0, other, other_blob).model_copy(
                update={"rollout_id": "vr_g0", "attempt_index": 1, "capture_key": "vr_g0-a1"}
            ),
            "vr_g0",
            1,
        )


def test_records_the_policy_cannot_score_are_refused(policy: Policy) -> None:
    records = agent_records(policy, [("vr_g0", 1)], turns=(2, 3))[0]

    def arrays(entries: list[TokenEntry]) -> TokenArrays:
        return decode_arrays(encode_entries(entries))

    out_of_vocab = arrays([
        records[0].model_copy(
            update={"generation_token_ids": [policy.vocab_size] * len(records[0].generation_token_ids)}
        )
    ])  # fmt: skip
    with pytest.raises(TokenRecordError, match="outside the policy's vocabulary"):
        prepare_attempt(out_of_vocab, policy, "vr_g0", 1, CPU)
    too_long = arrays([records[0].model_copy(update={"prompt_token_ids": [1] * policy.max_seq_len})])
    with pytest.raises(TokenRecordError, match="more than the policy's"):
        prepare_attempt(too_long, policy, "vr_g0", 1, CPU)
    no_prompt = arrays([records[0].model_copy(update={"prompt_token_ids": []})])
    with pytest.raises(TokenRecordError, match="empty prompt"):
        prepare_attempt(no_prompt, policy, "vr_g0", 1, CPU)
