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

from sglang_mxfp8.kernels import registry
from sglang_mxfp8.kernels.base import LayerState, MoESpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dense import SHAPES  # noqa: E402
from bench_moe import E, H, I, TOPK, experts  # noqa: E402
from hopper_layers import linear  # noqa: E402

MIN_TOKENS = 1024  # the registry's prefill band for DeepGEMM's dense GEMM and its grouped MoE
DEEPGEMM_MOE = next(e.kernel for e in registry.HOPPER_MOE if e.kernel.name == "deepgemm_moe")


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
             f"{MIN_TOKENS}..{args.max_m} tokens", "",
             "| layer | batches run | kernels compiled | seconds |", "|---|---|---|---|"]
    for name, (k, n, _) in SHAPES.items():
        layer, _ = linear(registry.FLASHINFER_SM90, n, k)
        before, start = cache_entries(), time.perf_counter()
        runs = registry.DEEPGEMM.precompile(layer, layer.mxfp8_state, MIN_TOKENS, args.max_m)
        lines.append(f"| {name} | {runs} | {cache_entries() - before} | {time.perf_counter() - start:.1f} |")
        print(lines[-1], flush=True)
    _, _, q13, q2, c13, c2, _ = experts(I, torch.Generator(device="cuda").manual_seed(0))
    moe = torch.nn.Module()
    moe.w13_weight, moe.w2_weight, moe.top_k, moe.mxfp8_state = q13, q2, TOPK, LayerState()
    moe.mxfp8_state.w13, moe.mxfp8_state.w2 = c13, c2
    DEEPGEMM_MOE.create_buffers(moe, MoESpec("bench", E, H, I), moe.mxfp8_state)
    before, start = cache_entries(), time.perf_counter()
    runs = DEEPGEMM_MOE.precompile(moe, moe.mxfp8_state, MIN_TOKENS, args.max_m)
    lines.append(f"| qwen3-30b-a3b MoE (E={E}, H={H}, I={I}, top-{TOPK}) | {runs} | {cache_entries() - before} "
                 f"| {time.perf_counter() - start:.1f} |")
    print(lines[-1], flush=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
