"""``sglang-mxfp8``: convert checkpoints, check what each layer will run on, and run the demo."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import OrderedDict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from . import __version__, checkpoint, resolver

KNOWN_GPUS = {"h100": ("NVIDIA H100", 90), "h200": ("NVIDIA H200", 90), "b200": ("NVIDIA B200", 100),
              "gb200": ("NVIDIA GB200", 100), "rtx6000": ("NVIDIA RTX PRO 6000", 120)}


def _pkg(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _gpu(arg: Optional[str]) -> Optional[resolver.GpuSpec]:
    if arg:
        if arg.lower() not in KNOWN_GPUS:
            raise SystemExit(f"--gpu {arg}: choose one of {', '.join(KNOWN_GPUS)} (or omit it to use this machine's GPU)")
        return resolver.GpuSpec(*KNOWN_GPUS[arg.lower()])
    from .gpu import visible_gpu

    return visible_gpu()


def layer_kinds(ckpt: Path) -> "OrderedDict[str, Tuple[str, int, int, int]]":
    """Quantized tensors grouped by kind (name without layer/expert numbers): (kind, N, K, count)."""
    import re

    from safetensors import safe_open

    from .convert import _shards

    kinds: "OrderedDict[str, list]" = OrderedDict()
    for shard in _shards(ckpt):
        with safe_open(str(ckpt / shard), framework="pt") as f:
            for name in f.keys():
                if not name.endswith((".weight_scale_inv", ".weight_scale")):
                    continue
                wname = name.rsplit(".", 1)[0] + ".weight"
                if wname not in f.keys():
                    continue
                n, k = f.get_slice(wname).get_shape()
                kind = re.sub(r"\.\d+\.", ".N.", wname.rsplit(".", 1)[0])
                entry = kinds.setdefault(kind, ["experts" if ".experts." in wname else "dense", n, k, 0])
                entry[3] += 1
    return OrderedDict((k, tuple(v)) for k, v in kinds.items())


def startup_hook_status() -> str:
    """Whether SGLang processes started from this environment will run sglang_mxfp8."""
    from .startup import autoload

    if autoload.disabled():
        return f"disabled by {autoload.DISABLE_ENV}=1 (SGLang runs as shipped)"
    if not any(isinstance(f, autoload.SglangImportHook) for f in sys.meta_path):
        return "NOT active: sglang_mxfp8.pth did not run in this interpreter; reinstall with `pip install -e .`"
    return "active (sglang_mxfp8.pth patches SGLang in every process it starts)"


MOE_GEMV = "; one-token batches on the GEMV MoE (SGLANG_MXFP8_MOE_GEMV=0 turns it off)"
GEMV_NOTE = "; one-token batches on the weight-streaming GEMV (SGLANG_MXFP8_GEMV=0 turns it off)"
FUSED_AS_SERVED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                   "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def served_dense_layers(dense: Dict[str, Tuple[int, int, int]]) -> "OrderedDict[str, Tuple[int, int, int, List[str]]]":
    """Checkpoint layer kinds {kind: (N, K, count)} as SGLang builds them, where the kernel is chosen: q/k/v and
    gate/up each one weight, N summed; {served kind: (N, K, count, the checkpoint kinds' last names)}."""
    served: "OrderedDict[str, list]" = OrderedDict()
    for kind, (n, k, count) in dense.items():
        prefix, leaf = kind.rsplit(".", 1)
        entry = served.setdefault(f"{prefix}.{FUSED_AS_SERVED.get(leaf, leaf)}", [0, k, count, []])
        entry[0] += n
        entry[3].append(leaf)
    return OrderedDict((name, tuple(v)) for name, v in served.items())


def per_rank(name: str, n: int, k: int, tp: int, config: dict) -> Tuple[int, int]:
    """(N, K) of one tensor-parallel rank's shard of a served dense layer, as SGLang's parallel linears split it:
    q/k/v by heads (key/value heads replicated when there are fewer than ranks), gate/up by rows, o and down by
    columns; a layer of another name whole."""
    leaf = name.rsplit(".", 1)[1]
    if tp == 1 or leaf not in ("qkv_proj", "gate_up_proj", "o_proj", "down_proj"):
        return n, k
    if leaf == "qkv_proj":
        heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        if heads % tp:
            raise resolver.Mxfp8ConfigError(f"{name}: --tp {tp} does not divide {heads} attention heads (SGLang refuses it too)")
        if kv_heads % tp if kv_heads >= tp else tp % kv_heads:
            raise resolver.Mxfp8ConfigError(f"{name}: neither of --tp {tp} and {kv_heads} key/value heads divides the "
                                            "other (SGLang refuses it too)")
        return (heads // tp + 2 * max(1, kv_heads // tp)) * head_dim, k
    split = n if leaf == "gate_up_proj" else k
    if split % tp:
        raise resolver.Mxfp8ConfigError(f"{name}: --tp {tp} does not divide {split} (SGLang refuses it too)")
    return (split // tp, k) if leaf == "gate_up_proj" else (n, split // tp)


def dense_extras(choice: resolver.Choice, n: int, k: int, dtype: str = "bfloat16") -> str:
    """What else a Hopper dense layer runs beside its kernel, each with its switch (dtype: the model's)."""
    import torch

    from .dense import backend_class, dense_gemv_enabled, dense_prefill_choice, weight_only_max_m
    from .flashinfer_sm90 import precompile_enabled

    extra, small_m = "", weight_only_max_m(n)
    if choice.kernel == resolver.HOPPER_TRITON and small_m:
        extra = f"; weight-only FP8 GEMM for batches of up to {small_m} tokens"
    elif choice.kernel == resolver.HOPPER_FLASHINFER:
        extra = "; its kernels compiled while the model loads" if precompile_enabled() else ""
        kind, prefill_m, why_not_deepgemm = dense_prefill_choice(n, k, getattr(torch, dtype))
        if kind == "deepgemm":
            extra += f"; batches of {prefill_m}+ tokens on DeepGEMM's FP8 GEMM (SGLANG_MXFP8_DEEPGEMM_PREFILL_DENSE=0 turns it off)"
        elif kind == "cublas":
            extra += (f"; batches of {prefill_m}+ tokens on cuBLAS's block-scaled GEMM (SGLANG_MXFP8_CUBLAS_PREFILL=0 "
                      f"turns it off; not DeepGEMM: {why_not_deepgemm})")
    cls = backend_class(choice.kernel)
    if cls is not None and (n, k) in cls.gemv_shapes and dense_gemv_enabled():
        extra += GEMV_NOTE
    return extra


def moe_report(gpu, flag: str, fi: bool, experts: Dict[str, Tuple[int, int]], tp: int, ep: int) -> Tuple[str, bool]:
    """Doctor's MoE line for a checkpoint's experts {kind: (N, K)} at --tp / --ep-size, and whether it can run."""
    from .moe_hopper import gemv_moe_runs, prefill_moe_choice

    hidden = next(k for kind, (n, k) in experts.items() if not kind.endswith("down_proj"))
    inter = next(k for kind, (n, k) in experts.items() if kind.endswith("down_proj"))
    moe_tp = tp // ep  # SGLang: experts split ep ways, each expert's rows tp / ep ways
    try:
        if inter % moe_tp:
            raise resolver.Mxfp8ConfigError(f"--tp / --ep-size {moe_tp} does not divide the experts' intermediate "
                                            f"size {inter} (SGLang refuses it too)")
        rank_inter = inter // moe_tp
        choice = resolver.resolve_moe(gpu, flag, flashinfer=fi, hidden=hidden, intermediate=rank_inter, tp=moe_tp)
    except resolver.Mxfp8ConfigError as e:
        return f"  MoE experts: ERROR {e}", False
    extra = ""
    if choice.kernel == resolver.HOPPER_TRITON_MOE and ep == 1:  # neither runs with expert parallelism
        kind, prefill_tokens, why_not_deepgemm = prefill_moe_choice()
        if kind == "deepgemm":
            extra = f"; batches of {prefill_tokens}+ tokens on DeepGEMM's grouped FP8 GEMM"
        elif prefill_tokens:
            extra = f"; batches of {prefill_tokens}+ tokens on SGLang's CUTLASS grouped MoE (not DeepGEMM: {why_not_deepgemm})"
        if gemv_moe_runs(hidden, rank_inter):
            extra += MOE_GEMV
    split = (f", {rank_inter} per rank" if moe_tp > 1 else "") + (f", experts split {ep} ways" if ep > 1 else "")
    return f"  MoE experts (hidden {hidden}, intermediate {inter}{split}): {choice}{extra}", True


def doctor(args) -> int:
    from .gpu import flashinfer_available

    gpu = _gpu(args.gpu)
    fi = flashinfer_available()
    print(f"sglang_mxfp8 {__version__}  sglang {_pkg('sglang')}  flashinfer {_pkg('flashinfer-python')}  torch {_pkg('torch')}")
    print(f"startup hook: {startup_hook_status()}")
    if gpu is None:
        print("GPU: none visible (pass --gpu h200|b200|... to see what a GPU would run)")
    else:
        print(f"GPU: {gpu.label}")
        print(f"  {resolver.DENSE_FLAG}: valid {', '.join(resolver.dense_flag_choices(gpu, fi)) or 'none'}")
        print(f"  {resolver.MOE_FLAG}: valid {', '.join(resolver.moe_flag_choices(gpu, fi)) or 'none'}")
    if not args.model:
        return 0
    ckpt = Path(args.model)
    if not (ckpt / "config.json").is_file():
        print(f"{ckpt}: no config.json there; pass the checkpoint's folder (config.json and *.safetensors)")
        return 1
    fmt = checkpoint.detect_checkpoint(ckpt)
    if fmt is None:
        print(f"{ckpt}: not an MXFP8 checkpoint (no quant_method mxfp8 / quant_algo MXFP8)")
        return 1
    flavor = "ModelOpt" if fmt.flavor == checkpoint.MODELOPT else "SGLang/miles"
    print(f"checkpoint: {ckpt} ({flavor} MXFP8, scales '{fmt.scale_name}', {len(fmt.ignored)} modules kept unquantized)")
    if gpu is None:  # the checkpoint is checked; which kernel each layer gets depends on the GPU
        print("  kernels per layer: pass --gpu h200|b200|... to see them")
        return 0
    status = 0
    experts: Dict[str, Tuple[int, int]] = {}
    dense: Dict[str, Tuple[int, int, int]] = {}
    for kind, (role, n, k, count) in layer_kinds(ckpt).items():
        if role == "experts":
            experts[kind] = (n, k)
        else:
            dense[kind] = (n, k, count)
    config = json.loads((ckpt / "config.json").read_text())
    config = config.get("text_config") or config
    model_dtype = "float16" if (config.get("torch_dtype") or config.get("dtype")) == "float16" else "bfloat16"
    tp, ep = args.tp, args.ep_size
    if tp % ep:
        print(f"--ep-size {ep} does not divide --tp {tp}; SGLang's expert parallelism splits the tensor-parallel ranks")
        return 1
    if tp > 1:
        print(f"  at --tp {tp}" + (f" --ep-size {ep}" if ep > 1 else "") + ": kernels chosen on one rank's shard")
    for name, (n, k, count, parts) in served_dense_layers(dense).items():
        fused = f" ({' + '.join(sorted(parts, key=list(FUSED_AS_SERVED).index))})" if len(parts) > 1 else ""
        try:
            rn, rk = per_rank(name, n, k, tp, config)
            rank = f", [{rn} x {rk}] per rank" if (rn, rk) != (n, k) else ""
            choice = resolver.resolve_dense(gpu, args.fp8_gemm_backend, flashinfer=fi, n=rn, k=rk, layer=name)
            extra = dense_extras(choice, rn, rk, model_dtype)
            print(f"  dense {name} [{n} x {k}] x{count}{fused}{rank}: {choice}{extra}")
        except resolver.Mxfp8ConfigError as e:
            print(f"  dense {name}{fused}: ERROR {e}")
            status = 1
    if experts:
        line, ok = moe_report(gpu, args.moe_runner_backend, fi, experts, tp, ep)
        print(line)
        status = status if ok else 1
    return status


def convert_cmd(args) -> int:
    from .convert import ConvertError, convert

    try:
        r = convert(args.input, args.output, force=args.force, rounding=args.rounding)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.output}: {len(r.quantized)} tensors quantized to MXFP8, {len(r.kept)} kept, {r.shards} shard(s), "
          f"{r.bytes_in / 2**20:.1f} MiB -> {r.bytes_out / 2**20:.1f} MiB")
    return 0


def _cpu_check(bf16: Path, mx: Path) -> List[str]:
    """Dequantize every converted weight, compare with the BF16 original, and run one layer the Hopper way."""
    import torch
    from safetensors.torch import load_file

    from .numerics import convert_to_block_scales, dequantize_block_fp8, dequantize_mxfp8, quantize_activation_1x128

    a, b = load_file(str(bf16 / "model.safetensors")), load_file(str(mx / "model.safetensors"))
    worst, name_worst = 0.0, ""
    for name, s in b.items():
        if name.endswith("weight_scale_inv"):
            w = name[: -len("_scale_inv")]
            ref = a[w].float()
            err = ((dequantize_mxfp8(b[w], s) - ref).norm() / ref.norm()).item()
            if err > worst:
                worst, name_worst = err, w
    w = "model.layers.0.self_attn.o_proj.weight"
    q = b[w].clone()
    scales, changed = convert_to_block_scales(q, b[w + "_scale_inv"], 1)
    x = torch.randn(4, q.shape[1])
    xq, xs = quantize_activation_1x128(x)
    hopper = (xq.float() * xs.repeat_interleave(128, 1)[:, : q.shape[1]]) @ dequantize_block_fp8(q, scales, 1).t()
    exact = x @ a[w].float().t()
    layer_err = ((hopper - exact).norm() / exact.norm()).item()
    return [
        f"worst MXFP8 weight error vs BF16: {worst:.4f} relative ({name_worst})",
        f"{w}: Hopper conversion changed {changed} of {q.numel()} elements; "
        f"W8A8 output vs BF16 output: {layer_err:.4f} relative (FP8 activations + MXFP8 weights)",
    ]


def demo(args) -> int:
    from .convert import convert
    from .gpu import visible_gpu
    from .tiny_model import write_qwen3_moe

    work = Path(args.workdir or tempfile.mkdtemp(prefix="sglang_mxfp8_demo_"))
    bf16, mx, mx2 = work / "tiny-qwen3-moe-bf16", work / "tiny-qwen3-moe-mxfp8", work / "tiny-qwen3-moe-mxfp8-step2"
    print(f"[1/4] writing a random Qwen3-MoE (BF16) to {bf16}")
    write_qwen3_moe(bf16, seed=0)
    print(f"[2/4] converting to MXFP8: {mx}")
    r = convert(bf16, mx, force=True, progress=False)
    print(f"      {len(r.quantized)} tensors quantized, {r.bytes_in / 2**20:.1f} MiB -> {r.bytes_out / 2**20:.1f} MiB")
    for line in _cpu_check(bf16, mx):
        print("      " + line)
    gpu = visible_gpu()
    if gpu is None:
        print("[3/4] no GPU here; on a GPU this demo serves the checkpoint with stock SGLang. It would run:")
        for name in ("h200", "b200"):
            g = resolver.GpuSpec(*KNOWN_GPUS[name])
            for flag in ("flashinfer_trtllm", "triton"):
                print(f"      {g.label} {resolver.DENSE_FLAG} {flag}: "
                      f"{resolver.resolve_dense(g, flag, flashinfer=True, n=512, k=256)}")
            print(f"      {g.label} {resolver.MOE_FLAG} auto: {resolver.resolve_moe(g, 'auto', flashinfer=True, hidden=256, intermediate=128)}")
        print("[4/4] done (CPU path)")
        return 0
    from .serving import Server

    write_qwen3_moe(work / "step2-bf16", seed=1)
    convert(work / "step2-bf16", mx2, force=True, progress=False)
    flags = f"{resolver.DENSE_FLAG} {args.fp8_gemm_backend} {resolver.MOE_FLAG} {args.moe_runner_backend}"
    print(f"[3/4] serving {mx} on {gpu.label}: python -m sglang.launch_server ... {flags}")
    s = Server("demo", str(mx), flags, args.port, work)
    try:
        s.wait()
        before = s.generate()
        print(f"      first prompt -> {before[0]['ids']}")
        code, body = s.refit(str(mx2))
        after = s.generate()
        print(f"      /update_weights_from_disk -> {code} {body.get('message')}; first prompt -> {after[0]['ids']}")
    finally:
        s.stop()
    lines = [l for l in s.log.read_text().splitlines() if "sglang_mxfp8" in l]
    print("[4/4] plugin log lines from the server:\n      " + "\n      ".join(lines[:6]))
    return 0


def _parallel_size(text: str) -> int:
    """argparse type of --tp / --ep-size: a GPU count, 1 or more."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GPUs (1 or more)")
    return int(text)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="sglang-mxfp8", description=__doc__)
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

    for name, helptext, func in (("doctor", "what each layer will run on", doctor), ("demo", "convert and serve a small model", demo)):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--fp8-gemm-backend", default="auto", choices=resolver.DENSE_FLAG_CHOICES)
        p.add_argument("--moe-runner-backend", default="auto", choices=resolver.MOE_FLAG_CHOICES)
        p.set_defaults(func=func)
    sub.choices["doctor"].add_argument("--model", help="MXFP8 checkpoint folder")
    sub.choices["doctor"].add_argument("--gpu", help=f"pretend GPU: {', '.join(KNOWN_GPUS)}")
    sub.choices["doctor"].add_argument("--tp", type=_parallel_size, default=1, help="tensor-parallel size: each rank's shapes")
    sub.choices["doctor"].add_argument("--ep-size", type=_parallel_size, default=1, help="expert-parallel size (divides --tp)")
    sub.choices["demo"].add_argument("--workdir", help="where to write the checkpoints (default: a temp dir)")
    sub.choices["demo"].add_argument("--port", type=int, default=30123)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
