"""Tile-config sweeps of our Hopper Triton GEMMs.

--kernel w8a8 (default): per (shape, M), BF16 cuBLAS time, the quantizer's time, the default config's
GEMM time and the best config found (do_bench). --kernel w8a16: the weight-only GEMM at small M, GPU
time inside a CUDA graph over distinct weight copies, against BF16 cuBLAS and our W8A8 whole op.
--kernel moe_w8a16: the weight-only fused MoE (Qwen3-30B-A3B layer) at decode batch sizes, GPU time
in a CUDA graph, against SGLang's BF16 fused MoE. --kernel gemv: the one-token dense GEMV, GPU time in a
CUDA graph, against BF16 and the weight-only GEMM. --kernel moe_gemv: the one-token GEMV MoE (Qwen3-30B-A3B
layer), against SGLang's BF16 and MXFP8 fused MoE. Writes the table to --out (input for tuned configs).

    python benchmarks/kernels/sweep_triton.py --out OUT/sweep.md [--kernel w8a16|moe_w8a16|gemv|moe_gemv]
"""

import argparse
import itertools

import torch
import triton
from triton.testing import do_bench

from sglang_mxfp8.ops import triton_sm90 as th
from sglang_mxfp8.format.numerics import convert_to_block_scales, quantize_mxfp8

from bench_dense import WORKING_SET, graph_copies  # this folder
from gpu_timer import graph_us

SHAPES = {"2048->5120": (2048, 5120), "4096->14336": (4096, 14336)}
MS = [1, 16, 128, 1024, 8192]
GRID = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=w, num_stages=st)
        for bm, bn, w, st in itertools.product((16, 64, 128), (64, 128, 256), (4, 8), (3, 4))
        if not (bm == 128 and bn == 256 and st == 4)]


def gemm(a_q, a_s, w, w_s, cfg):
    m, k = a_q.shape
    n = w.shape[0]
    c = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    th._w8a8_gemm_kernel[grid](a_q, w, c, a_s, w_s, c, m, n, k, triton.cdiv(k, 128), a_q.stride(0), w.stride(0),
                               c.stride(0), HAS_BIAS=False, **cfg)
    return c


W8A16_SHAPES = {"2048->5120": (2048, 5120), "4096->2048": (4096, 2048), "4096->14336": (4096, 14336),
                "14336->4096": (14336, 4096)}
W8A16_MS = [1, 16, 64, 128]
W8A16_GRID = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
              for bm, bn, w, st in itertools.product((16, 32, 64), (16, 32, 64, 128), (2, 4), (3, 5))]


def best_config(grid, run, time):
    """(best time, its config, configs that ran) over ``grid``: ``run(cfg)`` computes with a config (None:
    the kernel's default, the reference), ``time(cfg)`` times it."""
    ref = run(None).float()
    best, tried = (float("inf"), None), 0
    for cfg in grid:
        try:
            got = run(cfg).float()
            t = time(cfg)
        except Exception:  # noqa: BLE001 - out of shared memory etc.
            continue
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2, cfg  # same math, other tiling
        tried += 1
        best = min(best, (t, cfg), key=lambda b: b[0])
    return (*best, tried)


def short(cfg):
    """A config in a table cell: tile, warps, stages."""
    tile = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}" if "BLOCK_M" in cfg else f"n{cfg['BLOCK_N']} g{cfg['GROUPS']}"
    return f"{tile} w{cfg['num_warps']} s{cfg['num_stages']}"


def weight_copies(n, k):
    """Distinct [n, k] weights filling the timed working set: (e4m3, per-row 1x128 scales) pairs and BF16 ones."""
    ws = []
    for _ in range(graph_copies(n, k)):
        q, s = quantize_mxfp8(torch.randn(n, k, device="cuda") * 0.02)
        ws.append((q, convert_to_block_scales(q, s, 1)[0]))
    return ws, [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in ws]


def copies_us(call, copies, reps=20):
    """GPU time per ``call(copy)`` in one CUDA graph that runs it on every weight copy (from HBM, not L2)."""
    return graph_us([lambda w=w: call(w) for w in copies], reps=reps)


