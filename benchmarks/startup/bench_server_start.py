"""Server start time with the stock launcher (process start to /health_generate answering), BF16 against MXFP8, on
empty compile caches (a fresh machine) and again on the caches that start left (a restart), all in one run.

Each cache set is its own folder for FlashInfer's JIT modules (FLASHINFER_WORKSPACE_BASE), FlashInfer's DeepGEMM
kernels (TRTLLM_DG_CACHE_DIR), DeepGEMM's (DG_JIT_CACHE_DIR), Triton's (TRITON_CACHE_DIR) and TorchInductor's
(TORCHINDUCTOR_CACHE_DIR). Runs, in order: BF16 fresh, BF16 restart, MXFP8 fresh, MXFP8 restart (--skip-bf16: the
last two alone; --mx-restart-only: the last alone, on what an earlier command's MXFP8 fresh start left; --fresh-first:
both fresh starts before the restarts, for a command short of time); with --compile-jobs-zero MXFP8 fresh with
FlashInfer compiling its GEMM kernels alone (SGLANG_MXFP8_COMPILE_JOBS=0); with --build-first MXFP8 on empty caches
that ``sglang-mxfp8 build`` then filled (an image built with it; its own time in the notes column); --extras-only:
those two alone.
Python's imports are warmed once first, so that the first run does not pay for a cold page cache alone.

    python benchmarks/startup/bench_server_start.py --out OUT --bf16 CKPT_BF16 --mx CKPT_MX \
        --mx-flags "--fp8-gemm-backend flashinfer_trtllm --moe-runner-backend triton" --label tiny
"""

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from sglang_mxfp8.cli.serving import Server

CACHE_VARS = {"FLASHINFER_WORKSPACE_BASE": "flashinfer", "TRTLLM_DG_CACHE_DIR": "trtllm_deep_gemm",
              "DG_JIT_CACHE_DIR": "deep_gemm", "TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def cache_env(root: Path, fresh: bool) -> dict:
    if fresh and root.exists():
        shutil.rmtree(root)
    env = {var: str(root / sub) for var, sub in CACHE_VARS.items()}
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    return env


def backend_flags(flags: str) -> list:
    """The --fp8-gemm-backend / --moe-runner-backend pairs of a launch flag string, for sglang-mxfp8 build."""
    words = flags.split()
    out = []
    for flag, value in zip(words, words[1:]):
        if flag in ("--fp8-gemm-backend", "--moe-runner-backend"):
            out += [flag, value]
    return out


def plugin_compile_lines(log: Path) -> list:
    return [line.split("sglang_mxfp8:", 1)[1].strip()[:160] for line in log.read_text().splitlines()
            if "sglang_mxfp8:" in line and ("ran " in line or "JIT module" in line or "compil" in line)][:6]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--bf16", required=True)
    ap.add_argument("--mx", required=True)
    ap.add_argument("--mx-flags", default="--fp8-gemm-backend flashinfer_trtllm --moe-runner-backend triton")
    ap.add_argument("--flags", default="", help="launch flags for every server")
    ap.add_argument("--label", default="model")
    ap.add_argument("--cache-root", default="/tmp/start_caches")
    ap.add_argument("--compile-jobs-zero", action="store_true")
    ap.add_argument("--build-first", action="store_true")
    ap.add_argument("--skip-bf16", action="store_true",
                    help="MXFP8 fresh and restart alone (BF16's measured by an earlier command on the same machine)")
    ap.add_argument("--mx-restart-only", action="store_true",
                    help="MXFP8 restart alone, on the caches an earlier command's MXFP8 fresh start left on the same "
                         "machine (when that command's time ran out before it)")
    ap.add_argument("--fresh-first", action="store_true",
                    help="BF16 fresh, MXFP8 fresh, then the two restarts (a command short of time gets the fresh pair)")
    ap.add_argument("--extras-only", action="store_true",
                    help="only the runs --compile-jobs-zero and --build-first add (the four base runs measured by an "
                         "earlier command on the same machine; all in one passes 10 minutes)")
    ap.add_argument("--port", type=int, default=30400)
    ap.add_argument("--timeout", type=int, default=560)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", "import sglang.launch_server, sglang.srt.models.qwen3_moe, sglang_mxfp8"],
                   check=True)
    root = Path(args.cache_root) / args.label
    runs = [("BF16", "fresh", args.bf16, "", {}), ("BF16", "restart", args.bf16, "", {}),
            ("MXFP8", "fresh", args.mx, args.mx_flags, {}), ("MXFP8", "restart", args.mx, args.mx_flags, {})]
    if args.fresh_first:
        runs.sort(key=lambda run: run[1] == "restart")
    if args.skip_bf16:
        runs = [run for run in runs if run[0] == "MXFP8"]
    if args.mx_restart_only:
        runs = [run for run in runs if run[:2] == ("MXFP8", "restart")]
    if args.extras_only:
        runs = []
    if args.compile_jobs_zero:
        runs.append(("MXFP8, FlashInfer compiling alone", "fresh", args.mx, args.mx_flags,
                     {"SGLANG_MXFP8_COMPILE_JOBS": "0"}))
    if args.build_first:
        runs.append(("MXFP8 after sglang-mxfp8 build", "fresh, then built", args.mx, args.mx_flags, {}))
    part = ("_extras" if args.extras_only else "_mx_restart" if args.mx_restart_only
            else "_mx" if args.skip_bf16 else "")
    table = out / f"startup_{args.label}{part}.md"
    lines = [f"{args.label}: start to /health_generate (s), stock launcher, flags {args.flags or '(base)'}", "",
             "| server | caches | start s | the plugin's compile lines |", "|---|---|---|---|"]
    for i, (kind, caches, ckpt, flags, extra) in enumerate(runs):
        cache_set = ("mx" if kind.startswith("MXFP8") else "bf16") + ("_jobs0" if extra else "") + (
            "_built" if caches.endswith("built") else "")
        env = {**cache_env(root / cache_set, caches != "restart"), **extra}
        name = f"{args.label}_{cache_set}_{caches.split(',')[0]}"
        built = ""
        if caches.endswith("built"):
            start = time.time()
            subprocess.run(["sglang-mxfp8", "build", "--model", ckpt, *backend_flags(flags)], check=True,
                           env={**os.environ, **env}, stdout=subprocess.DEVNULL)
            built = f"sglang-mxfp8 build {time.time() - start:.0f} s before the start; "
        server = Server(name, ckpt, f"{args.flags} {flags}".strip(), args.port + i, out, env=env)
        try:
            server.wait(timeout=args.timeout)
            seconds = time.time() - server.t0
        finally:
            server.stop()
        notes = built + ("; ".join(plugin_compile_lines(server.log)) or "-")
        lines.append(f"| {kind} | {caches} | {seconds:.0f} | {notes} |")
        print(lines[-1], flush=True)
        table.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
