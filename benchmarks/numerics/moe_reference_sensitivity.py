"""How far a correct W8A8 MoE can sit from the host reference (CPU, no GPU needed).

The reference (`format.numerics.moe_reference`) rounds GEMM1's output to bf16, then the SiLU-and-mul result to bf16
and FP8, as the kernels store them. A kernel that sums GEMM1 in another order rounds some of those values the other
way, and the FP8 rounding after it turns a one-ulp bf16 difference into a one-ulp FP8 difference. This script puts
relative noise of a chosen size before each of the reference's bf16 roundings and prints how far that moves the
output, and how far each lies from the float32 layer with unquantized activations (the error FP8 activations cost):

    python benchmarks/numerics/moe_reference_sensitivity.py --tokens 1 16 256 --noise 1e-3 2e-3
"""

import argparse
import contextlib

import torch

from sglang_mxfp8.format.numerics import moe_reference, quantize_mxfp8
from sglang_mxfp8.format.refit import BlockScaleConverter


@contextlib.contextmanager
def noise_before_bf16_rounding(scale: float, generator: torch.Generator):
    """Every float32 -> bf16 rounding inside the block sees its input times (1 + scale * N(0, 1))."""
    plain = torch.Tensor.bfloat16

    def noisy(t, *args, **kwargs):
        if t.dtype == torch.float32:
            t = t * (1 + scale * torch.randn(t.shape, generator=generator))
        return plain(t, *args, **kwargs)

    torch.Tensor.bfloat16 = noisy
    try:
        yield
    finally:
        torch.Tensor.bfloat16 = plain


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--noise", type=float, nargs="+", default=[1e-3, 2e-3])
    args = ap.parse_args()
    e, h, i = args.experts, args.hidden, args.intermediate
    gen = torch.Generator().manual_seed(0)
    w13, s13 = quantize_mxfp8(torch.randn(e, 2 * i, h, generator=gen) * 0.05)
    w2, s2 = quantize_mxfp8(torch.randn(e, h, i, generator=gen) * 0.05)
    c13, c2 = BlockScaleConverter(e, 2 * i, h, 128, "cpu", "w13"), BlockScaleConverter(e, h, i, 128, "cpu", "w2")
    c13.refresh(w13, s13)
    c2.refresh(w2, s2)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    print(f"MoE E={e} H={h} I={i} top-{args.top_k}, MXFP8 weights (0.05 N(0,1)), activations N(0,1), CPU float32")
    print("| tokens | noise | reference vs float32 layer | perturbed vs reference | perturbed vs float32 layer (x reference's) |")
    print("|---|---|---|---|---|")
    for m in args.tokens:
        x = torch.randn(m, h, generator=gen).bfloat16()
        tw, ids = torch.topk(torch.softmax(torch.randn(m, e, generator=gen), -1), args.top_k, dim=-1)
        tw, ids = (tw / tw.sum(-1, keepdim=True)).float(), ids.int()

        def run(fp8_activations=True):
            return moe_reference(x, w13, c13.block_scale, w2, c2.block_scale, tw, ids, fp8_activations)

        ref, exact = run(), run(fp8_activations=False)
        for noise in args.noise:
            with noise_before_bf16_rounding(noise, gen):
                moved = run()
            print(f"| {m} | {noise:g} | {rel(ref, exact):.4f} | {rel(moved, ref):.4f} | {rel(moved, exact):.4f} "
                  f"({rel(moved, exact) / rel(ref, exact):.3f}x) |")


if __name__ == "__main__":
    main()
