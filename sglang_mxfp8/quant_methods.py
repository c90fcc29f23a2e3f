"""SGLang quantization config and methods for MXFP8 checkpoints (imports SGLang; loaded by the plugin).

``Mxfp8Config`` replaces ``QUANTIZATION_METHODS["mxfp8"]``. It keeps SGLang's parameters exactly
(e4m3 ``weight``, uint8 ``weight_scale_inv`` [N, K/32], MoE ``w13_*``/``w2_*``), so checkpoints and
``/update_weights_from_disk`` load as they do in SGLang, and adds the kernel layouts as derived
buffers owned by :mod:`sglang_mxfp8.refit`.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import weakref
from typing import Any, Dict, List, Optional

import torch
from sglang.srt.compilation.piecewise_context_manager import is_in_piecewise_cuda_graph
from sglang.srt.layers.moe import MoeRunner, MoeRunnerBackend, get_moe_runner_backend
from sglang.srt.layers.moe.moe_runner.triton import TritonMoeQuantInfo
from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod, Fp8MoEMethod
from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod, UnquantizedLinearMethod
from sglang.srt.layers.quantization.utils import is_layer_skipped

from . import __version__, checkpoint, resolver
from .deepgemm_sm90 import precompile_enabled as deepgemm_precompile_enabled
from .dense import dispatch_w8a8_mxfp8_linear, serving_max_tokens, sglang_fp8_gemm_flag
from .gpu import current_gpu, flashinfer_available
from .blackwell import CutlassMoeScales, cutlass_mxfp8_moe
from .moe_hopper import CutlassGroupedMoE, DeepGemmGroupedMoE, fused_moe_unsupported, gemv_moe_runs, prefill_moe_choice
from .refit import BlockScaleConverter, LoadTracker

logger = logging.getLogger("sglang_mxfp8")


def _announce_once() -> None:
    if getattr(_announce_once, "done", False):
        return
    _announce_once.done = True
    logger.info(
        "sglang_mxfp8 %s active in process %s (pid %d)",
        __version__, multiprocessing.current_process().name, os.getpid(),
    )


@functools.lru_cache(maxsize=None)
def _note_prefill_once(kind: str, min_tokens: int, why_not_deepgemm: Optional[str]) -> None:
    """Log which kernel takes the Hopper MoE's prefill batches, once per process (as dense._note_dense_prefill_once)."""
    if kind == "deepgemm":
        logger.info("MoE batches of %d+ tokens: DeepGEMM's grouped FP8 GEMM", min_tokens)
    else:
        logger.info("MoE batches of %s: SGLang's CUTLASS grouped MoE; DeepGEMM not used: %s",
                    f"{min_tokens}+ tokens" if min_tokens else "any size stay on the Triton fused MoE", why_not_deepgemm)


def _check_loads(layer) -> None:
    """Refuse a load that wrote a weight without its scale (layers built by hand have no tracker)."""
    tracker = getattr(layer, "mxfp8_loads", None)
    if tracker is not None:
        tracker.check()


class ConversionReport:
    """What one model load's post-processing converted; the plugin logs it after each load."""

    changed = total = layers = 0

    @classmethod
    def reset(cls) -> None:
        cls.changed = cls.total = cls.layers = 0

    @classmethod
    def add(cls, stats, numel: int) -> None:
        cls.changed += stats.changed_elements
        cls.total += numel
        cls.layers += stats.converted_rows > 0

    @classmethod
    def line(cls) -> str:
        frac = cls.changed / cls.total if cls.total else 0.0
        return (
            f"sglang_mxfp8: converted {cls.layers} MXFP8 weights to Hopper block scales in place; "
            f"{cls.changed} of {cls.total} elements changed value ({frac:.2e}, e4m3 subnormal rounding)"
        )


class Mxfp8Config(Fp8Config):
    """Fp8Config for serialized MXFP8 checkpoints (miles/SGLang and ModelOpt), runnable from SM90."""

    def __init__(self, *args, scale_name: str = "weight_scale_inv", **kwargs):
        super().__init__(*args, **kwargs)
        self.scale_name = scale_name
        _announce_once()

    def get_min_capability(self) -> int:
        return resolver.MIN_CAPABILITY if self.use_mxfp8 else super().get_min_capability()

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "Mxfp8Config":
        fmt = checkpoint.detect_mxfp8(config)
        if fmt is None or fmt.flavor == checkpoint.MILES:
            return super().from_config(config)
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
        blackwell = current_gpu().sm != 90
        if isinstance(layer, LinearBase):
            if skipped:
                return UnquantizedLinearMethod()
            if blackwell and sglang_fp8_gemm_flag() == "triton":
                return Fp8LinearMethod(self)  # SGLang's own Triton tl.dot_scaled MXFP8 kernel
            return Mxfp8LinearMethod(self, prefix)
        if isinstance(layer, FusedMoE):
            if skipped:
                return UnquantizedFusedMoEMethod(layer.use_triton_kernels, layer.use_flashinfer_trtllm_moe)
            if blackwell and not get_moe_runner_backend().is_flashinfer_cutlass():
                return Fp8MoEMethod(self)  # SGLang's own flashinfer_trtllm(_routed) / cutlass MXFP8 MoE
            return Mxfp8MoEMethod(self, prefix)
        return super().get_quant_method(layer, prefix)


