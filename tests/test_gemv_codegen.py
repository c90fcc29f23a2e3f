"""What the one-token GEMVs compile to for the H200 (sm90), checked on the CPU machine.

A one-token GEMV is bound by how many weight bytes each SM has in flight. Triton compiles for sm90 here
without a GPU (its bundled ptxas; SASS read with its bundled nvdisasm), so the two properties the H200
sweeps rewarded are asserted on the machine code of the shipped configs: the FP8 weights are read with
16-byte loads, and a thread issues all of a loop step's weight loads before the step's first multiply. (The
kernel before commit 53d0ae0 read its weights 4 bytes at a time and ran 1.1-1.5x slower on the H200; this
test fails on it.)
Speed itself is measured on the GPU (sglang-mxfp8 bench layers).
"""

import os
import re
import subprocess

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sglang_mxfp8.ops.triton_sm90 import act_quant, gemv  # noqa: E402

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
# pointer arguments by name (every other pointer is a bf16 activation or output; every other argument an int32)
POINTERS = {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "ids_ptr": "*i32", "tw_ptr": "*fp32", "q_ptr": "*fp8e4nv"}
# integer arguments Triton specializes as multiples of 16 at launch on the served shapes
DIVISIBLE = {"N", "K", "I", "stride_wn", "stride_we", "stride_act"}


def sm90_compile(kernel, constants: dict, config: dict):
    """``kernel`` compiled for sm90 with ``config``'s tile constants, warps and stages (argument types from the
    parameters' names)."""
    cfg = dict(config)
    options = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
    constants = {**constants, **cfg}
    names = [p.name for p in kernel.params]
    sig = {n: "constexpr" if n in constants else POINTERS.get(n, "*bf16") if n.endswith("_ptr") else "i32"
           for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n][0] == "*" or n in DIVISIBLE}
    return triton.compile(ASTSource(kernel, sig, constants, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def sm90_sass(kernel, constants: dict, config: dict) -> str:
    """SASS of ``kernel`` compiled for sm90 (see sm90_compile)."""
    compiled = sm90_compile(kernel, constants, config)
    path = f"/tmp/sglang_mxfp8_codegen_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([NVDISASM, path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)


def load_order(sass: str) -> str:
    """The kernel's 16-byte global loads ('W') and floating multiplies ('*') in program order."""
    ops = re.findall(r"\b(LDG\.E\.128|FMUL|FFMA|HADD2\.F32)\b", sass)
    return "".join("W" if op.startswith("LDG") else "*" for op in ops)


def weight_bytes_per_thread(rows: int, groups: int, num_warps: int) -> int:
    return rows * groups * 128 // (num_warps * 32)


@pytest.mark.parametrize("n,k", sorted(gemv.GEMV_TUNED))
def test_dense_gemv_issues_its_weight_loads_16_bytes_wide_before_any_multiply(n, k):
    cfg = gemv.gemv_config(n, k)
    order = load_order(sm90_sass(gemv._w8a16_gemv_kernel, dict(SCALE_ROWS=128, HAS_BIAS=False), cfg))
    need = weight_bytes_per_thread(cfg["BLOCK_N"], cfg["GROUPS"], cfg["num_warps"]) // 16
    # each thread's share of a step's weight tile in 16-byte loads, all issued before the step's first multiply
    assert need >= 1 and order.index("*") >= need, (cfg, order)


def test_moe_gemv_launches_issue_their_weight_loads_16_bytes_wide_before_any_multiply():
    up, down = gemv.MOE_GEMV_UP_CONFIG, gemv.MOE_GEMV_DOWN_CONFIG
    for kernel, constants, cfg, rows in (
            (gemv._moe_gemv_up_kernel, dict(UP_FIRST=0), up, 2 * up["BLOCK_N"]),  # a gate and an up row per output
            (gemv._moe_gemv_up_kernel, dict(UP_FIRST=1), up, 2 * up["BLOCK_N"]),  # w13 as [up; gate]
            (gemv._moe_gemv_down_kernel, dict(SLOTS=8), down, 8 * down["BLOCK_N"])):  # rows of 8 experts
        order = load_order(sm90_sass(kernel, constants, cfg))
        need = weight_bytes_per_thread(rows, cfg["GROUPS"], cfg["num_warps"]) // 16
        assert need >= 1 and order.index("*") >= need, (kernel.__name__, order)


def test_activation_quantizer_compiles_its_nan_check_for_sm90():
    """The quantizer's NaN scale for a group holding a NaN survives compilation for sm90 (a NaN test on the
    loaded values, a per-row reduction of it, a select of the scale; its numerics: test_triton_cpu.py)."""
    kernel = sm90_compile(act_quant._quant_act_kernel, dict(ROWS=16, BLOCK=128), dict(num_warps=4, num_stages=1))
    ptx = kernel.asm["ptx"]
    assert re.search(r"setp\.nan\.", ptx) and "redux.sync.max" in ptx and "selp.f32" in ptx
