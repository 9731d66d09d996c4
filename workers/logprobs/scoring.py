"""Token records in, policy logprobs out.

Where the token records live: the trainer copies a try's `/token_capture` list into the log's
content-addressed blob table (canonical JSON of the `TokenEntry` dumps, under `tokens_digest` of the
try's `RolloutReceipt`) in the same transaction as the event that carries the receipt.  They therefore
exist exactly when the seal exists and outlive the agent's copy, which the agent deletes after the ACK.
A worker never talks to an agent.

Before anything is scored the records are checked against the receipt (`verify_token_records`); a
mismatch raises `TokenRecordError`, which the worker records as `LogprobsRefused` instead of scoring.

Scoring one model call: `sequence = prompt + generation`, `hidden = final_hidden(sequence[:-1])`, and
the rows at the generated positions (`len(prompt) - 1 ...`) go through the fused kernel with the
generated ids as targets.  Rows of many calls (of many tries) are concatenated into kernel launches of at
most `batch_tokens` rows; the Triton kernels are batch-invariant, so a token's logprob does not depend
on what else shares its launch (the torch fallback is not, so there each try gets launches of its own).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from pydantic import TypeAdapter, ValidationError

from eventstore.events import RolloutReceipt
from protocol.digests import sha256_digest
from protocol.ids import capture_key
from protocol.lineage import LineageError, full_prompts
from protocol.wire import TokenEntry
from workers.kernels import Backend, fused_linear_logprobs, resolve_backend
from workers.policy import Policy

LOGPROBS_MEDIA_TYPE = "application/vnd.rollout-ledger.logprobs+float32-le"
_TOKEN_LIST = TypeAdapter(list[TokenEntry])


class TokenRecordError(ValueError):
    """The token records do not match the receipt (or cannot be scored by this policy): refuse the try."""


@dataclass(frozen=True, slots=True)
class CallInput:
    """One model call, ready for the policy: ids on the device, generation-time logprobs on the host."""

    model_call_id: str
    ids: torch.Tensor  # [prompt + generation] int64
    prompt_len: int
    generation_log_probs: list[float]

    @property
    def generated(self) -> int:
        return len(self.generation_log_probs)


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
    blob: bytes | None, receipt: RolloutReceipt, rollout_id: str, attempt_index: int
) -> list[TokenEntry]:
    """The try's token records, parsed, or `TokenRecordError` naming the first mismatch with its receipt."""
    if (receipt.rollout_id, receipt.attempt_index) != (rollout_id, attempt_index):
        raise TokenRecordError(
            f"receipt is for try ({receipt.rollout_id}, {receipt.attempt_index}), "
            f"the sealed try is ({rollout_id}, {attempt_index})"
        )
    key = capture_key(rollout_id, attempt_index)
    if receipt.capture_key != key:
        raise TokenRecordError(f"receipt names capture key {receipt.capture_key!r}, the try's is {key!r}")
    if blob is None:
        raise TokenRecordError(f"token records {receipt.tokens_digest} are not in the blob table")
    actual = sha256_digest(blob)
    if actual != receipt.tokens_digest:
        raise TokenRecordError(
            f"token records stored under {receipt.tokens_digest} hash to {actual}: the blob was altered"
        )
    try:
        records = _TOKEN_LIST.validate_python(json.loads(blob))
    except (ValueError, ValidationError) as exc:  # JSONDecodeError is a ValueError
        raise TokenRecordError(f"token records do not parse as a TokenEntry list: {exc}") from None
    if not records:
        raise TokenRecordError("the token record list is empty")
    for record in records:
        if record.rollout_id != key:
            raise TokenRecordError(
                f"token record of call {record.model_call_id!r} names capture key {record.rollout_id!r}, "
                f"the try's is {key!r}"
            )
    call_ids = [r.model_call_id for r in records]
    if call_ids != receipt.model_call_ids:
        raise TokenRecordError(
            f"token records hold model calls {call_ids}, the receipt lists {receipt.model_call_ids}"
        )
    if call_ids[-1] != receipt.terminal_model_call_id:
        raise TokenRecordError(
            f"last token record is call {call_ids[-1]!r}, the receipt's terminal call is "
            f"{receipt.terminal_model_call_id!r}"
        )
    count = sum(len(r.generation_token_ids) for r in records)
    if count != receipt.token_count:
        raise TokenRecordError(
            f"token records hold {count} generated tokens, the receipt says {receipt.token_count}"
        )
    return records


def prepare_attempt(
    records: Sequence[TokenEntry], policy: Policy, rollout_id: str, attempt_index: int, device: torch.device
) -> AttemptInput:
    """Checks the records against the policy's limits and builds the id tensors."""
    calls = []
    vocab = policy.vocab_size
    try:
        prompts = full_prompts(records)  # a delta prompt is rebuilt from its parent chain
    except LineageError as exc:
        raise TokenRecordError(str(exc)) from None
    for record, prompt in zip(records, prompts, strict=True):
        generation = record.generation_token_ids
        if not generation:
            continue  # a call that generated nothing has nothing to score
        if not prompt:
            raise TokenRecordError(
                f"call {record.model_call_id!r} has an empty prompt: its first token has no prefix"
            )
        if len(prompt) + len(generation) > policy.max_seq_len:
            raise TokenRecordError(
                f"call {record.model_call_id!r} spans {len(prompt) + len(generation)} tokens, more than the "
                f"policy's {policy.max_seq_len}"
            )
        ids = prompt + generation
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise TokenRecordError(
                f"call {record.model_call_id!r} has token id {bad[0]} outside the policy's vocabulary 0..{vocab - 1}"
            )
        if not all(math.isfinite(v) for v in record.generation_log_probs):
            raise TokenRecordError(f"call {record.model_call_id!r} has a non-finite generation logprob")
        calls.append(
            CallInput(
                model_call_id=record.model_call_id,
                ids=torch.tensor(ids, dtype=torch.long, device=device),
                prompt_len=len(prompt),
                generation_log_probs=list(record.generation_log_probs),
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
            reference = torch.tensor(call.generation_log_probs, dtype=torch.float64)
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
