"""Every MXFP8 kernel, and which one runs each layer: one priority list per (layer kind, GPU architecture, flag).

A flag's list is walked once per layer, when SGLang creates its weights (:func:`select_linear`,
:func:`select_moe`), into a :class:`~sglang_mxfp8.kernels.base.Plan`: the kernel for each batch band. Launch
validation, the server log and ``sglang-mxfp8 doctor`` all print that plan. Every threshold and shape list below
cites the section of benchmarks/RESULTS.md that measured it on the H200.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence, Tuple, Union

from ..platform import GpuSpec
from ..settings import DISABLED_KERNELS_ENV, ENABLED_KERNELS_ENV, Settings
from ..settings import current as current_settings
from .base import DENSE_FLAG, MOE_FLAG, Entry, Kernel, LinearSpec, MoESpec, Mxfp8ConfigError, Plan, log_once, select
from .linear.cublas import CublasBlockScale
from .linear.deepgemm import DeepGemmDense
from .linear.flashinfer_sm90 import FlashInferSm90
from .linear.flashinfer_sm100 import FlashInferCutlassMxfp8, FlashInferTrtllmMxfp8
from .linear.gemv import Gemv
from .linear.sglang_native import SglangTritonMxfp8
from .linear.triton_w8a8 import TritonW8A8
from .linear.weight_only import WeightOnly
from .moe.cutlass_grouped import CutlassGroupedPrefillMoE
from .moe.deepgemm import DeepGemmPrefillMoE
from .moe.flashinfer_cutlass import FlashInferCutlassMxfp8MoE, FlashInferCutlassSm90MoE
from .moe.gemv import GemvMoE
from .moe.sglang_native import SglangNativeMoE
from .moe.triton_fused import TritonFusedMoE
from .moe.triton_w8a8 import TritonW8A8MoE

DENSE_FLAGS = ("auto", "triton", "flashinfer_trtllm", "flashinfer_cutlass")
MOE_FLAGS = ("auto", "triton", "flashinfer_cutlass", "flashinfer_trtllm", "flashinfer_trtllm_routed", "cutlass")

# -- Hopper dense ----------------------------------------------------------------------------------------------------
# Served [N, K] whose one-token batches run the GEMV (RESULTS, "Wider GEMV tiles"; one token, same run): Qwen3-30B-
# A3B's qkv and o, Llama-3-8B's down projection: 5.9 / 5.2 / 21.4 us against FlashInfer's whole op (quantizer + GEMM)
# 7.9 / 9.7 / 24.9 and the Triton W8A8 whole op; Llama-3-8B's up projection only beside Triton (20.7 against its
# 23.3; FlashInfer's 20.3).
GEMV_SHAPES = frozenset({(5120, 2048), (2048, 4096), (4096, 14336)})
GEMV_BESIDE_FLASHINFER = Gemv(GEMV_SHAPES)
GEMV_BESIDE_TRITON = Gemv(GEMV_SHAPES | {(14336, 4096)})
# RESULTS, "Weight-only FP8 kernels": at M <= 16 it beat the W8A8 whole op by 1.2-1.6x on layers with N <= 5120
# and lost 5-13% on 4096->14336; at M = 64 it lost on three of four. FlashInfer's fused-quantization GEMM beat it.
WEIGHT_ONLY = WeightOnly(max_n=5120)
TRITON_W8A8 = TritonW8A8()
FLASHINFER_SM90 = FlashInferSm90()
DEEPGEMM = DeepGemmDense()
CUBLAS = CublasBlockScale()

HOPPER_TRITON_DENSE = (
    Entry(GEMV_BESIDE_TRITON, 1, 1, measured="Wider GEMV tiles"),
    Entry(WEIGHT_ONLY, 1, 16, measured="Weight-only FP8 kernels"),
    Entry(TRITON_W8A8),
)
HOPPER_FLASHINFER_DENSE = (
    Entry(GEMV_BESIDE_FLASHINFER, 1, 1, with_base=FLASHINFER_SM90.name, measured="Wider GEMV tiles"),
    # RESULTS, "DeepGEMM's dense GEMM for prefill batches": our quantizer + DeepGEMM beat cuBLAS on 11 of 12 cells
    # at 1024 / 4096 / 8192 tokens (1.02-1.27x); "cuBLAS's block-scaled GEMM": cuBLAS beat FlashInfer's GEMM at
    # 1024 and 4096 tokens on all four shapes, lost at 16-512 on Qwen3-30B-A3B's.
    Entry(DEEPGEMM, 1024, measured="DeepGEMM's dense GEMM for prefill batches"),
    Entry(CUBLAS, 1024, measured="cuBLAS's block-scaled GEMM"),
    # RESULTS, "Dense layers": FlashInfer's GEMM beat our Triton kernel at every measured shape and M.
    Entry(FLASHINFER_SM90, measured="Dense layers"),
    Entry(GEMV_BESIDE_TRITON, 1, 1, with_base=TRITON_W8A8.name, measured="Wider GEMV tiles"),
    Entry(WEIGHT_ONLY, 1, 16, with_base=TRITON_W8A8.name, measured="Weight-only FP8 kernels"),
    Entry(TRITON_W8A8, fallback=True),  # shapes FlashInfer's GEMM cannot take (K % 128, N % 64)
)

# -- Blackwell dense (CPU-verified, not run on SM100) ------------------------------------------------------------------
FLASHINFER_TRTLLM_MXFP8 = FlashInferTrtllmMxfp8()
FLASHINFER_CUTLASS_MXFP8 = FlashInferCutlassMxfp8()
SGLANG_TRITON_MXFP8 = SglangTritonMxfp8()

LINEAR: Dict[Tuple[str, str], Tuple[Entry, ...]] = {
    ("sm90", "auto"): HOPPER_FLASHINFER_DENSE,
    ("sm90", "flashinfer_trtllm"): HOPPER_FLASHINFER_DENSE,
    ("sm90", "triton"): HOPPER_TRITON_DENSE,
    ("sm100", "auto"): (Entry(FLASHINFER_CUTLASS_MXFP8),),
    ("sm100", "flashinfer_cutlass"): (Entry(FLASHINFER_CUTLASS_MXFP8),),
    ("sm100", "flashinfer_trtllm"): (Entry(FLASHINFER_TRTLLM_MXFP8), Entry(FLASHINFER_CUTLASS_MXFP8, fallback=True)),
    ("sm100", "triton"): (Entry(SGLANG_TRITON_MXFP8),),
    ("sm110", "auto"): (Entry(FLASHINFER_CUTLASS_MXFP8),),
    ("sm110", "flashinfer_cutlass"): (Entry(FLASHINFER_CUTLASS_MXFP8),),
    ("sm120", "auto"): (Entry(FLASHINFER_CUTLASS_MXFP8),),
    ("sm120", "flashinfer_cutlass"): (Entry(FLASHINFER_CUTLASS_MXFP8),),
    ("sm120", "triton"): (Entry(SGLANG_TRITON_MXFP8),),
}

# -- Hopper MoE ------------------------------------------------------------------------------------------------------
# RESULTS, "GEMV MoE with SiLU-and-mul in its up launch": one token, Qwen3-30B-A3B's layer (hidden 2048,
# intermediate 768, 128 experts, top-8): 16.8 us against SGLang's Triton fused MoE 31.5 (MXFP8) and 36.5 (BF16).
# RESULTS, "DeepGEMM's grouped GEMM for the prefill MoE": DeepGEMM with our glue 284.4 / 351.2 / 516.9 / 852.3 us at
# 1024 / 2048 / 4096 / 8192 tokens against the CUTLASS grouped MoE's 304.8 / 431.1 / 712.2 / 1282.0 (the Triton
# fused MoE 283-292 at 1024). RESULTS, "CUTLASS grouped MoE for prefill": 435.9 vs the Triton fused MoE's 447.3 us
# at 2048 tokens, 719.5 vs 769.9 at 4096, 1293.0 vs 1480.3 at 8192; slower at 1024 and below.
TRITON_MOE = TritonFusedMoE()
# hidden or intermediate sizes off the 128 grid (multiples of 32): the masked W8A8 MoE is the base kernel
TRITON_W8A8_MOE = TritonW8A8MoE()
HOPPER_MOE = (
    Entry(GemvMoE({(2048, 768)}), 1, 1, measured="GEMV MoE with SiLU-and-mul in its up launch"),
    Entry(DeepGemmPrefillMoE(), 1024, measured="DeepGEMM's grouped GEMM for the prefill MoE"),
    Entry(CutlassGroupedPrefillMoE(), 2048, measured="CUTLASS grouped MoE for prefill"),
    Entry(TRITON_MOE),
    Entry(TRITON_W8A8_MOE),
)
MOE: Dict[Tuple[str, str], Tuple[Entry, ...]] = {
    ("sm90", "auto"): HOPPER_MOE,
    ("sm90", "triton"): HOPPER_MOE,
    ("sm90", "flashinfer_cutlass"): (Entry(FlashInferCutlassSm90MoE()), Entry(TRITON_W8A8_MOE, fallback=True)),
    ("sm100", "flashinfer_cutlass"): (Entry(FlashInferCutlassMxfp8MoE()),),
    ("sm100", "auto"): (Entry(SglangNativeMoE("flashinfer_trtllm")),),
    **{("sm100", flag): (Entry(SglangNativeMoE(flag)),) for flag in ("flashinfer_trtllm", "flashinfer_trtllm_routed",
                                                                     "cutlass")},
}

TABLES = {"linear": (LINEAR, DENSE_FLAG, DENSE_FLAGS), "moe": (MOE, MOE_FLAG, MOE_FLAGS)}


def all_kernels() -> List[Kernel]:
    """Every registered kernel once, in the registry's order."""
    seen: Dict[str, Kernel] = {}
    for table, _, _ in TABLES.values():
        for entries in table.values():
            for e in entries:
                seen.setdefault(e.kernel.name, e.kernel)
    return list(seen.values())


