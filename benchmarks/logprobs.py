"""Benchmark of the logprob kernels against torch eager and (when installed) Liger-Kernel.

Usage::

    python -m benchmarks.logprobs                  # CPU: correctness + peak memory, about a minute
    python -m benchmarks.logprobs --quick          # CPU, smaller sizes
    python -m benchmarks.logprobs --device cuda    # GPU: the sizes of docs/performance.md

One ``rich`` table per run: size (T, H, V, dtype), time, throughput (kernel (b): TFLOP/s of
``2*T*H*V``; kernel (a): GB/s of logits read), peak extra memory, max abs error against the fp64
reference, and speed relative to torch eager (materialised fp32 logits). The Triton rows time the
kernel launchers; input validation (two small host syncs) runs once, outside the timed region.

How memory is measured:

* CUDA: ``torch.cuda.max_memory_allocated()`` during the call minus the memory allocated before it.
* CPU: ``workers.kernels.memory.AllocationTracker``, a TorchDispatchMode that counts every tensor
  storage created during the call until it is freed; the peak of live bytes is reported. Triton's
  CPU interpreter keeps its tiles in numpy arrays (the stand-in for on-chip memory), which are not
  counted. On the CPU the Triton kernels run in that interpreter: their times are not meaningful
  and are shown in grey (one run); their errors and memory are. Other CPU times are from a second
  run after the tracked one.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

Fn = Callable[[], torch.Tensor]


@dataclass
class Result:
    kernel: str
    impl: str
    size: str
    time_ms: float | None
    rate: str
    peak_bytes: int | None
    max_err: float | None
    vs_eager: str
    note: str = ""
    timing_meaningful: bool = True


@dataclass(frozen=True)
class Timing:
    out: torch.Tensor
    time_ms: float
    peak_bytes: int


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _measure_cpu(fn: Fn, timed_rerun: bool) -> Timing:
    from workers.kernels.memory import AllocationTracker

    with AllocationTracker() as tracker:
        start = time.perf_counter()
        out = fn()
        elapsed_ms = (time.perf_counter() - start) * 1e3
    if timed_rerun:
        # The first run paid one-off costs (allocator growth, lazy init) and the tracker's overhead.
        start = time.perf_counter()
        fn()
        elapsed_ms = (time.perf_counter() - start) * 1e3
    return Timing(out=out, time_ms=elapsed_ms, peak_bytes=tracker.report.peak_bytes)


def _measure_cuda(fn: Fn, warmup: int, reps: int) -> Timing:
    # The first call's output is the one checked for errors: Liger's cross-entropy writes gradients
    # into its input in place, so later calls may see different inputs (their timing is unaffected).
    out = fn()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return Timing(out=out, time_ms=min(times), peak_bytes=peak)


def _liger() -> tuple[Callable[..., torch.Tensor] | None, Callable[..., torch.Tensor] | None, str]:
    """Liger's per-token cross-entropy (= -logprob) for kernel (a) and its fused linear CE for (b)."""
    try:
        from liger_kernel.transformers.functional import (
            liger_cross_entropy,
            liger_fused_linear_cross_entropy,
        )
    except ImportError:
        return None, None, "Liger-Kernel not installed: column skipped (pip install liger-kernel)"
    except Exception as exc:  # a Liger built against another Triton can fail at import in other ways
        return None, None, f"Liger-Kernel failed to import ({type(exc).__name__}: {exc}): column skipped"
    return liger_cross_entropy, liger_fused_linear_cross_entropy, ""


class Bench:
    def __init__(self, device: torch.device, quick: bool) -> None:
        self.device = device
        self.quick = quick
        self.results: list[Result] = []
        self.notes: list[str] = []
        self.liger_ce, self.liger_flce, liger_note = _liger()
        if liger_note:
            self.notes.append(liger_note)
        elif device.type != "cuda":
            self.notes.append("Liger-Kernel is CUDA-only: column skipped on the CPU")
            self.liger_ce = self.liger_flce = None

    def measure(self, fn: Fn, timing_meaningful: bool) -> Timing:
        if self.device.type == "cuda":
            return _measure_cuda(fn, warmup=1 if self.quick else 2, reps=3 if self.quick else 5)
        return _measure_cpu(fn, timed_rerun=timing_meaningful)

    def add(
        self,
        kernel: str,
        impl: str,
        size: str,
        fn: Fn,
        oracle: torch.Tensor,
        work: float,
        unit: str,
        eager_ms: float | None,
        timing_meaningful: bool = True,
        note: str = "",
    ) -> Timing | None:
        try:
            timing = self.measure(fn, timing_meaningful)
        except Exception as exc:  # out of memory, an API mismatch in Liger...: report it, keep going
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            first_line = str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__
            self.results.append(
                Result(kernel, impl, size, None, "-", None, None, "-", f"failed: {first_line}")
            )
            return None
        err = (timing.out.float() - oracle.to(timing.out.device)).abs().max().item()
        seconds = timing.time_ms / 1e3
        if unit == "flop":
            tflops = work / seconds / 1e12
            rate = f"{tflops:.1f} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.1f} GFLOP/s"
        else:
            rate = f"{work / seconds / 1e9:.1f} GB/s"
        vs = "1.00x" if eager_ms is None else f"{eager_ms / timing.time_ms:.2f}x"
        if not timing_meaningful:
            rate, vs = "-", "-"
        self.results.append(
            Result(
                kernel, impl, size, timing.time_ms, rate, timing.peak_bytes, err, vs, note, timing_meaningful
            )
        )
        return timing


