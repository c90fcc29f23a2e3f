"""MoE layer time, MXFP8 (our Hopper path: SGLang's Triton fused MoE on converted 128x128 block-FP8
weights) vs SGLang's BF16 Triton fused MoE in the same run, plus accuracy and weight memory; our
weight-only MoE kernels (BF16 activations, no quantization launches) at decode batch sizes (the one-token
GEMV MoE at 1 token); and, as a
candidate, SGLang's CUTLASS grouped block-FP8 MoE (sgl_kernel ``fp8_blockwise_scaled_grouped_mm``,
``--moe-runner-backend cutlass`` for block-FP8 checkpoints; what our Hopper MoE runs for prefill batches) on
the same converted weights, also with its SM90 expert-specialized grouped GEMM
(sgl_kernel ``es_fp8_blockwise_scaled_grouped_mm``).

Qwen3-30B-A3B MoE layer: 128 experts, hidden 2048, intermediate 768, top-8.

    python benchmarks/kernels/bench_moe.py --out OUT/moe.md [--tp 2]

Two timings: do_bench (eager: each call's host launch cost included when the GPU work is shorter; the L2
is flushed between calls) and GPU time inside a CUDA graph (as SGLang's decode graphs run it). From 16
tokens up a routing touches most experts, 0.6-1.2 GB, far more than the 50 MB L2, so one call per graph is
enough; one token touches 8 experts (38 MB in FP8, 75 MB in BF16), so its graph runs 16 calls, each with its
own routing, as a decode step's layers do. --tp T: one tensor-parallel rank's shard (intermediate size I / T
per expert; the all-reduce is not timed).
"""

import argparse
import sys
from pathlib import Path

import torch
from sglang_mxfp8.sglang.plugin import sglang_object
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from triton.testing import do_bench

from sglang_mxfp8.format.numerics import quantize_mxfp8
from sglang_mxfp8.kernels.moe.cutlass_grouped import CutlassGroupedMoE
from sglang_mxfp8.format.refit import BlockScaleConverter
from sglang_mxfp8.ops.triton_sm90 import moe_gemv, moe_w8a16

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_timer import graph_us  # noqa: E402
from plot_speedup import plot_beside  # noqa: E402

E, H, I, TOPK = 128, 2048, 768, 8
outplace_fused_experts = sglang_object("fused_experts")  # SGLang's Triton fused MoE, where this SGLang keeps it

MS = [1, 16, 64, 128, 256, 1024, 2048, 4096, 8192]
WEIGHT_ONLY_MAX = 256  # our weight-only MoE kernel is meant for decode batches
ONE_TOKEN_ROUTINGS = 16  # one-token graph calls, each with its own experts, so they stream from HBM


def routing(m, gen):
    logits = torch.randn(m, E, device="cuda", generator=gen)
    w, ids = torch.topk(torch.softmax(logits, -1), TOPK, dim=-1)
    return (w / w.sum(-1, keepdim=True)).float(), ids.int()


def experts(inter: int, gen, num_experts: int = E, hidden: int = H):
    """Random BF16 experts and their MXFP8 form on our Hopper path (converted 128x128 block scales):
    (w13, w2, w13 e4m3, w2 e4m3, w13 converter, w2 converter, MXFP8 bytes incl. every derived buffer)."""
    w13_16 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    w2_16 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    q13, s13 = quantize_mxfp8(w13_16)
    q2, s2 = quantize_mxfp8(w2_16)
    c13 = BlockScaleConverter(num_experts, 2 * inter, hidden, 128, "cuda", "w13")
    c2 = BlockScaleConverter(num_experts, hidden, inter, 128, "cuda", "w2")
    torch.cuda.synchronize()
    mx_bytes = torch.cuda.memory_allocated() - base  # weights + checkpoint scales + all derived buffers
    c13.refresh(q13, s13)
    c2.refresh(q2, s2)
    return w13_16, w2_16, q13, q2, c13, c2, mx_bytes


def triton_block_fp8(x, q13, q2, s13, s2, tw, ids):
    """SGLang's Triton fused MoE in block-FP8 mode on our converted weights and 128x128 scales: what the Hopper
    MoE runs for batches below the prefill kernels' threshold."""
    return outplace_fused_experts(x, q13, q2, tw, ids, use_fp8_w8a8=True, w1_scale=s13, w2_scale=s2,
                                  block_shape=[128, 128])


def bf16_case(m: int, gen, w13_16, w2_16):
    """A batch of m tokens with one routing, and SGLang's BF16 fused MoE on it: (x, [routing], its output in float32,
    its GPU time per call in a CUDA graph)."""
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    routings = [routing(m, gen)]

    def bf16(tw, ids):
        return outplace_fused_experts(x, w13_16, w2_16, tw, ids)

    return x, routings, bf16(*routings[0]).float(), graph_per_call_us(bf16, routings)


def graph_per_call_us(run, routings, reps: int = 20) -> float:
    """GPU time of ``run(topk_weights, topk_ids)`` per call, in one CUDA graph with one call per routing."""
    return graph_us([lambda r=r: run(*r) for r in routings], reps=reps)


