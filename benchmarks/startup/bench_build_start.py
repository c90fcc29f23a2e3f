"""When a launch starts its JIT builds: seconds from the launcher's process start to the startup hook's early start
(before SGLang's server_args module executes) and to SGLang's MoE-kernel step of argument resolution (where the builds
started before). Each run is a fresh interpreter doing what ``python -m sglang.launch_server`` does first
(``prepare_server_args(argv)``) on an MXFP8 checkpoint; where a GPU is visible the early start also plans and starts
the build process, and that process is stopped at the end of the run.

    python benchmarks/startup/bench_build_start.py --model CKPT [--runs 5] [-- SGLANG ARGS]
"""

import argparse
import json
import statistics
import subprocess
import sys

RUN = r"""
import json, os, signal, sys, time
import psutil
born = psutil.Process().create_time()
from sglang_mxfp8.sglang import plugin
marks = {}
def timed(name, fn):
    def wrapper(*args):
        marks[name] = round(time.time() - born, 2)
        try:
            return fn(*args)
        finally:
            marks[name + " returned"] = round(time.time() - born, 2)
    return wrapper
plugin.start_launch_builds = timed("early start", plugin.start_launch_builds)
plugin.moe_kernel_config = timed("MoE-kernel step", plugin.moe_kernel_config)
from sglang.srt.server_args import prepare_server_args
try:
    prepare_server_args(sys.argv[1:])
finally:
    for process in set(plugin._BUILDING.values()):
        os.killpg(process.pid, signal.SIGTERM)
    print("MARKS " + json.dumps(marks), flush=True)
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="MXFP8 checkpoint folder")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("sglang_args", nargs="*", help="more server arguments (after --)")
    args = ap.parse_args(argv)
    runs = []
    for _ in range(args.runs):
        p = subprocess.run([sys.executable, "-c", RUN, "--model-path", args.model, *args.sglang_args],
                           capture_output=True, text=True, timeout=600)
        line = next((l for l in p.stdout.splitlines() if l.startswith("MARKS ")), None)
        if line is None:
            sys.exit(f"run failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
        runs.append(json.loads(line[6:]))
    print("| seconds after the launcher's process started | median | runs |")
    print("|---|---|---|")
    for key in runs[0]:
        values = [r[key] for r in runs if key in r]
        print(f"| {key} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")


if __name__ == "__main__":
    main()
