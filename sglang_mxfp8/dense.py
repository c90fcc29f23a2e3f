"""Dense MXFP8 GEMM backends, one class each, and the dispatch that picks one per layer.

Each backend: ``is_supported(gpu)``, ``can_implement(n, k)``, ``create_buffers(layer)`` (derived
tensors allocated once), ``process_weights_after_loading(layer)`` (idempotent, in place) and
``apply(layer, x, bias)``. The choice itself is :func:`sglang_mxfp8.resolver.resolve_dense`.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional, Tuple, Type

import torch

from . import deepgemm_sm90, resolver
from .envs import env_switch
from .gpu import current_gpu, flashinfer_available
from .refit import BlockScaleConverter

logger = logging.getLogger(__name__)

WEIGHT_ONLY_ENV = "SGLANG_MXFP8_WEIGHT_ONLY"
# H200, CUDA-graph GPU time (benchmarks/RESULTS.md, "Weight-only FP8 kernels"): at M <= 16 the weight-only
# kernel beat our W8A8 whole op (quantizer + GEMM) by 1.2-1.6x on the layers with N <= 5120 (2048->5120,
# 4096->2048, 14336->4096) and lost 5-13% on 4096->14336; at M = 64 it lost on three of four.
# FlashInfer's fused-quantization GEMM beat it at M <= 16.
WEIGHT_ONLY_MAX_M = 16
WEIGHT_ONLY_MAX_N = 5120
# Served [N, K] whose one-token batches both Hopper backends give the GEMV: Qwen3-30B-A3B's qkv and o,
# Llama-3-8B's down projection
HOPPER_GEMV_SHAPES = frozenset({(5120, 2048), (2048, 4096), (4096, 14336)})
GEMV_ENV = "SGLANG_MXFP8_GEMV"
CUBLAS_PREFILL_ENV = "SGLANG_MXFP8_CUBLAS_PREFILL"
# H200, CUDA-graph GPU time, same run (benchmarks/RESULTS.md, "cuBLAS's block-scaled GEMM" and "Per-row scales
# probe"): cuBLAS beat FlashInfer's GEMM (both with their quantizers) at 1024 and 4096 tokens on all four measured
# shapes in both runs, at 8192 in one run of two on Llama-3-8B's (0.90-0.95x in the other), lost at 16-512 on
# Qwen3-30B-A3B's
CUBLAS_MIN_TOKENS = 1024


def weight_only_max_m(n: int) -> int:
    """Largest BF16 batch the Triton backend serves with the weight-only FP8 GEMM on a layer of N outputs
    (0: never; SGLANG_MXFP8_WEIGHT_ONLY=0 turns it off)."""
    return WEIGHT_ONLY_MAX_M if env_switch(WEIGHT_ONLY_ENV, default=True) and n <= WEIGHT_ONLY_MAX_N else 0


def cublas_prefill_min_tokens(n: int, k: int) -> int:
    """Smallest batch the FlashInfer backend hands to cuBLAS's block-scaled GEMM on a [n, k] layer (0: never;
    SGLANG_MXFP8_CUBLAS_PREFILL=0 turns it off). The same operands and scales: only the kernel changes."""
    from .cublas_sm90 import shape_supported

    return CUBLAS_MIN_TOKENS if env_switch(CUBLAS_PREFILL_ENV, default=True) and shape_supported(n, k) else 0


def dense_prefill_choice(n: int, k: int, dtype: torch.dtype) -> Tuple[Optional[str], int, Optional[str]]:
    """For a FlashInfer-backend layer [n, k]'s prefill batches: (kernel: "deepgemm", "cublas" or None for FlashInfer's
    own; the smallest batch it takes, 0 for none; why DeepGEMM does not run, or None). DeepGEMM's dense GEMM from
    deepgemm_sm90.DENSE_MIN_TOKENS tokens where it can, else cuBLAS's block-scaled GEMM from cublas_prefill_min_tokens;
    SGLANG_MXFP8_CUBLAS_PREFILL=1 asks for cuBLAS by name, over DeepGEMM."""
    if env_switch(CUBLAS_PREFILL_ENV, default=False):
        why = f"{CUBLAS_PREFILL_ENV}=1 asks for cuBLAS"
    else:
        why = deepgemm_sm90.dense_unavailable(n, k, dtype)
    if why is None:
        return "deepgemm", deepgemm_sm90.DENSE_MIN_TOKENS, None
    min_m = cublas_prefill_min_tokens(n, k)
    return ("cublas" if min_m else None), min_m, why


@functools.lru_cache(maxsize=None)
def _note_dense_prefill_once(kind: Optional[str], min_m: int, why_not_deepgemm: Optional[str]) -> None:
    if kind == "deepgemm":
        logger.info("sglang_mxfp8: dense batches of %d+ tokens: DeepGEMM's FP8 GEMM", min_m)
    else:
        logger.info("sglang_mxfp8: dense batches of %s; DeepGEMM not used: %s",
                    f"{min_m}+ tokens: cuBLAS's block-scaled GEMM" if kind else "any size: FlashInfer's GEMM",
                    why_not_deepgemm)


@functools.lru_cache(maxsize=None)
def _warn_cublas_unavailable(reason: str) -> None:
    logger.warning("sglang_mxfp8: cuBLAS's block-scaled FP8 GEMM cannot run here (%s): batches of %d+ tokens stay on "
                   "FlashInfer's GEMM (%s=0 silences this)", reason, CUBLAS_MIN_TOKENS, CUBLAS_PREFILL_ENV)


def dense_gemv_enabled() -> bool:
    """One-token batches (batch-1 decode) of the Hopper dense layers on the weight-streaming GEMV of
    sglang_mxfp8.triton_hopper, for the layer shapes each backend lists as measured faster on the H200
    (``DenseBackend.gemv_shapes``). On unless SGLANG_MXFP8_GEMV=0."""
    return env_switch(GEMV_ENV, default=True)


class DenseBackend:
    kernel: str = ""
    block_rows: int = 1
    gemv = False  # this layer's one-token batches run the weight-streaming GEMV; set with the converter
    # (N, K) of served layers (after SGLang fuses q/k/v and gate/up) where the one-token GEMV ran faster than
    # this backend's own kernel at M = 1 on the H200 (benchmarks/RESULTS.md, "Wider GEMV tiles")
    gemv_shapes: frozenset = frozenset()

    def __init__(self, choice: resolver.Choice, layer_name: str):
        self.choice = choice
        self.layer_name = layer_name

    def create_buffers(self, layer: torch.nn.Module, n: int, k: int) -> None:
        """The Hopper backends' block-scale converter, and whether one-token batches take the GEMV (which reads it)."""
        layer.mxfp8_converter = BlockScaleConverter(1, n, k, self.block_rows, layer.weight.device, self.layer_name)
        self.gemv = (n, k) in self.gemv_shapes and dense_gemv_enabled()

    def process_weights_after_loading(self, layer: torch.nn.Module, scale: torch.Tensor):
        return layer.mxfp8_converter.refresh(layer.weight.data, scale.data)

    def apply(self, layer, x, bias=None):  # pragma: no cover - interface
        raise NotImplementedError

    def one_token(self, layer, x2: torch.Tensor, bias):
        """The one-token GEMV's output on this backend's converted scales, or None where its own kernel runs."""
        if not self.gemv or x2.shape[0] != 1 or x2.dtype != torch.bfloat16:
            return None
        from .triton_hopper import w8a16_gemv

        return w8a16_gemv(x2, layer.weight, layer.mxfp8_converter.block_scale[0], self.block_rows, bias)


