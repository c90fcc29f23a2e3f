"""Prefill layers as a server runs them, outside CUDA graphs: GPU time per call (in a CUDA graph), wall time per call
run back to back (eager, as SGLang runs prefill batches), and the host's own time to issue one call (measured while
the GPU is held busy by a sleep kernel, so nothing waits on the GPU). Where the host's time is above the GPU's, the
eager prefill layer runs at the host's speed, not the kernel's.

Qwen3-30B-A3B shapes: the dense qkv (2048->5120) and o (4096->2048) layers through the FlashInfer backend's own
apply (DeepGEMM from 1024 tokens where deep_gemm imports, else cuBLAS) against BF16 cuBLAS, the MoE layer
(E=128, H=2048, I=768, top-8) on SGLang's BF16 fused MoE, SGLang's Triton block-FP8 fused MoE, our DeepGEMM grouped
MoE and SGLang's CUTLASS grouped MoE.

    python benchmarks/kernels/bench_prefill_host.py --out OUT/prefill_host.md [--ms 1024 2048 8192]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from sglang_mxfp8.kernels import registry
from sglang_mxfp8.kernels.base import LinearSpec
from sglang_mxfp8.platform import deep_gemm_or_why, visible_gpu
from sglang_mxfp8.kernels.moe.cutlass_grouped import CutlassGroupedMoE
from sglang_mxfp8.kernels.moe.deepgemm import DeepGemmGroupedMoE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hopper_layers import linear  # noqa: E402
from bench_moe import moe_setup, E, H, I, experts, outplace_fused_experts, routing, triton_block_fp8  # noqa: E402
from gpu_timer import graph_us  # noqa: E402

CALLS = 20  # calls per eager and per host measurement
SLEEP_CYCLES = 1 << 29  # ~0.27 s of GPU sleep at the H200's 1.98 GHz: longer than issuing CALLS calls


def eager_us(fn) -> float:
    """Wall microseconds per call, CALLS calls back to back, then one sync."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / CALLS


def host_us(fn) -> float:
    """The host's microseconds to issue one call while the GPU is busy (nothing waits on the GPU); inf where a call
    waited for the GPU (it synchronises with the host)."""
    torch.cuda.synchronize()
    start_gpu = torch.cuda.Event(enable_timing=True)
    end_sleep = torch.cuda.Event(enable_timing=True)
    start_gpu.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    end_sleep.record()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    slept = start_gpu.elapsed_time(end_sleep) / 1e3
    return issued * 1e6 / CALLS if issued < 0.9 * slept else float("inf")


def row(label: str, m: int, fn) -> str:
    try:
        gpu, wall, host = graph_us([fn]), eager_us(fn), host_us(fn)
    except Exception as e:  # noqa: BLE001 - a kernel that cannot run here: say so in the table
        return f"| {label} | {m} | failed: {type(e).__name__}: {str(e).splitlines()[0][:100]} | | | |"
    bound = "host" if host > gpu else "GPU"
    return f"| {label} | {m} | {gpu:.1f} | {wall:.1f} | {host:.1f} | {bound} |"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--ms", type=int, nargs="+", default=[1024, 2048, 8192], help="prefill batch sizes (tokens)")
    args = ap.parse_args()
    gen = moe_setup()
    deep_gemm, why = deep_gemm_or_why()
    lines = [f"GPU: {torch.cuda.get_device_name()}; deep_gemm: {deep_gemm.__version__ if deep_gemm else why}; "
             f"us per call: GPU time in a CUDA graph, wall time of {CALLS} eager calls back to back, the host's time to "
             "issue one call while the GPU sleeps", "",
             "| layer | tokens | GPU us | eager wall us | host issue us | bound by |", "|---|---|---|---|---|---|"]

    def emit(line):
        lines.append(line)
        print(line, flush=True)
        args.out.write_text("\n".join(lines) + "\n")

    with torch.inference_mode():
        for name, n, k in (("qkv 2048->5120", 5120, 2048), ("o 4096->2048", 2048, 4096)):
            w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
            layer, _ = linear(registry.FLASHINFER_SM90, n, k)
            plan = registry.select_linear(LinearSpec(name, n, k), visible_gpu(), "flashinfer_trtllm")  # as served
            for m in args.ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                emit(row(f"{name} BF16 cuBLAS", m, lambda: torch.nn.functional.linear(x, w16)))
                emit(row(f"{name} plan apply ({plan.kernel_for(m).name})", m,
                         lambda: plan.apply(layer, layer.mxfp8_state, x, None)))
        w13_16, w2_16, q13, q2, c13, c2, _ = experts(I, gen)
        s13, s2 = c13.block_scale, c2.block_scale
        cutlass = CutlassGroupedMoE(E, H, I, "cuda")
        deepgemm = DeepGemmGroupedMoE(E, H, I) if deep_gemm else None
        for m in args.ms:
            x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16, generator=gen)
            tw, ids = routing(m, gen)
            emit(row("MoE BF16 fused (Triton)", m, lambda: outplace_fused_experts(x, w13_16, w2_16, tw, ids)))
            emit(row("MoE Triton block-FP8 fused", m, lambda: triton_block_fp8(x, q13, q2, s13, s2, tw, ids)))
            if deepgemm:
                emit(row("MoE DeepGEMM grouped", m, lambda: deepgemm(x, tw, ids, q13, q2, s13, s2)))
            emit(row("MoE CUTLASS grouped", m, lambda: cutlass(x, tw, ids, q13, q2, s13, s2)))


if __name__ == "__main__":
    main()
