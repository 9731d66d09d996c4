"""Public API of ``workers.kernels``: validation, backend selection, return convention, memory."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

import workers.kernels as kernels
from tests.kernels.helpers import TOL, assert_close, oracle_fused, oracle_logits
from workers.kernels import fused_linear_logprobs, logprobs_from_logits, resolve_backend
from workers.kernels.fused_linear_logprobs import default_fused_config, jit_kernels
from workers.kernels.memory import AllocationTracker

T, H, V = 6, 16, 50


def _logits_args(device: torch.device) -> dict[str, Any]:
    return {
        "logits": torch.randn(T, V, device=device),
        "targets": torch.randint(0, V, (T,), device=device),
        "temperature": 1.0,
    }


def _fused_args(device: torch.device) -> dict[str, Any]:
    return {
        "hidden": torch.randn(T, H, device=device),
        "weight": torch.randn(V, H, device=device),
        "targets": torch.randint(0, V, (T,), device=device),
        "temperature": 1.0,
        "bias": None,
    }


# Each case edits the valid arguments into an invalid call; `match` is part of the expected message.
LOGITS_CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "logits-not-tensor": (lambda a: a.update(logits=[[0.0]]), "must be a torch.Tensor"),
    "logits-1d": (lambda a: a.update(logits=a["logits"][0]), "2-D"),
    "logits-float64": (lambda a: a.update(logits=a["logits"].double()), "dtype"),
    "logits-int": (lambda a: a.update(logits=a["logits"].long()), "dtype"),
    "logits-non-contiguous": (lambda a: a.update(logits=torch.randn(V, T).t()), "contiguous"),
    "logits-strided-rows": (lambda a: a.update(logits=torch.randn(T, 2 * V)[:, ::2]), "contiguous"),
    "empty-T": (
        lambda a: a.update(logits=torch.randn(0, V), targets=torch.zeros(0, dtype=torch.long)),
        "non-empty",
    ),
    "empty-V": (lambda a: a.update(logits=torch.randn(T, 0)), "non-empty"),
    "targets-float": (lambda a: a.update(targets=a["targets"].float()), "int64 or int32"),
    "targets-2d": (lambda a: a.update(targets=a["targets"][:, None]), "1-D"),
    "targets-short": (lambda a: a.update(targets=a["targets"][:-1]), "entries"),
    "targets-negative": (lambda a: a["targets"].__setitem__(0, -1), r"\[0, 50\)"),
    "targets-too-big": (lambda a: a["targets"].__setitem__(2, V), r"\[0, 50\)"),
    "targets-non-contiguous": (
        lambda a: a.update(targets=torch.randint(0, V, (2 * T,))[::2]),
        "contiguous",
    ),
    "temperature-zero": (lambda a: a.update(temperature=0.0), "positive"),
    "temperature-negative": (lambda a: a.update(temperature=-1.0), "positive"),
    "temperature-nan": (lambda a: a.update(temperature=float("nan")), "positive"),
    "temperature-inf": (lambda a: a.update(temperature=float("inf")), "positive"),
    "temperature-bool": (lambda a: a.update(temperature=True), "bool"),
    "temperature-str": (lambda a: a.update(temperature="1.0"), "float or a tensor"),
    "temperature-wrong-length": (lambda a: a.update(temperature=torch.ones(T + 1)), r"shape \[6\]"),
    "temperature-2d": (lambda a: a.update(temperature=torch.ones(T, 1)), "scalar or"),
    "temperature-int-tensor": (lambda a: a.update(temperature=torch.ones(T, dtype=torch.long)), "floating"),
    "temperature-row-zero": (
        lambda a: a.update(temperature=torch.tensor([1.0] * (T - 1) + [0.0])),
        "positive",
    ),
}

FUSED_CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "hidden-1d": (lambda a: a.update(hidden=a["hidden"][0]), "2-D"),
    "hidden-float64": (lambda a: a.update(hidden=a["hidden"].double()), "dtype"),
    "hidden-non-contiguous": (lambda a: a.update(hidden=torch.randn(H, T).t()), "contiguous"),
    "weight-non-contiguous": (lambda a: a.update(weight=torch.randn(H, V).t()), "contiguous"),
    "weight-transposed-shape": (lambda a: a.update(weight=torch.randn(H, V)), "expected weight"),
    "dtype-mismatch": (lambda a: a.update(weight=a["weight"].bfloat16()), "same dtype"),
    "empty-T": (
        lambda a: a.update(hidden=torch.randn(0, H), targets=torch.zeros(0, dtype=torch.long)),
        "non-empty",
    ),
    "empty-H": (lambda a: a.update(hidden=torch.randn(T, 0), weight=torch.randn(V, 0)), "non-empty"),
    "empty-V": (lambda a: a.update(weight=torch.randn(0, H)), "non-empty"),
    "bias-wrong-shape": (lambda a: a.update(bias=torch.randn(V + 1)), r"bias must have shape \[50\]"),
    "bias-2d": (lambda a: a.update(bias=torch.randn(1, V)), "1-D"),
    "bias-non-contiguous": (lambda a: a.update(bias=torch.randn(2 * V)[::2]), "contiguous"),
    "targets-too-big": (lambda a: a["targets"].__setitem__(0, V), r"\[0, 50\)"),
    "targets-int16": (lambda a: a.update(targets=a["targets"].short()), "int64 or int32"),
    "temperature-zero": (lambda a: a.update(temperature=0), "positive"),
    "temperature-wrong-length": (lambda a: a.update(temperature=torch.ones(T - 1)), r"shape \[6\]"),
}


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any kernel launch fail loudly, to prove validation happens before it."""

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("a kernel was launched before validation")

    monkeypatch.setattr(kernels._logits_module, "logprobs_from_logits_triton", boom)
    monkeypatch.setattr(kernels._fused_module, "fused_linear_logprobs_triton", boom)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", list(LOGITS_CASES), ids=list(LOGITS_CASES))