def sweep_w8a16(out):
    """Weight-only GEMM tiles, GPU time in a CUDA graph over distinct weight copies (HBM, not L2)."""
    lines = [f"GPU: {torch.cuda.get_device_name()}; GPU time per call inside one CUDA graph over "
             f"{WORKING_SET >> 20} MiB of distinct weights, microseconds; whole op for W8A8 (quantize + GEMM)", "",
             "| K->N | M | BF16 | W8A8 (ours, default) | W8A16 default cfg | W8A16 best cfg | best cfg | "
             "best vs BF16 | configs tried |", "|---|---|---|---|---|---|---|---|---|"]
    for name, (k, n) in W8A16_SHAPES.items():
        ws, w16 = weight_copies(n, k)
        for m in W8A16_MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t16 = copies_us(lambda w: torch.nn.functional.linear(x, w), w16)
            t88 = copies_us(lambda w: th.w8a8_gemm(*th.quantize_act_1x128(x), *w), ws)
            tdef = copies_us(lambda w: th.w8a16_gemm(x, *w), ws)
            t, cfg, tried = best_config(
                [cfg for cfg in W8A16_GRID if cfg["BLOCK_M"] <= max(16, triton.next_power_of_2(m))],
                lambda cfg: th.w8a16_gemm(x, *ws[0], config=cfg),
                lambda cfg: copies_us(lambda w: th.w8a16_gemm(x, *w, config=cfg), ws, reps=10))
            lines.append(f"| {name} | {m} | {t16:.1f} | {t88:.1f} | {tdef:.1f} | {t:.1f} | {short(cfg)} | "
                         f"{t16 / t:.2f}x | {tried} |")
            print(lines[-1], flush=True)
        ws = w16 = None  # free the copies before the next shape
        torch.cuda.empty_cache()
    open(out, "w").write("\n".join(lines) + "\n")


def qwen3_moe_layer():
    """SGLang's fused MoE (with the server args its kernels read), a seeded generator and the Qwen3-30B-A3B
    layer's experts from bench_moe.experts: (outplace_fused_experts, gen, (w13_16, w2_16, q13, q2, c13, c2))."""
    from sglang_mxfp8.sglang.plugin import sglang_object
    outplace_fused_experts = sglang_object("fused_experts")  # where this SGLang keeps it
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from bench_moe import I, experts  # this folder

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    return outplace_fused_experts, gen, experts(I, gen)[:6]


MOE_W8A16_TOKENS = [1, 4, 16, 32, 64]
MOE_W8A16_GRID = [dict(BLOCK_M=16, BLOCK_N=bn, num_warps=w, num_stages=st)
                  for bn, w, st in itertools.product((32, 64, 128), (2, 4, 8), (3, 4, 5))]


def sweep_moe_w8a16(out):
    """Weight-only fused MoE tiles on the Qwen3-30B-A3B layer (its 1.2 GB of experts exceed L2)."""
    from bench_moe import E, H, I, routing  # this folder

    fused_experts, gen, (w13_16, w2_16, q13, q2, c13, c2) = qwen3_moe_layer()
    lines = [f"GPU: {torch.cuda.get_device_name()}; E={E} H={H} I={I}; GPU time per MoE layer in a CUDA graph, us", "",
             "| tokens | BF16 fused MoE | weight-only default cfg | weight-only best cfg | best cfg | best vs BF16 | "
             "configs tried |", "|---|---|---|---|---|---|---|"]
    for m in MOE_W8A16_TOKENS:
        x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        tw, ids = routing(m, gen)
        t16 = graph_us([lambda: fused_experts(x, w13_16, w2_16, tw, ids)])

        def moe(cfg):
            return th.moe_w8a16(x, q13, c13.block_scale, q2, c2.block_scale, tw, ids, config=cfg)

        tdef = graph_us([lambda: moe(None)])
        t, cfg, tried = best_config(MOE_W8A16_GRID, moe, lambda cfg: graph_us([lambda: moe(cfg)], reps=10))
        lines.append(f"| {m} | {t16:.1f} | {tdef:.1f} | {t:.1f} | {short(cfg)} | {t16 / t:.2f}x | {tried} |")
        print(lines[-1], flush=True)
    open(out, "w").write("\n".join(lines) + "\n")


