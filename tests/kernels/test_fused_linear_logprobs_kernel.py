"""Kernel (b), ``fused_linear_logprobs``, against the reference (Triton interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import TOL, assert_close, oracle_fused
from workers.kernels.fused_linear_logprobs import FusedConfig, fused_linear_logprobs_triton

# Small tiles: several vocabulary splits, several tiles per split and several K steps even at toy
# sizes, so every merge path runs. TINY_WORKSPACE also forces many row chunks per call.
SMALL = FusedConfig(block_t=16, block_v=128, block_h=32, split_v=512, num_warps=4, num_stages=1)
TINY_WORKSPACE = FusedConfig(
    block_t=16, block_v=128, block_h=32, split_v=512, num_warps=4, num_stages=1, max_workspace_bytes=512
)
# tl.dot itself through the interpreter (numpy matmul) rather than the row-separable product.
SMALL_DOT = FusedConfig(
    block_t=16, block_v=128, block_h=32, split_v=512, num_warps=4, num_stages=1, separable_dot=False
)


def _run(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    bias: torch.Tensor | None = None,
    config: FusedConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    logp, ent = fused_linear_logprobs_triton(hidden, weight, targets, temperature, bias, True, config)
    assert ent is not None
    return logp, ent


def _check(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    bias: torch.Tensor | None = None,
    config: FusedConfig | None = None,
) -> torch.Tensor:
    logp, ent = _run(hidden, weight, targets, temperature, bias, config)
    ref_logp, ref_ent = oracle_fused(hidden, weight, targets, temperature, bias)
    tol = TOL[hidden.dtype]
    assert_close(logp, ref_logp, tol)
    assert_close(ent, ref_ent, tol)
    assert bool((logp <= 0).all())
    return logp


def _problem(
    num_tokens: int, hidden_size: int, vocab: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = torch.randn(num_tokens, hidden_size, device=device).to(dtype)
    weight = (torch.randn(vocab, hidden_size, device=device) / hidden_size**0.5 * 3).to(dtype)
    targets = torch.randint(0, vocab, (num_tokens,), device=device)
    return hidden, weight, targets


@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", [(1, 16, 17), (37, 40, 1000), (53, 16, 1500)], ids=str)
def test_matches_reference_ragged(
    device: torch.device, shape: tuple[int, int, int], with_bias: bool, config: FusedConfig | None
) -> None:
    hidden, weight, targets = _problem(*shape, device)
    bias = torch.randn(shape[2], device=device) if with_bias else None
    _check(hidden, weight, targets, 1.0, bias, config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tl_dot_path(device: torch.device, dtype: torch.dtype) -> None:
    # On a GPU this is the only path; under the interpreter it checks the tl.dot operand layout.
    hidden, weight, targets = _problem(29, 40, 1500, device, dtype)
    _check(hidden, weight, targets, 0.8, torch.randn(1500, device=device).to(dtype), SMALL_DOT)


@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small"])
def test_all_negative_logits(device: torch.device, config: FusedConfig | None) -> None:
    hidden, weight, targets = _problem(21, 32, 3000, device)
    bias = -300.0 - 20.0 * torch.rand(3000, device=device)
    logp = _check(hidden, weight, targets, 1.0, bias, config)
    assert bool(torch.isfinite(logp).all())


@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small"])
def test_large_common_offset(device: torch.device, config: FusedConfig | None) -> None:
    # Entries that are multiples of 1/8 make every dot product exact in fp32 whatever the summation
    # order, so the kernel and the reference see the same fp32 logits even at +1e4 (where one fp32 ulp
    # is 1e-3 and any rounding difference would swamp the 1e-5 tolerance).
    hidden = torch.randint(-8, 9, (19, 32), device=device).float() / 8
    weight = torch.randint(-8, 9, (2100, 32), device=device).float() / 8
    targets = torch.randint(0, 2100, (19,), device=device)
    bias = torch.full((2100,), 1e4, device=device)
    _check(hidden, weight, targets, 1.0, bias, config)


@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small"])
def test_temperature(device: torch.device, config: FusedConfig | None) -> None:
    hidden, weight, targets = _problem(23, 24, 2000, device)
    _check(hidden, weight, targets, 0.7, None, config)
    _check(hidden, weight, targets, 1.6, None, config)
    temps = torch.rand(23, device=device) * 2 + 0.25
    _check(hidden, weight, targets, temps, None, config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small"])
def test_low_precision_inputs(device: torch.device, dtype: torch.dtype, config: FusedConfig | None) -> None:
    hidden, weight, targets = _problem(31, 40, 3000, device, dtype)
    bias = torch.randn(3000, device=device).to(dtype)
    _check(hidden, weight, targets, 0.9, bias, config)


@pytest.mark.parametrize("vocab", [151_936, 128_256, 256_000], ids=["qwen", "llama3", "256k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_vocab_sizes(device: torch.device, vocab: int, dtype: torch.dtype) -> None:
    hidden, weight, _ = _problem(3, 32, vocab, device, dtype)
    targets = torch.tensor([0, vocab - 1, vocab // 2], device=device)
    _check(hidden, weight, targets, torch.tensor([1.0, 0.6, 1.3], device=device))


@pytest.mark.parametrize(
    ("config", "dtype"),
    [
        (None, torch.float32),
        (None, torch.bfloat16),
        (SMALL, torch.float32),
        (SMALL, torch.bfloat16),
        (TINY_WORKSPACE, torch.float32),
    ],
    ids=["default-fp32", "default-bf16", "small-fp32", "small-bf16", "chunked-fp32"],
)
def test_batch_invariance(device: torch.device, config: FusedConfig | None, dtype: torch.dtype) -> None:
    num_tokens, vocab = 45, 700
    hidden, weight, targets = _problem(num_tokens, 24, vocab, device, dtype)
    bias = torch.randn(vocab, device=device).to(dtype)
    temps = torch.rand(num_tokens, device=device) + 0.5
    full_logp, full_ent = _run(hidden, weight, targets, temps, bias, config)

    # Subsets: rows land at other positions of their token tile (and in other tiles).
    for start, stop in [(5, 6), (3, 40), (17, 45)]:
        logp, ent = _run(hidden[start:stop], weight, targets[start:stop], temps[start:stop], bias, config)
        assert torch.equal(logp, full_logp[start:stop]), (start, stop)
        assert torch.equal(ent, full_ent[start:stop]), (start, stop)

    # A different chunking of the same rows.
    chunks = [
        _run(hidden[i : i + 11], weight, targets[i : i + 11], temps[i : i + 11], bias, config)
        for i in range(0, num_tokens, 11)
    ]
    assert torch.equal(torch.cat([c[0] for c in chunks]), full_logp)
    assert torch.equal(torch.cat([c[1] for c in chunks]), full_ent)

    # Neighbouring rows replaced by very different data.
    other = hidden.clone()
    other[::2] = (torch.randn_like(other[::2].float()) * 30).to(dtype)
    logp, ent = _run(other, weight, targets, temps, bias, config)
    assert torch.equal(logp[1::2], full_logp[1::2])
    assert torch.equal(ent[1::2], full_ent[1::2])

    # Run to run.
    again = _run(hidden, weight, targets, temps, bias, config)
    assert torch.equal(again[0], full_logp)
    assert torch.equal(again[1], full_ent)


def test_entropy_flag_does_not_change_logprobs(device: torch.device) -> None:
    hidden, weight, targets = _problem(17, 16, 700, device)
    logp, ent = fused_linear_logprobs_triton(hidden, weight, targets, 1.0, None, False, SMALL)
    assert ent is None
    assert torch.equal(logp, _run(hidden, weight, targets, 1.0, None, SMALL)[0])


def test_config_rejects_bad_tiles() -> None:
    with pytest.raises(ValueError, match="power of two"):
        FusedConfig(block_t=8, block_v=64, block_h=16, split_v=256)
    with pytest.raises(ValueError, match="multiple of block_v"):
        FusedConfig(block_t=16, block_v=64, block_h=16, split_v=100)