_LINEAR_LAYERS: List[weakref.ref] = []  # our linear layers, by layer.mxfp8_linear_index


@torch.library.custom_op("sglang_mxfp8::linear", mutates_args=())
def _linear_op(x: torch.Tensor, bias: Optional[torch.Tensor], layer_index: int) -> torch.Tensor:
    """One MXFP8 linear layer as a single opaque op for SGLang's piecewise CUDA graphs (on by default): SGLang
    traces the model with torch.compile(fullgraph=True) before capturing prefill graphs, and our kernels' host code
    (FlashInfer's JIT loader, DeepGEMM's bindings) cannot be traced. The op runs the layer eagerly while the graph
    is captured, as SGLang's own MXFP8 and MoE ops do."""
    layer = _LINEAR_LAYERS[layer_index]()
    return layer.quant_method.backend.apply(layer, x, bias)


@_linear_op.register_fake
def _(x, bias, layer_index):
    return x.new_empty((*x.shape[:-1], _LINEAR_LAYERS[layer_index]().weight.shape[0]))  # weight: [N, K] as loaded


class Mxfp8LinearMethod(Fp8LinearMethod):
    """MXFP8 linear layer: SGLang's parameters, our kernels (see :mod:`sglang_mxfp8.dense`)."""

    def __init__(self, quant_config: Mxfp8Config, prefix: str):
        # Fp8LinearMethod.__init__ would pick SGLang's Blackwell-only GEMM; set what create_weights reads.
        self.quant_config = quant_config
        self.prefix = prefix
        self.use_mxfp8 = True
        self.block_quant = True
        self.is_checkpoint_fp8_serialized = True
        self.use_marlin = False
        self.backend = None

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype, **extra):
        n, k = sum(output_partition_sizes), input_size_per_partition
        self.backend = dispatch_w8a8_mxfp8_linear(n, k, layer=self.prefix, dtype=params_dtype)
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype, **extra)
        self.quant_config.rename_scales(layer, ("",))
        layer.mxfp8_loads = LoadTracker(self.prefix, {"": (layer.weight, getattr(layer, self.quant_config.scale_name))})
        self.backend.create_buffers(layer, n, k)
        layer.mxfp8_linear_index = len(_LINEAR_LAYERS)
        _LINEAR_LAYERS.append(weakref.ref(layer))
        logger.debug("sglang_mxfp8: %s [%d x %d] -> %s", self.prefix, n, k, self.backend.choice)

    def process_weights_after_loading(self, layer) -> None:
        _check_loads(layer)
        scale = getattr(layer, self.quant_config.scale_name)
        stats = self.backend.process_weights_after_loading(layer, scale)
        ConversionReport.add(stats, layer.weight.numel())

    def apply(self, layer, x, bias=None):
        if is_in_piecewise_cuda_graph():  # being traced for (or replayed as) a piecewise CUDA graph
            return torch.ops.sglang_mxfp8.linear(x, bias, layer.mxfp8_linear_index)
        return self.backend.apply(layer, x, bias)


