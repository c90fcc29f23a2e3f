"""``sglang-mxfp8 demo``: a small random Qwen3-MoE written, converted to MXFP8 and checked on the CPU; on a GPU also
served by stock SGLang and refit."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import List, Tuple

from ..format.convert import convert
from ..kernels import registry
from ..kernels.base import LinearSpec, MoESpec
from ..platform import GpuSpec, as_on_a_server, visible_gpu
from .doctor import KNOWN_GPUS
from ..bench.tiny_model import qwen3_moe_config, write_qwen3_moe


def _cpu_check(bf16: Path, mx: Path) -> List[str]:
    """Dequantize every converted weight, compare with the BF16 original, and run one layer the Hopper way."""
    import torch
    from safetensors.torch import load_file

    from ..format.numerics import (
        convert_to_block_scales,
        dequantize_block_fp8,
        dequantize_mxfp8,
        quantize_activation_1x128,
    )

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
    """The demo in ``--workdir`` (kept), or in a temporary folder it names and removes at the end unless --keep."""
    if args.workdir:
        work = Path(args.workdir)
        print(f"demo: writing its checkpoints to {work}")
        return _demo(args, work)
    work = Path(tempfile.mkdtemp(prefix="sglang_mxfp8_demo_"))
    print(
        f"demo: writing its checkpoints to {work} ({'kept' if args.keep else 'removed at the end; --keep keeps them'})"
    )
    try:
        return _demo(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _demo(args, work: Path) -> int:
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
        with as_on_a_server():
            _print_plans()
        print("[4/4] done (CPU path)")
        return 0
    _serve(args, work, gpu, mx, mx2)
    return 0


def _demo_layers() -> Tuple[List[LinearSpec], MoESpec]:
    """The demo model's dense layers (as SGLang fuses them) and its MoE layer, from the config it writes."""
    c = qwen3_moe_config()
    h, hd = c["hidden_size"], c["head_dim"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd
    dense = [LinearSpec("qkv_proj", qkv, h), LinearSpec("o_proj", h, c["num_attention_heads"] * hd)]
    return dense, MoESpec("experts", c["num_experts"], h, c["moe_intermediate_size"])


def _print_plans() -> None:
    """What an H200 and a B200 server would run for the demo model's shapes, flag by flag."""
    dense, moe = _demo_layers()
    for name in ("h200", "b200"):
        g = GpuSpec(*KNOWN_GPUS[name])
        for flag in ("flashinfer_trtllm", "triton"):
            for spec in dense:
                plan = registry.select_linear(spec, g, flag)
                print(f"      {g.label} {registry.DENSE_FLAG} {flag}: {plan.explain(skipped=False)}")
        plan = registry.select_moe(moe, g, "auto")
        print(f"      {g.label} {registry.MOE_FLAG} auto: {plan.explain(skipped=False)}")


def _serve(args, work: Path, gpu: GpuSpec, mx: Path, mx2: Path) -> None:
    """Serve the MXFP8 checkpoint with stock SGLang, generate, refit to a second checkpoint, generate again."""
    from ..bench.serving import Server

    write_qwen3_moe(work / "step2-bf16", seed=1)
    convert(work / "step2-bf16", mx2, force=True, progress=False)
    flags = f"{registry.DENSE_FLAG} {args.dense_flag} {registry.MOE_FLAG} {args.moe_flag}"
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
    lines = [line for line in s.log.read_text().splitlines() if "sglang_mxfp8" in line]
    print("[4/4] plugin log lines from the server:\n      " + "\n      ".join(lines[:6]))
