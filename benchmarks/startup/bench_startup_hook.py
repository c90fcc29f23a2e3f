"""What the startup hook (sglang_mxfp8.pth) adds to every Python start in its environment.

Runs ``python -X importtime -c pass`` RUNS times with this interpreter and reports the median cumulative import time of
the hook's module (``sglang_mxfp8.sglang.autoload`` and all it imports), beside the whole start-up, and, where the
package is an editable install, setuptools' editable finder (its cost, not the hook's: a wheel install has none).

    python benchmarks/startup/bench_startup_hook.py [--runs 20]
"""

import argparse
import re
import statistics
import subprocess
import sys

LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def top_level_us(stderr: str) -> dict:
    """{module: cumulative us} of the imports made at the top level of start-up (those site itself triggers)."""
    out = {}
    for m in LINE.finditer(stderr):
        depth = len(m.group(3)) // 2
        if depth <= 1:
            out[m.group(4)] = int(m.group(2))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args(argv)
    hook, finder, site = [], [], []
    for _ in range(args.runs):
        err = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True).stderr
        times = top_level_us(err)
        hook.append(times.get("sglang_mxfp8.sglang.autoload", 0))
        finder.append(sum(v for k, v in times.items() if k.startswith("__editable___sglang_mxfp8")))
        site.append(times.get("site", 0))
    med = statistics.median
    print(f"python {sys.version.split()[0]} at {sys.executable}, median of {args.runs} starts (-X importtime):")
    print(f"  startup hook (sglang_mxfp8.sglang.autoload, cumulative): {med(hook) / 1000:.2f} ms")
    print(f"  setuptools' editable finder for the package (editable installs only): {med(finder) / 1000:.2f} ms")
    print(f"  site (all .pth files and site-packages set-up): {med(site) / 1000:.2f} ms")
    return 0 if med(hook) else 1  # 0 ms: the hook did not run in this environment


if __name__ == "__main__":
    sys.exit(main())
