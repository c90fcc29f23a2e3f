"""``sglang-mxfp8``: convert checkpoints, check what each layer will run on, compile its kernels ahead of a server,
and run the demo."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .. import __version__


def convert_cmd(args) -> int:
    from ..format.checkpoint import CheckpointError
    from ..format.convert import convert

    try:
        r = convert(args.input, args.output, force=args.force, rounding=args.rounding)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.output}: {len(r.quantized)} tensors quantized to MXFP8, {len(r.kept)} kept, {r.shards} shard(s), "
          f"{r.bytes_in / 2**20:.1f} MiB -> {r.bytes_out / 2**20:.1f} MiB")
    return 0


def doctor_cmd(args) -> int:
    from .doctor import doctor

    return doctor(args)


def build_cmd(args) -> int:
    from .build import build

    return build(args)


def demo_cmd(args) -> int:
    from .demo import demo

    return demo(args)


def _parallel_size(text: str) -> int:
    """argparse type of --tp / --ep-size: a GPU count, 1 or more."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GPUs (1 or more)")
    return int(text)


def main(argv: Optional[List[str]] = None) -> int:
    from ..kernels.registry import DENSE_FLAGS, MOE_FLAGS

    ap = argparse.ArgumentParser(prog="sglang-mxfp8", description=__doc__)
    ap.add_argument("--version", action="version", version=f"sglang_mxfp8 {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("convert", help="HF BF16/FP16 safetensors -> MXFP8 checkpoint for SGLang")
    c.add_argument("input", help="Hugging Face checkpoint folder: config.json and BF16/FP16 *.safetensors")
    c.add_argument("output", help="folder for the MXFP8 checkpoint: safetensors, config.json, the input's other files copied")
    c.add_argument("--force", action="store_true", help="overwrite a non-empty OUTPUT")
    c.add_argument("--rounding", choices=("ceil", "floor"), default="ceil",
                   help="E8M0 scale of each 32-block: ceil = amax/448 rounded up to a power of two, no element "
                        "saturates, as MXFP8 training recipes do (default); floor = OCP MX v1.0's "
                        "floor(log2(amax)) - 8, elements above 448 saturate")
    c.set_defaults(func=convert_cmd)

    for name, helptext, func in (("doctor", "what each layer will run on", doctor_cmd),
                                 ("build", "compile on the CPU what a server on this GPU compiles at its first start",
                                  build_cmd),
                                 ("demo", "convert and serve a small model", demo_cmd)):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--fp8-gemm-backend", default="auto", choices=DENSE_FLAGS)
        p.add_argument("--moe-runner-backend", default="auto", choices=MOE_FLAGS)
        p.set_defaults(func=func)
    sub.choices["doctor"].add_argument("--model", help="MXFP8 checkpoint folder")
    sub.choices["doctor"].add_argument("--gpu", help="pretend GPU: h100, h200, b200, gb200, rtx6000")
    sub.choices["doctor"].add_argument("--tp", type=_parallel_size, default=1, help="tensor-parallel size: each rank's shapes")
    sub.choices["doctor"].add_argument("--ep-size", type=_parallel_size, default=1, help="expert-parallel size (divides --tp)")
    b = sub.choices["build"]
    b.add_argument("--model", help="MXFP8 checkpoint folder: also the kernels its layer shapes select")
    b.add_argument("--gpu", help="the server's GPU, where this machine has none: h100, h200")
    b.add_argument("--tp", type=_parallel_size, default=1, help="tensor-parallel size of the server")
    b.add_argument("--ep-size", type=_parallel_size, default=1, help="expert-parallel size of the server")
    b.add_argument("--max-tokens", type=_parallel_size, default=16384,
                   help="largest batch the server runs (at least its --chunked-prefill-size; default 16384)")
    b.add_argument("--jobs", type=_parallel_size, default=None, help="concurrent compiler processes (default: one per CPU)")
    sub.choices["demo"].add_argument("--workdir", help="where to write the checkpoints (default: a temp dir)")
    sub.choices["demo"].add_argument("--port", type=int, default=30123)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