GEMV_GRID = [dict(BLOCK_N=bn, GROUPS=g, num_warps=w, num_stages=1)  # GROUPS 16 = all of K = 2048 in one step
             for bn, g, w in itertools.product((1, 2, 4, 8, 16), (2, 4, 8, 16, 32), (4, 8))]
MOE_GEMV_UP_GRID = [dict(BLOCK_N=bn, GROUPS=g, num_warps=w, num_stages=1)
                    for bn, g, w in itertools.product((2, 4, 8, 16, 32), (2, 4, 8, 16), (4, 8))]  # BLOCK_N outputs: 2x rows
MOE_GEMV_DOWN_GRID = [dict(BLOCK_N=bn, GROUPS=g, num_warps=w, num_stages=1)  # I = 768: 6 K groups, in 3, 2 or 1 steps
                      for bn, g, w in itertools.product((1, 2, 4, 8, 16), (2, 4, 8), (2, 4, 8))]


def sweep_gemv(out):
    """One-token GEMV tiles on the dense shapes, over distinct weight copies."""
    lines = [f"GPU: {torch.cuda.get_device_name()}; one token; GPU time per call inside one CUDA graph, microseconds "
             f"(dense: over {WORKING_SET >> 20} MiB of distinct weights)", "",
             "| layer | BF16 | baseline MXFP8 | GEMV shipped cfg | GEMV rule cfg | GEMV best cfg | best cfg | best vs BF16 | "
             "best vs baseline MXFP8 | configs tried |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, (k, n) in W8A16_SHAPES.items():
        ws, w16 = weight_copies(n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        t16 = copies_us(lambda w: torch.nn.functional.linear(x, w), w16)
        two = copies_us(lambda w: th.w8a16_gemm(x, *w), ws)
        tdef = copies_us(lambda w: th.w8a16_gemv(x, *w), ws)
        rule = th.gemv_rule_config(n)
        trule = copies_us(lambda w: th.w8a16_gemv(x, *w, config=rule), ws)
        t, cfg, tried = best_config(GEMV_GRID, lambda cfg: th.w8a16_gemv(x, *ws[0], config=cfg),
                                    lambda cfg: copies_us(lambda w: th.w8a16_gemv(x, *w, config=cfg), ws, reps=10))
        lines.append(f"| {name} (baseline: weight-only GEMM) | {t16:.1f} | {two:.1f} | {tdef:.1f} | {trule:.1f} | {t:.1f} | {short(cfg)} | "
                     f"{t16 / t:.2f}x | {two / t:.2f}x | {tried} |")
        print(lines[-1], flush=True)
        ws = w16 = None  # free the copies before the next shape
        torch.cuda.empty_cache()
    open(out, "w").write("\n".join(lines) + "\n")


def sweep_moe_gemv(out):
    """The one-token GEMV MoE (Qwen3-30B-A3B layer), one call per routing in a CUDA graph: the up projection's
    tiles with the shipped down config, then the down projection's with the best up config."""
    from bench_moe import E, H, I, ONE_TOKEN_ROUTINGS, graph_per_call_us, routing, triton_block_fp8  # this folder

    fused_experts, gen, (w13_16, w2_16, q13, q2, c13, c2) = qwen3_moe_layer()
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    routings = [routing(1, gen) for _ in range(ONE_TOKEN_ROUTINGS)]  # as a decode step's layers: experts not in L2
    t16 = graph_per_call_us(lambda tw, ids: fused_experts(x, w13_16, w2_16, tw, ids), routings)
    t8 = graph_per_call_us(lambda tw, ids: triton_block_fp8(x, q13, q2, c13.block_scale, c2.block_scale, tw, ids),
                           routings)

    def moe(up, down, r=routings[0]):
        return th.moe_gemv(x, q13, c13.block_scale, q2, c2.block_scale, *r, up_config=up, down_config=down)

    def time(up, down, reps=10):
        return graph_per_call_us(lambda tw, ids: moe(up, down, (tw, ids)), routings, reps=reps)

    tdef = time(None, None, reps=20)
    print(f"BF16 {t16:.1f} us, SGLang MXFP8 {t8:.1f} us, GEMV MoE shipped cfgs {tdef:.1f} us", flush=True)
    t_up, up, tried_up = best_config(MOE_GEMV_UP_GRID, lambda cfg: moe(cfg, None), lambda cfg: time(cfg, None))
    t, down, tried_down = best_config(MOE_GEMV_DOWN_GRID, lambda cfg: moe(up, cfg), lambda cfg: time(up, cfg))
    lines = [f"GPU: {torch.cuda.get_device_name()}; one token, MoE E={E} H={H} I={I} top-8; GPU time per call inside "
             f"one CUDA graph of {ONE_TOKEN_ROUTINGS} calls, each with its own routing, microseconds", "",
             "| BF16 fused MoE | SGLang MXFP8 fused MoE | GEMV MoE shipped cfgs | best up cfg (shipped down) | "
             "best down cfg (with best up) | best up / down cfg | best vs BF16 | best vs SGLang MXFP8 | configs tried |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| {t16:.1f} | {t8:.1f} | {tdef:.1f} | {t_up:.1f} | {t:.1f} | {short(up)} / {short(down)} | "
             f"{t16 / t:.2f}x | {t8 / t:.2f}x | {tried_up} + {tried_down} |"]
    print(lines[-1], flush=True)
    open(out, "w").write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernel", choices=["w8a8", "w8a16", "moe_w8a16", "gemv", "moe_gemv"], default="w8a8")
    args = ap.parse_args()
    if args.kernel == "gemv":
        return sweep_gemv(args.out)
    if args.kernel == "moe_gemv":
        return sweep_moe_gemv(args.out)
    if args.kernel == "w8a16":
        return sweep_w8a16(args.out)
    if args.kernel == "moe_w8a16":
        return sweep_moe_w8a16(args.out)
    lines = [f"GPU: {torch.cuda.get_device_name()}; do_bench medians, microseconds", "",
             "| K->N | M | BF16 | act quant (default rows) | act quant rows 1 / 4 / 16 / 32 | GEMM default cfg | "
             "GEMM best cfg | best cfg | best whole op vs BF16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, (k, n) in SHAPES.items():
        q, s = quantize_mxfp8(torch.randn(n, k, device="cuda") * 0.02)
        w_s, _ = convert_to_block_scales(q, s, 1)
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a_q, a_s = th.quantize_act_1x128(x)
            t16 = do_bench(lambda: torch.nn.functional.linear(x, w16), rep=50) * 1e3
            tq = do_bench(lambda: th.quantize_act_1x128(x), rep=50) * 1e3
            tq_rows = {r: do_bench(lambda: th.quantize_act_1x128(x, r), rep=50) * 1e3 for r in (1, 4, 16, 32)}
            tdef = do_bench(lambda: gemm(a_q, a_s, q, w_s, th._config(m)), rep=50) * 1e3
            best = (float("inf"), None)
            for cfg in GRID:
                if cfg["BLOCK_M"] > max(16, triton.next_power_of_2(m)) * 8:
                    continue
                try:
                    t = do_bench(lambda: gemm(a_q, a_s, q, w_s, cfg), warmup=5, rep=20) * 1e3
                except Exception:  # noqa: BLE001 - out of shared memory etc.
                    continue
                best = min(best, (t, cfg), key=lambda b: b[0])
            t, cfg = best
            rows = " / ".join(f"{tq_rows[r]:.1f}" for r in sorted(tq_rows))
            lines.append(f"| {name} | {m} | {t16:.1f} | {tq:.1f} | {rows} | {tdef:.1f} | {t:.1f} | {short(cfg)} | "
                         f"{t16 / (t + tq):.2f}x |")
            print(lines[-1], flush=True)
    open(args.out, "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