def kernel_names() -> List[str]:
    return [k.name for k in all_kernels()]


def flag_kernels(kind: str, gpu: GpuSpec, flag: str, settings: Settings = None) -> List[Kernel]:
    """The kernels of a flag's priority list that can run on ``gpu`` (any layer shape); Mxfp8ConfigError (one line)
    where the flag cannot run MXFP8 ``kind`` layers there."""
    settings = settings or current_settings()
    check_flag(kind, gpu, flag, settings)
    return [e.kernel for e in TABLES[kind][0][(gpu.arch, flag)] if e.kernel.is_supported(gpu, settings)[0]]


def opt_in_kernels(gpu: GpuSpec) -> List[str]:
    """The kernels for ``gpu``'s architecture that run only where SGLANG_MXFP8_ENABLED_KERNELS names them."""
    return [k.name for k in all_kernels() if gpu.arch in k.archs and k.opt_in(gpu)]


def check_gpu(gpu: GpuSpec) -> None:
    if not any(arch == gpu.arch for arch, _ in LINEAR):
        raise Mxfp8ConfigError(
            f"MXFP8 checkpoints need an FP8 tensor-core path; {gpu.label} has none in sglang_mxfp8 (Hopper SM90 or "
            "Blackwell SM100/103/107/110/120/121 required): serve the BF16 checkpoint instead")


