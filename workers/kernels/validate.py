"""Input checks shared by every backend of the logprob kernels.

Everything here runs before any kernel launch, so a bad call fails with a ``ValueError`` that names the
argument instead of an out-of-bounds read inside a kernel (which on a GPU is a silent garbage result or
an asynchronous illegal-address error reported far from its cause).

Decisions (documented here because callers rely on them):

* Empty inputs (``T == 0``, ``V == 0`` or ``H == 0``) are refused: a logprob over an empty vocabulary
  is undefined and an empty batch is almost always an upstream bug in the worker.
* Non-contiguous tensors are refused rather than silently copied: a hidden ``.contiguous()`` on a
  ``[T, V]`` logits view would allocate exactly the ``T x V`` buffer the kernels exist to avoid.
* Target ids must be an integer tensor in ``[0, V)``. Checking the range costs one small reduction and
  a host sync; it is worth it because an out-of-range id is an out-of-bounds load in the kernel.
* Temperature is a positive finite Python number, a 0-d tensor, or a ``[T]`` tensor (one per row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
TARGET_DTYPES: tuple[torch.dtype, ...] = (torch.int64, torch.int32)

Temperature = float | torch.Tensor


@dataclass(frozen=True)
class LogitsProblem:
    """Validated shape of a ``logprobs_from_logits`` call."""

    num_tokens: int
    vocab_size: int


@dataclass(frozen=True)
class FusedProblem:
    """Validated shape of a ``fused_linear_logprobs`` call."""

    num_tokens: int
    hidden_size: int
    vocab_size: int


def _check_float_tensor(name: str, t: object, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype must be one of float32/bfloat16/float16, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()}); "
            "call .contiguous() explicitly if the copy is intended"
        )
    return t


def _check_targets(targets: object, num_tokens: int, vocab_size: int, device: torch.device) -> None:
    if not isinstance(targets, torch.Tensor):
        raise ValueError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    if targets.dim() != 1:
        raise ValueError(f"targets must be 1-D [T], got shape {tuple(targets.shape)}")
    if targets.dtype not in TARGET_DTYPES:
        raise ValueError(f"targets dtype must be int64 or int32, got {targets.dtype}")
    if targets.shape[0] != num_tokens:
        raise ValueError(f"targets has {targets.shape[0]} entries but there are {num_tokens} tokens")
    if targets.device != device:
        raise ValueError(f"targets is on {targets.device} but the inputs are on {device}")
    if not targets.is_contiguous():
        raise ValueError("targets must be contiguous")
    lo = int(targets.min().item())
    hi = int(targets.max().item())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"targets must lie in [0, {vocab_size}), got values in [{lo}, {hi}]")


def _check_temperature(temperature: object, num_tokens: int, device: torch.device) -> None:
    if isinstance(temperature, bool):
        raise ValueError("temperature must be a number or a tensor, not a bool")
    if isinstance(temperature, int | float):
        if not math.isfinite(temperature) or temperature <= 0:
            raise ValueError(f"temperature must be a positive finite number, got {temperature}")
        return
    if not isinstance(temperature, torch.Tensor):
        raise ValueError(f"temperature must be a float or a tensor, got {type(temperature).__name__}")
    if not temperature.is_floating_point():
        raise ValueError(f"temperature tensor must be floating point, got {temperature.dtype}")
    if temperature.dim() == 1:
        if temperature.shape[0] != num_tokens:
            raise ValueError(
                f"per-row temperature must have shape [{num_tokens}], got {tuple(temperature.shape)}"
            )
    elif temperature.dim() != 0:
        raise ValueError(f"temperature must be a scalar or [T], got shape {tuple(temperature.shape)}")
    if temperature.device != device:
        raise ValueError(f"temperature is on {temperature.device} but the inputs are on {device}")
    if not bool(torch.isfinite(temperature).all().item()) or not bool((temperature > 0).all().item()):
        raise ValueError("temperature values must be positive and finite")


def validate_logits_inputs(logits: object, targets: object, temperature: object) -> LogitsProblem:
    """Check the arguments of ``logprobs_from_logits``; raise ``ValueError`` on the first problem."""
    x = _check_float_tensor("logits", logits, 2)
    num_tokens, vocab_size = x.shape
    if num_tokens == 0 or vocab_size == 0:
        raise ValueError(f"logits must be non-empty, got shape {tuple(x.shape)}")
    _check_targets(targets, num_tokens, vocab_size, x.device)
    _check_temperature(temperature, num_tokens, x.device)
    return LogitsProblem(num_tokens=num_tokens, vocab_size=vocab_size)


def validate_fused_inputs(
    hidden: object, weight: object, targets: object, temperature: object, bias: object
) -> FusedProblem:
    """Check the arguments of ``fused_linear_logprobs``; raise ``ValueError`` on the first problem."""
    h = _check_float_tensor("hidden", hidden, 2)
    w = _check_float_tensor("weight", weight, 2)
    num_tokens, hidden_size = h.shape
    vocab_size, w_hidden = w.shape
    if num_tokens == 0 or hidden_size == 0:
        raise ValueError(f"hidden must be non-empty, got shape {tuple(h.shape)}")
    if vocab_size == 0:
        raise ValueError(f"weight must be non-empty, got shape {tuple(w.shape)}")
    if w_hidden != hidden_size:
        raise ValueError(
            f"hidden is [T, {hidden_size}] but weight is [V, {w_hidden}]; expected weight [V, H]"
        )
    if h.dtype != w.dtype:
        raise ValueError(f"hidden ({h.dtype}) and weight ({w.dtype}) must have the same dtype")
    if h.device != w.device:
        raise ValueError(f"hidden is on {h.device} but weight is on {w.device}")
    if bias is not None:
        b = _check_float_tensor("bias", bias, 1)
        if b.shape[0] != vocab_size:
            raise ValueError(f"bias must have shape [{vocab_size}], got {tuple(b.shape)}")
        if b.device != h.device:
            raise ValueError(f"bias is on {b.device} but the inputs are on {h.device}")
    _check_targets(targets, num_tokens, vocab_size, h.device)
    _check_temperature(temperature, num_tokens, h.device)
    return FusedProblem(num_tokens=num_tokens, hidden_size=hidden_size, vocab_size=vocab_size)


def temperature_per_row(temperature: Temperature, num_tokens: int, device: torch.device) -> torch.Tensor:
    """A ``[T]`` fp32 tensor of temperatures, so kernels have a single code path for scalar and per-row."""
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(device=device, dtype=torch.float32)
        return t.expand(num_tokens).contiguous() if t.dim() == 0 else t.contiguous()
    return torch.full((num_tokens,), float(temperature), dtype=torch.float32, device=device)
