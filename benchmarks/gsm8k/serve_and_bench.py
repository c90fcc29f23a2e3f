"""Start a stock SGLang server on a checkpoint, run bench_sglang.py against it, stop it.

    python benchmarks/gsm8k/serve_and_bench.py CKPT --flags "--fp8-gemm-backend triton" -- --num-questions 200
"""

import argparse
import subprocess
import sys
from pathlib import Path

from sglang_mxfp8.cli.serving import Server


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--flags", default="")
    ap.add_argument("--port", type=int, default=30200)
    ap.add_argument("--log-dir", default=".")
    args, bench_args = ap.parse_known_args()
    bench_args = [a for a in bench_args if a != "--"]
    s = Server("gsm8k", args.ckpt, args.flags, args.port, args.log_dir, text=True)
    try:
        s.wait()
        bench = Path(__file__).with_name("bench_sglang.py")
        rc = subprocess.call([sys.executable, str(bench), "--port", str(args.port), *bench_args])
    finally:
        s.stop()
    sys.exit(rc)


if __name__ == "__main__":
    main()
