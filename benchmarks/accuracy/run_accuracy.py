"""GSM8K on several served checkpoints in one go, on one GPU: accuracy, speed, answers that differ.

All servers start at once (each with a small --mem-fraction-static), so their start-ups overlap; the
benchmarks then run one after another, each server stopped after its run, so no two runs share the GPU.

    python benchmarks/accuracy/run_accuracy.py --out OUT \\
        --serve bf16=/tmp/coder-bf16 \\
        --serve mx_fi=/tmp/coder-mxfp8:"--fp8-gemm-backend flashinfer_trtllm" \\
        --compare bf16,mx_fi -- --num-questions 1319 --num-shots 8 --parallel 256

Writes OUT/accuracy.md (one row per server, one per comparison) and OUT/gsm8k_NAME.jsonl.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from sglang_mxfp8.serving import Server

BENCH = Path(__file__).resolve().parents[1] / "gsm8k" / "bench_sglang.py"


def parse_serve(spec: str):
    name, rest = spec.split("=", 1)
    ckpt, _, flags = rest.partition(":")
    return name, ckpt, flags


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--serve", action="append", required=True, help="NAME=CKPT[:FLAGS]")
    ap.add_argument("--compare", action="append", default=[], help="NAME_A,NAME_B: count differing answers")
    ap.add_argument("--mem-fraction", type=float, default=0.12, help="per server; all run at once")
    ap.add_argument("--port", type=int, default=30400)
    args, bench_args = ap.parse_known_args()
    bench_args = [a for a in bench_args if a != "--"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    servers = []
    for i, spec in enumerate(args.serve):
        name, ckpt, flags = parse_serve(spec)
        flags += f" --mem-fraction-static {args.mem_fraction}"
        servers.append(Server(name, ckpt, flags, args.port + i, out, text=True))
    records, rows = {}, []

    def write_table():
        lines = ["| server | accuracy | invalid | latency s | output tok/s | failed requests | command |",
                 "| --- | --- | --- | --- | --- | --- | --- |", *rows, "",
                 "| comparison | answers that differ | accuracy diff (points) | throughput ratio |",
                 "| --- | --- | --- | --- |"]
        for pair in args.compare:
            a, b = pair.split(",")
            if a in records and b in records:
                ra, rb = records[a], records[b]
                differ = sum(x != y for x, y in zip(ra["answers"], rb["answers"]))
                lines.append(f"| {b} vs {a} | {differ} of {len(ra['answers'])} | "
                             f"{100 * (rb['accuracy'] - ra['accuracy']):+.1f} | "
                             f"{rb['output_throughput'] / ra['output_throughput']:.2f}x |")
        (out / "accuracy.md").write_text("\n".join(lines) + "\n")
        return "\n".join(lines)

    try:
        for s in servers:
            try:
                s.wait(timeout=600)
            except (RuntimeError, TimeoutError) as e:
                last = [line for line in str(e).splitlines() if line.strip()][-1]
                print(f"[{s.name}] did not start: {last}", flush=True)
                rows.append(f"| {s.name} | did not start: {last[:200]} | | | | | `{s.cmd}` |")
                s.stop()
                write_table()
                continue
            result = out / f"gsm8k_{s.name}.jsonl"
            rc = subprocess.call([sys.executable, str(BENCH), "--port", str(s.port), "--result-file", str(result),
                                  *bench_args])
            s.stop()
            if not result.is_file():
                rows.append(f"| {s.name} | benchmark exited {rc} | | | | | `{s.cmd}` |")
            else:
                r = records[s.name] = json.loads(result.read_text().splitlines()[-1])
                rows.append(f"| {s.name} | {r['accuracy']:.3f} | {r['invalid']:.3f} | {r['latency']:.1f} | "
                            f"{r['output_throughput']:.0f} | {r['failed_requests']} | `{s.cmd}` |")
            print(rows[-1], flush=True)
            write_table()
    finally:
        for s in servers:
            s.stop()
    print(write_table())

if __name__ == "__main__":
    main()
