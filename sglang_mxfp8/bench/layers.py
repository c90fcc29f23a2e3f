"""``layers``: one dense or MoE layer, MXFP8 against BF16 in the same process, at batch sizes of 1 to 8192 tokens.

MXFP8 runs the kernels the registry plans for each flag (``--all-kernels``: every kernel registered for this GPU that
can run the layer, each beside a base kernel whose layout it reads), BF16 what SGLang runs (cuBLAS for a dense layer,
its Triton fused MoE). Both are timed by :mod:`.timer` (CUDA graphs over weights that do not fit the L2 cache), and
both outputs are compared with a float32 reference on the unquantized weights. Each row says what fraction of the floor
:mod:`.roofline` puts under the layer each side reaches (the GPU's copy bandwidth and GEMM peaks, measured first).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from .. import error_line
from ..flags import DENSE_FLAG, MOE_FLAG
from .roofline import Peaks, dense_traffic, moe_traffic, measure as measure_peaks
from .rows import Environment, Row, measurement
from .shapes import SETS, DenseShape, MoEShape, from_checkpoint
from .timer import copies_for, gpu_us, relative_error

TOKENS = (1, 16, 64, 256, 1024, 2048, 4096, 8192)
ONE_TOKEN_ROUTINGS = 16  # one token reads 8 experts (38 MB in FP8): 16 routings per timed sequence leave the L2


@dataclass(frozen=True)
class LayerOptions:
    sets: Tuple[str, ...] = ("qwen3-30b-a3b",)
    model: Optional[str] = None  # an MXFP8 checkpoint whose layer shapes are timed instead
    tokens: Tuple[int, ...] = TOKENS
    dense_flags: Tuple[str, ...] = ("flashinfer_trtllm",)
    moe_flags: Tuple[str, ...] = ("flashinfer_cutlass", "auto")
    all_kernels: bool = False

    def shapes(self) -> List[Tuple[List[DenseShape], Optional[MoEShape]]]:
        if self.model:
            return [from_checkpoint(Path(self.model))]
        return [SETS[name] for name in self.sets]


@dataclass
class Target:
    """One MXFP8 column: a kernel (or a plan choosing one per batch) on layers built with one weight layout."""

    flags: str
    label: Callable[[int], str]  # the kernel that runs a batch of m tokens
    run: Callable[[object, object, object], object]  # (layer, state, x) -> output; for MoE (layer, state, batch)
    layers: list
    takes: Callable[[int], bool] = lambda m: True
    planned: bool = True


def _generator(seed_text: str):
    import torch

    return torch.Generator(device="cuda").manual_seed(sum(map(ord, seed_text)))


def _extra(err: float, bf16_err: float, planned: bool, peaks: Optional[Peaks], traffic, us: float,
           bf16_us: float) -> dict:
    """A layer row's extras: both sides' relative errors, whether a plan chose the kernel, the floors reached."""
    floors = peaks.fractions(*traffic, us, bf16_us) if peaks else {}
    return {"mxfp8_error": round(err, 6), "bf16_error": round(bf16_err, 6), "planned": planned, **floors}


# -- dense -------------------------------------------------------------------------------------------------------------
def _dense_layers(plan, q, s, copies: int) -> list:
    import torch

    layers = []
    for _ in range(copies):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(q.clone(), requires_grad=False)
        layer.weight_scale_inv = torch.nn.Parameter(s.clone(), requires_grad=False)
        state = plan.create_buffers(layer)
        plan.process_weights_after_loading(layer, state, layer.weight_scale_inv)
        layers.append((layer, state))
    return layers


def _dense_targets(shape: DenseShape, opts: LayerOptions, q, s, copies: int) -> List[Target]:
    from ..kernels import registry
    from ..kernels.base import LinearSpec
    from ..platform import current_gpu

    gpu, spec = current_gpu(), LinearSpec(str(shape), shape.n, shape.k)
    if not opts.all_kernels:
        targets = []
        for flag in opts.dense_flags:
            plan = registry.select_linear(spec, gpu, flag)
            targets.append(Target(f"{DENSE_FLAG} {flag}", lambda m, p=plan: p.kernel_for(m).name,
                                  lambda layer, state, x, p=plan: p.apply(layer, state, x, None),
                                  _dense_layers(plan, q, s, copies)))
        return targets
    targets = []
    for entry, base in registry.candidates("linear", gpu, spec):
        layers = _dense_layers(_plan_of(entry, base, spec, gpu), q, s, copies)
        targets.append(Target("--all-kernels", lambda m, k=entry.kernel: k.name,
                              lambda layer, state, x, k=entry.kernel: k.apply(layer, state, x, None),
                              layers, takes=entry.takes, planned=False))
    return targets


def _plan_of(entry, base, spec, gpu):
    """The plan a layer of ``entry``'s kernel has beside ``base`` (the base alone for a base kernel): its layers get
    the buffers each kernel of a real plan creates."""
    from ..kernels.plan import Entry, Plan

    return Plan(spec, gpu, "bench", (Entry(base),) if entry.kernel is base else (entry, Entry(base)))


def dense_rows(env: Environment, shape: DenseShape, opts: LayerOptions, deadline: float,
               record: Callable[[List[Row]], None], peaks: Optional[Peaks]) -> None:
    import torch
    import torch.nn.functional as F

    from ..format.numerics import quantize_mxfp8

    g = _generator(str(shape))
    w = torch.randn(shape.n, shape.k, device="cuda", generator=g) * 0.02
    copies = copies_for(shape.n * shape.k)
    w16 = [w.to(torch.bfloat16) for _ in range(copies)]
    q, s = quantize_mxfp8(w)
    targets = _dense_targets(shape, opts, q, s, copies)
    for m in opts.tokens:
        if time.monotonic() > deadline:
            print(f"layers: time limit reached before {shape} at {m} tokens", flush=True)
            return
        x = torch.randn(m, shape.k, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = x.float() @ w.t()
        bf16_us = gpu_us([lambda b=b: F.linear(x, b) for b in w16])
        bf16_err = relative_error(F.linear(x, w16[0]), ref)
        traffic = dense_traffic(m, shape.n, shape.k, 1), dense_traffic(m, shape.n, shape.k, 2)
        rows = []
        for t in targets:
            if not t.takes(m):
                continue
            us = gpu_us([lambda layer=layer, state=state, t=t: t.run(layer, state, x) for layer, state in t.layers])
            err = relative_error(t.run(*t.layers[0], x), ref)
            rows.append(measurement(env, "layers", "layer time", str(shape), t.flags, "us", "lower", us, bf16_us,
                                    tokens=m, kernel=t.label(m),
                                    extra=_extra(err, bf16_err, t.planned, peaks, traffic, us, bf16_us)))
        record(rows)


# -- MoE ---------------------------------------------------------------------------------------------------------------
def moe_reference(x, w13, w2, topk_weights, topk_ids):
    """The MoE in float32 on the unquantized weights (w13 [E, 2I, H] as [gate; up]): SiLU-gated experts, the
    router weights applied to each expert's output, summed over the top-k."""
    import torch
    import torch.nn.functional as F

    m, top_k = topk_ids.shape
    inter = w2.shape[2]
    xf = x.float()
    out = torch.zeros(m, w2.shape[1], device=x.device)
    tokens = torch.arange(m, device=x.device).repeat_interleave(top_k)
    experts, weights = topk_ids.reshape(-1).long(), topk_weights.reshape(-1).float()
    for e in experts.unique().tolist():
        rows = (experts == e).nonzero().flatten()
        h = xf[tokens[rows]] @ w13[e].t()
        act = F.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tokens[rows], (act @ w2[e].t()) * weights[rows, None])
    return out