@pytest.mark.usefixtures("no_launch")
def test_logits_value_errors(device: torch.device, case: str, backend: str) -> None:
    edit, match = LOGITS_CASES[case]
    args = _logits_args(torch.device("cpu"))
    edit(args)
    with pytest.raises(ValueError, match=match):
        logprobs_from_logits(backend=backend, **args)  # type: ignore[call-overload]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", list(FUSED_CASES), ids=list(FUSED_CASES))
@pytest.mark.usefixtures("no_launch")
def test_fused_value_errors(device: torch.device, case: str, backend: str) -> None:
    edit, match = FUSED_CASES[case]
    args = _fused_args(torch.device("cpu"))
    edit(args)
    with pytest.raises(ValueError, match=match):
        fused_linear_logprobs(backend=backend, **args)  # type: ignore[call-overload]


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="backend must be"):
        logprobs_from_logits(**_logits_args(torch.device("cpu")), backend="cuda")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="backend must be"):
        resolve_backend("jax", torch.device("cpu"))


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("torch", cuda) == "torch"
    assert resolve_backend("auto", cuda) == "triton"
    assert resolve_backend("triton", cuda) == "triton"

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", cpu) == "triton"
    assert resolve_backend("triton", cpu) == "triton"
    assert resolve_backend("torch", cpu) == "torch"

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert resolve_backend("auto", cpu) == "torch"
    assert resolve_backend("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", cpu)
    # On CPU without the interpreter, auto quietly uses the reference.
    args = _logits_args(cpu)
    out = logprobs_from_logits(**args)
    assert torch.equal(out, logprobs_from_logits(**args, backend="torch"))