class HopperTritonDense(DenseBackend):
    """Our Triton W8A8 kernel: 1x128 dynamic activation scales x per-row 1x128 weight scales."""

    kernel = resolver.HOPPER_TRITON
    block_rows = 1
    # H200, one token, same run (RESULTS, "Wider GEMV tiles"): 5.9 / 5.2 / 21.4 us against the weight-only GEMM's
    # 8.7 / 10.3 / 31.5, and 20.7 us on Llama-3-8B's up projection against the W8A8 whole op's 23.3
    gemv_shapes = HOPPER_GEMV_SHAPES | {(14336, 4096)}

    weight_only_max_m = 0  # set per layer by create_buffers

    def create_buffers(self, layer: torch.nn.Module, n: int, k: int) -> None:
        super().create_buffers(layer, n, k)
        self.weight_only_max_m = weight_only_max_m(n)

    def weight_only(self, layer, x2: torch.Tensor, bias):
        """The weight-only product for a small BF16 batch, or None where the W8A8 kernel runs."""
        if x2.shape[0] > self.weight_only_max_m or x2.dtype != torch.bfloat16:
            return None
        from .triton_hopper import w8a16_gemm

        return w8a16_gemm(x2, layer.weight, layer.mxfp8_converter.block_scale[0], self.block_rows, bias)

    def apply(self, layer, x, bias=None):
        from .triton_hopper import quantize_act_1x128, w8a8_gemm

        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        out = self.one_token(layer, x2, bias)
        if out is None:
            out = self.weight_only(layer, x2, bias)
        if out is None:
            a_q, a_s = quantize_act_1x128(x2)
            out = w8a8_gemm(a_q, a_s, layer.weight, layer.mxfp8_converter.block_scale[0], x.dtype, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class HopperFlashInferDense(DenseBackend):
    """FlashInfer ``fp8_blockscale_gemm_sm90``: BF16 input (quantized 1x128 inside), 128x128 weight scales.

    On FlashInfer 0.6.7.post3 this is the only input combination of that op measured numerically
    right on an H200; per-row weight scales and external FP8 inputs give 23-39% error.
    """

    kernel = resolver.HOPPER_FLASHINFER
    block_rows = 128
    # H200, one token, same run (RESULTS, "Wider GEMV tiles"): 5.9 / 5.2 / 21.4 us against FlashInfer's whole op
    # (its quantizer + GEMM) 7.9 / 9.7 / 24.9; not Llama-3-8B's up projection (20.7 against 20.3)
    gemv_shapes = HOPPER_GEMV_SHAPES

    prefill_kernel: Optional[str] = None  # "deepgemm" or "cublas" from prefill_min_m tokens; set by create_buffers
    prefill_min_m = 0

    def create_buffers(self, layer: torch.nn.Module, n: int, k: int) -> None:
        super().create_buffers(layer, n, k)
        kind, self.prefill_min_m, why_not_deepgemm = dense_prefill_choice(
            n, k, getattr(layer, "orig_dtype", torch.bfloat16))
        self.prefill_kernel = kind
        _note_dense_prefill_once(kind, self.prefill_min_m, why_not_deepgemm)

    def process_weights_after_loading(self, layer: torch.nn.Module, scale: torch.Tensor):
        stats = super().process_weights_after_loading(layer, scale)
        from . import flashinfer_sm90

        if self.prefill_kernel == "cublas" and layer.weight.is_cuda:
            from .cublas_sm90 import unavailable_reason

            reason = unavailable_reason(layer.weight.device.index or 0)
            if reason and env_switch(CUBLAS_PREFILL_ENV, default=False):  # asked for by name
                raise resolver.Mxfp8ConfigError(
                    f"{self.layer_name}: {CUBLAS_PREFILL_ENV}=1 asks for cuBLAS's block-scaled FP8 GEMM, which "
                    f"cannot run on {torch.cuda.get_device_name(layer.weight.device)} ({reason}); unset it")
            if reason:
                _warn_cublas_unavailable(reason)
                self.prefill_kernel, self.prefill_min_m = None, 0

        block_scale = layer.mxfp8_converter.block_scale[0]
        serving_max = serving_max_tokens()
        max_m = serving_max if flashinfer_sm90.precompile_enabled() else None
        if max_m and self.prefill_min_m:  # larger batches never reach FlashInfer's GEMM
            max_m = min(max_m, self.prefill_min_m - 1)
        if max_m:
            flashinfer_sm90.precompile(layer.weight, block_scale, getattr(layer, "orig_dtype", torch.bfloat16), max_m)
        if self.prefill_kernel == "deepgemm" and serving_max and layer.weight.is_cuda and deepgemm_sm90.precompile_enabled():
            deepgemm_sm90.precompile(layer.weight, block_scale, self.prefill_min_m, serving_max)
        return stats

    def apply(self, layer, x, bias=None):
        from flashinfer.gemm import fp8_blockscale_gemm_sm90

        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        out = self.one_token(layer, x2, bias)
        block_scale = layer.mxfp8_converter.block_scale[0]
        if out is None and self.prefill_min_m and x2.shape[0] >= self.prefill_min_m:
            if self.prefill_kernel == "deepgemm":
                out = deepgemm_sm90.dense_gemm(x2, layer.weight, block_scale, bias)
            else:
                from .cublas_sm90 import blockscale_gemm

                out = blockscale_gemm(x2, layer.weight, block_scale, bias, x.dtype)
        elif out is None:
            out = fp8_blockscale_gemm_sm90(x2, layer.weight, None, block_scale, out_dtype=x.dtype)
            if bias is not None:
                out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def backend_class(kernel: str) -> Optional[Type[DenseBackend]]:
    from .blackwell import BlackwellCutlassDense, BlackwellTrtllmDense

    classes = (HopperTritonDense, HopperFlashInferDense, BlackwellTrtllmDense, BlackwellCutlassDense)
    return {cls.kernel: cls for cls in classes}.get(kernel)


def dispatch_w8a8_mxfp8_linear(
    n: int, k: int, *, layer: str = "layer", flag: Optional[str] = None, gpu: Optional[resolver.GpuSpec] = None,
    dtype: torch.dtype = torch.bfloat16,
) -> DenseBackend:
    """The dense MXFP8 backend for a weight [n, k], from --fp8-gemm-backend, the GPU and the model dtype."""
    gpu = gpu or current_gpu()
    flag = flag or sglang_fp8_gemm_flag()
    choice = resolver.resolve_dense(
        gpu, flag, flashinfer=flashinfer_available(), n=n, k=k, layer=layer, bf16=dtype == torch.bfloat16
    )
    if choice.fallback_from:
        logger.warning("sglang_mxfp8: %s: %s %s -> %s", layer, resolver.DENSE_FLAG, choice.fallback_from, choice)
    cls = backend_class(choice.kernel)
    if cls is None:  # SGLang's own Triton MXFP8 kernel, reached only as a shape fallback (N or K < 128)
        raise resolver.Mxfp8ConfigError(
            f"{layer}: [{n} x {k}] is too small for FlashInfer's mm_mxfp8 on {gpu.label} ({choice.reason}); "
            "keep this layer BF16 (modules_to_not_convert) or use --fp8-gemm-backend triton"
        )
    return cls(choice, layer)


def serving_max_tokens() -> Optional[int]:
    """Most tokens one forward of this SGLang server runs (largest prefill chunk or decode graph
    batch); None outside a server."""
    try:
        from sglang.srt.server_args import get_global_server_args

        args = get_global_server_args()
    except (ImportError, ValueError):
        return None
    if args is None:
        return None
    chunk = args.chunked_prefill_size if (args.chunked_prefill_size or 0) > 0 else args.max_prefill_tokens
    return max(chunk or 0, args.cuda_graph_max_bs or 0) or None


def sglang_fp8_gemm_flag() -> str:
    """The --fp8-gemm-backend value SGLang recorded for this process ('auto' before it is set)."""
    try:
        from sglang.srt.layers.quantization.fp8_utils import get_fp8_gemm_runner_backend
    except ImportError:
        return "auto"
    return get_fp8_gemm_runner_backend().value
