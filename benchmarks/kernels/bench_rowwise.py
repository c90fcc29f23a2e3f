"""Per-row-scale candidates on Hopper, timed against what runs today (a probe: nothing here is dispatched).

MXFP8 weights converted in place to one power-of-two scale per output row (``numerics.convert_to_row_scales``:
per-channel FP8, exact but for e4m3 subnormals, as the 128x128 conversion) and activations quantized per token
(sgl_kernel) can run kernels that apply both scales once after the K loop instead of per 128-K block:
- dense: torch's row-wise scaled GEMM (``torch._scaled_mm``, scales [M, 1] x [1, N]), against BF16 cuBLAS,
  FlashInfer's block-scaled GEMM and cuBLAS's block-scaled GEMM (what runs below / from 1024 tokens);
- MoE: SGLang's Triton fused MoE in its per-channel FP8 mode, and torch's grouped row-wise FP8 GEMM
  (``torch._scaled_grouped_mm``, CUTLASS on SM90) with the token-slot rows sorted by expert, gathered and summed
  back per token around it (torch ops), against SGLang's BF16 fused MoE and our Hopper MoE (SGLang's Triton
  block-FP8 MoE; SGLang's CUTLASS grouped MoE from 2048 tokens). Qwen3-30B-A3B layer: 128 experts, hidden 2048,
  intermediate 768, top-8.
GPU time per call in a CUDA graph (dense: over 256 MiB of distinct weights), ratio to BF16, and each path's
relative error (dense: against the float32 product of BF16 activations and the MXFP8 weights; MoE: against the
BF16 layer). Both GEMM kinds accumulate without FP8 fast accumulation.

    python benchmarks/kernels/bench_rowwise.py --out-dir OUT     # rowwise_dense.md, rowwise_moe.md and their plots
"""

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench
from sglang_mxfp8.sglang.plugin import sglang_object
from sglang.srt.layers.quantization.fp8_kernel import sglang_per_token_quant_fp8

from sglang_mxfp8.ops.cublas_sm90 import blockscale_gemm
from sglang_mxfp8.kernels.registry import FLASHINFER_SM90
from sglang_mxfp8.kernels.moe.cutlass_grouped import CutlassGroupedMoE
from sglang_mxfp8.format.numerics import convert_to_row_scales, dequantize_block_fp8, quantize_mxfp8

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dense import SHAPES, graph_copies  # noqa: E402
from bench_moe import moe_setup, E, H, I, TOPK, bf16_case, experts, graph_per_call_us, triton_block_fp8  # noqa: E402
from gpu_timer import graph_us  # noqa: E402
from hopper_layers import block_scale, linear  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plot_speedup import plot_beside  # noqa: E402

outplace_fused_experts = sglang_object("fused_experts")  # SGLang's Triton fused MoE, where this SGLang keeps it

MS = [16, 64, 256, 1024, 2048, 4096, 8192]
DENSE_MS = [16, 128, 1024, 4096, 8192]


def row_scaled(q: torch.Tensor, s: torch.Tensor):
    """(e4m3 [E, N, K] converted in place to per-row scales, float32 scales [E, N]); the rows are independent,
    so the experts convert as one [E * N, K] matrix."""
    e, n, k = q.shape
    scales, _ = convert_to_row_scales(q.view(e * n, k), s.view(e * n, -1))
    return q, scales.view(e, n)


def grouped_gemm(a, q, sa, s, offs):
    """Rows of a [R, K] e4m3 (per-row scales sa [R, 1]) sorted by expert, offs [E] their cumulative ends, times
    each expert's q [N, K] e4m3 with per-row scales s [N]: [R, N] bf16."""
    return torch._scaled_grouped_mm(a, q.transpose(1, 2), sa.view(-1), s, offs=offs, out_dtype=torch.bfloat16,
                                    use_fast_accum=False)


