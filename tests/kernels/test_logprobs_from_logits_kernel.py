"""Kernel (a), ``logprobs_from_logits``, against the reference (Triton interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import TOL, assert_close, oracle_logits
from workers.kernels.logprobs_from_logits import LogitsConfig, logprobs_from_logits_triton

# A narrow block so small vocabularies still take several online-merge steps.
NARROW = LogitsConfig(block_v=512)


def _run(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    config: LogitsConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    logp, ent = logprobs_from_logits_triton(logits, targets, temperature, True, config)
    assert ent is not None
    return logp, ent


def _check(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    config: LogitsConfig | None = None,
) -> torch.Tensor:
    logp, ent = _run(logits, targets, temperature, config)
    ref_logp, ref_ent = oracle_logits(logits, targets, temperature)
    tol = TOL[logits.dtype]
    assert_close(logp, ref_logp, tol)
    assert_close(ent, ref_ent, tol)
    assert bool((logp <= 0).all())
    return logp


@pytest.mark.parametrize("config", [None, NARROW], ids=["default", "narrow"])
@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (7, 1000), (33, 4097), (5, 32768 + 5)])
def test_matches_reference_ragged(device: torch.device, shape: tuple[int, int], config: LogitsConfig) -> None:
    num_tokens, vocab = shape
    logits = torch.randn(num_tokens, vocab, device=device) * 4
    targets = torch.randint(0, vocab, (num_tokens,), device=device)
    _check(logits, targets, config=config)


@pytest.mark.parametrize("config", [None, NARROW], ids=["default", "narrow"])
def test_all_negative_logits(device: torch.device, config: LogitsConfig) -> None:
    # A running max that starts at 0 instead of -inf returns garbage here.
    logits = -200.0 - 30.0 * torch.rand(9, 3001, device=device)
    targets = torch.randint(0, 3001, (9,), device=device)
    logp = _check(logits, targets, config=config)
    assert bool(torch.isfinite(logp).all())


@pytest.mark.parametrize("config", [None, NARROW], ids=["default", "narrow"])
def test_large_common_offset(device: torch.device, config: LogitsConfig) -> None:
    logits = torch.randn(6, 2500, device=device) * 3 + 1e4
    targets = torch.randint(0, 2500, (6,), device=device)
    _check(logits, targets, config=config)


def test_clamped_to_non_positive(device: torch.device) -> None:
    # One logit takes all the mass: x_t - lse rounds to 0 (or a hair above without the clamp).
    logits = torch.full((4, 300), -1e4, device=device)
    targets = torch.tensor([0, 7, 150, 299], device=device)
    logits[torch.arange(4), targets] = 1e4
    logp, ent = _run(logits, targets)
    assert torch.equal(logp, torch.zeros_like(logp))
    assert bool((ent.abs() <= 1e-6).all())


def test_neg_inf_logits(device: torch.device) -> None:
    # Masked vocabulary entries at -inf: no NaN from exp(-inf - -inf) or 0 * -inf.
    logits = torch.randn(5, 700, device=device)
    logits[:, 300:] = float("-inf")
    targets = torch.randint(0, 300, (5,), device=device)
    _check(logits, targets, config=NARROW)


@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_scalar_temperature(device: torch.device, temperature: float) -> None:
    logits = torch.randn(11, 5003, device=device) * 3
    targets = torch.randint(0, 5003, (11,), device=device)
    _check(logits, targets, temperature, config=NARROW)
    _check(logits, targets, temperature)


def test_per_row_temperature(device: torch.device) -> None:
    logits = torch.randn(11, 5003, device=device) * 3
    targets = torch.randint(0, 5003, (11,), device=device)
    temperature = torch.rand(11, device=device) * 2 + 0.25
    _check(logits, targets, temperature, config=NARROW)
    # A 0-d tensor behaves like the scalar.
    assert torch.equal(
        _run(logits, targets, torch.tensor(0.8, device=device))[0], _run(logits, targets, 0.8)[0]
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [None, NARROW], ids=["default", "narrow"])
def test_low_precision_inputs(device: torch.device, dtype: torch.dtype, config: LogitsConfig) -> None:
    logits = (torch.randn(13, 3333, device=device) * 4).to(dtype)
    targets = torch.randint(0, 3333, (13,), device=device)
    _check(logits, targets, 0.9, config=config)


@pytest.mark.parametrize("vocab", [151_936, 128_256, 256_000], ids=["qwen", "llama3", "256k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_vocab_sizes(device: torch.device, vocab: int, dtype: torch.dtype) -> None:
    logits = (torch.randn(3, vocab, device=device) * 3).to(dtype)
    targets = torch.tensor([0, vocab - 1, vocab // 2], device=device)
    _check(logits, targets, torch.tensor([1.0, 0.6, 1.3], device=device))


@pytest.mark.parametrize("config", [None, NARROW], ids=["default", "narrow"])
def test_batch_invariance(device: torch.device, config: LogitsConfig) -> None:
    num_tokens, vocab = 24, 1500
    logits = torch.randn(num_tokens, vocab, device=device) * 5
    targets = torch.randint(0, vocab, (num_tokens,), device=device)
    temps = torch.rand(num_tokens, device=device) + 0.5
    full_logp, full_ent = _run(logits, targets, temps, config)

    # Row subsets and a different chunking of the same rows.
    for start, stop in [(0, 1), (5, 6), (3, 17), (23, 24)]:
        logp, ent = _run(logits[start:stop], targets[start:stop], temps[start:stop], config)
        assert torch.equal(logp, full_logp[start:stop])
        assert torch.equal(ent, full_ent[start:stop])
    chunks = [_run(logits[i : i + 5], targets[i : i + 5], temps[i : i + 5], config) for i in range(0, 24, 5)]
    assert torch.equal(torch.cat([c[0] for c in chunks]), full_logp)
    assert torch.equal(torch.cat([c[1] for c in chunks]), full_ent)

    # Other rows replaced by different data.
    other = logits.clone()
    other[::2] = torch.randn_like(other[::2]) * 50 - 100
    logp, ent = _run(other, targets, temps, config)
    assert torch.equal(logp[1::2], full_logp[1::2])
    assert torch.equal(ent[1::2], full_ent[1::2])

    # And run to run.
    again = _run(logits, targets, temps, config)
    assert torch.equal(again[0], full_logp)
    assert torch.equal(again[1], full_ent)


def test_int32_targets(device: torch.device) -> None:
    logits = torch.randn(4, 999, device=device)
    targets = torch.randint(0, 999, (4,), device=device)
    assert torch.equal(_run(logits, targets.int())[0], _run(logits, targets)[0])


def test_no_entropy_output(device: torch.device) -> None:
    logits = torch.randn(4, 999, device=device)
    targets = torch.randint(0, 999, (4,), device=device)
    logp, ent = logprobs_from_logits_triton(logits, targets)
    assert ent is None
    assert torch.equal(logp, _run(logits, targets)[0])
