"""Dense MXFP8 layer time per backend vs BF16 cuBLAS, measured in the same run (whole op: activation
quantization + GEMM, with --flashinfer also FlashInfer's and cuBLAS's block-scaled FP8 GEMMs, with --deepgemm
DeepGEMM's dense FP8 GEMM on the same operands; and our weight-only FP8 GEMM at small M and one-token GEMV,
which quantize nothing). Prints a markdown table and writes it to --out.

    python benchmarks/kernels/bench_dense.py --out OUT/dense.md [--flashinfer [--deepgemm]] [--timer graph] [--tp 2]

--timer eager: triton's do_bench (L2 flushed between calls; includes each launch's host cost when the
GPU work is shorter, as in prefill and eager decode). --timer graph: GPU time per layer inside one CUDA
graph that runs enough distinct copies of the layer to exceed the L2 cache, as SGLang's decode graphs
run a model's layers one after another. --tp T: each layer's shard on one rank (N / T for column-,
K / T for row-parallel layers; the all-reduce is not timed).
"""

import argparse
import math
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

from sglang_mxfp8.kernels.base import LinearSpec
from sglang_mxfp8.kernels.registry import CUBLAS as CUBLAS_KERNEL
from sglang_mxfp8.kernels.registry import FLASHINFER_SM90, TRITON_W8A8
from sglang_mxfp8.ops.cublas_sm90 import blockscale_gemm
from sglang_mxfp8.ops.deepgemm_sm90 import dense_gemm
from sglang_mxfp8.ops.triton_sm90 import w8a16_gemm, w8a16_gemv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_timer import graph_us  # noqa: E402
from hopper_layers import block_scale, linear  # noqa: E402
from plot_speedup import plot_beside  # noqa: E402

SHAPES = {  # name: (K, N, the dimension tensor parallelism splits: N for column-, K for row-parallel layers)
    "qwen3-30b-a3b qkv 2048->5120": (2048, 5120, "N"),
    "qwen3-30b-a3b o 4096->2048": (4096, 2048, "K"),
    "llama3-8b up 4096->14336": (4096, 14336, "N"),
    "llama3-8b down 14336->4096": (14336, 4096, "K"),
}
MS = [1, 16, 64, 128, 1024, 8192]
WEIGHT_ONLY = "triton_w8a16 (weight-only, M <= 128)"  # BF16 activations, no quantization launch
GEMV = "triton_gemv (weight-only, M = 1)"  # one token, CUDA cores, no quantization launch
CUBLAS = "cublas_blockscale (our quantizer + cuBLAS)"  # torch's scaled_mm, 1x128 x 128x128 scales
DEEPGEMM = "deepgemm (our quantizer + DeepGEMM fp8_gemm_nt)"  # the same operands on DeepGEMM's Hopper 1D2D GEMM
WORKING_SET = 256 << 20  # bytes of weights per timed graph: several times the H200's 50 MB L2


def graph_copies(n: int, k: int) -> int:
    """Distinct [n, k] FP8 weight copies a timed graph cycles through, so weights come from HBM, not L2."""
    return min(64, max(1, math.ceil(WORKING_SET / (n * k))))


def variants(n, k, flashinfer: bool, copies: int, deepgemm: bool = False):
    """{label: [one callable per weight copy]}: BF16 first (the baseline), then the MXFP8 paths."""
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    out = {"BF16 cuBLAS": [lambda x, w=w: torch.nn.functional.linear(x, w) for w in w16]}
    tri = [linear(TRITON_W8A8, n, k) for _ in range(copies)]
    out[TRITON_W8A8.name] = [run for _, run in tri]
    out[WEIGHT_ONLY] = [lambda x, layer=layer: w8a16_gemm(x, layer.weight, block_scale(layer)) for layer, _ in tri]
    out[GEMV] = [lambda x, layer=layer: w8a16_gemv(x, layer.weight, block_scale(layer)) for layer, _ in tri]
    if flashinfer:
        fi = [linear(FLASHINFER_SM90, n, k) for _ in range(copies)]
        out[FLASHINFER_SM90.name] = [run for _, run in fi]
        if CUBLAS_KERNEL.can_implement(LinearSpec("bench", n, k))[0]:  # the same operands (128x128 scales) on cuBLAS
            out[CUBLAS] = [lambda x, layer=layer: blockscale_gemm(x, layer.weight, block_scale(layer)) for layer, _ in fi]
        if deepgemm:
            out[DEEPGEMM] = [lambda x, layer=layer: dense_gemm(x, layer.weight, block_scale(layer)) for layer, _ in fi]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--flashinfer", action="store_true", help="also time fp8_blockscale_gemm_sm90 (JIT ~2 min first time) and "
                    "cuBLAS's block-scaled GEMM on the same operands")
    ap.add_argument("--deepgemm", action="store_true", help="with --flashinfer: also DeepGEMM's dense FP8 GEMM on the "
                    "same operands (needs deep_gemm importable; bash benchmarks/run_h200.sh deepgemm sets it up)")
    ap.add_argument("--timer", choices=["eager", "graph"], default="eager")
    ap.add_argument("--tp", type=int, default=1, help="time one tensor-parallel rank's shard")
    ap.add_argument("--ms", type=int, nargs="+", default=MS, help="batch sizes (rows of the activation)")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    how = ("do_bench medians" if args.timer == "eager" else
           f"medians per layer inside one CUDA graph over distinct copies ({WORKING_SET >> 20} MiB of FP8 weights)")
    tp = f"; one rank's shard at TP{args.tp}" if args.tp > 1 else ""
    lines, header = [f"GPU: {gpu}; {how}, microseconds{tp}; ratio = BF16 time / backend time (>1 is faster)", ""], None
    for name, (k, n, split) in SHAPES.items():
        k, n = (k // args.tp, n) if split == "K" else (k, n // args.tp)
        name = name if args.tp == 1 else f"{name.rsplit(' ', 1)[0]} {k}->{n}"
        copies = 1 if args.timer == "eager" else graph_copies(n, k)
        fns = variants(n, k, args.flashinfer, copies, args.deepgemm)
        if header is None:
            labels = list(fns)[1:]
            header = ["| shape | M | BF16 cuBLAS us | " + " | ".join(f"{b} us (ratio)" for b in labels) + " |",
                      "|---|---|---|" + "---|" * len(labels)]
            lines += header
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            times = {}
            for label, calls in fns.items():
                if (label == WEIGHT_ONLY and m > 128) or (label == GEMV and m > 1):
                    times[label] = None
                    continue
                try:
                    if args.timer == "eager":
                        times[label] = do_bench(lambda: calls[0](x), warmup=25, rep=100) * 1e3
                    else:
                        times[label] = graph_us([lambda f=f: f(x) for f in calls])
                except RuntimeError as e:  # e.g. a kernel that cannot be captured in a CUDA graph
                    print(f"{label} M={m}: {str(e).splitlines()[0]}", flush=True)
                    times[label] = None
            t16 = times.pop("BF16 cuBLAS")
            lines.append(f"| {name} | {m} | {t16:.1f} | " + " | ".join(
                f"{t:.1f} ({t16 / t:.2f}x)" if t else "n/a" for t in times.values()) + " |")
            print(lines[-1], flush=True)
        del fns
        torch.cuda.empty_cache()
    open(args.out, "w").write("\n".join(lines) + "\n")
    plot_beside(args.out, f"Dense MXFP8 layer (quantize + GEMM) vs BF16 cuBLAS, {gpu}, {args.timer} timing", target=1.6)


if __name__ == "__main__":
    main()
