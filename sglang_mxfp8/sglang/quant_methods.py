"""SGLang quantization config and methods for MXFP8 checkpoints (imports SGLang; loaded by the plugin).

``Mxfp8Config`` replaces ``QUANTIZATION_METHODS["mxfp8"]``. It keeps SGLang's parameters exactly
(e4m3 ``weight``, uint8 ``weight_scale_inv`` [N, K/32], MoE ``w13_*``/``w2_*``), so checkpoints and
``/update_weights_from_disk`` load as they do in SGLang, and adds the kernel layouts as derived
buffers of each layer's kernel plan (:mod:`sglang_mxfp8.kernels.registry`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import time
import weakref
from dataclasses import replace
from typing import Any, Dict, List, Optional

import torch
from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod, Fp8MoEMethod
from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod, UnquantizedLinearMethod
from sglang.srt.layers.quantization.utils import is_layer_skipped

from .. import __version__
from ..format import checkpoint
from .loads import LoadClock, LoadTracker
from ..kernels import registry
from ..kernels.base import LinearSpec, MoESpec, log_once
from ..kernels.moe.common import non_standard
from ..platform import current_gpu
from ..settings import current as current_settings
from ..compat import graph_max_batch, served_args, sglang_object
from .launch import layer_flags
from .patching import check_complete, run_queued

logger = logging.getLogger("sglang_mxfp8")


def _check_loads(layer) -> None:
    """Refuse a load that wrote a weight without its scale (layers built by hand have no tracker)."""
    tracker = getattr(layer, "mxfp8_loads", None)
    if tracker is not None:
        tracker.check()


class ConversionReport:
    """What one model load's post-processing converted and how long it took; the plugin logs it after each load."""

    changed = total = layers = 0
    processing_s = check_s = layout_s = precompile_s = 0.0

    @classmethod
    def reset(cls) -> None:
        cls.changed = cls.total = cls.layers = 0
        cls.processing_s = cls.check_s = cls.layout_s = cls.precompile_s = 0.0

    @classmethod
    def add(cls, stats, numel: int) -> None:
        if stats is None:  # a layout without a conversion (Blackwell scales)
            return
        cls.changed += stats.changed_elements
        cls.check_s += stats.check_s
        cls.layout_s += stats.layout_s
        cls.total += numel
        cls.layers += stats.converted_rows > 0

    @classmethod
    @contextlib.contextmanager
    def timed(cls, what: str, device: torch.device):
        """Add the block's time, its GPU work finished, to ``what`` (processing_s or precompile_s); copies the
        loader left in flight finish first, counted as copying."""
        if device.type == "cuda":
            start = time.perf_counter()
            torch.cuda.synchronize(device)
            LoadClock.copy_s += time.perf_counter() - start
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        setattr(cls, what, getattr(cls, what) + time.perf_counter() - start)

    @classmethod
    def line(cls) -> str:
        frac = cls.changed / cls.total if cls.total else 0.0
        return (
            f"sglang_mxfp8: converted {cls.layers} MXFP8 weights to Hopper block scales in place; "
            f"{cls.changed} of {cls.total} elements changed value ({frac:.2e}, e4m3 subnormal rounding)"
        )

    @classmethod
    def time_line(cls, load_s: float, what: str = "load") -> str:
        """Where a load's time went (``sglang-mxfp8 bench refit`` reads this line back): reading is the rest (the
        checkpoint's files, SGLang's loader, the tensors of other layers). ``what``: "load", or "tensor update" for
        the updates sent as tensors since the last post-processing (their copies, then the post-processing)."""
        copy_s, quantize_s = LoadClock.copy_s, LoadClock.quantize_s()
        read_s = max(0.0, load_s - copy_s - quantize_s - cls.processing_s - cls.precompile_s)
        return (f"sglang_mxfp8: {what} took {load_s:.3f} s: reading {read_s:.3f} s, copying into the MXFP8 weights "
                f"{copy_s:.3f} s, quantizing float tensors {quantize_s:.3f} s, MXFP8 post-load processing "
                f"{cls.processing_s:.3f} s (checks {cls.check_s:.3f} s, kernel layouts {cls.layout_s:.3f} s), kernel "
                f"precompilation {cls.precompile_s:.3f} s; peak GPU memory {LoadClock.peak_gib():.3f} GiB above its "
                "start")