def rowwise_grouped_moe(x, tw, ids, q13, s13, q2, s2, keep=None):
    """The MoE on torch's grouped row-wise FP8 GEMM: token-slot rows sorted by expert (stable), per-token FP8
    activations, SiLU-and-mul in between, the rows put back in slot order and summed with the routing weights.
    ``keep``: a dict that receives both GEMMs' inputs, to time the GEMMs alone."""
    from sgl_kernel import silu_and_mul

    m = x.shape[0]
    flat = ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    a, sa = sglang_per_token_quant_fp8(x.index_select(0, order // TOPK))
    h = grouped_gemm(a, q13, sa, s13, offs)
    act = torch.empty(h.shape[0], h.shape[1] // 2, dtype=h.dtype, device=h.device)
    silu_and_mul(h, act)
    a2, sa2 = sglang_per_token_quant_fp8(act)
    y = grouped_gemm(a2, q2, sa2, s2, offs)
    if keep is not None:
        keep.update(gemm1=(a, q13, sa, s13, offs), gemm2=(a2, q2, sa2, s2, offs))
    slots = torch.empty_like(y)
    slots[order] = y
    return torch.bmm(tw.to(y.dtype).view(m, 1, TOPK), slots.view(m, TOPK, H)).view(m, H)


def timed(run, routings) -> str:
    """GPU time per call in a CUDA graph; do_bench's eager time, marked, where the call cannot be captured."""
    try:
        return f"{graph_per_call_us(run, routings):.1f}"
    except Exception:  # noqa: BLE001 - e.g. a host sync inside the op
        return f"{do_bench(lambda: run(*routings[0]), warmup=10, rep=50) * 1e3:.1f} eager"


def cell(run, routings, ref, bf16_us) -> str:
    """'time (ratio to BF16) | rel. error vs BF16' for an MoE call ``run(topk_weights, topk_ids)``, or why it failed."""
    try:
        got = run(*routings[0]).float()
    except Exception as e:  # noqa: BLE001 - a refused shape or layout: say so in the table
        return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100]} | n/a"
    t = timed(run, routings)
    return f"{t} ({bf16_us / float(t.split()[0]):.2f}x) | {((got - ref).norm() / ref.norm()).item():.4f}"


def rowwise_linear(x, q, s_row):
    """x [M, K] bf16 quantized per token, times q [N, K] e4m3 with per-row scales s_row [N]: torch's row-wise GEMM."""
    a, sa = sglang_per_token_quant_fp8(x)
    return torch._scaled_mm(a, q.t(), scale_a=sa, scale_b=s_row.view(1, -1), out_dtype=torch.bfloat16,
                            use_fast_accum=False)


def dense_table() -> list:
    lines = ["| shape | M | BF16 cuBLAS us | FlashInfer block-scaled us (ratio) | cuBLAS block-scaled us (ratio) "
             "| per-row, torch row-wise us (ratio) | block rel. error | per-row rel. error |", "|---|---|---|---|---|---|---|---|"]
    for name, (k, n, _) in SHAPES.items():
        copies = graph_copies(n, k)
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        block = [linear(FLASHINFER_SM90, n, k) for _ in range(copies)]
        rows = [row_scaled(*quantize_mxfp8(w[None].float()))
                for w in w16]  # per-row copies of the BF16 weights (the block copies are their own draws)
        for m in DENSE_MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t16 = graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in w16])
            cells = []
            for calls in ([lambda run=run: run(x) for _, run in block],
                          [lambda lb=lb: blockscale_gemm(x, lb[0].weight, block_scale(lb[0])) for lb in block],
                          [lambda r=r: rowwise_linear(x, r[0][0], r[1][0]) for r in rows]):
                try:
                    t = graph_us(calls)
                    cells.append(f"{t:.1f} ({t16 / t:.2f}x)")
                except Exception as e:  # noqa: BLE001 - a refused layout: say so in the table
                    cells.append(f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            layer, run_block = block[0]
            ref_block = x.float() @ dequantize_block_fp8(layer.weight, block_scale(layer), 128).t()
            q, s_row = rows[0][0][0], rows[0][1][0]
            ref_row = x.float() @ (q.float() * s_row[:, None]).t()
            errs = []
            for run, ref in ((lambda: run_block(x), ref_block), (lambda: rowwise_linear(x, q, s_row), ref_row)):
                try:
                    errs.append(f"{((run().float() - ref).norm() / ref.norm()).item():.4f}")
                except Exception:  # noqa: BLE001 - its failure is in the time column
                    errs.append("n/a")
            lines.append(f"| {name} | {m} | {t16:.1f} | " + " | ".join(cells + errs) + " |")
            print(lines[-1], flush=True)
        del w16, block, rows
        torch.cuda.empty_cache()
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", required=True, type=Path)
    args = ap.parse_args()
    gen = moe_setup()
    gpu = torch.cuda.get_device_name()
    dense = [f"GPU: {gpu}; dense layers, whole op (quantizer + GEMM), GPU time per layer in one CUDA graph over "
             "256 MiB of distinct weights (us), ratio to BF16 cuBLAS", ""] + dense_table()
    (args.out_dir / "rowwise_dense.md").write_text("\n".join(dense) + "\n")
    plot_beside(args.out_dir / "rowwise_dense.md", f"Dense, per-row scales vs block scales vs BF16, {gpu}", target=1.6)
    w13_16, w2_16, q13, q2, c13, c2, _ = experts(I, gen)
    r13, s13 = row_scaled(*quantize_mxfp8(w13_16))
    r2, s2 = row_scaled(*quantize_mxfp8(w2_16))
    cutlass = CutlassGroupedMoE(E, H, I, "cuda")
    lines = [f"GPU: {gpu}; MoE layer, E={E} H={H} I={I} top-{TOPK}; GPU time per call in a CUDA graph (us), "
             "ratio to BF16; rel. error vs the BF16 layer on the same routing", "",
             "| tokens | BF16 us | MXFP8 block, Triton us (ratio) | its rel. error | MXFP8 block, CUTLASS grouped us (ratio) "
             "| its rel. error | per-row, Triton per-channel us (ratio) | its rel. error "
             "| per-row, torch grouped row-wise us (ratio) | its rel. error | its two grouped GEMMs alone us |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in MS:
        x, routings, ref, g16 = bf16_case(m, gen, w13_16, w2_16)
        cells = [
            cell(lambda tw, ids: triton_block_fp8(x, q13, q2, c13.block_scale, c2.block_scale, tw, ids),
                 routings, ref, g16),
            cell(lambda tw, ids: cutlass(x, tw, ids, q13, q2, c13.block_scale, c2.block_scale), routings, ref, g16),
            cell(lambda tw, ids: outplace_fused_experts(
                x, r13, r2, tw, ids, use_fp8_w8a8=True, per_channel_quant=True, w1_scale=s13[..., None],
                w2_scale=s2[..., None]), routings, ref, g16),
            cell(lambda tw, ids: rowwise_grouped_moe(x, tw, ids, r13, s13, r2, s2), routings, ref, g16),
        ]
        gemms = "n/a"
        if not cells[-1].startswith("failed"):
            keep = {}
            rowwise_grouped_moe(x, *routings[0], r13, s13, r2, s2, keep=keep)
            gemms = timed(lambda tw, ids: (grouped_gemm(*keep["gemm1"]), grouped_gemm(*keep["gemm2"])), routings)
        lines.append(f"| {m} | {g16:.1f} | " + " | ".join(cells) + f" | {gemms} |")
        print(lines[-1], flush=True)
        (args.out_dir / "rowwise_moe.md").write_text("\n".join(lines) + "\n")
    plot_beside(args.out_dir / "rowwise_moe.md", f"MoE layer, per-row scales vs block scales vs BF16, {gpu}", target=1.5)


if __name__ == "__main__":
    main()
