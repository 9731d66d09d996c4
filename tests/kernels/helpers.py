"""Oracles and tolerances shared by the kernel tests."""

from __future__ import annotations

import torch

from workers.kernels.reference import fused_linear_logprobs_torch, logprobs_from_logits_torch
from workers.kernels.validate import Temperature

# The kernels' promise (docs/performance.md, Logprob kernels): fp32 inputs within 1e-5 absolute of the reference, bf16/fp16 inputs within 2e-2.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def oracle_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperature: Temperature = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference with an fp64 softmax: the fp32 one is itself ~4e-5 off at a 256k vocabulary."""
    logp, ent = logprobs_from_logits_torch(
        logits.cpu(),
        targets.cpu(),
        temperature.cpu() if isinstance(temperature, torch.Tensor) else temperature,
        return_entropy=True,
        compute_dtype=torch.float64,
    )
    return logp, ent


def oracle_fused(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = 1.0,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    logp, ent = fused_linear_logprobs_torch(
        hidden.cpu(),
        weight.cpu(),
        targets.cpu(),
        temperature.cpu() if isinstance(temperature, torch.Tensor) else temperature,
        None if bias is None else bias.cpu(),
        return_entropy=True,
        compute_dtype=torch.float64,
    )
    return logp, ent


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert actual.dtype == torch.float32
    assert actual.shape == expected.shape
    diff = (actual.cpu() - expected.cpu()).abs().max().item()
    assert diff <= tol, f"max abs error {diff:.3e} > {tol:.1e}"
