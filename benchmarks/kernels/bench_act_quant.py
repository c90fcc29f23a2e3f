"""Activation quantizer (BF16 -> e4m3 + float32 scale per 1x128 group) time and bandwidth per tile height.

    python benchmarks/kernels/bench_act_quant.py --out OUT/act_quant.md

Bytes moved = 2 (read BF16) + 1 (write e4m3) per element + 4 per group; bandwidth against the H200's
~4.8 TB/s HBM3e peak says how far the kernel is from memory-bound.
"""

import argparse

import torch
from triton.testing import do_bench

from sglang_mxfp8.ops import triton_sm90 as th

KS = [2048, 4096, 14336]
MS = [1, 16, 128, 1024, 8192]
ROWS = [1, 4, 16, 32]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    lines = [f"GPU: {torch.cuda.get_device_name()}; do_bench medians, microseconds (GB/s)", "",
             "| K | M | default rows | " + " | ".join(f"rows {r}" for r in ROWS) + " |",
             "|---|---|---|" + "---|" * len(ROWS)]
    for k in KS:
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref_q, ref_s = th.quantize_act_1x128(x, 1)
            nbytes = m * k * 3 + m * (k // 128) * 4
            cells = []
            for rows in ROWS:
                q, s = th.quantize_act_1x128(x, rows)
                assert torch.equal(s, ref_s) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), rows
                t = do_bench(lambda: th.quantize_act_1x128(x, rows), rep=50) * 1e3
                cells.append(f"{t:.1f} ({nbytes / t / 1e3:.0f})")
            lines.append(f"| {k} | {m} | {th.act_quant_rows(m)} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    open(args.out, "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
