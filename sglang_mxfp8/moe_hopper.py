"""The Hopper MoE path's prefill kernels, on the converted weights: DeepGEMM's grouped FP8 GEMM where the
``deep_gemm`` package is installed, else SGLang's CUTLASS grouped block-FP8 MoE; and which layers and batches
take them or the one-token GEMV (the rest run SGLang's Triton fused MoE, set up in quant_methods).

SGLang is imported only when the kernel runs, so this module loads before SGLang's own modules do
(the benchmarks, the tests and ``sglang-mxfp8 doctor`` import it directly).
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Tuple

import torch

from .deepgemm_sm90 import load as load_deep_gemm, load_or_why
from .envs import env_switch

logger = logging.getLogger(__name__)

CUTLASS_PREFILL_ENV = "SGLANG_MXFP8_CUTLASS_PREFILL_MOE"
# H200, Qwen3-30B-A3B MoE layer, CUDA-graph GPU time (benchmarks/RESULTS.md, "CUTLASS grouped MoE for prefill"):
# SGLang's CUTLASS grouped block-FP8 MoE vs its Triton fused MoE: 435.9 vs 447.3 us at 2048 tokens, 719.5 vs
# 769.9 at 4096, 1293.0 vs 1480.3 at 8192; slower at 1024 (303.8 vs 292.2) and below.
CUTLASS_PREFILL_MIN_TOKENS = 2048

DEEPGEMM_PREFILL_ENV = "SGLANG_MXFP8_DEEPGEMM_PREFILL_MOE"
# H200, same layer (benchmarks/RESULTS.md, "DeepGEMM's grouped GEMM for the prefill MoE"): DeepGEMM with our glue
# 284.4 / 351.2 / 516.9 / 852.3 us at 1024 / 2048 / 4096 / 8192 tokens, the CUTLASS grouped MoE 304.8 / 431.1 /
# 712.2 / 1282.0; at 1024 the Triton fused MoE took 283-292 in earlier runs, about the same.
DEEPGEMM_PREFILL_MIN_TOKENS = 1024


# H200, one token, Qwen3-30B-A3B MoE layer (128 experts, top-8), CUDA-graph GPU time over 16 routings
# (benchmarks/RESULTS.md, "GEMV MoE with SiLU-and-mul in its up launch"): the GEMV MoE 16.8 us vs SGLang's Triton
# fused MoE 31.5 (MXFP8) and 36.5 (BF16); served, 4 layers: 65.1 vs 112.4 us of MoE kernels per decode step.
GEMV_MOE_SHAPES = frozenset({(2048, 768)})  # (hidden, intermediate per rank)
MOE_GEMV_ENV = "SGLANG_MXFP8_MOE_GEMV"


def gemv_moe_runs(hidden: int, intermediate: int) -> bool:
    """Whether one-token batches of a Hopper MoE layer take the GEMV MoE: on the shapes it measured faster
    on the H200, unless SGLANG_MXFP8_MOE_GEMV=0."""
    return (hidden, intermediate) in GEMV_MOE_SHAPES and env_switch(MOE_GEMV_ENV, default=True)


def cutlass_prefill_min_tokens() -> int:
    """Smallest batch the Hopper MoE runs on SGLang's CUTLASS grouped MoE instead of its Triton fused MoE
    (0: never; SGLANG_MXFP8_CUTLASS_PREFILL_MOE=0 turns it off)."""
    return CUTLASS_PREFILL_MIN_TOKENS if env_switch(CUTLASS_PREFILL_ENV, default=True) else 0


def deepgemm_unavailable() -> Optional[str]:
    """Why DeepGEMM's grouped GEMM cannot take the Hopper MoE's prefill batches here, or None: it is off
    (SGLANG_MXFP8_DEEPGEMM_PREFILL_MOE=0), ``deep_gemm`` does not import, or its build lacks the per-expert
    end-row ("psum") layout of the contiguous grouped GEMM or the 128-row alignment this path writes."""
    if not env_switch(DEEPGEMM_PREFILL_ENV, default=True):
        return f"{DEEPGEMM_PREFILL_ENV}=0"
    deep_gemm, why = load_or_why()
    if why:
        return why
    gemm = getattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous", None)
    if gemm is None or "use_psum_layout" not in (gemm.__doc__ or ""):
        return f"deep_gemm {getattr(deep_gemm, '__version__', '?')} has no contiguous grouped GEMM with use_psum_layout"
    from .triton_hopper import SEGMENT_ALIGN

    if deep_gemm.get_mk_alignment_for_contiguous_layout() != SEGMENT_ALIGN:
        return f"deep_gemm's M alignment is {deep_gemm.get_mk_alignment_for_contiguous_layout()}, not {SEGMENT_ALIGN}"
    return None


def fused_moe_unsupported(config, ep_size: int) -> Optional[str]:
    """Why a MoE layer cannot take our own paths, the CUTLASS grouped prefill MoE and the one-token GEMV (they
    compute SiLU-gated experts, combined with the router weights, on all experts of this rank), or None."""
    if config.activation != "silu" or not config.is_gated:
        return f"activation {config.activation} (gated {config.is_gated}); it runs SiLU-gated experts only"
    if config.apply_router_weight_on_input or config.no_combine:
        return "router weights on the input / no combine"
    if config.gemm1_alpha is not None or config.gemm1_clamp_limit is not None:
        return "a clamped or scaled gate"
    if ep_size != 1:
        return f"expert parallel size {ep_size}"
    return None


def prefill_moe_choice() -> Tuple[str, int, Optional[str]]:
    """For a Hopper MoE layer's prefill batches (its hidden and per-rank intermediate sizes multiples of 128: the
    resolver refuses the Hopper MoE otherwise): (kernel, the smallest batch it takes, 0 for none; why DeepGEMM does
    not run, or None). "deepgemm" from DEEPGEMM_PREFILL_MIN_TOKENS tokens where it can, else "cutlass" from
    cutlass_prefill_min_tokens()."""
    why = deepgemm_unavailable()
    if why is None:
        return "deepgemm", DEEPGEMM_PREFILL_MIN_TOKENS, None
    return "cutlass", cutlass_prefill_min_tokens(), why


class CutlassGroupedMoE:
    """SGLang's CUTLASS grouped block-FP8 MoE (sgl_kernel ``fp8_blockwise_scaled_grouped_mm``) on the
    converted weights, for prefill batches. It reads transposed views of the FP8 weights and their 128x128
    scales (nothing copied). Its pointer, problem-size and workspace tensors are rewritten by every call and
    its strides depend only on the layer shape, so the layers of one shape on one device, which run one
    after another on the stream, share one set.
    expert_specialized: both GEMMs through sgl_kernel's SM90 expert-specialized grouped GEMM."""

    _scratch: Dict[tuple, Dict[str, torch.Tensor]] = {}
    activation_dtypes = (torch.bfloat16, torch.float16)

    def __init__(self, experts: int, hidden: int, intermediate: int, device, expert_specialized: bool = False):
        self.enable_es = (expert_specialized, expert_specialized)
        key = (experts, hidden, intermediate, str(device))
        if key not in self._scratch:
            i64 = dict(dtype=torch.int64, device=device)
            i32 = dict(dtype=torch.int32, device=device)
            self._scratch[key] = dict(
                a1_strides=torch.full((experts,), hidden, **i64), c1_strides=torch.full((experts,), 2 * intermediate, **i64),
                a2_strides=torch.full((experts,), intermediate, **i64), c2_strides=torch.full((experts,), hidden, **i64),
                workspace=torch.empty(7182 * 1024, dtype=torch.uint8, device=device),  # the size SGLang allocates
                **{n: torch.empty(experts, **i64) for n in ("a_ptrs", "b_ptrs", "out_ptrs", "a_scales_ptrs", "b_scales_ptrs")},
                expert_offsets=torch.empty(experts + 1, **i32),
                problem_sizes1=torch.empty(experts, 3, **i32), problem_sizes2=torch.empty(experts, 3, **i32),
            )
        self.scratch = self._scratch[key]

    def __call__(self, x, topk_weights, topk_ids, w13, w2, w13_block_scale, w2_block_scale) -> torch.Tensor:
        from sglang.srt.layers.moe.cutlass_moe import cutlass_fused_experts_fp8

        return cutlass_fused_experts_fp8(
            x, w13.transpose(1, 2), w2.transpose(1, 2), w13_block_scale.transpose(1, 2), w2_block_scale.transpose(1, 2),
            topk_weights, topk_ids, use_fp8_blockscale=True, enable_es=self.enable_es, **self.scratch,
        )