def _named_base(entries: Sequence[Entry]) -> Entry:
    """The base kernel a flag asks for by name: its list's first whole-range entry."""
    return next(e for e in entries if e.is_base)


def flag_choices(kind: str, gpu: GpuSpec, settings: Settings = None) -> Tuple[str, ...]:
    """Values of the ``kind`` ("linear" or "moe") flag that can run MXFP8 on ``gpu``: a named flag where the kernel it
    names is supported; ``auto`` where any of its base kernels is."""
    settings = settings or current_settings()
    table, _, flags = TABLES[kind]
    valid = []
    for flag in flags:
        entries = table.get((gpu.arch, flag))
        if not entries:
            continue
        bases = [e for e in entries if e.is_base] if flag == "auto" else [_named_base(entries)]
        if any(e.kernel.is_supported(gpu, settings)[0] for e in bases):
            valid.append(flag)
    return tuple(valid)


def check_flag(kind: str, gpu: GpuSpec, flag: str, settings: Settings = None) -> None:
    """One line naming the flag, the GPU and the valid choices, where ``flag`` cannot run MXFP8 ``kind`` layers."""
    settings = settings or current_settings()
    check_gpu(gpu)
    table, flag_name, flags = TABLES[kind]
    valid = flag_choices(kind, gpu, settings)
    if flag in valid:
        return
    entries = table.get((gpu.arch, flag))
    if not any(arch == gpu.arch for arch, _ in table):
        raise Mxfp8ConfigError(
            f"{flag_name} {flag}: no MXFP8 MoE kernel exists for {gpu.label} (FlashInfer's and SGLang's MXFP8 MoE "
            "kernels are SM100/103/107 only, ours SM90): serve the BF16 checkpoint")
    if flag not in flags:
        why = "not an MXFP8 " + ("dense" if kind == "linear" else "MoE") + " backend"
    elif not entries:
        why = "no such kernel for this architecture"
    else:
        why = _named_base(entries).kernel.is_supported(gpu, settings)[1]
        if why.startswith(flag_name):  # the kernel's own line names the flag and what to use instead
            raise Mxfp8ConfigError(why)
    raise Mxfp8ConfigError(f"{flag_name} {flag} cannot run MXFP8 on {gpu.label}: {why}; valid choices on this GPU: "
                           f"{', '.join(valid) or 'none'}")