class Mxfp8MoEMethod(Fp8MoEMethod):
    """MXFP8 fused MoE on SGLang's FusedMoE parameters; kernel chosen by the resolver."""

    def __init__(self, quant_config: Mxfp8Config, prefix: str):
        super().__init__(quant_config)
        self.prefix = prefix
        self.choice: Optional[resolver.Choice] = None
        self.prefill_min_tokens = 0  # batches this large run layer.mxfp8_prefill (Hopper path; 0: never)
        self.gemv = False  # one-token batches run the GEMV MoE (Hopper path, moe_hopper.gemv_moe_runs)

    @property
    def load_up_proj_weight_first(self) -> bool:
        """FlashInfer CUTLASS MoE wants w13 as [up; gate]; SGLang's loader reads this on every load."""
        return self.choice is not None and self.choice.kernel in (
            resolver.HOPPER_FLASHINFER_CUTLASS_MOE, resolver.SM100_FLASHINFER_CUTLASS_MOE,
        )

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra):
        gpu = current_gpu()
        flag = get_moe_runner_backend().value
        self.choice = resolver.resolve_moe(
            gpu, flag, flashinfer=flashinfer_available(), hidden=hidden_size,
            intermediate=intermediate_size_per_partition, layer=self.prefix, tp=getattr(layer, "moe_tp_size", 1),
        )
        if self.choice.kernel not in (resolver.HOPPER_TRITON_MOE, resolver.SM100_FLASHINFER_CUTLASS_MOE):
            raise resolver.Mxfp8ConfigError(f"{self.prefix}: " + resolver.hopper_cutlass_moe_unavailable(gpu))
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra)
        self.quant_config.rename_scales(layer, ("w13_", "w2_"))
        layer.mxfp8_loads = LoadTracker(self.prefix, {w: (getattr(layer, f"{w}_weight"), self._scale(layer, w))
                                                      for w in ("w13", "w2")})
        dev = layer.w13_weight.device
        if self.choice.kernel == resolver.SM100_FLASHINFER_CUTLASS_MOE:
            layer.mxfp8_cutlass_scales = CutlassMoeScales(num_experts, hidden_size, intermediate_size_per_partition, dev)
            return
        layer.mxfp8_w13 = BlockScaleConverter(num_experts, layer.w13_weight.shape[1], hidden_size, 128, dev, f"{self.prefix}.w13")
        layer.mxfp8_w2 = BlockScaleConverter(num_experts, hidden_size, intermediate_size_per_partition, 128, dev, f"{self.prefix}.w2")
        kind, self.prefill_min_tokens, why_not_deepgemm = prefill_moe_choice()
        self.gemv = gemv_moe_runs(hidden_size, intermediate_size_per_partition)
        if self.prefill_min_tokens:
            layer.mxfp8_prefill = (DeepGemmGroupedMoE(num_experts, hidden_size, intermediate_size_per_partition)
                                   if kind == "deepgemm" else
                                   CutlassGroupedMoE(num_experts, hidden_size, intermediate_size_per_partition, dev))
        _note_prefill_once(kind, self.prefill_min_tokens, why_not_deepgemm)

    def _scale(self, layer, w: str) -> torch.Tensor:
        return getattr(layer, f"{w}_{self.quant_config.scale_name}")

    def process_weights_after_loading(self, layer) -> None:
        _check_loads(layer)
        if self.choice.kernel == resolver.SM100_FLASHINFER_CUTLASS_MOE:
            layer.mxfp8_cutlass_scales.refresh(self._scale(layer, "w13").data, self._scale(layer, "w2").data)
            return
        for w in ("w13", "w2"):
            weight = getattr(layer, f"{w}_weight")
            stats = getattr(layer, f"mxfp8_{w}").refresh(weight.data, self._scale(layer, w).data)
            ConversionReport.add(stats, weight.numel())
        prefill, max_m = getattr(layer, "mxfp8_prefill", None), serving_max_tokens()
        if (isinstance(prefill, DeepGemmGroupedMoE) and self.prefill_min_tokens and max_m and layer.w13_weight.is_cuda
                and deepgemm_precompile_enabled()):
            prefill.precompile(layer.w13_weight, layer.w2_weight, layer.mxfp8_w13.block_scale, layer.mxfp8_w2.block_scale,
                               layer.top_k, self.prefill_min_tokens, max_m)

    def create_moe_runner(self, layer, moe_runner_config):
        self.moe_runner_config = moe_runner_config
        if self.choice.kernel == resolver.HOPPER_TRITON_MOE:
            self.runner = MoeRunner(MoeRunnerBackend.TRITON, moe_runner_config)
            why_not = (self.prefill_min_tokens or self.gemv) and fused_moe_unsupported(moe_runner_config, layer.moe_ep_size)
            if why_not:
                logger.info("%s: every batch stays on the Triton fused MoE: %s", self.prefix, why_not)
                self.prefill_min_tokens, self.gemv = 0, False

    def apply(self, layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        x = dispatch_output.hidden_states
        topk_weights, topk_ids, _ = dispatch_output.topk_output
        if self.choice.kernel == resolver.SM100_FLASHINFER_CUTLASS_MOE:
            out = cutlass_mxfp8_moe(
                x, topk_weights, topk_ids, layer.w13_weight, layer.w2_weight,
                layer.mxfp8_cutlass_scales, tp_size=layer.moe_tp_size, tp_rank=layer.moe_tp_rank,
                ep_size=layer.moe_ep_size, ep_rank=layer.moe_ep_rank,
            )
            return StandardCombineInput(hidden_states=out)
        out = None
        if self.gemv and x.shape[0] == 1 and x.dtype == torch.bfloat16:
            from .triton_hopper import moe_gemv

            out = moe_gemv(x, layer.w13_weight, layer.mxfp8_w13.block_scale, layer.w2_weight,
                           layer.mxfp8_w2.block_scale, topk_weights, topk_ids)
        elif (self.prefill_min_tokens and x.shape[0] >= self.prefill_min_tokens
              and x.dtype in layer.mxfp8_prefill.activation_dtypes):
            out = layer.mxfp8_prefill(x, topk_weights, topk_ids, layer.w13_weight, layer.w2_weight,
                                      layer.mxfp8_w13.block_scale, layer.mxfp8_w2.block_scale)
        if out is not None:
            if self.moe_runner_config.routed_scaling_factor is not None:
                out *= self.moe_runner_config.routed_scaling_factor
            return StandardCombineInput(hidden_states=out)
        quant_info = TritonMoeQuantInfo(
            w13_weight=layer.w13_weight,
            w2_weight=layer.w2_weight,
            use_fp8_w8a8=True,
            w13_scale=layer.mxfp8_w13.block_scale,
            w2_scale=layer.mxfp8_w2.block_scale,
            block_shape=[128, 128],
        )
        return self.runner.run(dispatch_output, quant_info)