def _oracle_chunk(vocab: int) -> int:
    # fp64 oracle chunks of about 512 MB of logits.
    return max(1, (512 << 20) // (8 * vocab))


def bench_logits_kernel(b: Bench, num_tokens: int, vocab: int, dtype: torch.dtype, triton_ok: bool) -> None:
    from workers.kernels.logprobs_from_logits import logprobs_from_logits_triton
    from workers.kernels.reference import logprobs_from_logits_torch
    from workers.kernels.validate import validate_logits_inputs

    dev = b.device
    logits = (torch.randn(num_tokens, vocab, device=dev) * 3).to(dtype)
    targets = torch.randint(0, vocab, (num_tokens,), device=dev)
    oracle = logprobs_from_logits_torch(
        logits, targets, chunk_size=_oracle_chunk(vocab), compute_dtype=torch.float64
    )
    size = f"T={num_tokens:,} V={vocab:,} {str(dtype).removeprefix('torch.')}"
    bytes_read = float(logits.numel() * logits.element_size())
    name = "(a) logits"

    eager = b.add(
        name,
        "torch eager (fp32 log_softmax)",
        size,
        lambda: logprobs_from_logits_torch(logits, targets),
        oracle,
        bytes_read,
        "bytes",
        None,
    )
    eager_ms = eager.time_ms if eager else None
    if b.device.type == "cpu":
        b.add(
            name,
            "torch chunked (256 rows)",
            size,
            lambda: logprobs_from_logits_torch(logits, targets, chunk_size=256),
            oracle,
            bytes_read,
            "bytes",
            eager_ms,
        )
    if triton_ok:
        # Validated once here; the timed call is the launcher (validation costs two host syncs).
        validate_logits_inputs(logits, targets, 1.0)
        b.add(
            name,
            "triton kernel (a)" + (" (interpreter)" if b.device.type == "cpu" else ""),
            size,
            lambda: logprobs_from_logits_triton(logits, targets)[0],
            oracle,
            bytes_read,
            "bytes",
            eager_ms,
            timing_meaningful=b.device.type == "cuda",
        )
    if b.liger_ce is not None:
        liger_ce = b.liger_ce
        liger_logits = logits.clone()  # Liger may overwrite its input with gradients
        b.add(
            name,
            "Liger cross_entropy (none)",
            size,
            lambda: -liger_ce(liger_logits, targets, reduction="none"),
            oracle,
            bytes_read,
            "bytes",
            eager_ms,
        )


def bench_fused_kernel(
    b: Bench, num_tokens: int, hidden_size: int, vocab: int, dtype: torch.dtype, triton_ok: bool
) -> None:
    from workers.kernels.fused_linear_logprobs import FusedConfig, fused_linear_logprobs_triton
    from workers.kernels.reference import fused_linear_logprobs_torch
    from workers.kernels.validate import validate_fused_inputs

    dev = b.device
    hidden = torch.randn(num_tokens, hidden_size, device=dev).to(dtype)
    weight = (torch.randn(vocab, hidden_size, device=dev) * (2.0 / math.sqrt(hidden_size))).to(dtype)
    targets = torch.randint(0, vocab, (num_tokens,), device=dev)
    oracle = fused_linear_logprobs_torch(
        hidden, weight, targets, chunk_size=_oracle_chunk(vocab), compute_dtype=torch.float64
    )
    size = f"T={num_tokens:,} H={hidden_size:,} V={vocab:,} {str(dtype).removeprefix('torch.')}"
    flops = 2.0 * num_tokens * hidden_size * vocab
    name = "(b) fused"

    def eager() -> torch.Tensor:
        # What RL frameworks commonly do: logits in the model dtype, cast to fp32, log_softmax, gather.
        logits = (hidden @ weight.T).float()
        return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)

    eager_t = b.add(name, "torch eager (fp32 logits)", size, eager, oracle, flops, "flop", None)
    eager_ms = eager_t.time_ms if eager_t else None
    if b.device.type == "cpu":
        b.add(
            name,
            "torch chunked (256 rows)",
            size,
            lambda: fused_linear_logprobs_torch(hidden, weight, targets, chunk_size=256),
            oracle,
            flops,
            "flop",
            eager_ms,
        )
    if triton_ok:
        validate_fused_inputs(hidden, weight, targets, 1.0, None)
        if b.device.type == "cuda":
            b.add(
                name,
                "triton kernel (b)",
                size,
                lambda: fused_linear_logprobs_triton(hidden, weight, targets)[0],
                oracle,
                flops,
                "flop",
                eager_ms,
            )
        else:
            # Interpreter-sized tiles through tl.dot (numpy matmul): the same kernel code, few steps.
            cfg = FusedConfig(
                block_t=64, block_v=8192, block_h=128, split_v=32768, num_stages=1, separable_dot=False
            )

            def fused_interp() -> torch.Tensor:
                return fused_linear_logprobs_triton(hidden, weight, targets, config=cfg)[0]

            b.add(
                name,
                "triton kernel (b) (interpreter)",
                size,
                fused_interp,
                oracle,
                flops,
                "flop",
                eager_ms,
                timing_meaningful=False,
            )
    if b.liger_flce is not None:
        liger_flce = b.liger_flce
        b.add(
            name,
            "Liger fused linear CE (none)",
            size,
            lambda: -liger_flce(hidden, weight, targets, reduction="none"),
            oracle,
            flops,
            "flop",
            eager_ms,
        )


