"""FlashInfer's CUTLASS fused MoE on Hopper (``cutlass_fused_moe`` with ``use_deepseek_fp8_block_scale``, from the
trimmed SM90 build in ops/flashinfer_moe_sm90.py) against SGLang's BF16 fused MoE, our Hopper MoE's Triton path
(SGLang's Triton fused MoE on the converted 128x128 block-FP8 weights) and, where ``deep_gemm`` imports, our DeepGEMM
prefill MoE, in the same run: GPU time per call in a CUDA graph, relative error against a float32 reference with
1x128 FP8 activations, and the trimmed module's build (or cache load) time.

Qwen3-30B-A3B MoE layer: 128 experts, hidden 2048, intermediate 768, top-8.

    python benchmarks/kernels/bench_flashinfer_moe_sm90.py --out OUT/fi_moe.md
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from sglang_mxfp8.format.numerics import moe_reference
from sglang_mxfp8.ops import flashinfer_moe_sm90
from sglang_mxfp8.platform import deep_gemm_missing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import moe_setup, E, H, I, TOPK, experts, graph_per_call_us, outplace_fused_experts, routing, triton_block_fp8  # noqa: E402,E501

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plot_speedup import plot_beside  # noqa: E402

MS = [1, 16, 64, 256, 1024, 2048, 4096, 8192]


def up_gate(w, rows_per_half):
    """[gate; up] rows per expert -> [up; gate] (what cutlass_fused_moe reads)."""
    return torch.cat([w[:, rows_per_half:], w[:, :rows_per_half]], dim=1).contiguous()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gen = moe_setup()

    start = time.perf_counter()
    was_built = flashinfer_moe_sm90.block_scale_moe_spec().is_compiled
    flashinfer_moe_sm90.fused_moe_api()
    build_s = time.perf_counter() - start

    w13_16, w2_16, q13, q2, c13, c2, _ = experts(I, gen)
    q13_ug, s13_ug = up_gate(q13, I), up_gate(c13.block_scale, I // 128)
    use_deepgemm = not deep_gemm_missing("m_grouped_fp8_gemm_nt_contiguous", "use_psum_layout")
    if use_deepgemm:
        from sglang_mxfp8.kernels.moe.deepgemm import DeepGemmGroupedMoE

        deepgemm = DeepGemmGroupedMoE(E, H, I)
    lines = [
        f"GPU: {torch.cuda.get_device_name()}; E={E} H={H} I={I} top-{TOPK}; GPU time per call in a CUDA graph (us); "
        f"rel. error vs float32 with 1x128 FP8 activations",
        f"trimmed module: {'loaded from the cache' if was_built else 'built'} in {build_s:.1f} s "
        f"({os.cpu_count()} CPUs)", "",
        "| tokens | BF16 us | FlashInfer SM90 us (x BF16) | its rel. error | Triton block-FP8 us (x BF16) "
        "| its rel. error | DeepGEMM MoE us (x BF16) | its rel. error | FlashInfer vs Triton |",
        "|---|---|---|---|---|---|---|---|---|"]
    for m in MS:
        x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        routings = [routing(m, gen) for _ in range(16 if m == 1 else 1)]
        ref = moe_reference(x, q13, c13.block_scale, q2, c2.block_scale, *routings[0])

        def rel(out):
            return ((out.float() - ref).norm() / ref.norm()).item()

        def fi(tw, ids):
            return flashinfer_moe_sm90.block_scale_moe(x, tw, ids, q13_ug, q2, s13_ug, c2.block_scale)

        def tri(tw, ids):
            return triton_block_fp8(x, q13, q2, c13.block_scale, c2.block_scale, tw, ids)

        g16 = graph_per_call_us(lambda tw, ids: outplace_fused_experts(x, w13_16, w2_16, tw, ids), routings)
        gfi, gtri = graph_per_call_us(fi, routings), graph_per_call_us(tri, routings)
        dg = "n/a | n/a"
        if use_deepgemm and m >= 256:
            def dgm(tw, ids):
                return deepgemm(x, tw, ids, q13, q2, c13.block_scale, c2.block_scale)

            gdg = graph_per_call_us(dgm, routings)
            dg = f"{gdg:.1f} ({g16 / gdg:.2f}x) | {rel(dgm(*routings[0])):.4f}"
        lines.append(f"| {m} | {g16:.1f} | {gfi:.1f} ({g16 / gfi:.2f}x) | {rel(fi(*routings[0])):.4f} "
                     f"| {gtri:.1f} ({g16 / gtri:.2f}x) | {rel(tri(*routings[0])):.4f} | {dg} | {gtri / gfi:.2f}x |")
        print(lines[-1], flush=True)
        open(args.out, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines[:2]))
    plot_beside(args.out, "MoE layer, FlashInfer SM90 fused MoE vs BF16, " + torch.cuda.get_device_name(), target=1.5)


if __name__ == "__main__":
    main()
