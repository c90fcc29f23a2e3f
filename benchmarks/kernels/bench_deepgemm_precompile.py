"""What compiling DeepGEMM's kernels at load costs: the dense FP8 GEMM per layer shape of bench_dense.py
(deepgemm_sm90.precompile: one GEMM per 64-row bucket of the prefill range) and the Qwen3-30B-A3B MoE layer of
bench_moe.py (DeepGemmGroupedMoE.precompile: one batch per tile config of its grouped GEMMs): the batches run, the
kernels DeepGEMM compiled (new entries in its cache folder) and the seconds. Run it twice on one DeepGEMM cache folder: the first run is a server's first
load on a machine, the second what each later server pays (kernels read back from disk).

    DG_JIT_CACHE_DIR=/tmp/dg python benchmarks/kernels/bench_deepgemm_precompile.py --out OUT/a.md --label "empty cache"
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from sglang_mxfp8 import deepgemm_sm90
from sglang_mxfp8.moe_hopper import DEEPGEMM_PREFILL_MIN_TOKENS, DeepGemmGroupedMoE
from sglang_mxfp8.numerics import quantize_mxfp8
from sglang_mxfp8.refit import BlockScaleConverter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dense import SHAPES  # noqa: E402
from bench_moe import E, H, I, TOPK, experts  # noqa: E402


def cache_entries() -> int:
    root = Path(os.environ.get("DG_JIT_CACHE_DIR") or Path.home() / ".deep_gemm") / "cache"
    return len(list(root.iterdir())) if root.is_dir() else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--label", required=True, help="what this run's cache held, for the table")
    ap.add_argument("--max-m", type=int, default=8192, help="the server's largest batch (its chunked prefill size)")
    args = ap.parse_args()
    compiler = "NVRTC" if os.environ.get("DG_JIT_USE_NVRTC", "0") != "0" else "nvcc"
    lines = [f"GPU: {torch.cuda.get_device_name()}; DeepGEMM compiling with {compiler}; {args.label}; batches of "
             f"{deepgemm_sm90.DENSE_MIN_TOKENS}..{args.max_m} tokens", "",
             "| layer | batches run | kernels compiled | seconds |", "|---|---|---|---|"]
    for name, (k, n, _) in SHAPES.items():
        q, s = quantize_mxfp8(torch.randn(n, k, device="cuda") * 0.02)
        scales = BlockScaleConverter(1, n, k, 128, q.device, name)
        scales.refresh(q, s)
        before, start = cache_entries(), time.perf_counter()
        runs = deepgemm_sm90.precompile(q, scales.block_scale[0], deepgemm_sm90.DENSE_MIN_TOKENS, args.max_m)
        lines.append(f"| {name} | {runs} | {cache_entries() - before} | {time.perf_counter() - start:.1f} |")
        print(lines[-1], flush=True)
    _, _, q13, q2, c13, c2, _ = experts(I, torch.Generator(device="cuda").manual_seed(0))
    before, start = cache_entries(), time.perf_counter()
    runs = DeepGemmGroupedMoE(E, H, I).precompile(q13, q2, c13.block_scale, c2.block_scale, TOPK,
                                                  DEEPGEMM_PREFILL_MIN_TOKENS, args.max_m)
    lines.append(f"| qwen3-30b-a3b MoE (E={E}, H={H}, I={I}, top-{TOPK}) | {runs} | {cache_entries() - before} "
                 f"| {time.perf_counter() - start:.1f} |")
    print(lines[-1], flush=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
