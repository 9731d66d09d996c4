"""Plain PyTorch references for the logprob kernels.

These are the test oracle and the CPU fallback. They do what most RL frameworks do: materialise the
logits in fp32, ``log_softmax``, gather. That costs ``4 * T * V`` bytes (10 GB at 16,384 tokens and a
151,936 vocabulary), which is exactly what the Triton kernels avoid; ``fused_linear_logprobs_torch``
therefore takes an optional ``chunk_size`` that bounds the materialised block to ``chunk_size x V``.

Conventions shared with the kernels (so results are comparable bit-for-bit where the maths allows):

* logits are upcast to fp32 before anything else; the bias is added after the matmul, then the row
  is divided by its fp32 temperature (scalars are broadcast to a ``[T]`` fp32 tensor first);
* logprobs are clamped to ``<= 0`` (rounding can make ``x_t - lse`` a hair positive when one token
  takes all the mass);
* entropy is ``-sum(p * log p)`` computed from ``log_softmax`` so a large common offset (+1e4) does not
  cancel catastrophically; ``p * log p`` is taken as 0 where ``p == 0`` (logits at ``-inf``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, overload

import torch

from workers.kernels.validate import Temperature, temperature_per_row


def _logprobs_from_fp32_logits(
    x: torch.Tensor, targets: torch.Tensor, return_entropy: bool, compute_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # The logits themselves are always rounded to fp32 first (as in the kernels); compute_dtype only
    # changes the precision of the softmax reduction. fp32 is the fallback; the tests use fp64 because
    # a CPU fp32 log_softmax over 256k entries is itself off by ~4e-5, more than the kernels are.
    log_probs = torch.log_softmax(x.to(compute_dtype), dim=-1)
    logp = log_probs.gather(1, targets.long().unsqueeze(1)).squeeze(1).clamp(max=0.0)
    if not return_entropy:
        return logp.float(), None
    plogp = torch.where(torch.isneginf(log_probs), 0.0, log_probs.exp() * log_probs)
    return logp.float(), (-plogp.sum(dim=-1)).float()


def _logprobs_from_logits_pair(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference for kernel (a).

    Args:
        logits: ``[T, V]`` fp32/bf16/fp16.
        targets: ``[T]`` integer token ids in ``[0, V)``.
        temperature: positive scalar or ``[T]`` tensor; logits are divided by it.
        return_entropy: also return the entropy of each row's distribution.
        chunk_size: if set, rows are processed ``chunk_size`` at a time so at most ``chunk_size x V``
            fp32 logits exist at once (the CPU fallback uses this).
        compute_dtype: precision of the softmax reduction (fp32 for the fallback, fp64 for the tests).

    Returns:
        ``(logprobs [T] fp32, entropy [T] fp32 or None)``.
    """
    num_tokens = logits.shape[0]
    temp = temperature_per_row(temperature, num_tokens, logits.device)
    return _chunked(
        lambda start, stop: logits[start:stop].float() / temp[start:stop].unsqueeze(1),
        targets,
        return_entropy,
        chunk_size,
        compute_dtype,
    )