def _routing(m: int, experts: int, top_k: int, g):
    import torch

    w, ids = torch.topk(torch.softmax(torch.randn(m, experts, device="cuda", generator=g), -1), top_k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).float(), ids.int()


def _moe_layer(plan, w13, w2, top_k: int):
    """A layer with the plan's weight layout: FP8 experts quantized as the converter does, w13 in the order the
    base kernel loads it, post-load processing run."""
    import torch

    from ..format.numerics import quantize_mxfp8

    inter = w2.shape[2]
    order = torch.cat([w13[:, inter:], w13[:, :inter]], 1) if plan.base.layout.up_first else w13
    q13, s13 = quantize_mxfp8(order)
    q2, s2 = quantize_mxfp8(w2)
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(q13, requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(q2, requires_grad=False)
    layer.top_k, layer.moe_tp_size, layer.moe_tp_rank, layer.moe_ep_size, layer.moe_ep_rank = top_k, 1, 0, 1, 0
    state = plan.create_buffers(layer)
    plan.process_weights_after_loading(layer, state, s13, s2)
    return layer, state


def _moe_targets(shape: MoEShape, opts: LayerOptions, w13, w2) -> List[Target]:
    from ..kernels import registry
    from ..kernels.base import MoESpec
    from ..platform import current_gpu

    gpu = current_gpu()
    spec = MoESpec(str(shape), shape.experts, shape.hidden, shape.intermediate)
    if not opts.all_kernels:
        targets = []
        for flag in opts.moe_flags:
            plan = registry.select_moe(spec, gpu, flag)
            targets.append(Target(f"{MOE_FLAG} {flag}", lambda m, p=plan: p.kernel_for(m).name,
                                  lambda layer, state, b, p=plan: p.kernel_for(b[0].shape[0]).experts(layer, state, *b),
                                  [_moe_layer(plan, w13, w2, shape.top_k)]))
        return targets
    targets = []
    for entry, base in registry.candidates("moe", gpu, spec):
        layer = _moe_layer(_plan_of(entry, base, spec, gpu), w13, w2, shape.top_k)
        targets.append(Target("--all-kernels", lambda m, k=entry.kernel: k.name,
                              lambda layer, state, b, k=entry.kernel: k.experts(layer, state, *b),
                              [layer], takes=entry.takes, planned=False))
    return targets


def _sglang_moe_setup():
    """What SGLang's fused MoE needs outside a server (its global server arguments), and that fused MoE."""
    from ..compat import sglang_object

    try:
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))
    except (ImportError, TypeError, ValueError):  # newer SGLang: its fused MoE reads no global arguments
        pass
    return sglang_object("fused_experts")


