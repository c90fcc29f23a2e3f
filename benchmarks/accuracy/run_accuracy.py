"""GSM8K on several served checkpoints in one go, on one GPU: accuracy, speed, answers that differ.

One server at a time (start, benchmark, stop), all with the same flags but the ones given per server.
Servers started side by side do not work: SGLang sizes its KV pool from the memory its own load took,
which the neighbours' loads inflate ("Not enough memory" at --mem-fraction-static 0.12, seen on the H200).

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

from sglang_mxfp8.cli.serving import Server

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
    ap.add_argument("--port", type=int, default=30400)
    args, bench_args = ap.parse_known_args()
    bench_args = [a for a in bench_args if a != "--"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    servers = [parse_serve(spec) for spec in args.serve]
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

    for name, ckpt, flags in servers:
        s = Server(name, ckpt, flags, args.port, out, text=True)
        try:
            s.wait(timeout=600)
        except (RuntimeError, TimeoutError) as e:
            last = [line for line in str(e).splitlines() if line.strip()][-1]
            print(f"[{name}] did not start: {last}", flush=True)
            rows.append(f"| {name} | did not start: {last[:200]} | | | | | `{s.cmd}` |")
            s.stop()
            write_table()
            continue
        result = out / f"gsm8k_{name}.jsonl"
        try:
            rc = subprocess.call([sys.executable, str(BENCH), "--port", str(args.port), "--result-file", str(result),
                                  *bench_args])
        finally:
            s.stop()
        if not result.is_file():
            rows.append(f"| {name} | benchmark exited {rc} | | | | | `{s.cmd}` |")
        else:
            r = records[name] = json.loads(result.read_text().splitlines()[-1])
            rows.append(f"| {name} | {r['accuracy']:.3f} | {r['invalid']:.3f} | {r['latency']:.1f} | "
                        f"{r['output_throughput']:.0f} | {r['failed_requests']} | `{s.cmd}` |")
        print(rows[-1], flush=True)
        write_table()
    print(write_table())

if __name__ == "__main__":
    main()