def _select(kind: str, spec, gpu: GpuSpec, flag: str, settings: Settings, bands: bool = True) -> Plan:
    for env, names in ((DISABLED_KERNELS_ENV, settings.disabled_kernels), (ENABLED_KERNELS_ENV, settings.enabled_kernels)):
        unknown = names - set(kernel_names()) - {"precompile"}
        if unknown:
            log_once(30, f"sglang_mxfp8: {env} names no kernel called {', '.join(sorted(unknown))} "
                         f"(kernels: {', '.join(kernel_names())})")
    check_flag(kind, gpu, flag, settings)
    table = TABLES[kind][0]
    return select(spec, gpu, flag, table[(gpu.arch, flag)], settings, bands)


def select_linear(spec: LinearSpec, gpu: GpuSpec, flag: str, settings: Settings = None, bands: bool = True) -> Plan:
    """The plan of one MXFP8 linear layer; Mxfp8ConfigError (one line) where no kernel can run it."""
    if spec.k % 32:
        raise Mxfp8ConfigError(f"{spec.name}: K={spec.k} is not a multiple of 32, so it cannot be MXFP8 on "
                               f"{gpu.label}; list it in modules_to_not_convert and keep it BF16")
    return _select("linear", spec, gpu, flag, settings or current_settings(), bands)


def select_moe(spec: MoESpec, gpu: GpuSpec, flag: str, settings: Settings = None, bands: bool = True) -> Plan:
    """The plan of one MXFP8 fused-MoE layer; Mxfp8ConfigError (one line) where no kernel can run it."""
    return _select("moe", spec, gpu, flag, settings or current_settings(), bands)


def plan_checkpoint(ckpt: Path, gpu: GpuSpec, dense_flag: str, moe_flag: str, tp: int = 1, ep: int = 1,
                    settings: Settings = None, bands: bool = True) -> List[Tuple[str, Union[Plan, str]]]:
    """(layer kind, its plan or why it cannot run, one line) for each layer kind of an MXFP8 checkpoint as SGLang
    serves it at --tp / --ep-size: what the launch checks, the server logs and ``sglang-mxfp8 doctor`` prints."""
    import torch

    from ..format.layers import ServedDense, ShardError, model_dtype, served_layers

    dtype = getattr(torch, model_dtype(ckpt))
    out: List[Tuple[str, Union[Plan, str]]] = []
    for layer in served_layers(ckpt, tp, ep):
        if isinstance(layer, ShardError):
            out.append((("MoE " if ".experts" in str(layer).split(":")[0] else "dense ") + str(layer).split(":")[0],
                        str(layer)))
            continue
        try:
            if isinstance(layer, ServedDense):
                fused = f" ({' + '.join(layer.parts)})" if len(layer.parts) > 1 else ""
                rank = f", [{layer.rank_n} x {layer.rank_k}] per rank" if (layer.rank_n, layer.rank_k) != (layer.n, layer.k) else ""
                what = f"dense {layer.name} [{layer.n} x {layer.k}] x{layer.count}{fused}{rank}"
                spec = LinearSpec(layer.name, layer.rank_n, layer.rank_k, dtype)
                out.append((what, select_linear(spec, gpu, dense_flag, settings, bands)))
            else:
                split = (f", {layer.intermediate // layer.tp} per rank" if layer.tp > 1 else "") + (
                    f", experts split {layer.ep} ways" if layer.ep > 1 else "")
                what = f"MoE {layer.name} (hidden {layer.hidden}, intermediate {layer.intermediate}{split})"
                spec = MoESpec(layer.name, layer.experts, layer.hidden, layer.intermediate // layer.tp, tp=layer.tp,
                               ep=layer.ep, dtype=dtype)
                out.append((what, select_moe(spec, gpu, moe_flag, settings, bands)))
        except Mxfp8ConfigError as e:
            out.append((what, str(e)))
    return out


def native(kind: str, gpu: GpuSpec, flag: str) -> bool:
    """Whether SGLang's own MXFP8 method runs ``kind`` layers for this flag on this GPU (decided by flag and GPU
    alone, before any layer's shape is known)."""
    entries = TABLES[kind][0].get((gpu.arch, flag), ())
    return bool(entries) and all(e.kernel.native for e in entries)
