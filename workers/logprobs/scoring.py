"""Token records in, policy logprobs out.

Where the token records live: the trainer stores a try's `/token_capture` records as one payload (the
binary form of `protocol.token_codec`) before it appends the event whose `RolloutReceipt` claims it
(`tokens`), so they exist whenever the seal exists and outlive the agent's copy, which the agent
deletes after the ACK.  A worker never talks to an agent: it reads the payload by its claim (checked
against the digest) and works on views of its arrays; no token becomes a Python object on the way to
the kernel.

Before anything is scored the records are checked against the receipt (`verify_token_records`); a
mismatch raises `TokenRecordError`, which the worker records as `LogprobsRefused` instead of scoring.

Scoring one model call: `sequence = prompt + generation`, `hidden = final_hidden(sequence[:-1])`, and
the rows at the generated positions (`len(prompt) - 1 ...`) go through the fused kernel with the
generated ids as targets.  Rows of many calls (of many tries) are concatenated into kernel launches of at
most `batch_tokens` rows; the Triton kernels are batch-invariant, so a token's logprob does not depend
on what else shares its launch (the torch fallback is not, so there each try gets launches of its own).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from eventstore.events import RolloutReceipt
from payloads.token_arrays import TokenArrays, decode_payload
from protocol.ids import capture_key
from protocol.lineage import LineageError
from protocol.token_codec import TokenCodecError
from workers.kernels import Backend, fused_linear_logprobs, resolve_backend
from workers.policy import Policy


class TokenRecordError(ValueError):
    """The token records do not match the receipt (or cannot be scored by this policy): refuse the try."""


@dataclass(frozen=True, slots=True)
class CallInput:
    """One model call, ready for the policy: ids on the device, generation-time logprobs on the host."""

    model_call_id: str
    ids: torch.Tensor  # [prompt + generation] int64
    prompt_len: int
    generation_log_probs: torch.Tensor  # [generation] float64 on the host

    @property
    def generated(self) -> int:
        return int(self.generation_log_probs.shape[0])


@dataclass(frozen=True, slots=True)
class AttemptInput:
    rollout_id: str
    attempt_index: int
    calls: list[CallInput]

    @property
    def token_count(self) -> int:
        return sum(c.generated for c in self.calls)


@dataclass(frozen=True, slots=True)
class AttemptScore:
    rollout_id: str
    attempt_index: int
    logprobs: torch.Tensor  # [token_count] fp32 on the host, calls in record order
    logprob_sum: float
    max_abs_diff: float
    mean_abs_diff: float

    @property
    def token_count(self) -> int:
        return int(self.logprobs.shape[0])

    @property
    def non_finite(self) -> int:
        """Tokens the policy scored NaN or infinite (a diverged policy, or a masked vocabulary entry):
        such a score has no place in the log or a batch.  Its float64 sum is finite exactly when every
        value is (float32 values cannot overflow it)."""
        if math.isfinite(self.logprob_sum):
            return 0
        return int((~torch.isfinite(self.logprobs)).sum().item())

    def array_bytes(self) -> bytes:
        return encode_logprobs(self.logprobs)


def encode_logprobs(logprobs: torch.Tensor) -> bytes:
    """The stored array: the try's logprobs as little-endian float32, calls in record order."""
    return np.ascontiguousarray(logprobs.detach().cpu().float().numpy(), dtype="<f4").tobytes()


def decode_logprobs(content: bytes) -> torch.Tensor:
    if len(content) % 4:
        raise ValueError(f"a logprob array is a multiple of 4 bytes, got {len(content)}")
    return torch.from_numpy(np.frombuffer(content, dtype="<f4").astype(np.float32))


def verify_token_records(
    content: bytes | None, media_type: str, receipt: RolloutReceipt, rollout_id: str, attempt_index: int
) -> TokenArrays:
    """The try's token records as arrays, or `TokenRecordError` naming the first mismatch with its
    receipt.  `content` is the payload as the plane returned it (already checked against its digest)."""
    if (receipt.rollout_id, receipt.attempt_index) != (rollout_id, attempt_index):
        raise TokenRecordError(
            f"receipt is for try ({receipt.rollout_id}, {receipt.attempt_index}), "
            f"the sealed try is ({rollout_id}, {attempt_index})"
        )
    key = capture_key(rollout_id, attempt_index)
    if receipt.capture_key != key:
        raise TokenRecordError(f"receipt names capture key {receipt.capture_key!r}, the try's is {key!r}")
    if content is None:
        raise TokenRecordError(f"token records {receipt.tokens_digest} are not stored")
    try:
        records = decode_payload(bytearray(content), media_type, check_canonical=False)
    except TokenCodecError as exc:
        raise TokenRecordError(f"token records do not decode: {exc}") from None
    if not len(records):
        raise TokenRecordError("the token record list is empty")
    for record in records.records:
        if record.get("rollout_id") != key:
            raise TokenRecordError(
                f"token record of call {record.get('model_call_id')!r} names capture key "
                f"{record.get('rollout_id')!r}, the try's is {key!r}"
            )
    call_ids = records.model_call_ids
    if call_ids != receipt.model_call_ids:
        raise TokenRecordError(
            f"token records hold model calls {call_ids}, the receipt lists {receipt.model_call_ids}"
        )
    if call_ids[-1] != receipt.terminal_model_call_id:
        raise TokenRecordError(
            f"last token record is call {call_ids[-1]!r}, the receipt's terminal call is "
            f"{receipt.terminal_model_call_id!r}"
        )
    if records.token_count != receipt.token_count:
        raise TokenRecordError(
            f"token records hold {records.token_count} generated tokens, the receipt says {receipt.token_count}"
        )
    return records


