"""Dense MXFP8 layer time per backend vs BF16 cuBLAS, measured in the same run (whole op: activation
quantization + GEMM). Prints a markdown table and writes it to --out.

    python benchmarks/kernels/bench_dense.py --out OUT/dense.md
"""

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

from sglang_mxfp8.dense import HopperFlashInferDense, HopperTritonDense
from sglang_mxfp8.numerics import quantize_mxfp8
from sglang_mxfp8.resolver import Choice

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plot_speedup import plot_beside  # noqa: E402

SHAPES = {  # name: (K, N)
    "qwen3-30b-a3b qkv 2048->5120": (2048, 5120),
    "qwen3-30b-a3b o 4096->2048": (4096, 2048),
    "llama3-8b up 4096->14336": (4096, 14336),
    "llama3-8b down 14336->4096": (14336, 4096),
}
MS = [1, 16, 128, 1024, 8192]


class Layer(torch.nn.Module):
    pass


def make(cls, n, k):
    q, s = quantize_mxfp8(torch.randn(n, k, device="cuda") * 0.02)
    layer = Layer()
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    be = cls(Choice(cls.kernel, "bench"), "bench")
    be.create_buffers(layer, n, k)
    be.process_weights_after_loading(layer, s)
    return layer, be


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--flashinfer", action="store_true", help="also time fp8_blockscale_gemm_sm90 (JIT ~2 min first time)")
    args = ap.parse_args()
    backends = [HopperTritonDense] + ([HopperFlashInferDense] if args.flashinfer else [])
    gpu = torch.cuda.get_device_name()
    lines = [f"GPU: {gpu}; times are do_bench medians in microseconds; ratio = BF16 time / backend time (>1 is faster)", "",
             "| shape | M | BF16 cuBLAS us | " + " | ".join(f"{b.kernel} us (ratio)" for b in backends) + " |",
             "|---|---|---|" + "---|" * len(backends)]
    for name, (k, n) in SHAPES.items():
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        made = [make(b, n, k) for b in backends]
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t16 = do_bench(lambda: torch.nn.functional.linear(x, w16), warmup=25, rep=100) * 1e3
            cells = []
            for layer, be in made:
                t = do_bench(lambda: be.apply(layer, x), warmup=25, rep=100) * 1e3
                cells.append(f"{t:.1f} ({t16 / t:.2f}x)")
            lines.append(f"| {name} | {m} | {t16:.1f} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    open(args.out, "w").write("\n".join(lines) + "\n")
    plot_beside(args.out, "Dense MXFP8 layer (quantize + GEMM) vs BF16 cuBLAS, " + torch.cuda.get_device_name(), target=1.6)


if __name__ == "__main__":
    main()
