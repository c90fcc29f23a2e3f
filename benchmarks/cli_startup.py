"""How long ``sglang-mxfp8`` takes to answer help, its version and an argument error (none of them imports torch,
SGLang or FlashInfer), as a user's shell runs it: the console script, a fresh process each time, median of N.

    python benchmarks/cli_startup.py [--runs 10]
"""

import argparse
import shutil
import statistics
import subprocess
import sys
import time

CASES = {"--help": ["--help"], "--version": ["--version"], "bench --help": ["bench", "--help"],
         "an argument error": ["convert"], "no command": []}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10, help="processes per case (default: 10)")
    args = ap.parse_args()
    exe = shutil.which("sglang-mxfp8")
    if exe is None:
        sys.exit("cli_startup.py: sglang-mxfp8 is not on PATH; pip install -e . first")
    command = [exe]
    print(f"{exe}, median of {args.runs} fresh processes:")
    for name, argv in CASES.items():
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            subprocess.run(command + argv, capture_output=True)
            times.append(time.perf_counter() - start)
        print(f"  {name:18} {statistics.median(times):.3f} s (min {min(times):.3f})")


if __name__ == "__main__":
    main()