def prepare_attempt(
    records: TokenArrays, policy: Policy, rollout_id: str, attempt_index: int, device: torch.device
) -> AttemptInput:
    """Checks the records against the policy's limits and builds the id tensors from the arrays (one
    concatenation per call; the checks are numpy's reductions)."""
    calls = []
    vocab = policy.vocab_size
    try:
        prompts = records.full_prompts()  # a delta prompt is rebuilt from its parent chain
    except LineageError as exc:
        raise TokenRecordError(str(exc)) from None
    for r, prompt in enumerate(prompts):
        call_id = records.model_call_ids[r]
        generation = records.generation(r)
        if not generation.size:
            continue  # a call that generated nothing has nothing to score
        if not prompt.size:
            raise TokenRecordError(f"call {call_id!r} has an empty prompt: its first token has no prefix")
        if prompt.size + generation.size > policy.max_seq_len:
            raise TokenRecordError(
                f"call {call_id!r} spans {prompt.size + generation.size} tokens, more than the "
                f"policy's {policy.max_seq_len}"
            )
        ids = np.concatenate([prompt, generation]).astype(np.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise TokenRecordError(
                f"call {call_id!r} has token id {bad} outside the policy's vocabulary 0..{vocab - 1}"
            )
        logprobs = records.logprobs(r).astype(np.float64)
        if not np.isfinite(logprobs).all():
            raise TokenRecordError(f"call {call_id!r} has a non-finite generation logprob")
        calls.append(
            CallInput(
                model_call_id=call_id,
                ids=torch.from_numpy(ids).to(device),
                prompt_len=int(prompt.size),
                generation_log_probs=torch.from_numpy(logprobs),
            )
        )
    return AttemptInput(rollout_id, attempt_index, calls)


def check_rows(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reference: torch.Tensor
) -> None:
    """Shapes of one launch, checked before the kernel sees them (a bad row count is a silent misalignment)."""
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden and weight must be 2-D, got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden size {hidden.shape[1]} does not match the LM head's {weight.shape[1]} "
            f"(weight shape {tuple(weight.shape)})"
        )
    if targets.dim() != 1 or targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"{hidden.shape[0]} hidden rows but targets of shape {tuple(targets.shape)}")
    if reference.dim() != 1 or reference.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"{hidden.shape[0]} hidden rows but {tuple(reference.shape)} generation logprobs to compare with"
        )


def _launches(
    tries: Sequence[AttemptInput], total: int, batch_tokens: int, backend: str
) -> list[tuple[int, int]]:
    """Row ranges of the kernel launches.

    The Triton kernels are batch-invariant, so their launches are fixed-size slices of all rows.  The
    torch fallback is not (BLAS picks other code paths for other shapes), so there each try is launched
    on its own: a try's logprobs then never depend on what else was claimed with it.
    """
    if backend == "triton":
        return [(i, min(i + batch_tokens, total)) for i in range(0, total, batch_tokens)]
    ranges: list[tuple[int, int]] = []
    start = 0
    for attempt in tries:
        end = start + attempt.token_count
        ranges.extend((i, min(i + batch_tokens, end)) for i in range(start, end, batch_tokens))
        start = end
    return ranges


def score_attempts(
    tries: Sequence[AttemptInput],
    policy: Policy,
    *,
    batch_tokens: int = 4096,
    temperature: float = 1.0,
    backend: Backend = "auto",
) -> list[AttemptScore]:
    """Policy logprobs of every generated token of every try, with their drift from generation time.

    Every shape is checked before the first kernel launch, so a bad call fails with a `ValueError`
    and nothing half-scored.
    """
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    weight = policy.lm_head_weight.contiguous()
    bias = policy.lm_head_bias
    rows: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    references: list[torch.Tensor] = []
    for attempt in tries:
        for call in attempt.calls:
            if not 1 <= call.prompt_len < call.ids.shape[0]:
                raise ValueError(
                    f"call {call.model_call_id!r}: prompt length {call.prompt_len} does not fit a sequence of "
                    f"{call.ids.shape[0]} ids"
                )
            hidden = policy.final_hidden(call.ids[:-1])
            start = call.prompt_len - 1
            call_rows = hidden[start : start + call.generated]
            call_targets = call.ids[call.prompt_len :]
            reference = call.generation_log_probs
            check_rows(call_rows, weight, call_targets, reference)
            rows.append(call_rows)
            targets.append(call_targets)
            references.append(reference)

    flat = torch.empty(0, dtype=torch.float32)
    if rows:
        all_rows = torch.cat(rows)
        all_targets = torch.cat(targets)
        outputs = [
            fused_linear_logprobs(
                all_rows[i:j].contiguous(),
                weight,
                all_targets[i:j].contiguous(),
                temperature=temperature,
                bias=bias,
                backend=backend,
            )
            .float()
            .cpu()
            for i, j in _launches(
                tries, all_rows.shape[0], batch_tokens, resolve_backend(backend, weight.device)
            )
        ]
        flat = torch.cat(outputs)
    reference_all = torch.cat(references) if references else torch.empty(0, dtype=torch.float64)

    scores = []
    cursor = 0
    for attempt in tries:
        n = attempt.token_count
        logprobs = flat[cursor : cursor + n].clone()
        diff = (logprobs.double() - reference_all[cursor : cursor + n]).abs()
        cursor += n
        scores.append(
            AttemptScore(
                rollout_id=attempt.rollout_id,
                attempt_index=attempt.attempt_index,
                logprobs=logprobs,
                logprob_sum=float(logprobs.double().sum().item()),
                max_abs_diff=float(diff.max().item()) if n else 0.0,
                mean_abs_diff=float(diff.mean().item()) if n else 0.0,
            )
        )
    return scores
