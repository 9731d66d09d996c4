"""Ahead-of-time compilation of the kernels for an H100/H200 (sm_90), without a GPU.

Run as a test (``test_kernels_compile_for_sm90``) or directly: ``python -m tests.kernels.test_gpu_compile``.

The interpreter tests never run Triton's compiler, so a kernel that only fails to compile (a type or
layout error in the compiled path, the tl.dot branch) would pass CI. This compiles each kernel with the
GPU default configuration through Triton's own pipeline (TTIR -> TTGIR -> LLVM -> PTX -> ptxas cubin)
and checks two properties visible in the PTX: the bf16 tile product uses tensor cores, and nothing
uses atomics (the reduction is fixed-order by construction).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.kernels.fused_linear_logprobs import (
    _fused_partials_kernel,
    _fused_reduce_kernel,
    default_fused_config,
)
from workers.kernels.logprobs_from_logits import _logprobs_from_logits_kernel, default_logits_config

TRITON_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
REPO_ROOT = Path(__file__).resolve().parents[2]


def _compile(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], **options: Any) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    jit_fn = JITFunction(fn)
    # What a real launch specialises on (16-byte aligned pointers, sizes divisible by 16): without it
    # Triton cannot use 16-byte async copies and does not pipeline the K loop. num_tokens is never
    # specialised (do_not_specialize).
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(jit_fn.arg_names)
        if signature.get(name, "constexpr") != "constexpr" and name != "num_tokens"
    }
    src = ASTSource(jit_fn, signature, constexprs, attrs)
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": True, **options}
    )
    ptx: str = kernel.asm["ptx"]
    return ptx


def _facts(ptx: str) -> dict[str, bool]:
    return {"atomics": "atom." in ptx, "tensor_cores": "wgmma" in ptx or "mma.sync" in ptx}


def compile_logits_kernel() -> dict[str, bool]:
    cfg = default_logits_config(151_936, interpreted=False)
    constexprs = {"BLOCK_V": cfg.block_v, "RETURN_ENTROPY": True}
    signature = {
        "logits_ptr": "*bf16",
        "targets_ptr": "*i64",
        "temp_ptr": "*fp32",
        "logp_ptr": "*fp32",
        "entropy_ptr": "*fp32",
        "num_tokens": "i32",
        "vocab_size": "i32",
        **dict.fromkeys(constexprs, "constexpr"),
    }
    return _facts(_compile(_logprobs_from_logits_kernel, signature, constexprs, num_warps=cfg.num_warps))


def compile_fused_partials_kernel(dtype: torch.dtype) -> dict[str, bool]:
    cfg = default_fused_config(dtype, interpreted=False)
    dt = TRITON_DTYPE[dtype]
    constexprs = {
        "HAS_BIAS": True,
        "RETURN_ENTROPY": True,
        "BLOCK_T": cfg.block_t,
        "BLOCK_V": cfg.block_v,
        "BLOCK_H": cfg.block_h,
        "SPLIT_V": cfg.split_v,
        "GROUP_T": cfg.group_t,
        "UPCAST_DOT": False,
        "SEPARABLE_DOT": False,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "EVEN_H": True,
    }
    signature = {
        "hidden_ptr": f"*{dt}",
        "weight_ptr": f"*{dt}",
        "bias_ptr": f"*{dt}",
        "targets_ptr": "*i64",
        "temp_ptr": "*fp32",
        "part_m_ptr": "*fp32",
        "part_s_ptr": "*fp32",
        "part_e_ptr": "*fp32",
        "x_t_ptr": "*fp32",
        "num_tokens": "i32",
        "hidden_size": "i32",
        "vocab_size": "i32",
        "num_splits": "i32",
        **dict.fromkeys(constexprs, "constexpr"),
    }
    return _facts(
        _compile(
            _fused_partials_kernel, signature, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages
        )
    )


def compile_fused_reduce_kernel() -> dict[str, bool]:
    cfg = default_fused_config(torch.bfloat16, interpreted=False)
    reduce_constexprs = {"RETURN_ENTROPY": True, "BLOCK_T": cfg.reduce_block_t, "BLOCK_S": 64}
    reduce_signature = {
        "part_m_ptr": "*fp32",
        "part_s_ptr": "*fp32",
        "part_e_ptr": "*fp32",
        "x_t_ptr": "*fp32",
        "logp_ptr": "*fp32",
        "entropy_ptr": "*fp32",
        "num_tokens": "i32",
        "num_splits": "i32",
        **dict.fromkeys(reduce_constexprs, "constexpr"),
    }
    return _facts(_compile(_fused_reduce_kernel, reduce_signature, reduce_constexprs, num_warps=4))


def main() -> None:
    facts = {
        "logits": compile_logits_kernel(),
        "partials_bf16": compile_fused_partials_kernel(torch.bfloat16),
        "partials_fp32": compile_fused_partials_kernel(torch.float32),
        "reduce": compile_fused_reduce_kernel(),
    }
    print(json.dumps(facts))


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    # A fresh process with TRITON_INTERPRET unset: Triton decides interpreter-vs-compiler for its own
    # helpers (tl.sum, tl.cdiv, ...) when it is imported, and this test process imported it with
    # TRITON_INTERPRET=1.
    pytest.importorskip("triton.compiler.compiler", reason="no Triton compiler API")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.test_gpu_compile"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0 and ("ptxas" in proc.stderr and "not found" in proc.stderr.lower()):
        pytest.skip("no ptxas bundled with this Triton")  # pragma: no cover
    assert proc.returncode == 0, proc.stderr[-4000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not any(f["atomics"] for f in facts.values()), facts  # fixed-order reductions only
    assert facts["partials_bf16"]["tensor_cores"], facts  # the bf16 tile product uses tensor cores


if __name__ == "__main__":
    main()