def test_public_functions_are_not_shadowed_by_modules() -> None:
    # The Triton modules share their names with the public functions (and were imported above through
    # ``from workers.kernels.fused_linear_logprobs import ...``); the package attributes stay functions.
    assert inspect.isfunction(kernels.logprobs_from_logits)
    assert inspect.isfunction(kernels.fused_linear_logprobs)


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
def test_logits_return_convention_and_backends_agree(device: torch.device, backend: str) -> None:
    args = _logits_args(device)
    args["logits"] = args["logits"] * 3
    logp = logprobs_from_logits(**args, backend=backend)  # type: ignore[call-overload]
    assert isinstance(logp, torch.Tensor)
    assert logp.shape == (T,) and logp.dtype == torch.float32 and logp.device == device
    pair = logprobs_from_logits(**args, return_entropy=True, backend=backend)  # type: ignore[call-overload]
    assert isinstance(pair, tuple) and len(pair) == 2
    ref_logp, ref_ent = oracle_logits(args["logits"], args["targets"])
    assert_close(pair[0], ref_logp, TOL[torch.float32])
    assert_close(pair[1], ref_ent, TOL[torch.float32])
    assert torch.equal(pair[0], logp)


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
def test_fused_return_convention_and_backends_agree(device: torch.device, backend: str) -> None:
    args = _fused_args(device)
    args["bias"] = torch.randn(V, device=device)
    args["temperature"] = torch.rand(T, device=device) + 0.5
    logp = fused_linear_logprobs(**args, backend=backend)  # type: ignore[call-overload]
    assert isinstance(logp, torch.Tensor)
    assert logp.shape == (T,) and logp.dtype == torch.float32 and logp.device == device
    pair = fused_linear_logprobs(**args, return_entropy=True, backend=backend)  # type: ignore[call-overload]
    assert isinstance(pair, tuple) and len(pair) == 2
    ref_logp, ref_ent = oracle_fused(**args)
    assert_close(pair[0], ref_logp, TOL[torch.float32])
    assert_close(pair[1], ref_ent, TOL[torch.float32])


def test_torch_fallback_chunks_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # Force a chunk of 2 rows: results must match the one-shot reference.
    monkeypatch.setattr(kernels, "_TORCH_CHUNK_BYTES", 2 * 4 * V)
    largs, fargs = _logits_args(torch.device("cpu")), _fused_args(torch.device("cpu"))
    with AllocationTracker() as tracker:
        logp, ent = logprobs_from_logits(**largs, return_entropy=True, backend="torch")
    assert tracker.report.largest_numel <= 2 * V
    ref_logp, ref_ent = oracle_logits(largs["logits"], largs["targets"])
    assert_close(logp, ref_logp, TOL[torch.float32])
    assert_close(ent, ref_ent, TOL[torch.float32])
    with AllocationTracker() as tracker:
        logp, ent = fused_linear_logprobs(**fargs, return_entropy=True, backend="torch")
    assert tracker.report.largest_numel <= 2 * V
    ref_logp, ref_ent = oracle_fused(**fargs)
    assert_close(logp, ref_logp, TOL[torch.float32])
    assert_close(ent, ref_ent, TOL[torch.float32])


def test_fused_never_allocates_logits(device: torch.device) -> None:
    """What is measured: every tensor allocated while the call runs (an ``AllocationTracker``, i.e. a
    TorchDispatchMode that sees each aten op and counts new output storages until they are freed).
    The materialising reference must show a ``[T, V]`` allocation (so the tracker works); the Triton
    path must allocate nothing larger than its ``[T, num_splits]`` partials, and its peak must grow
    with T, not with V."""
    if device.type != "cpu":
        pytest.skip("the tracker test is CPU-only; on CUDA the benchmark reports max_memory_allocated")
    num_tokens, hidden_size, vocab = 48, 16, 40_000
    hidden = torch.randn(num_tokens, hidden_size)
    weight = torch.randn(vocab, hidden_size)
    targets = torch.randint(0, vocab, (num_tokens,))
    logits_bytes = num_tokens * vocab * 4

    with AllocationTracker() as ref_tracker:
        fused_linear_logprobs(hidden, weight, targets, return_entropy=True, backend="torch")
    assert ref_tracker.report.largest_numel >= num_tokens * vocab
    assert ref_tracker.report.peak_bytes >= logits_bytes

    num_splits = -(-vocab // default_fused_config(torch.float32, jit_kernels().interpreted).split_v)
    peaks = {}
    for rows in (num_tokens // 2, num_tokens):
        with AllocationTracker() as tracker:
            fused_linear_logprobs(
                hidden[:rows], weight, targets[:rows], return_entropy=True, backend="triton"
            )
        report = tracker.report
        assert report.largest_numel <= rows * num_splits, [a.shape for a in report.allocations]
        # Outputs, temperatures, x_t and three partials per split: a few words per token.
        assert report.peak_bytes <= rows * 4 * (3 * num_splits + 8)
        peaks[rows] = report.peak_bytes
    assert peaks[num_tokens] < logits_bytes / 1000
