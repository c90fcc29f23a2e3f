"""``sglang-mxfp8``: convert checkpoints, check what each layer will run on, compile its kernels ahead of a server,
run the demo, and benchmark MXFP8 against BF16.

Parsing imports nothing heavy (no torch, SGLang or FlashInfer): help, the version and argument errors answer at once;
each command imports what it needs when it runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from .. import __version__
from ..flags import DENSE_FLAGS, DENSE_HELP, MOE_FLAGS, MOE_HELP

COMMANDS = ("convert", "doctor", "build", "demo", "bench")
GPUS = "h100, h200, b200, gb200, rtx6000"


def convert_cmd(args) -> int:
    from ..format.checkpoint import CheckpointError
    from ..format.convert import convert

    unknown = unserved_architectures(Path(args.input))
    if unknown:
        print(f"warning: the installed SGLang ({unknown[1]}) has no model class for {', '.join(unknown[0])}; it may "
              "not serve this checkpoint", file=sys.stderr)
    try:
        r = convert(args.input, args.output, force=args.force, rounding=args.rounding, keep_bf16=args.keep_bf16)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.output}: {len(r.quantized)} tensors quantized to MXFP8, {len(r.kept)} kept, {r.shards} shard(s), "
          f"{r.bytes_in / 2**20:.1f} MiB -> {r.bytes_out / 2**20:.1f} MiB")
    return 0


def unserved_architectures(ckpt: Path):
    """(the architectures of ``ckpt``'s config.json the installed SGLang has no class for, its version), or None."""
    import json

    from ..compat import sglang_architectures, sglang_version

    known = sglang_architectures()
    try:
        wanted = json.loads((ckpt / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    missing = [a for a in wanted if isinstance(a, str) and a not in known] if known else []
    return (missing, sglang_version()) if missing else None


def doctor_cmd(args) -> int:
    from .doctor import doctor

    return doctor(args)


def build_cmd(args) -> int:
    from .build import build

    return build(args)


def demo_cmd(args) -> int:
    from .demo import demo

    return demo(args)


def bench_cmd(args) -> int:
    from ..bench.run import main

    return main(args)


def _count(what: str):
    """argparse type of a count of ``what``, 1 or more, whose refusal names what was counted."""

    def count(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of {what} (1 or more)")
        return int(text)

    return count


_parallel_size = _count("GPUs")


def _backend_flags(p: argparse.ArgumentParser) -> None:
    """SGLang's two backend flags, read into the launch configuration's names (sglang/launch.py)."""
    p.add_argument("--fp8-gemm-backend", dest="dense_flag", default="auto", choices=DENSE_FLAGS, metavar="BACKEND",
                   help=f"{DENSE_HELP} (default: auto)")
    p.add_argument("--moe-runner-backend", dest="moe_flag", default="auto", choices=MOE_FLAGS, metavar="BACKEND",
                   help=f"{MOE_HELP} (default: auto)")


def _bench_parser(sub) -> None:
    from ..bench.rows import ROUTINES as ROW_ROUTINES

    b = sub.add_parser("bench", help="MXFP8 against BF16 in the same run: layers, served tok/s, start, refit, accuracy",
                       description="Measure MXFP8 against BF16 in the same run, one JSON row per measurement appended "
                                   "under --results-dir. With no ROUTINE, the --suite's. 'report' instead regenerates "
                                   "benchmarks/CURRENT.md and the README's speed paragraph from the rows.")
    b.add_argument("routines", nargs="*", metavar="ROUTINE",
                   help=f"any of {', '.join(r for r in ROW_ROUTINES)}; or 'report' (routing runs only when named: it "
                        "launches every server with SGLang's routing capture on)")
    b.add_argument("--suite", choices=("quick", "full"), default="quick",
                   help="quick: served c1/16/128, first start, refit, accuracy and layers, under 9 minutes on one "
                        "H100 / H200 (--dry-run says each step's); full: every shape set, every candidate kernel, "
                        "restarts, a cold refit, gsm8k, the GPU tests (default: quick)")
    b.add_argument("--dry-run", action="store_true", help="print what each step would run, touch no GPU")
    b.add_argument("--model", help="checkpoint to serve and whose layer shapes to time: BF16 (converted once) or "
                                   "MXFP8 with --bf16-model (default: a generated Qwen3-30B-A3B-shaped model)")
    b.add_argument("--bf16-model", help="the BF16 checkpoint an MXFP8 --model was converted from")
    b.add_argument("--layers", type=_count("layers"), help="layers of the generated model (default: 16)")
    b.add_argument("--mx-flags", action="append", metavar="FLAGS",
                   help="backend flags of an MXFP8 server (repeatable, one row set each; default: the recommended "
                        "--fp8-gemm-backend flashinfer_trtllm --moe-runner-backend flashinfer_cutlass)")
    b.add_argument("--server-flags", default="", metavar="FLAGS",
                   help="launch flags for every server, BF16 and MXFP8 (e.g. --attention-backend triton)")
    b.add_argument("--concurrency", type=_count("concurrent requests"), nargs="+",
                   help="serve: concurrencies (default: 1 16 128)")
    b.add_argument("--profile-concurrency", type=_count("concurrent requests"), metavar="N",
                   help="serve: profile one load at N concurrent requests per server and split its GPU time into "
                        "attention, dense, MoE and other (the full suite: 128)")
    b.add_argument("--restart", action="store_true", help="start: also restart each server on its caches")
    b.add_argument("--cold-refit", action="store_true",
                   help="refit: also refit from disk with the checkpoint's files dropped from the page cache")
    b.add_argument("--sets", nargs="+", choices=("qwen3-30b-a3b", "llama-3-8b", "gpt-oss-20b"),
                   help="layers: named shape sets (default: qwen3-30b-a3b)")
    b.add_argument("--tokens", type=_count("tokens"), nargs="+", help="layers: batch sizes in tokens")
    b.add_argument("--all-kernels", action="store_true", help="layers: every candidate kernel, not only the planned")
    b.add_argument("--results-dir", default="benchmarks/results", help="where rows go (default: benchmarks/results)")
    b.add_argument("--workdir", default=None, help="models, caches, logs, plots (default: ~/.cache/sglang_mxfp8/bench)")
    b.add_argument("--time-limit", type=float, metavar="SECONDS", help="start no step that would end after this")
    b.add_argument("--port", type=int, help="port of the servers (default: 30700)")
    b.add_argument("--check", action="store_true", help="report: exit 1 where CURRENT.md or the README differ from "
                                                        "what the rows give, instead of writing them")
    b.set_defaults(func=bench_cmd)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sglang-mxfp8", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=f"sglang_mxfp8 {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    c = sub.add_parser("convert", help="HF BF16/FP16 safetensors -> MXFP8 checkpoint for SGLang")
    c.add_argument("input", help="Hugging Face checkpoint folder: config.json and BF16/FP16 *.safetensors")
    c.add_argument("output", help="folder for the MXFP8 checkpoint: safetensors, config.json, the input's other files "
                                  "copied")
    c.add_argument("--force", action="store_true", help="replace an earlier conversion in OUTPUT")
    c.add_argument("--rounding", choices=("ceil", "floor"), default="ceil",
                   help="E8M0 scale of each 32-block: ceil = amax/448 rounded up to a power of two (torchao's "
                        "RCEIL, not its CEIL), no element saturates, as MXFP8 training recipes do (default); "
                        "floor = OCP MX v1.0's "
                        "floor(log2(amax)) - 8, elements above 448 saturate")
    c.add_argument("--keep-bf16", action="append", default=[], metavar="PATTERN",
                   help="keep matching layers BF16 (repeatable): a module name or glob, e.g. lm_head, "
                        "'model.layers.0.*', or 'first:N' / 'last:N' for the first or last N decoder layers")
    c.set_defaults(func=convert_cmd)

    d = sub.add_parser("doctor", help="what each layer of a checkpoint will run on, and why")
    _backend_flags(d)
    d.add_argument("--model", help="MXFP8 checkpoint folder")
    d.add_argument("--gpu", help=f"plan for this GPU instead of this machine's: {GPUS}")
    d.add_argument("--tp", type=_parallel_size, default=1, help="tensor-parallel size: each rank's shapes")
    d.add_argument("--ep-size", type=_parallel_size, default=1, help="expert-parallel size (divides --tp)")
    d.add_argument("--markdown", action="store_true", help="the kernel registry as a Markdown table (for the README)")
    d.set_defaults(func=doctor_cmd)

    b = sub.add_parser("build", help="compile on the CPU what a server on this GPU compiles at its first start")
    _backend_flags(b)
    b.add_argument("--model", help="MXFP8 checkpoint folder: also the kernels its layer shapes select")
    b.add_argument("--gpu", help="the server's GPU, where this machine has none: h100, h200")
    b.add_argument("--tp", type=_parallel_size, default=1, help="tensor-parallel size of the server")
    b.add_argument("--ep-size", type=_parallel_size, default=1, help="expert-parallel size of the server")
    b.add_argument("--max-tokens", type=_count("tokens"), default=16384,
                   help="largest batch the server runs (at least its --chunked-prefill-size; default 16384)")
    b.add_argument("--jobs", type=_count("compiler processes"), default=None,
                   help="concurrent compiler processes (default: one per CPU)")
    b.set_defaults(func=build_cmd)

    m = sub.add_parser("demo", help="convert a small model to MXFP8; on a GPU also serve and refit it")
    _backend_flags(m)
    m.add_argument("--workdir", help="where to write the checkpoints (default: a temporary folder, removed after "
                                     "unless --keep)")
    m.add_argument("--keep", action="store_true", help="keep the checkpoints the demo wrote")
    m.add_argument("--port", type=int, default=30123, help="port of the demo's server (default: 30123)")
    m.set_defaults(func=demo_cmd)

    _bench_parser(sub)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_usage(sys.stderr)
        print(f"sglang-mxfp8: choose a command: {', '.join(COMMANDS)} (sglang-mxfp8 COMMAND --help says more)",
              file=sys.stderr)
        return 2
    args.argv = argv[1:]  # bench rows record the command that reproduces them
    if args.command == "bench" and args.workdir is None:
        from pathlib import Path

        args.workdir = str(Path.home() / ".cache" / "sglang_mxfp8" / "bench")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