def _chunked(
    make_logits: Callable[[int, int], torch.Tensor],
    targets: torch.Tensor,
    return_entropy: bool,
    chunk_size: int | None,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    num_tokens = targets.shape[0]
    step = num_tokens if chunk_size is None else max(1, chunk_size)
    logps: list[torch.Tensor] = []
    ents: list[torch.Tensor] = []
    for start in range(0, num_tokens, step):
        stop = min(start + step, num_tokens)
        # Each chunk's logits die at the end of the iteration, before the next chunk is allocated.
        logp, ent = _logprobs_from_fp32_logits(
            make_logits(start, stop), targets[start:stop], return_entropy, compute_dtype
        )
        logps.append(logp)
        if ent is not None:
            ents.append(ent)
    logp_all = logps[0] if len(logps) == 1 else torch.cat(logps)
    if not return_entropy:
        return logp_all, None
    return logp_all, ents[0] if len(ents) == 1 else torch.cat(ents)


def _fused_linear_logprobs_pair(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = 1.0,
    bias: torch.Tensor | None = None,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference for kernel (b): ``logits = hidden @ weight.T (+ bias)`` materialised in fp32.

    Args:
        hidden: ``[T, H]``; weight: ``[V, H]``; bias: optional ``[V]``.
        targets, temperature, return_entropy: as in :func:`logprobs_from_logits_torch`.
        chunk_size: if set, rows are processed ``chunk_size`` at a time so at most
            ``chunk_size x V`` fp32 logits exist at once (the CPU fallback uses this). ``None``
            materialises all ``T x V`` logits, the baseline the kernels are measured against.

    Returns:
        ``(logprobs [T] fp32, entropy [T] fp32 or None)``.
    """
    num_tokens = hidden.shape[0]
    temp = temperature_per_row(temperature, num_tokens, hidden.device)
    w = weight.float()
    b = None if bias is None else bias.float()

    def make_logits(start: int, stop: int) -> torch.Tensor:
        x = hidden[start:stop].float() @ w.T
        if b is not None:
            x = x + b
        return x / temp[start:stop].unsqueeze(1)

    return _chunked(make_logits, targets, return_entropy, chunk_size, compute_dtype)


LogprobResult = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def pack_result(logp: torch.Tensor, entropy: torch.Tensor | None) -> LogprobResult:
    """Public return convention: a ``[T]`` tensor, or ``(logprobs, entropy)`` when entropy was asked for."""
    return logp if entropy is None else (logp, entropy)


@overload
def logprobs_from_logits_torch(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = ...,
    return_entropy: Literal[False] = ...,
    *,
    chunk_size: int | None = ...,
    compute_dtype: torch.dtype = ...,
) -> torch.Tensor: ...
@overload
def logprobs_from_logits_torch(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature,
    return_entropy: Literal[True],
    *,
    chunk_size: int | None = ...,
    compute_dtype: torch.dtype = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def logprobs_from_logits_torch(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = ...,
    *,
    return_entropy: Literal[True],
    chunk_size: int | None = ...,
    compute_dtype: torch.dtype = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
def logprobs_from_logits_torch(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = 1.0,
    return_entropy: bool = False,
    *,
    chunk_size: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> LogprobResult:
    """Reference for kernel (a); returns logprobs ``[T]`` or ``(logprobs, entropy)``.

    See :func:`_logprobs_from_logits_pair` for the arguments. No validation here; the public
    wrappers in ``workers.kernels`` validate first.
    """
    return pack_result(
        *_logprobs_from_logits_pair(logits, targets, temperature, return_entropy, chunk_size, compute_dtype)
    )


@overload
def fused_linear_logprobs_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = ...,
    bias: torch.Tensor | None = ...,
    return_entropy: Literal[False] = ...,
    chunk_size: int | None = ...,
    *,
    compute_dtype: torch.dtype = ...,
) -> torch.Tensor: ...
@overload
def fused_linear_logprobs_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature,
    bias: torch.Tensor | None,
    return_entropy: Literal[True],
    chunk_size: int | None = ...,
    *,
    compute_dtype: torch.dtype = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def fused_linear_logprobs_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = ...,
    bias: torch.Tensor | None = ...,
    *,
    return_entropy: Literal[True],
    chunk_size: int | None = ...,
    compute_dtype: torch.dtype = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
def fused_linear_logprobs_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = 1.0,
    bias: torch.Tensor | None = None,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> LogprobResult:
    """Reference for kernel (b); returns logprobs ``[T]`` or ``(logprobs, entropy)``.

    See :func:`_fused_linear_logprobs_pair` for the arguments.
    """
    return pack_result(
        *_fused_linear_logprobs_pair(
            hidden, weight, targets, temperature, bias, return_entropy, chunk_size, compute_dtype
        )
    )