def deepgemm_moe_precompile_ms(min_m: int, max_m: int, top_k: int, experts: int) -> List[int]:
    """One batch size per tile config DeepGEMM's grouped GEMM can pick for batches of min_m..max_m tokens. On SM90
    its block M is the 128-row alignment and the rest follows from the expected rows per expert we pass,
    ceil(m * top_k / experts), through ceil(that / 128) (csrc/jit_kernels/heuristics/sm90.hpp)."""
    first: Dict[int, int] = {}
    for m in range(min_m, max_m + 1):
        first.setdefault(-(-(-(-m * top_k // experts)) // 128), m)
    return sorted(first.values())


_PRECOMPILED_MOE: set = set()  # (experts, hidden, intermediate, top_k, device) done in this process


class DeepGemmGroupedMoE:
    """A prefill batch's MoE on DeepGEMM's grouped FP8 GEMM (contiguous layout; on Hopper its kernel takes 1x128
    activation and 128x128 weight scales in float32: the converted weights and scales as they are, nothing
    copied). Our Triton glue (triton_hopper): the tokens quantized and scattered to their experts' row segments
    in one pass, SiLU-and-mul with the quantizer, and the routing-weighted gather. No host sync: the buffers take
    the most rows a routing can need (each expert padded to 128), and DeepGEMM gets each expert's end row (its
    "psum" layout), so it schedules only the rows the routing fills."""

    activation_dtypes = (torch.bfloat16,)  # DeepGEMM writes bf16

    def __init__(self, experts: int, hidden: int, intermediate: int):
        self.experts, self.hidden = experts, hidden

    def __call__(self, x, topk_weights, topk_ids, w13, w2, w13_block_scale, w2_block_scale, keep=None) -> torch.Tensor:
        """``keep``: a dict that receives each step as a zero-argument call on this call's operands, and the
        segments' padded ends (seg_end), for benchmarks/kernels/bench_deepgemm_moe.py to time the steps alone."""
        from .triton_hopper import SEGMENT_ALIGN, moe_gather, moe_scatter_quant, moe_segments, silu_mul_quant

        deep_gemm = load_deep_gemm()

        m, top_k = topk_ids.shape
        rows = -(-(m * top_k + self.experts * (SEGMENT_ALIGN - 1)) // SEGMENT_ALIGN) * SEGMENT_ALIGN
        cursor, seg_end, ends = moe_segments(topk_ids, self.experts)
        per_expert = dict(use_psum_layout=True, expected_m_for_psum_layout=-(-m * top_k // self.experts))
        a, a_scale, slots = moe_scatter_quant(x, topk_ids, cursor, rows)
        h = torch.empty((rows, w13.shape[1]), dtype=x.dtype, device=x.device)
        up = ((a, a_scale), (w13, w13_block_scale), h, ends)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(*up, **per_expert)
        a2, a2_scale = silu_mul_quant(h, seg_end, ends)
        y = torch.empty((rows, self.hidden), dtype=x.dtype, device=x.device)
        down = ((a2, a2_scale), (w2, w2_block_scale), y, ends)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(*down, **per_expert)
        if keep is not None:
            keep.update(seg_end=seg_end, steps=dict(
                segments=lambda: moe_segments(topk_ids, self.experts),
                segments_scatter_quantize=lambda: moe_scatter_quant(x, topk_ids, moe_segments(topk_ids, self.experts)[0], rows),
                gemm_up=lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(*up, **per_expert),
                silu_quantize=lambda: silu_mul_quant(h, seg_end, ends),
                gemm_down=lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(*down, **per_expert),
                gather=lambda: moe_gather(y, slots, topk_weights)))
        return moe_gather(y, slots, topk_weights)

    def precompile(self, w13, w2, w13_block_scale, w2_block_scale, top_k: int, min_m: int, max_m: int) -> Optional[int]:
        """Run the layer once per tile config its two GEMMs can pick for batches of min_m..max_m tokens, so that no
        served prefill waits for nvcc (once per layer shape and process). Returns how many batches ran, or None."""
        key = (self.experts, self.hidden, w2.shape[2], top_k, w13.device)
        ms = deepgemm_moe_precompile_ms(min_m, max_m, top_k, self.experts)
        if key in _PRECOMPILED_MOE or not ms:
            return None
        _PRECOMPILED_MOE.add(key)
        start, dev = time.perf_counter(), w13.device
        x = torch.zeros(ms[-1], self.hidden, dtype=torch.bfloat16, device=dev)
        ids = (torch.arange(ms[-1] * top_k, device=dev, dtype=torch.int32) % self.experts).view(-1, top_k)
        weights = torch.full(ids.shape, 1.0 / top_k, dtype=torch.float32, device=dev)
        for m in ms:
            self(x[:m], weights[:m], ids[:m], w13, w2, w13_block_scale, w2_block_scale)
        torch.cuda.synchronize(dev)
        del x, ids, weights
        torch.cuda.empty_cache()  # SGLang sizes its KV cache from the free memory after loading
        logger.info("sglang_mxfp8: DeepGEMM grouped MoE (%d experts, top-%d): ran batches of %s tokens in %.1f s",
                    self.experts, top_k, ms, time.perf_counter() - start)
        return len(ms)
