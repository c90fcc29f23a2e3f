"""The Hopper MoE's prefill kernels at prefill sizes: DeepGEMM's grouped FP8 GEMM with our glue
(kernels/moe/deepgemm.py, DeepGemmGroupedMoE: tokens quantized and scattered to their experts' rows in one pass, grouped GEMM
gate/up, SiLU-and-mul with the quantizer, grouped GEMM down, the weighted gather) against SGLang's CUTLASS
grouped MoE, SGLang's Triton fused MoE on the same block-FP8 weights (what smaller batches run; SGLang's default
tile configs, as in a plain process) and SGLang's BF16 fused MoE, in the same run; GPU time per call in a CUDA graph (neither prefill
MoE syncs with the host), and each DeepGEMM step alone on the layer's own operands, beside what two of its glue
steps were before (the segments as torch ops; SiLU-and-mul over every padded row, not only the rows holding slots).

Qwen3-30B-A3B MoE layer: 128 experts, hidden 2048, intermediate 768, top-8. Needs ``deep_gemm`` importable
(bash benchmarks/run_h200.sh deepgemm builds it from source on the GPU machine).

    python benchmarks/kernels/bench_deepgemm_moe.py --out OUT/deepgemm_moe.md
"""

import argparse
import sys
from pathlib import Path

import torch

from sglang_mxfp8.platform import load_deep_gemm
from sglang_mxfp8.kernels.moe.cutlass_grouped import CutlassGroupedMoE
from sglang_mxfp8.kernels.moe.deepgemm import DeepGemmGroupedMoE
from sglang_mxfp8.ops.triton_sm90 import silu_mul_quant

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import moe_setup, E, H, I, TOPK, bf16_case, experts, graph_per_call_us, triton_block_fp8  # noqa: E402
from bench_rowwise import cell  # noqa: E402
from gpu_timer import graph_us  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plot_speedup import plot_beside  # noqa: E402

MS = [512, 1024, 2048, 4096, 8192]


def torch_segments(topk_ids, experts: int):
    """The segments as torch ops computed them before triton_hopper.moe_segments (ten small launches), timed beside
    it: (cursor, seg_end, end)."""
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    padded = (counts + 127) // 128 * 128
    seg_end = torch.cumsum(padded, 0, dtype=torch.int32)
    starts = seg_end - padded
    return starts.clone(), seg_end, starts + counts


def before_steps(ids, keep) -> dict:
    """GPU us of what two glue steps were before: the segments as torch ops, and SiLU-and-mul with the quantizer
    over every padded row (now only the rows holding slots), each on this layer's routing."""
    seg_end = keep["seg_end"]
    h = torch.randn(int(seg_end[-1]) + 128, 2 * I, device="cuda").to(torch.bfloat16)
    return {"segments before (torch)": graph_us([lambda: torch_segments(ids, E)]),
            "silu_quantize before (all padded rows)": graph_us([lambda: silu_mul_quant(h, seg_end, seg_end)])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    deep_gemm = load_deep_gemm()

    gen = moe_setup()
    gpu = torch.cuda.get_device_name()
    w13_16, w2_16, q13, q2, c13, c2, _ = experts(I, gen)
    s13, s2 = c13.block_scale, c2.block_scale
    cutlass, deepgemm = CutlassGroupedMoE(E, H, I, "cuda"), DeepGemmGroupedMoE(E, H, I)
    lines = [f"GPU: {gpu}; DeepGEMM {deep_gemm.__version__}; MoE layer, E={E} H={H} I={I} top-{TOPK}; us per call; "
             "ratios to BF16 timed the same way; rel. error vs the BF16 layer on the same routing", "",
             "| tokens | BF16 graph us | Triton fused MXFP8 graph us (ratio) | its rel. error "
             "| CUTLASS grouped graph us (ratio) | its rel. error "
             "| DeepGEMM layer graph us (ratio) | its rel. error | DeepGEMM's two GEMMs alone, graph us "
             "| their TFLOP/s (routed rows) | rows padded / routed | each step alone, graph us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in MS:
        x, routings, ref, g16 = bf16_case(m, gen, w13_16, w2_16)
        tri = cell(lambda tw, ids: triton_block_fp8(x, q13, q2, s13, s2, tw, ids), routings, ref, g16)
        cut = cell(lambda tw, ids: cutlass(x, tw, ids, q13, q2, s13, s2), routings, ref, g16)
        try:
            keep = {}
            got = deepgemm(x, *routings[0], q13, q2, s13, s2, keep=keep).float()
            rel = ((got - ref).norm() / ref.norm()).item()
            gdg = graph_per_call_us(lambda tw, ids: deepgemm(x, tw, ids, q13, q2, s13, s2), routings)
            steps = {name: graph_us([run]) for name, run in keep["steps"].items()}
            steps.update(before_steps(routings[0][1], keep))
            gemms = steps["gemm_up"] + steps["gemm_down"]
            flop = 2 * m * TOPK * (2 * I * H + H * I)
            dg = (f"{gdg:.1f} ({g16 / gdg:.2f}x) | {rel:.4f} | {gemms:.1f} | {flop / gemms / 1e6:.0f} "
                  f"| {int(keep['seg_end'][-1])} / {m * TOPK} | " + ", ".join(f"{k} {v:.1f}" for k, v in steps.items()))
        except Exception as e:  # noqa: BLE001 - a refused shape or a JIT failure: say so in the table
            dg = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | n/a | n/a | n/a | n/a | n/a"
        lines.append(f"| {m} | {g16:.1f} | {tri} | {cut} | {dg} |")
        print(lines[-1], flush=True)
        args.out.write_text("\n".join(lines) + "\n")
    plot_beside(args.out, f"MoE layer, DeepGEMM grouped vs CUTLASS grouped vs Triton fused vs BF16, {gpu}", target=1.5)


if __name__ == "__main__":
    main()