def moe_rows(env: Environment, shape: MoEShape, opts: LayerOptions, deadline: float,
             record: Callable[[List[Row]], None], peaks: Optional[Peaks]) -> None:
    import torch

    fused_experts = _sglang_moe_setup()
    g = _generator(str(shape))
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", generator=g) * 0.02
    w13_16, w2_16 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    targets = _moe_targets(shape, opts, w13, w2)
    for m in opts.tokens:
        if time.monotonic() > deadline:
            print(f"layers: time limit reached before {shape} at {m} tokens", flush=True)
            return
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g)
        routings = [_routing(m, e, shape.top_k, g) for _ in range(ONE_TOKEN_ROUTINGS if m == 1 else 1)]
        ref = moe_reference(x, w13, w2, *routings[0])
        bf16_us = gpu_us([lambda r=r: fused_experts(x, w13_16, w2_16, *r) for r in routings])
        bf16_err = relative_error(fused_experts(x, w13_16, w2_16, *routings[0]), ref)
        hit = sum(ids.unique().numel() for _, ids in routings) / len(routings)  # experts whose weights are read
        traffic = tuple(moe_traffic(m, shape.top_k, hit, h, i, size) for size in (1, 2))
        rows = []
        for t in targets:
            if not t.takes(m):
                continue
            layer, state = t.layers[0]
            us = gpu_us([lambda r=r, t=t: t.run(layer, state, (x, *r)) for r in routings])
            err = relative_error(t.run(layer, state, (x, *routings[0])), ref)
            rows.append(measurement(env, "layers", "layer time", str(shape), t.flags, "us", "lower", us, bf16_us,
                                    tokens=m, kernel=t.label(m),
                                    extra=_extra(err, bf16_err, t.planned, peaks, traffic, us, bf16_us)))
        record(rows)


def run(env: Environment, opts: LayerOptions, deadline: float, record: Callable[[List[Row]], None]) -> None:
    """Every dense layer, then the MoE layer, of each shape set; each batch size's rows recorded as they are
    measured."""
    try:
        peaks = measure_peaks()
        print(f"layers: this GPU copies {peaks.copy_tb_s} TB/s; cuBLAS {peaks.fp8_tflops} FP8 / {peaks.bf16_tflops} "
              "BF16 TFLOPS (the floors under each layer row)", flush=True)
    except Exception as e:  # noqa: BLE001 - the layer times stand without their floors
        peaks = None
        print(f"layers: the GPU's copy bandwidth and GEMM peaks were not measured ({error_line(e)}); the rows go "
              "without their roofline fractions", flush=True)
    for dense, moe in opts.shapes():
        for shape in dense:
            dense_rows(env, shape, opts, deadline, record, peaks)
        if moe is not None:
            moe_rows(env, moe, opts, deadline, record, peaks)


def describe(opts: LayerOptions) -> List[str]:
    """What :func:`run` would time, for ``--dry-run`` (no GPU, no torch)."""
    what = "every registered kernel that can run the layer" if opts.all_kernels else (
        f"the planned kernels of {DENSE_FLAG} {'/'.join(opts.dense_flags)}, {MOE_FLAG} {'/'.join(opts.moe_flags)}")
    lines = []
    for source in ([opts.model] if opts.model else opts.sets):
        lines.append(f"layers {source}: {what}, against BF16 (cuBLAS; SGLang's Triton fused MoE), at "
                     f"{', '.join(map(str, opts.tokens))} tokens")
        if not opts.model:
            dense, moe = SETS[source]
            lines += [f"  {shape}" for shape in dense] + ([f"  {moe}"] if moe else [])
    return lines


def estimate_s(opts: LayerOptions, sets: Sequence[str] = ()) -> float:
    """Rough seconds :func:`run` takes (compiles included), for the progress line's ETA."""
    shapes = 0
    for dense, moe in opts.shapes() if opts.model else [SETS[name] for name in opts.sets]:
        shapes += len(dense) + (3 if moe else 0)  # an MoE layer: slower timings and Triton compiles
    # a shape at one batch size, per flag value (H100: the quick suite's 3 shapes at 5 sizes, 2 MoE flags, took 62 s)
    per = 1.0 * (4 if opts.all_kernels else max(len(opts.dense_flags), len(opts.moe_flags)))
    return 20 + shapes * len(opts.tokens) * per
