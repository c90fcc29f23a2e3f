"""Tile-config sweep of SGLang's Triton fused MoE in block-FP8 mode (our Hopper MXFP8 MoE path) on
the Qwen3-30B-A3B MoE shape (128 experts, hidden 2048, intermediate 768, top-8).

SGLang 0.5.10.post1 ships no H200 config for the Triton it runs with (3.6) and falls back to one
tuned for Triton 3.2. Per token count this times, inside a CUDA graph (as decode runs it), SGLang's
BF16 MoE, the block-FP8 MoE with the config SGLang picks, and with each config of a grid (one config
for both GEMMs, via SGLang's ``override_config``). Writes the table to --out and, beside it,
tuned_moe_config.json: SGLang's config in effect with each measured token count whose best config
beats it by at least 3% replaced. sglang_mxfp8 ships that file as
sglang_mxfp8/moe_configs/triton_<version>/<the SGLang file name this prints>.

    python benchmarks/kernels/tune_moe.py --out OUT/tune_moe.md [--tokens 1 16 64 256 4096]
"""

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton
from sglang.srt.layers.moe.fused_moe_triton import get_config_file_name, override_config
from sglang.srt.layers.moe.fused_moe_triton.fused_moe_triton_config import get_moe_configs
from sglang_mxfp8.sglang.plugin import sglang_object
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from bench_moe import E, H, I, TOPK, experts, routing, triton_block_fp8  # this folder: the same layer as the MoE benchmark
from gpu_timer import graph_us


outplace_fused_experts = sglang_object("fused_experts")  # SGLang's Triton fused MoE, where this SGLang keeps it

def grid(tokens: int):
    """Configs worth trying at this token count: small M tiles while experts see few tokens each."""
    per_expert = tokens * TOPK / E
    block_m = (16, 32, 64) if per_expert <= 16 else (64, 128)
    group = (1,) if per_expert <= 16 else (16,)
    for bm, bn, g, w, st in itertools.product(block_m, (64, 128), group, (4, 8), (3, 4)):
        yield {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": g, "num_warps": w,
               "num_stages": st}


def label(cfg) -> str:
    return (f"{cfg['BLOCK_SIZE_M']}x{cfg['BLOCK_SIZE_N']} g{cfg['GROUP_SIZE_M']} w{cfg['num_warps']} "
            f"s{cfg['num_stages']}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 4096])
    args = ap.parse_args()
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13_16, w2_16, q13, q2, c13, c2, _ = experts(I, gen)

    lines = [f"GPU: {torch.cuda.get_device_name()}; E={E} H={H} I={I} top-{TOPK}; GPU time inside a CUDA graph (us); "
             "ratio = BF16 / MXFP8", "",
             "| tokens | BF16 us | MXFP8, SGLang's config us (ratio) | MXFP8, best of sweep us (ratio) | best config | configs tried |",
             "|---|---|---|---|---|---|"]
    name = get_config_file_name(E, I, "fp8_w8a8", [128, 128])
    tuned = {str(m): cfg for m, cfg in (get_moe_configs(E, I, "fp8_w8a8", 128, 128) or {}).items()}
    for m in args.tokens:
        x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        tw, ids = routing(m, gen)

        def mx():
            return triton_block_fp8(x, q13, q2, c13.block_scale, c2.block_scale, tw, ids)

        t16 = graph_us([lambda: outplace_fused_experts(x, w13_16, w2_16, tw, ids)])
        shipped = graph_us([mx])
        ref = mx().float()
        best, tried = (float("inf"), None), 0
        for cfg in grid(m):
            try:
                with override_config(cfg):
                    out = mx().float()
                    t = graph_us([mx])
            except Exception as e:  # a config Triton cannot compile (shared memory) is skipped
                print(f"  {label(cfg)}: {type(e).__name__}", flush=True)
                continue
            tried += 1
            assert ((out - ref).norm() / ref.norm()).item() < 1e-2, label(cfg)  # same math, other tiling
            best = min(best, (t, cfg), key=lambda b: b[0])
        t, cfg = best
        if t < 0.97 * shipped:
            tuned[str(m)] = cfg
        lines.append(f"| {m} | {t16:.1f} | {shipped:.1f} ({t16 / shipped:.2f}x) | {t:.1f} ({t16 / t:.2f}x) | "
                     f"{label(cfg)} | {tried} |")
        print(lines[-1], flush=True)
    out = Path(args.out)
    out.write_text("\n".join(lines) + "\n")
    tuned = dict(sorted(tuned.items(), key=lambda kv: int(kv[0])))
    (out.parent / "tuned_moe_config.json").write_text(json.dumps(tuned, indent=1) + "\n")
    print(f"tuned configs: {out.parent / 'tuned_moe_config.json'} (ship as moe_configs/triton_"
          f"{triton.__version__.replace('.', '_')}/{name})")


if __name__ == "__main__":
    main()
