"""MoE layers whose hidden or intermediate size is a multiple of 32 but not of 128, as the Hopper MoE serves them
(our masked Triton W8A8 MoE, ops/triton_sm90.moe_w8a8), against SGLang's BF16 fused MoE in the same run: GPU time
per call in a CUDA graph, relative error against a float32 reference with 1x128 FP8 activations. Beside it, SGLang's
Triton block-FP8 fused MoE: on the on-grid Qwen3-30B-A3B shape as it runs there (the base kernel), off the grid on the
experts zero-padded to the 128 grid, the activations padded per call (the alternative to masking; a served layer
would hold that padded FP8 copy beside the checkpoint-shaped weights SGLang's loader writes). Weight memory against
BF16 (FP8 weights, the checkpoint's UE8M0 scales, every derived buffer; the padded copy's alone).

    python benchmarks/kernels/bench_off_grid_moe.py --out OUT/off_grid_moe.md
"""

import argparse
import sys
from pathlib import Path

import torch

from sglang_mxfp8.format.numerics import moe_reference, quantize_mxfp8
from sglang_mxfp8.format.refit import BlockScaleConverter
from sglang_mxfp8.ops.triton_sm90 import moe_w8a8

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import moe_setup, experts, outplace_fused_experts as fused_experts, triton_block_fp8  # noqa: E402
from gpu_timer import graph_us  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plot_speedup import plot_beside  # noqa: E402

# (name, experts, hidden, intermediate, top_k)
LAYERS = [("gpt-oss-20b 2880x2880 E32", 32, 2880, 2880, 4), ("hidden 576 E64", 64, 576, 768, 8),
          ("intermediate 96 E128", 128, 2048, 96, 8), ("qwen3-30b-a3b (on grid)", 128, 2048, 768, 8)]
MS = [1, 16, 64, 256, 1024, 4096, 8192]


def _to_128(n: int) -> int:
    return -(-n // 128) * 128


def padded_experts(w13_16, w2_16, inter: int, hidden: int):
    """The experts zero-padded to the 128 grid (each of w13's two halves to the padded intermediate size, K to the
    padded hidden size; w2 to [padded hidden, padded intermediate]), quantized to MXFP8 and converted to 128x128 block
    scales: (w13, w2, their block scales, bytes of all of it). Hidden and intermediate sizes are multiples of 32, so
    the real region's FP8 values and scales are the unpadded layer's; all-zero blocks do not move a block's scale."""
    e, hp, ip = w13_16.shape[0], _to_128(hidden), _to_128(inter)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    w13 = torch.zeros(e, 2 * ip, hp, dtype=w13_16.dtype, device=w13_16.device)
    w13[:, :inter, :hidden], w13[:, ip:ip + inter, :hidden] = w13_16[:, :inter], w13_16[:, inter:]
    w2 = torch.zeros(e, hp, ip, dtype=w2_16.dtype, device=w2_16.device)
    w2[:, :hidden, :inter] = w2_16
    (q13, s13), (q2, s2) = quantize_mxfp8(w13), quantize_mxfp8(w2)
    del w13, w2
    c13 = BlockScaleConverter(e, 2 * ip, hp, 128, "cuda", "w13 padded")
    c2 = BlockScaleConverter(e, hp, ip, 128, "cuda", "w2 padded")
    c13.refresh(q13, s13)
    c2.refresh(q2, s2)
    del s13, s2  # the padded layout runs on block scales alone
    torch.cuda.synchronize()
    return q13, q2, c13.block_scale, c2.block_scale, torch.cuda.memory_allocated() - base


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gen = moe_setup()
    lines = [f"GPU: {torch.cuda.get_device_name()}; GPU time per call in a CUDA graph (us); rel. error vs float32 with "
             "1x128 FP8 activations", "",
             "| layer | tokens | BF16 us | masked W8A8 us (x BF16) | its rel. error | Triton block-FP8 (zero-padded off the "
             "grid) us (x BF16) | its rel. error |",
             "|---|---|---|---|---|---|---|"]
    notes = []
    for name, e_count, h, inter, top_k in LAYERS:
        w13_16, w2_16, q13, q2, c13, c2, mx_bytes = experts(inter, gen, e_count, h)
        ratio = mx_bytes / (w13_16.numel() + w2_16.numel()) / 2
        notes.append(f"{name}: MXFP8 weights + checkpoint scales + derived buffers = {ratio:.4f}x BF16")
        on_grid = h % 128 == 0 and inter % 128 == 0
        if on_grid:
            p13, p2, ps13, ps2 = q13, q2, c13.block_scale, c2.block_scale
        else:
            p13, p2, ps13, ps2, padded_bytes = padded_experts(w13_16, w2_16, inter, h)
            notes.append(f"{name}: the copy zero-padded to the 128 grid (FP8 + block scales) = "
                         f"{padded_bytes / (w13_16.numel() + w2_16.numel()) / 2:.4f}x BF16")
        pad = _to_128(h) - h
        for m in MS:
            x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=gen)
            logits = torch.randn(m, e_count, device="cuda", generator=gen)
            tw, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
            tw, ids = (tw / tw.sum(-1, keepdim=True)).float(), ids.int()
            ref = moe_reference(x, q13, c13.block_scale, q2, c2.block_scale, tw, ids)
            bf16 = graph_us([lambda: fused_experts(x, w13_16, w2_16, tw, ids)])
            run = lambda: moe_w8a8(x, q13, c13.block_scale, q2, c2.block_scale, tw, ids)  # noqa: E731
            masked = graph_us([run])
            rel = ((run().float() - ref).norm() / ref.norm()).item()
            block = lambda: triton_block_fp8(  # noqa: E731
                torch.nn.functional.pad(x, (0, pad)) if pad else x, p13, p2, ps13, ps2, tw, ids)[:, :h]
            t = graph_us([block])
            block_rel = ((block().float() - ref).norm() / ref.norm()).item()
            lines.append(f"| {name} | {m} | {bf16:.1f} | {masked:.1f} ({bf16 / masked:.2f}x) | {rel:.4f} | "
                         f"{t:.1f} ({bf16 / t:.2f}x) | {block_rel:.4f} |")
            print(lines[-1], flush=True)
            Path(args.out).write_text("\n".join(lines + [""] + notes) + "\n")
    print("\n".join(notes))
    plot_beside(args.out, "MoE layers off the 128 grid, masked W8A8 vs BF16, " + torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