class Mxfp8Config(Fp8Config):
    """Fp8Config for serialized MXFP8 checkpoints (miles/SGLang and ModelOpt), runnable from SM90."""

    def __init__(self, *args, scale_name: str = "weight_scale_inv", scale_rounding: str = "ceil", **kwargs):
        check_complete()
        super().__init__(*args, **kwargs)
        self.scale_name = scale_name
        self.scale_rounding = scale_rounding  # how weights a trainer sends as BF16 are quantized (the converter's)
        log_once(logging.INFO, f"sglang_mxfp8 {__version__} active in process "
                               f"{multiprocessing.current_process().name} (pid {os.getpid()})")

    def get_min_capability(self) -> int:
        return 90 if self.use_mxfp8 else super().get_min_capability()

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "Mxfp8Config":
        fmt = checkpoint.detect_mxfp8(config)
        if fmt is None or fmt.flavor == checkpoint.MILES:
            parsed = super().from_config(config)
            parsed.scale_rounding = config.get("scale_rounding", "ceil")  # sglang-mxfp8 convert records it
            return parsed
        ignored = []
        for name in fmt.ignored:
            base = name.removeprefix("model.")
            ignored += [base, f"model.{base}"]
        return cls(
            is_checkpoint_fp8_serialized=True,
            activation_scheme="dynamic",
            ignored_layers=ignored,
            weight_block_size=[1, 32],
            packed_modules_mapping=config.get("packed_modules_mapping") or {},
            use_mxfp8=True,
            scale_name=fmt.scale_name,
        )

    def rename_scales(self, layer: torch.nn.Module, prefixes) -> None:
        """Register SGLang's ``{prefix}weight_scale_inv`` under the checkpoint's scale name (ModelOpt: weight_scale)."""
        if self.scale_name != "weight_scale_inv":
            for p in prefixes:
                layer.register_parameter(f"{p}{self.scale_name}", layer._parameters.pop(f"{p}weight_scale_inv"))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        # Imported here as SGLang does: FusedMoE needs sgl_kernel, which CPU machines lack.
        from sglang.srt.layers.linear import LinearBase
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

        if not (self.use_mxfp8 and self.is_checkpoint_fp8_serialized):
            return super().get_quant_method(layer, prefix)
        skipped = is_layer_skipped(prefix, self.ignored_layers, fused_mapping=self.packed_modules_mapping)
        gpu = current_gpu()
        dense_flag, moe_flag = layer_flags()
        if isinstance(layer, LinearBase):
            if skipped:
                return UnquantizedLinearMethod()
            if registry.native("linear", gpu, dense_flag):
                return Fp8LinearMethod(self)  # SGLang's own Triton tl.dot_scaled MXFP8 kernel
            return Mxfp8LinearMethod(self, prefix)
        if isinstance(layer, FusedMoE):
            if skipped:
                return UnquantizedFusedMoEMethod(layer.use_triton_kernels, layer.use_flashinfer_trtllm_moe)
            if registry.native("moe", gpu, moe_flag):
                return Fp8MoEMethod(self)  # SGLang's own flashinfer_trtllm(_routed) / cutlass MXFP8 MoE
            return Mxfp8MoEMethod(self, prefix)
        return super().get_quant_method(layer, prefix)


def serving_max_tokens() -> Optional[int]:
    """Most tokens one forward of this SGLang server runs (largest prefill chunk or decode graph batch); None outside
    a server."""
    args = served_args()
    if args is None:
        return None
    chunk = args.chunked_prefill_size if (args.chunked_prefill_size or 0) > 0 else args.max_prefill_tokens
    graph_bs = graph_max_batch(args)
    return max(chunk or 0, graph_bs or 0) or None


