"""Kernel (a): logprob of a target token from materialised logits, one row per program.

Each program streams one row of ``logits[T, V]`` in ``BLOCK_V`` chunks and keeps a running
``(max, sum of exp, sum of exp * (x - max))`` in fp32 (an online log-sum-exp), so the row is read
exactly once whatever the input dtype. The target logit is a single scalar load.

Why one row per program: the kernel is memory-bound (reading bf16 logits), a row is a natural unit of
independent work, and it makes batch invariance trivial -- a row's result depends only on that row and
on ``BLOCK_V``, which is a function of ``V`` alone, never of ``T`` or of the neighbouring rows.

Why a scalar running max (one ``tl.max`` per block) rather than per-lane accumulators: per-lane
accumulators need two exponentials per element (rescale + term), and at H200 bandwidth the special
function units, not HBM, would then be the bottleneck.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from workers.kernels.validate import Temperature, temperature_per_row


@dataclass(frozen=True)
class LogitsConfig:
    """Launch configuration. Must not depend on ``T`` (batch invariance); may depend on ``V``."""

    block_v: int
    num_warps: int = 8


def default_logits_config(vocab_size: int, interpreted: bool) -> LogitsConfig:
    """GPU: 4K-wide chunks (16 elements per thread at 8 warps, i.e. two 16-byte loads in bf16; a
    starting point, not tuned on hardware). Interpreter: very wide chunks, because each interpreted op
    has a fixed Python overhead and numpy is fast on big arrays."""
    cap = 32768 if interpreted else 4096
    return LogitsConfig(block_v=min(cap, triton.next_power_of_2(vocab_size)))


def _logprobs_from_logits_kernel(  # type: ignore[no-untyped-def]  # Triton values, not Python types
    logits_ptr,
    targets_ptr,
    temp_ptr,
    logp_ptr,
    entropy_ptr,
    num_tokens,
    vocab_size,
    BLOCK_V: tl.constexpr,
    RETURN_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * V overflows int32 at real sizes (16k x 152k)
    row_ptr = logits_ptr + row * vocab_size
    temp = tl.load(temp_ptr + row)
    offs = tl.arange(0, BLOCK_V)

    # The running max starts at -inf, not 0: starting at 0 silently breaks on all-negative rows.
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    # ent_acc = sum exp(x - m) * (x - m), kept relative to the running max so that a large common
    # offset (+1e4 on every logit) does not cancel catastrophically in lse - E[x].
    ent_acc = tl.zeros((), tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + offs
        mask = cols < vocab_size
        x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32) / temp
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # A block that is entirely -inf (masked tail or -inf logits) leaves m_new at -inf; shift by 0
        # instead so exp(-inf - (-inf)) does not produce NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(x - m_safe)
        if RETURN_ENTROPY:
            # Zero the shifted logit of -inf entries before multiplying, so 0 * -inf never happens.
            xc = tl.where(x != float("-inf"), x - m_safe, 0.0)
            delta = tl.where(m == float("-inf"), 0.0, m - m_safe)
            ent_acc = alpha * (ent_acc + delta * s) + tl.sum(p * xc, axis=0)
        s = s * alpha + tl.sum(p, axis=0)
        m = m_new

    target = tl.load(targets_ptr + row).to(tl.int64)
    x_t = tl.load(row_ptr + target).to(tl.float32) / temp
    log_s = tl.log(s)
    # (x_t - m) - log s, not x_t - (m + log s): with a large common offset (+1e4) the lse rounds at
    # 1e-3 granularity in fp32, while x_t - m is exact (both within a factor of 2 of each other).
    logp = tl.minimum((x_t - m) - log_s, 0.0)
    tl.store(logp_ptr + row, logp)
    if RETURN_ENTROPY:
        tl.store(entropy_ptr + row, log_s - ent_acc / s)


@dataclass(frozen=True)
class JitKernel:
    fn: Any
    interpreted: bool


@functools.cache
def jit_kernel() -> JitKernel:
    """Decorate on first use, not at import: ``triton.jit`` decides between the compiler and the CPU
    interpreter from ``TRITON_INTERPRET`` at decoration time, and importing ``workers.kernels`` early
    (before a test conftest sets the variable) must not freeze that choice."""
    interpreted = bool(triton.knobs.runtime.interpret)
    # num_tokens is not specialised: one compiled kernel for every T, so nothing about a row's code
    # path can depend on the batch size.
    fn = triton.jit(do_not_specialize=["num_tokens"])(_logprobs_from_logits_kernel)
    return JitKernel(fn=fn, interpreted=interpreted)


def logprobs_from_logits_triton(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = 1.0,
    return_entropy: bool = False,
    config: LogitsConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch kernel (a) on already-validated inputs.

    Returns ``(logprobs [T] fp32, entropy [T] fp32 or None)``. ``config`` is for tests and tuning; the
    default depends only on ``V`` so results are batch-invariant.
    """
    kernel = jit_kernel()
    if logits.device.type == "cpu" and not kernel.interpreted:
        raise ValueError(
            "Triton kernels were compiled for a GPU (TRITON_INTERPRET was not set when they were first "
            "used); CPU tensors need backend='torch' or TRITON_INTERPRET=1 before the first launch"
        )
    num_tokens, vocab_size = logits.shape
    cfg = config if config is not None else default_logits_config(vocab_size, kernel.interpreted)
    temp = temperature_per_row(temperature, num_tokens, logits.device)
    logp = torch.empty(num_tokens, dtype=torch.float32, device=logits.device)
    # The entropy pointer is never dereferenced when RETURN_ENTROPY is off; pass logp to avoid an alloc.
    entropy = torch.empty_like(logp) if return_entropy else None
    kernel.fn[(num_tokens,)](
        logits,
        targets,
        temp,
        logp,
        entropy if entropy is not None else logp,
        num_tokens,
        vocab_size,
        BLOCK_V=cfg.block_v,
        RETURN_ENTROPY=return_entropy,
        num_warps=cfg.num_warps,
        # Explicit (Triton 3.9 warns when it is left to the default): contraction into FMA changes
        # rounding, but the same code runs for every row, so results stay deterministic.
        enable_fp_fusion=True,
    )
    return logp, entropy