def render(b: Bench, command: str, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=170)
    console.print(f"$ {command}")
    table = Table(title=title, show_lines=False)
    for col, justify in (
        ("kernel", "left"),
        ("implementation", "left"),
        ("size", "left"),
        ("time (ms)", "right"),
        ("throughput", "right"),
        ("peak extra mem", "right"),
        ("max abs err", "right"),
        ("vs eager", "right"),
        ("note", "left"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    previous = None
    for r in b.results:
        if previous is not None and (r.kernel, r.size) != previous:
            table.add_section()
        previous = (r.kernel, r.size)
        time_s = "-" if r.time_ms is None else f"{r.time_ms:,.1f}"
        if not r.timing_meaningful:
            time_s = f"[grey50]{time_s}[/grey50]"
        err = "-" if r.max_err is None else f"{r.max_err:.1e}"
        table.add_row(
            r.kernel, r.impl, r.size, time_s, r.rate, _fmt_bytes(r.peak_bytes), err, r.vs_eager, r.note
        )
    console.print(table)
    for note in b.notes:
        console.print(f"note: {note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.logprobs", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="smaller sizes / fewer repetitions")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.logprobs " + shlex.join(sys.argv[1:] if argv is None else argv)

    if args.device == "cpu":
        # The kernels decorate lazily, so this is early enough; never set it for CUDA runs.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print("--device cuda requested but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    torch.manual_seed(0)
    b = Bench(device, args.quick)

    from workers.kernels import resolve_backend

    try:
        triton_ok = resolve_backend("triton", device) == "triton"
    except ValueError as exc:
        triton_ok = False
        b.notes.append(f"Triton rows skipped: {exc}")

    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp64 oracle's fp32 matmul must be exact fp32
        sizes_t = [4096] if args.quick else [4096, 16384]
        for num_tokens in sizes_t:
            bench_logits_kernel(b, num_tokens, 151_936, torch.bfloat16, triton_ok)
            torch.cuda.empty_cache()
        for num_tokens in sizes_t:
            bench_fused_kernel(b, num_tokens, 4096, 151_936, torch.bfloat16, triton_ok)
            torch.cuda.empty_cache()
        if not args.quick:
            # Cut Cross-Entropy's anchor: 8,192 tokens, 256k vocabulary.
            bench_fused_kernel(b, 8192, 4096, 262_144, torch.bfloat16, triton_ok)
        title = (
            f"logprob kernels on {torch.cuda.get_device_name()} "
            "(goals: (a) >= 85% of HBM bandwidth; (b) >= 600 TFLOP/s, extra memory < 64 MB)"
        )
    else:
        vocab, hidden_size = 32_768, 256
        sizes_t = [256, 1024] if args.quick else [256, 1024, 4096]
        interp_t = {256} if args.quick else {256, 1024}  # the interpreter is slow; memory is the point
        for num_tokens in sizes_t:
            bench_logits_kernel(b, num_tokens, vocab, torch.float32, triton_ok and num_tokens in interp_t)
        for num_tokens in sizes_t:
            bench_fused_kernel(
                b, num_tokens, hidden_size, vocab, torch.float32, triton_ok and num_tokens in interp_t
            )
        title = "logprob kernels on CPU: correctness and peak extra memory (Triton via its interpreter)"
        b.notes.append(
            "CPU memory = peak live bytes of tensors allocated during the call (TorchDispatchMode tracker); "
            "interpreter times are not meaningful."
        )
    render(b, command, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