def dispatch_w8a8_mxfp8_linear(n: int, k: int, *, layer: str = "layer", flag: Optional[str] = None, gpu=None,
                               dtype: torch.dtype = torch.bfloat16):
    """The dense MXFP8 kernels (a registry Plan) for a weight [n, k], from --fp8-gemm-backend, the GPU and the model
    dtype; SGLang's ``dispatch_w8a8_mxfp8_linear`` answers with it when called with a shape."""
    return registry.select_linear(LinearSpec(layer, n, k, dtype), gpu or current_gpu(), flag or layer_flags()[0])


def _announce_plan(plan) -> None:
    """The server log line of a layer shape's plan (once per shape and plan); a fallback the flag did not ask for
    warns."""
    log_once(logging.WARNING if plan.fallback else logging.INFO,
             f"sglang_mxfp8: {plan.spec.shape}: {plan.explain(with_spec=False)}")


def _precompile(plan, layer, state, weight) -> None:
    """Compile at load what the server's batch sizes will run (SGLANG_MXFP8_PRECOMPILE=0 skips it)."""
    max_m = serving_max_tokens()
    if max_m and weight.is_cuda and current_settings().precompile:
        with ConversionReport.timed("precompile_s", weight.device):
            plan.precompile(layer, state, max_m)


_LINEAR_LAYERS: List[weakref.ref] = []  # our linear layers, by layer.mxfp8_linear_index


@torch.library.custom_op("sglang_mxfp8::linear", mutates_args=())
def _linear_op(x: torch.Tensor, bias: Optional[torch.Tensor], layer_index: int) -> torch.Tensor:
    """One MXFP8 linear layer as a single opaque op for SGLang's piecewise CUDA graphs (on by default): SGLang
    traces the model with torch.compile(fullgraph=True) before capturing prefill graphs, and our kernels' host code
    (FlashInfer's JIT loader, DeepGEMM's bindings) cannot be traced. The op runs the layer eagerly while the graph
    is captured, as SGLang's own MXFP8 and MoE ops do."""
    layer = _LINEAR_LAYERS[layer_index]()
    return layer.quant_method.plan.apply(layer, layer.mxfp8_state, x, bias)


@_linear_op.register_fake
def _(x, bias, layer_index):
    return x.new_empty((*x.shape[:-1], _LINEAR_LAYERS[layer_index]().weight.shape[0]))  # weight: [N, K] as loaded


class Mxfp8LinearMethod(Fp8LinearMethod):
    """MXFP8 linear layer: SGLang's parameters, the kernels of the layer's registry plan."""

    def __init__(self, quant_config: Mxfp8Config, prefix: str):
        # Fp8LinearMethod.__init__ would pick SGLang's Blackwell-only GEMM; set what create_weights reads.
        self.quant_config = quant_config
        self.prefix = prefix
        self.use_mxfp8 = True
        self.block_quant = True
        self.is_checkpoint_fp8_serialized = True
        self.use_marlin = False
        self.plan = None
        # SGLang's "inside a piecewise CUDA graph" test, looked up here: at import SGLang is still importing its
        # quantization package (circular), and in apply torch.compile would trace the lookup
        self.in_piecewise_cuda_graph = sglang_object("piecewise_graph_flag")

    def create_weights(
        self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype, **extra
    ):
        self.plan = dispatch_w8a8_mxfp8_linear(sum(output_partition_sizes), input_size_per_partition, layer=self.prefix,
                                               dtype=params_dtype)
        _announce_plan(self.plan)
        super().create_weights(
            layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype, **extra
        )
        self.quant_config.rename_scales(layer, ("",))
        layer.mxfp8_loads = LoadTracker(self.prefix, {"": (layer.weight, getattr(layer, self.quant_config.scale_name))},
                                        self.quant_config.scale_name, self.quant_config.scale_rounding)
        layer.mxfp8_state = self.plan.create_buffers(layer)
        layer.mxfp8_linear_index = len(_LINEAR_LAYERS)
        _LINEAR_LAYERS.append(weakref.ref(layer))

    def process_weights_after_loading(self, layer) -> None:
        _check_loads(layer)
        scale = getattr(layer, self.quant_config.scale_name)
        with ConversionReport.timed("processing_s", layer.weight.device):
            stats = self.plan.process_weights_after_loading(layer, layer.mxfp8_state, scale)
        ConversionReport.add(stats, layer.weight.numel())
        _precompile(self.plan, layer, layer.mxfp8_state, layer.weight)

    def apply(self, layer, x, bias=None):
        if self.in_piecewise_cuda_graph():  # being traced for (or replayed as) a piecewise CUDA graph
            return torch.ops.sglang_mxfp8.linear(x, bias, layer.mxfp8_linear_index)
        return self.plan.apply(layer, layer.mxfp8_state, x, bias)