def moe_setup() -> torch.Generator:
    """What SGLang's MoE kernels need before a call outside a server (global ServerArgs, as its own MoE kernel tests
    set them), and the seeded CUDA generator every MoE table draws its weights and routings from."""
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))
    return torch.Generator(device="cuda").manual_seed(0)


def candidate(run, routings, ref, bf16_us) -> str:
    """Table cells 'graph us (ratio to BF16) | rel. error vs BF16' for an MoE call ``run(topk_weights,
    topk_ids)`` (error on the first routing), or why it failed."""
    try:
        got = run(*routings[0]).float()
        us = graph_per_call_us(run, routings)
        return f"{us:.1f} ({bf16_us / us:.2f}x) | {((got - ref).norm() / ref.norm()).item():.4f}"
    except Exception as e:  # noqa: BLE001 - a kernel missing from this sgl_kernel build: say so in the table
        return f"failed: {type(e).__name__}: {str(e)[:80]} | n/a"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1, help="time one tensor-parallel rank's shard")
    args = ap.parse_args()
    inter = I // args.tp
    gen = moe_setup()
    w13_16, w2_16, q13, q2, c13, c2, mx_bytes = experts(inter, gen)
    bf16_bytes = (w13_16.numel() + w2_16.numel()) * 2

    tp = f" (one rank's shard at TP{args.tp})" if args.tp > 1 else ""
    lines = [f"GPU: {torch.cuda.get_device_name()}; E={E} H={H} I={inter}{tp} top-{TOPK}; do_bench medians and GPU time in a CUDA graph (us)",
             f"weight memory MXFP8 (fp8 + uint8 scales + converted scales + refit fingerprints) / BF16: "
             f"{mx_bytes / 2**20:.1f} MiB / {bf16_bytes / 2**20:.1f} MiB = {mx_bytes / bf16_bytes:.3f}x", "",
             "| tokens | BF16 us | MXFP8 us | speedup | BF16 graph us | MXFP8 graph us | graph speedup | rel. error vs BF16 "
             f"| weight-only MXFP8 graph us (ratio), tokens <= {WEIGHT_ONLY_MAX} "
             "| CUTLASS grouped MXFP8 graph us (ratio) | CUTLASS rel. error vs BF16 "
             "| CUTLASS expert-specialized graph us (ratio) | its rel. error vs BF16 "
             "| one-token GEMV MoE graph us (ratio) | its rel. error vs BF16 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print(lines[1], flush=True)
    cutlass = CutlassGroupedMoE(E, H, inter, "cuda")
    cutlass_es = CutlassGroupedMoE(E, H, inter, "cuda", expert_specialized=True)
    for m in MS:
        x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        routings = [routing(m, gen) for _ in range(ONE_TOKEN_ROUTINGS if m == 1 else 1)]

        def bf16(tw, ids):
            return outplace_fused_experts(x, w13_16, w2_16, tw, ids)

        def mx(tw, ids):
            return triton_block_fp8(x, q13, q2, c13.block_scale, c2.block_scale, tw, ids)

        ref, out = bf16(*routings[0]).float(), mx(*routings[0]).float()
        rel = ((out - ref).norm() / ref.norm()).item()
        t16 = do_bench(lambda: bf16(*routings[0]), warmup=10, rep=50) * 1e3
        t8 = do_bench(lambda: mx(*routings[0]), warmup=10, rep=50) * 1e3
        g16, g8 = graph_per_call_us(bf16, routings), graph_per_call_us(mx, routings)
        wo = "n/a"
        if m <= WEIGHT_ONLY_MAX:
            gw = graph_per_call_us(lambda tw, ids: moe_w8a16(x, q13, c13.block_scale, q2, c2.block_scale, tw, ids),
                                   routings)
            wo = f"{gw:.1f} ({g16 / gw:.2f}x)"
        cut = " | ".join(candidate(lambda tw, ids, run=run: run(x, tw, ids, q13, q2, c13.block_scale, c2.block_scale),
                                   routings, ref, g16)
                         for run in (cutlass, cutlass_es))
        gemv = "n/a | n/a"
        if m == 1:
            gemv = candidate(lambda tw, ids: moe_gemv(x, q13, c13.block_scale, q2, c2.block_scale, tw, ids),
                             routings, ref, g16)
        lines.append(f"| {m} | {t16:.1f} | {t8:.1f} | {t16 / t8:.2f}x | {g16:.1f} | {g8:.1f} | {g16 / g8:.2f}x | {rel:.4f} "
                     f"| {wo} | {cut} | {gemv} |")
        print(lines[-1], flush=True)
        open(args.out, "w").write("\n".join(lines) + "\n")  # each row kept should a later kernel fault
    plot_beside(args.out, "MoE layer, MXFP8 vs BF16, " + torch.cuda.get_device_name(), target=1.5)


if __name__ == "__main__":
    main()
