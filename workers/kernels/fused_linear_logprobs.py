"""Kernel (b): logprobs (and entropy) straight from hidden states and the LM-head weight.

``logits = hidden @ weight.T (+ bias)`` is never written to global memory. The work is a grid of
(token block x vocabulary split) programs:

1. ``_fused_partials_kernel``: a program owns ``BLOCK_T`` tokens and a ``SPLIT_V``-wide slice of the
   vocabulary. It walks the slice in ``BLOCK_V`` tiles; each ``[BLOCK_T, BLOCK_V]`` tile of logits is
   produced by a K-loop of ``tl.dot`` over ``H`` (fp32 accumulation) and consumed on-chip by an online
   log-sum-exp: running max (from -inf), sum of exponentials, and optionally the entropy term
   ``sum exp(x - max) * (x - max)``. The target logit is picked up when its tile goes by. The program
   writes one ``(max, sumexp, entropy term)`` triple per token for its split: ``O(T * V / SPLIT_V)``.
2. ``_fused_reduce_kernel``: merges the splits of each token in a fixed order (a fixed-width tree over
   ``next_power_of_2(num_splits)`` lanes), no atomics.

Determinism and batch invariance: the configuration (tile sizes, split width, warps) depends on the
dtype only, never on ``T``; a token's logits come from tiles whose shapes, K order and reduction trees
are the same wherever the token sits in its tile; rows never mix (a dot product is row-separable, and
the padding rows of a ragged last tile are never stored); and splits are merged in a fixed order. So a
token's result is bit-identical whatever else is in the batch and however the batch is chunked. The
wrapper may launch over several row chunks (to cap the workspace); that is harmless for the same
reason. No ``tl.atomic_*`` anywhere.

Under Triton's CPU interpreter the tile product is a broadcast multiply + fixed-order sum instead of
``tl.dot`` (numpy's matmul is not row-position-invariant; see the kernel), unless a config asks for
``separable_dot=False``. ``tests/kernels/test_gpu_compile.py`` compiles the GPU path for sm_90 on a
CPU-only machine: at the default bf16 tiles the K loop is software-pipelined (3 stages) with wgmma and
no register spills.

Compared with the anchors: Cut Cross-Entropy merges vocabulary blocks under a spin lock (order depends
on scheduling, so sums are not reproducible); Liger's fused linear cross-entropy still materialises a
chunk of logits in global memory. This follows veRL's vocab-split + epilogue-reduction layout.
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
class FusedConfig:
    """Launch configuration. Must not depend on ``T`` (batch invariance).

    ``split_v`` must be a multiple of ``block_v``. ``max_workspace_bytes`` caps the partials buffer;
    rows beyond it are processed in further launches (results do not depend on the chunking).
    """

    block_t: int
    block_v: int
    block_h: int
    split_v: int
    group_t: int = 8
    num_warps: int = 8
    num_stages: int = 3
    reduce_block_t: int = 64
    max_workspace_bytes: int = 32 << 20
    # Interpreter only: None = row-separable product (see the kernel), False = tl.dot through numpy.
    separable_dot: bool | None = None

    def __post_init__(self) -> None:
        for name in ("block_t", "block_v", "block_h"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {value}")
        if self.split_v <= 0 or self.split_v % self.block_v:
            raise ValueError(
                f"split_v ({self.split_v}) must be a positive multiple of block_v ({self.block_v})"
            )


def default_fused_config(dtype: torch.dtype, interpreted: bool) -> FusedConfig:
    """Default tiles. GPU values are a starting point for Hopper (not yet tuned on hardware): 128x256
    output tiles with a 64-deep K step in bf16/fp16 (3 stages of (128+256)x64x2 B = 144 KB of shared
    memory); fp32 halves the K step to fit. The interpreter gets wide vocabulary tiles because every
    interpreted op has a fixed Python cost and numpy is fast on large arrays."""
    if interpreted:
        # block_t x block_h x block_v is capped at 2**20 elements by the interpreter's row-separable
        # product (Triton's maximum tensor size).
        return FusedConfig(block_t=16, block_v=4096, block_h=16, split_v=32768, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return FusedConfig(block_t=128, block_v=128, block_h=32, split_v=4096)
    return FusedConfig(block_t=128, block_v=256, block_h=64, split_v=4096)


def _fused_partials_kernel(  # type: ignore[no-untyped-def]  # Triton values, not Python types
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    targets_ptr,
    temp_ptr,
    part_m_ptr,
    part_s_ptr,
    part_e_ptr,
    x_t_ptr,
    num_tokens,
    hidden_size,
    vocab_size,
    num_splits,
    HAS_BIAS: tl.constexpr,
    RETURN_ENTROPY: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLIT_V: tl.constexpr,
    GROUP_T: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SEPARABLE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_H: tl.constexpr,
):
    # Grouped launch order (Triton matmul tutorial): programs running at the same time share a few
    # token blocks and a few vocabulary splits, so hidden and weight tiles are reused from L2.
    # Placement only; it does not change what any program computes.
    pid = tl.program_id(0)
    num_t_blocks = tl.cdiv(num_tokens, BLOCK_T)
    programs_per_group = GROUP_T * num_splits
    first_t_block = (pid // programs_per_group) * GROUP_T
    group_rows = tl.minimum(num_t_blocks - first_t_block, GROUP_T)
    pid_t = first_t_block + (pid % programs_per_group) % group_rows
    pid_s = (pid % programs_per_group) // group_rows

    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < num_tokens
    temp = tl.load(temp_ptr + rows, mask=row_mask, other=1.0)
    # int32 is enough for a token id and keeps the [BLOCK_T, BLOCK_V] comparison below in 32-bit regs.
    tgt = tl.load(targets_ptr + rows, mask=row_mask, other=-1).to(tl.int32)
    offs_h = tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_V)
    # Padding rows of the last token tile (and padding columns of the last vocabulary tile) read a
    # clamped, real row instead of taking a masked load: unmasked loads vectorise and pipeline better,
    # padding rows are never stored, padding columns are set to -inf below, and rows never mix in a
    # dot product, so this cannot change any real row's result. int64: row * H overflows int32.
    rows_ld = tl.minimum(rows, num_tokens - 1).to(tl.int64)
    a_ptrs = hidden_ptr + rows_ld[:, None] * hidden_size + offs_h[None, :]

    # The running max starts at -inf, not 0: starting at 0 silently breaks on all-negative logits.
    m = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_T,), tl.float32)
    # Entropy term relative to the running max, so a large common offset does not cancel.
    e = tl.zeros((BLOCK_T,), tl.float32)
    x_t = tl.zeros((BLOCK_T,), tl.float32)

    v_begin = pid_s * SPLIT_V
    v_end = tl.minimum(v_begin + SPLIT_V, vocab_size)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + offs_v
        col_mask = cols < vocab_size
        cols_ld = tl.minimum(cols, vocab_size - 1).to(tl.int64)
        b_ptrs = weight_ptr + cols_ld[None, :] * hidden_size + offs_h[:, None]
        acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
        for h0 in range(0, hidden_size, BLOCK_H):
            if EVEN_H:
                a = tl.load(a_ptrs + h0)
                b = tl.load(b_ptrs + h0)
            else:
                h_mask = h0 + offs_h < hidden_size
                a = tl.load(a_ptrs + h0, mask=h_mask[None, :], other=0.0)
                b = tl.load(b_ptrs + h0, mask=h_mask[:, None], other=0.0)
            if SEPARABLE_DOT:
                # CPU interpreter only. tl.dot becomes numpy's matmul there, and OpenBLAS's small-matrix
                # kernels round a row differently depending on its position in the tile, which would
                # make the batch-invariance tests test OpenBLAS. A broadcast product summed over K in
                # a fixed sequential order is the same arithmetic for every row on every machine.
                acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
            else:
                if UPCAST_DOT:
                    # Triton's CPU interpreter multiplies bf16 tiles as their raw uint16 bits; fp32 is
                    # exact here (a bf16 x bf16 product fits in fp32), so only the interpreter takes it.
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        x = tl.where(col_mask[None, :], acc / temp[:, None], float("-inf"))

        # Exactly one tile of one split holds each target; adding zeros elsewhere keeps it exact.
        x_t += tl.sum(tl.where(cols[None, :] == tgt[:, None], x, 0.0), axis=1)

        m_new = tl.maximum(m, tl.max(x, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoid -inf - -inf = NaN
        alpha = tl.exp(m - m_safe)
        p = tl.exp(x - m_safe[:, None])
        if RETURN_ENTROPY:
            xc = tl.where(x != float("-inf"), x - m_safe[:, None], 0.0)
            delta = tl.where(m == float("-inf"), 0.0, m - m_safe)
            e = alpha * (e + delta * s) + tl.sum(p * xc, axis=1)
        s = s * alpha + tl.sum(p, axis=1)
        m = m_new

    part = rows.to(tl.int64) * num_splits + pid_s
    tl.store(part_m_ptr + part, m, mask=row_mask)
    tl.store(part_s_ptr + part, s, mask=row_mask)
    if RETURN_ENTROPY:
        tl.store(part_e_ptr + part, e, mask=row_mask)
    # Only the split that holds the target writes x_t: one writer per token, no race.
    tl.store(x_t_ptr + rows, x_t, mask=row_mask & (tgt >= v_begin) & (tgt < v_end))


def _fused_reduce_kernel(  # type: ignore[no-untyped-def]  # Triton values, not Python types
    part_m_ptr,
    part_s_ptr,
    part_e_ptr,
    x_t_ptr,
    logp_ptr,
    entropy_ptr,
    num_tokens,
    num_splits,
    RETURN_ENTROPY: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < num_tokens
    rows64 = rows.to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    mask = row_mask[:, None] & (splits[None, :] < num_splits)
    offs = rows64[:, None] * num_splits + splits[None, :]

    pm = tl.load(part_m_ptr + offs, mask=mask, other=float("-inf"))
    ps = tl.load(part_s_ptr + offs, mask=mask, other=0.0)
    big_m = tl.max(pm, axis=1)
    big_m_safe = tl.where(big_m == float("-inf"), 0.0, big_m)
    scale = tl.exp(pm - big_m_safe[:, None])
    # Padding rows have no partials; give them a sum of 1 so log/divide stay finite (never stored).
    big_s = tl.where(row_mask, tl.sum(ps * scale, axis=1), 1.0)
    log_s = tl.log(big_s)
    x_t = tl.load(x_t_ptr + rows64, mask=row_mask, other=0.0)
    # (x_t - max) - log s keeps a large common offset out of the rounding (see kernel (a)).
    tl.store(logp_ptr + rows64, tl.minimum((x_t - big_m) - log_s, 0.0), mask=row_mask)
    if RETURN_ENTROPY:
        pe = tl.load(part_e_ptr + offs, mask=mask, other=0.0)
        delta = tl.where(pm == float("-inf"), 0.0, pm - big_m_safe[:, None])
        big_e = tl.sum(scale * (pe + delta * ps), axis=1)
        tl.store(entropy_ptr + rows64, log_s - big_e / big_s, mask=row_mask)


@dataclass(frozen=True)
class JitKernels:
    partials: Any
    reduce: Any
    interpreted: bool


@functools.cache
def jit_kernels() -> JitKernels:
    """Decorate on first use, not at import: ``triton.jit`` decides between the compiler and the CPU
    interpreter from ``TRITON_INTERPRET`` at decoration time, and importing ``workers.kernels`` early
    (before a test conftest sets the variable) must not freeze that choice."""
    interpreted = bool(triton.knobs.runtime.interpret)
    # num_tokens is not specialised: one compiled kernel for every T, so nothing about a row's code
    # path can depend on the batch size.
    return JitKernels(
        partials=triton.jit(do_not_specialize=["num_tokens"])(_fused_partials_kernel),
        reduce=triton.jit(do_not_specialize=["num_tokens"])(_fused_reduce_kernel),
        interpreted=interpreted,
    )


def fused_linear_logprobs_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = 1.0,
    bias: torch.Tensor | None = None,
    return_entropy: bool = False,
    config: FusedConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch kernel (b) on already-validated inputs.

    Returns ``(logprobs [T] fp32, entropy [T] fp32 or None)``. Extra global memory: the ``[T]`` outputs,
    a ``[T]`` fp32 temperature and, per launched row chunk, ``(2 or 3) x rows x num_splits + rows`` fp32
    words of partials, capped by ``config.max_workspace_bytes``. ``config`` is for tests and tuning.
    """
    kernels = jit_kernels()
    if hidden.device.type == "cpu" and not kernels.interpreted:
        raise ValueError(
            "Triton kernels were compiled for a GPU (TRITON_INTERPRET was not set when they were first "
            "used); CPU tensors need backend='torch' or TRITON_INTERPRET=1 before the first launch"
        )
    num_tokens, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    cfg = config if config is not None else default_fused_config(hidden.dtype, kernels.interpreted)
    device = hidden.device
    num_splits = triton.cdiv(vocab_size, cfg.split_v)
    words_per_row = (3 if return_entropy else 2) * num_splits + 1
    rows_cap = max(cfg.block_t, cfg.max_workspace_bytes // (4 * words_per_row) // cfg.block_t * cfg.block_t)
    chunk = min(num_tokens, rows_cap)

    temp = temperature_per_row(temperature, num_tokens, device)
    logp = torch.empty(num_tokens, dtype=torch.float32, device=device)
    entropy = torch.empty_like(logp) if return_entropy else None
    part_m = torch.empty((chunk, num_splits), dtype=torch.float32, device=device)
    part_s = torch.empty_like(part_m)
    # Never dereferenced without RETURN_ENTROPY; reuse part_s rather than allocate.
    part_e = torch.empty_like(part_m) if return_entropy else part_s
    x_t = torch.empty(chunk, dtype=torch.float32, device=device)
    upcast = kernels.interpreted and hidden.dtype == torch.bfloat16
    separable = kernels.interpreted and cfg.separable_dot is not False
    if separable and cfg.block_t * cfg.block_h * cfg.block_v > 1 << 20:
        raise ValueError(
            "interpreter tiles block_t x block_h x block_v must be <= 2**20 elements, got "
            f"{cfg.block_t} x {cfg.block_h} x {cfg.block_v}"
        )
    # fp32 inputs must not silently drop to TF32 (10-bit mantissa) on tensor cores.
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    bias_arg = bias if bias is not None else hidden  # never dereferenced without HAS_BIAS
    block_s = triton.next_power_of_2(num_splits)

    for start in range(0, num_tokens, chunk):
        rows = min(chunk, num_tokens - start)
        grid_partials = (triton.cdiv(rows, cfg.block_t) * num_splits,)
        kernels.partials[grid_partials](
            hidden[start : start + rows],
            weight,
            bias_arg,
            targets[start : start + rows],
            temp[start : start + rows],
            part_m,
            part_s,
            part_e,
            x_t,
            rows,
            hidden_size,
            vocab_size,
            num_splits,
            HAS_BIAS=bias is not None,
            RETURN_ENTROPY=return_entropy,
            BLOCK_T=cfg.block_t,
            BLOCK_V=cfg.block_v,
            BLOCK_H=cfg.block_h,
            SPLIT_V=cfg.split_v,
            GROUP_T=cfg.group_t,
            UPCAST_DOT=upcast,
            SEPARABLE_DOT=separable,
            EVEN_H=hidden_size % cfg.block_h == 0,
            DOT_PRECISION=precision,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            # Explicit (Triton 3.9 warns when it is left to the default): contraction into FMA changes
            # rounding, but the same code runs for every row, so results stay deterministic.
            enable_fp_fusion=True,
        )
        kernels.reduce[(triton.cdiv(rows, cfg.reduce_block_t),)](
            part_m,
            part_s,
            part_e,
            x_t,
            logp[start : start + rows],
            (entropy if entropy is not None else logp)[start : start + rows],
            rows,
            num_splits,
            RETURN_ENTROPY=return_entropy,
            BLOCK_T=cfg.reduce_block_t,
            BLOCK_S=block_s,
            num_warps=4,
            enable_fp_fusion=True,
        )
    return logp, entropy