class Mxfp8MoEMethod(Fp8MoEMethod):
    """MXFP8 fused MoE on SGLang's FusedMoE parameters, the kernels of the layer's registry plan."""

    def __init__(self, quant_config: Mxfp8Config, prefix: str):
        super().__init__(quant_config)
        self.prefix = prefix
        self.plan = None

    @property
    def load_up_proj_weight_first(self) -> bool:
        """FlashInfer's CUTLASS MoE wants w13 as [up; gate]; SGLang's loader reads this on every load."""
        return self.plan is not None and self.plan.base.layout.up_first

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra):
        ep = getattr(layer, "moe_ep_size", 1)
        config = getattr(layer, "moe_runner_config", None)  # SGLang sets it before create_weights
        spec = MoESpec(self.prefix, num_experts, hidden_size, intermediate_size_per_partition,
                       tp=getattr(layer, "moe_tp_size", 1), ep=ep, dtype=params_dtype,
                       non_standard=non_standard(config, ep) if config is not None else None)
        self.plan = registry.select_moe(spec, current_gpu(), layer_flags()[1])
        _announce_plan(self.plan)
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra)
        self.quant_config.rename_scales(layer, ("w13_", "w2_"))
        layer.mxfp8_loads = LoadTracker(self.prefix, {w: (getattr(layer, f"{w}_weight"), self._scale(layer, w))
                                                      for w in ("w13", "w2")})
        layer.mxfp8_state = self.plan.create_buffers(layer)

    def _scale(self, layer, w: str) -> torch.Tensor:
        return getattr(layer, f"{w}_{self.quant_config.scale_name}")

    def process_weights_after_loading(self, layer) -> None:
        _check_loads(layer)
        with ConversionReport.timed("processing_s", layer.w13_weight.device):
            stats = self.plan.process_weights_after_loading(layer, layer.mxfp8_state, self._scale(layer, "w13"),
                                                             self._scale(layer, "w2"))
        for st, weight in zip(stats, (layer.w13_weight, layer.w2_weight)):
            ConversionReport.add(st, weight.numel())
        _precompile(self.plan, layer, layer.mxfp8_state, layer.w13_weight)

    def create_moe_runner(self, layer, moe_runner_config):
        self.moe_runner_config = moe_runner_config
        why = non_standard(moe_runner_config, getattr(layer, "moe_ep_size", 1))
        # config unknown at create_weights
        if why and self.plan.spec.non_standard is None and len(self.plan.entries) > 1:
            self.plan = registry.select_moe(replace(self.plan.spec, non_standard=why), self.plan.gpu, self.plan.flag)
            _announce_plan(self.plan)
        self.plan.base.create_runner(layer, layer.mxfp8_state, moe_runner_config)

    def apply(self, layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        out = self.plan.apply(layer, layer.mxfp8_state, dispatch_output.hidden_states, dispatch_output,
                              self.moe_runner_config)
        return StandardCombineInput(hidden_states=out) if isinstance(out, torch.Tensor) else out


run_queued(__name__)  # the patches this module's own SGLang imports started (patching.after_import_of)
