"""Logprob kernels for the logprob workers.

Public API::

    from workers.kernels import logprobs_from_logits, fused_linear_logprobs

    logp = logprobs_from_logits(logits, targets)                          # [T] fp32
    logp, ent = logprobs_from_logits(logits, targets, 0.7, return_entropy=True)
    logp = fused_linear_logprobs(hidden, weight, targets, temperature=t_per_row, bias=None)

Both return a ``[T]`` fp32 tensor of ``log p(target)`` (clamped to ``<= 0``), or a ``(logprobs,
entropy)`` pair of ``[T]`` fp32 tensors when ``return_entropy=True``. Inputs may be fp32, bf16 or
fp16; accumulation is always fp32. Bad inputs raise ``ValueError`` before anything is launched (see
:mod:`workers.kernels.validate`: empty and non-contiguous inputs are refused).

``backend``:

* ``"triton"``: the Triton kernels. On CUDA tensors they are compiled; on CPU tensors they need
  ``TRITON_INTERPRET=1`` (Triton's interpreter, slow, for tests) set before their first use.
* ``"torch"``: the PyTorch reference, which materialises fp32 logits ``chunk`` rows at a time
  (at most ~256 MB of fp32 logits per chunk). Its rows are not guaranteed bit-batch-invariant: that
  depends on the BLAS the matmul lands in.
* ``"auto"`` (default): Triton for CUDA tensors, and for CPU tensors when ``TRITON_INTERPRET=1``;
  otherwise the torch reference.

The Triton modules are ``workers.kernels.logprobs_from_logits`` and
``workers.kernels.fused_linear_logprobs``; they are imported here first so the public functions
below take the package attribute of the same name (use ``from workers.kernels.<module> import ...``
to reach module contents).
"""

from __future__ import annotations

import os
from typing import Literal, overload

import torch

from workers.kernels.reference import (
    LogprobResult,
    _fused_linear_logprobs_pair,
    _logprobs_from_logits_pair,
    fused_linear_logprobs_torch,
    logprobs_from_logits_torch,
    pack_result,
)
from workers.kernels.validate import Temperature, validate_fused_inputs, validate_logits_inputs

try:  # Triton is optional at import time (e.g. macOS); the torch backend works without it.
    from workers.kernels import fused_linear_logprobs as _fused_module
    from workers.kernels import logprobs_from_logits as _logits_module

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - triton is installed wherever the tests run
    TRITON_AVAILABLE = False

__all__ = [
    "Backend",
    "LogprobResult",
    "fused_linear_logprobs",
    "fused_linear_logprobs_torch",
    "logprobs_from_logits",
    "logprobs_from_logits_torch",
    "resolve_backend",
]

Backend = Literal["auto", "triton", "torch"]

# Bound on the fp32 logits the torch fallback materialises at once.
_TORCH_CHUNK_BYTES = 256 << 20


def _interpret_requested() -> bool:
    if TRITON_AVAILABLE:
        import triton

        return bool(triton.knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_backend(backend: str, device: torch.device) -> Literal["triton", "torch"]:
    """Pick the implementation for tensors on ``device``; raise ``ValueError`` if it cannot run there."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "torch":
        return "torch"
    triton_can_run = TRITON_AVAILABLE and (device.type == "cuda" or _interpret_requested())
    if backend == "auto":
        return "triton" if triton_can_run else "torch"
    if not TRITON_AVAILABLE:
        raise ValueError("backend='triton' but triton is not importable")
    if not triton_can_run:
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {device.type}) or TRITON_INTERPRET=1 for the "
            "CPU interpreter"
        )
    return "triton"


def _torch_chunk_rows(vocab_size: int) -> int:
    return max(1, _TORCH_CHUNK_BYTES // (4 * vocab_size))


@overload
def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = ...,
    return_entropy: Literal[False] = ...,
    *,
    backend: Backend = ...,
) -> torch.Tensor: ...
@overload
def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature,
    return_entropy: Literal[True],
    *,
    backend: Backend = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = ...,
    *,
    return_entropy: Literal[True],
    backend: Backend = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = 1.0,
    return_entropy: bool = False,
    *,
    backend: Backend = "auto",
) -> LogprobResult:
    """``log softmax(logits / temperature)[t, targets[t]]`` for every row, in one pass over the logits.

    Args:
        logits: ``[T, V]`` contiguous fp32/bf16/fp16.
        targets: ``[T]`` int64/int32 token ids in ``[0, V)``.
        temperature: positive number, or a ``[T]`` tensor with one temperature per row.
        return_entropy: also return each row's entropy ``-sum p log p`` (nats).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see the module docstring).

    Returns:
        ``[T]`` fp32 logprobs (``<= 0``), or ``(logprobs, entropy)`` when ``return_entropy``.

    Raises:
        ValueError: bad shapes, dtypes, devices, targets, temperatures, empty or non-contiguous inputs,
            or a backend that cannot run on these tensors.
    """
    problem = validate_logits_inputs(logits, targets, temperature)
    if resolve_backend(backend, logits.device) == "triton":
        return pack_result(
            *_logits_module.logprobs_from_logits_triton(logits, targets, temperature, return_entropy)
        )
    return pack_result(
        *_logprobs_from_logits_pair(
            logits, targets, temperature, return_entropy, chunk_size=_torch_chunk_rows(problem.vocab_size)
        )
    )


@overload
def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = ...,
    bias: torch.Tensor | None = ...,
    return_entropy: Literal[False] = ...,
    *,
    backend: Backend = ...,
) -> torch.Tensor: ...
@overload
def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature,
    bias: torch.Tensor | None,
    return_entropy: Literal[True],
    *,
    backend: Backend = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = ...,
    bias: torch.Tensor | None = ...,
    *,
    return_entropy: Literal[True],
    backend: Backend = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = 1.0,
    bias: torch.Tensor | None = None,
    return_entropy: bool = False,
    *,
    backend: Backend = "auto",
) -> LogprobResult:
    """Logprob of each target under ``softmax((hidden @ weight.T + bias) / temperature)``.

    The Triton backend never materialises the ``[T, V]`` logits: extra memory is ``O(T)`` (bounded by
    a 32 MB workspace). It is deterministic and batch-invariant: a token's result is bit-identical
    whatever else is in the batch and however the batch is chunked.

    Args:
        hidden: ``[T, H]`` final hidden states, contiguous fp32/bf16/fp16.
        weight: ``[V, H]`` LM-head weight, same dtype and device as ``hidden``.
        targets: ``[T]`` int64/int32 token ids in ``[0, V)``.
        temperature: positive number, or a ``[T]`` tensor with one temperature per row.
        bias: optional ``[V]`` LM-head bias.
        return_entropy: also return each row's entropy ``-sum p log p`` (nats).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see the module docstring).

    Returns:
        ``[T]`` fp32 logprobs (``<= 0``), or ``(logprobs, entropy)`` when ``return_entropy``.

    Raises:
        ValueError: bad shapes, dtypes, devices, targets, temperatures, empty or non-contiguous inputs,
            or a backend that cannot run on these tensors.
    """
    problem = validate_fused_inputs(hidden, weight, targets, temperature, bias)
    if resolve_backend(backend, hidden.device) == "triton":
        return pack_result(
            *_fused_module.fused_linear_logprobs_triton(
                hidden, weight, targets, temperature, bias, return_entropy
            )
        )
    return pack_result(
        *_fused_linear_logprobs_pair(
            hidden,
            weight,
            targets,
            temperature,
            bias,
            return_entropy,
            chunk_size=_torch_chunk_rows(problem.vocab_size),
        )
    )
