"""Every MXFP8 kernel, and which one runs each layer: per GPU architecture and layer kind, one list of band kernels
shared by every flag and, per flag, its base kernel preference.

A layer's plan (:func:`select_linear`, :func:`select_moe`, when SGLang creates its weights) is the first base kernel of
its flag that can run the layer, and before it every band kernel that can, that reads that base kernel's weight
layout and, where it names one, sits beside that base kernel. Launch validation, the server log and
``sglang-mxfp8 doctor`` print that plan. Each band and shape list cites the benchmark rows that measured it
(``benchmarks/results/``; a CPU test checks that every cited row exists).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple, Union

from ..flags import DENSE_FLAG, DENSE_FLAGS, MOE_FLAG, MOE_FLAGS
from ..platform import GpuSpec
from ..settings import DISABLED_KERNELS_ENV, Settings
from ..settings import current as current_settings
from .base import Kernel, LinearSpec, MoESpec, Mxfp8ConfigError, log_once
from .plan import Cite, Entry, Plan, select
from .linear.cublas import CublasBlockScale
from .linear.deepgemm import DeepGemmDense
from .linear.flashinfer_sm90 import FlashInferSm90
from .linear.flashinfer_sm100 import FlashInferCutlassMxfp8, FlashInferTrtllmMxfp8
from .linear.gemv import Gemv
from .linear.sglang_native import SglangTritonMxfp8
from .linear.splitk import SplitKW8A8
from .linear.triton_w8a8 import TritonW8A8
from .linear.weight_only import WeightOnly
from .moe.cutlass_grouped import CutlassGroupedPrefillMoE, CutlassGroupedUpFirstPrefillMoE
from .moe.deepgemm import DeepGemmPrefillMoE
from .moe.flashinfer_cutlass import FlashInferCutlassMxfp8MoE, FlashInferCutlassSm90MoE
from .moe.gemv import GemvMoE
from .moe.sglang_native import SglangNativeMoE
from .moe.triton_fused import TritonFusedMoE
from .moe.triton_w8a8 import TritonW8A8MoE

__all__ = ["DENSE_FLAG", "DENSE_FLAGS", "MOE_FLAG", "MOE_FLAGS"]


@dataclass(frozen=True)
class Table:
    """One layer kind on one GPU architecture: the band kernels every flag shares (tried in order, before the base),
    and each flag's base kernels (the first that can run the layer is the base; one marked ``fallback`` is taken
    only where the flag's own kernel cannot run the layer, and says so)."""

    bands: Tuple[Entry, ...]
    bases: Dict[str, Tuple[Entry, ...]]

    @property
    def planned_bands(self) -> Tuple[Entry, ...]:
        """The bands a plan may hold: trial entries are timed by the bench only."""
        return tuple(e for e in self.bands if not e.trial)

    def entries(self, flag: str) -> Tuple[Entry, ...]:
        """The priority list of ``flag``: planned bands, then its bases; empty where the flag has no kernel here."""
        return self.planned_bands + self.bases[flag] if flag in self.bases else ()

    def every_entry(self) -> Tuple[Entry, ...]:
        return self.bands + tuple(e for entries in self.bases.values() for e in entries)

    def only(self, *flags: str) -> "Table":
        """The same table for an architecture that has only ``flags``."""
        return Table(self.bands, {flag: self.bases[flag] for flag in flags})


def _layers(shape: str, tokens, *kernels: str, routine: str = "layers") -> Tuple[Cite, ...]:
    return tuple(Cite(routine, shape, t, k) for t in tokens for k in kernels)


QWEN_QKV, QWEN_O = "qwen3-30b-a3b qkv_proj [5120 x 2048]", "qwen3-30b-a3b o_proj [2048 x 4096]"
LLAMA_UP, LLAMA_DOWN = "llama-3-8b up_proj [14336 x 4096]", "llama-3-8b down_proj [4096 x 14336]"
QWEN_MOE = "qwen3-30b-a3b MoE E128 H2048 I768 top-8"

# -- Hopper dense ----------------------------------------------------------------------------------------------------
# one token: the GEMV against FlashInfer's whole op (quantizer + GEMM) and the Triton W8A8 whole op, same run
GEMV_SHAPES = frozenset({(5120, 2048), (2048, 4096), (4096, 14336)})
GEMV_BESIDE_FLASHINFER = Gemv(GEMV_SHAPES)
GEMV_BESIDE_TRITON = Gemv(GEMV_SHAPES | {(14336, 4096)})  # Llama-3-8B's up projection: only beside Triton
GEMV_CITES = sum((_layers(s, (1,), "gemv", "flashinfer_sm90", "triton_w8a8")
                  for s in (QWEN_QKV, QWEN_O, LLAMA_UP, LLAMA_DOWN)), ())
# up to 16 tokens the weight-only GEMM beat the W8A8 whole op on layers with N <= 5120; it lost on 4096 -> 14336
WEIGHT_ONLY = WeightOnly(max_n=5120)
SPLITK_W8A8 = SplitKW8A8()
TRITON_W8A8 = TritonW8A8()
FLASHINFER_SM90 = FlashInferSm90()
DEEPGEMM = DeepGemmDense()
CUBLAS = CublasBlockScale()
PREFILL_CITES = sum((_layers(s, (1024, 4096, 8192), "deepgemm", "cublas", "flashinfer_sm90")
                     for s in (QWEN_QKV, QWEN_O, LLAMA_UP, LLAMA_DOWN)), ())

# FlashInfer's GEMM beat our Triton W8A8 kernel at every measured shape and batch; Triton takes the shapes FlashInfer's
# cannot (K % 128, N % 64)
FLASHINFER_FIRST = (Entry(FLASHINFER_SM90, measured=_layers(QWEN_QKV, (16, 128, 1024, 8192), "flashinfer_sm90",
                                                            "triton_w8a8")),
                    Entry(TRITON_W8A8, fallback=True))
SM90_DENSE = Table(
    bands=(
        Entry(GEMV_BESIDE_FLASHINFER, 1, 1, with_base=FLASHINFER_SM90.name, measured=GEMV_CITES),
        Entry(GEMV_BESIDE_TRITON, 1, 1, with_base=TRITON_W8A8.name, measured=GEMV_CITES),
        Entry(WEIGHT_ONLY, 1, 16, with_base=TRITON_W8A8.name,
              measured=_layers(QWEN_QKV, (1, 16), "weight_only", "triton_w8a8")
              + _layers(QWEN_O, (1, 16), "weight_only", "triton_w8a8")),
        # DeepGEMM beat cuBLAS's block-scaled GEMM on 11 of 12 cells at 1024-8192 tokens; cuBLAS beat FlashInfer's
        # GEMM at 1024 and 4096 tokens on every shape and lost at 16-512 on Qwen3-30B-A3B's
        Entry(DEEPGEMM, 1024, measured=PREFILL_CITES),
        Entry(CUBLAS, 1024, measured=PREFILL_CITES),
        Entry(SPLITK_W8A8, 2, 128, trial=True),  # the weight read once at 2-128 tokens: timed, not yet planned
    ),
    bases={"auto": FLASHINFER_FIRST, "flashinfer_trtllm": FLASHINFER_FIRST, "triton": (Entry(TRITON_W8A8),)},
)

# -- Blackwell dense (CPU-verified, not run on SM100) ------------------------------------------------------------------
FLASHINFER_TRTLLM_MXFP8 = FlashInferTrtllmMxfp8()
FLASHINFER_CUTLASS_MXFP8 = FlashInferCutlassMxfp8()
SGLANG_TRITON_MXFP8 = SglangTritonMxfp8()
SM100_DENSE = Table(bands=(), bases={
    "auto": (Entry(FLASHINFER_CUTLASS_MXFP8),),
    "flashinfer_cutlass": (Entry(FLASHINFER_CUTLASS_MXFP8),),
    "flashinfer_trtllm": (Entry(FLASHINFER_TRTLLM_MXFP8), Entry(FLASHINFER_CUTLASS_MXFP8, fallback=True)),
    "triton": (Entry(SGLANG_TRITON_MXFP8),),
})

# -- Hopper MoE ------------------------------------------------------------------------------------------------------
TRITON_MOE = TritonFusedMoE()
TRITON_W8A8_MOE = TritonW8A8MoE()  # our masked W8A8 fused MoE: sizes off the 128 grid, any w13 order
FLASHINFER_CUTLASS_SM90_MOE = FlashInferCutlassSm90MoE()
MOE_GEMV = GemvMoE({(2048, 768)})
DEEPGEMM_MOE = DeepGemmPrefillMoE()
CUTLASS_MOE = CutlassGroupedPrefillMoE()
CUTLASS_MOE_UP_FIRST = CutlassGroupedUpFirstPrefillMoE()
TRITON_FIRST = (Entry(TRITON_MOE), Entry(TRITON_W8A8_MOE))
SM90_MOE = Table(
    bands=(
        # one token: the GEMV MoE against SGLang's Triton fused MoE (MXFP8 and BF16), same run
        Entry(MOE_GEMV, 1, 1, measured=_layers(QWEN_MOE, (1,), "moe_gemv", "triton_moe")),
        # DeepGEMM's grouped GEMM with our glue against the CUTLASS grouped and the Triton fused MoE, same run
        Entry(DEEPGEMM_MOE, 1024, measured=_layers(QWEN_MOE, (1024, 2048, 4096, 8192), "deepgemm_moe", "cutlass_moe",
                                                   "triton_moe")),
        Entry(CUTLASS_MOE, 2048, measured=_layers(QWEN_MOE, (2048, 4096, 8192), "cutlass_moe", "triton_moe")),
        # the same MoE on FlashInfer's [up; gate] w13: timed, not yet planned
        Entry(CUTLASS_MOE_UP_FIRST, 2048, trial=True),
        # FlashInfer's fused MoE ran 0.55-0.87x SGLang's Triton MoE at every batch, which our masked W8A8 MoE matches
        # on the grid; it reads w13 as FlashInfer loads it ([up; gate]), so it takes FlashInfer's batches
        Entry(TRITON_W8A8_MOE, 2, with_base=FLASHINFER_CUTLASS_SM90_MOE.name,
              measured=_layers(QWEN_MOE, (16, 64, 256, 1024, 4096, 8192), "flashinfer_cutlass_moe_sm90", "triton_moe")
              + _layers(QWEN_MOE, (16, 4096), "triton_w8a8_moe", "triton_moe")),
    ),
    bases={"auto": TRITON_FIRST, "triton": TRITON_FIRST,
           "flashinfer_cutlass": (Entry(FLASHINFER_CUTLASS_SM90_MOE), Entry(TRITON_W8A8_MOE, fallback=True))},
)

SM100_MOE = Table(bands=(), bases={
    "flashinfer_cutlass": (Entry(FlashInferCutlassMxfp8MoE()),),
    **{flag: (Entry(SglangNativeMoE(runner)),) for flag, runner in (
        ("auto", "flashinfer_trtllm"), ("flashinfer_trtllm", "flashinfer_trtllm"),
        ("flashinfer_trtllm_routed", "flashinfer_trtllm_routed"), ("cutlass", "cutlass"))},
})

# GPU architecture -> layer kind -> its table (no MoE table: no MXFP8 MoE kernel there)
REGISTRY: Dict[str, Dict[str, Table]] = {
    "sm90": {"linear": SM90_DENSE, "moe": SM90_MOE},
    "sm100": {"linear": SM100_DENSE, "moe": SM100_MOE},
    "sm110": {"linear": SM100_DENSE.only("auto", "flashinfer_cutlass")},
    "sm120": {"linear": SM100_DENSE.only("auto", "flashinfer_cutlass", "triton")},
}
FLAGS = {"linear": (DENSE_FLAG, DENSE_FLAGS), "moe": (MOE_FLAG, MOE_FLAGS)}


def table(kind: str, gpu: GpuSpec) -> Table:
    """``kind``'s table for ``gpu``'s architecture (an empty one where it has none)."""
    return REGISTRY.get(gpu.arch, {}).get(kind, Table((), {}))


def all_kernels() -> List[Kernel]:
    """Every registered kernel once, in the registry's order."""
    seen: Dict[str, Kernel] = {}
    for kinds in REGISTRY.values():
        for t in kinds.values():
            for e in t.every_entry():
                seen.setdefault(e.kernel.name, e.kernel)
    return list(seen.values())


def kernel_names() -> List[str]:
    return [k.name for k in all_kernels()]


def cited_rows() -> List[Cite]:
    """Every benchmark row an entry cites as its measurement, once."""
    cites: Dict[Cite, None] = {}
    for kinds in REGISTRY.values():
        for t in kinds.values():
            for e in t.every_entry():
                cites.update(dict.fromkeys(e.measured))
    return list(cites)


def flag_kernels(kind: str, gpu: GpuSpec, flag: str, settings: Settings = None) -> List[Kernel]:
    """The kernels of a flag's priority list that can run on ``gpu`` (any layer shape); Mxfp8ConfigError (one line)
    where the flag cannot run MXFP8 ``kind`` layers there."""
    settings = settings or current_settings()
    check_flag(kind, gpu, flag, settings)
    return [e.kernel for e in table(kind, gpu).entries(flag) if e.kernel.is_supported(gpu, settings)[0]]


def check_gpu(gpu: GpuSpec) -> None:
    if "linear" not in REGISTRY.get(gpu.arch, {}):
        raise Mxfp8ConfigError(
            f"MXFP8 checkpoints need an FP8 tensor-core path; {gpu.label} has none in sglang_mxfp8 (Hopper SM90 or "
            "Blackwell SM100/103/107/110/120/121 required): serve the BF16 checkpoint instead")


def flag_choices(kind: str, gpu: GpuSpec, settings: Settings = None) -> Tuple[str, ...]:
    """Values of the ``kind`` ("linear" or "moe") flag that can run MXFP8 on ``gpu``: a named flag where the kernel it
    names (its first base) is supported; ``auto`` where any of its bases is."""
    settings = settings or current_settings()
    t = table(kind, gpu)
    valid = []
    for flag in FLAGS[kind][1]:
        bases = t.bases.get(flag, ())
        if any(e.kernel.is_supported(gpu, settings)[0] for e in (bases if flag == "auto" else bases[:1])):
            valid.append(flag)
    return tuple(valid)


def check_flag(kind: str, gpu: GpuSpec, flag: str, settings: Settings = None) -> None:
    """One line naming the flag, the GPU and the valid choices, where ``flag`` cannot run MXFP8 ``kind`` layers."""
    settings = settings or current_settings()
    check_gpu(gpu)
    flag_name, flags = FLAGS[kind]
    valid = flag_choices(kind, gpu, settings)
    if flag in valid:
        return
    t = table(kind, gpu)
    if not t.bases:
        raise Mxfp8ConfigError(
            f"{flag_name} {flag}: no MXFP8 MoE kernel exists for {gpu.label} (FlashInfer's and SGLang's MXFP8 MoE "
            "kernels are SM100/103/107 only, ours SM90): serve the BF16 checkpoint")
    if flag not in flags:
        why = "not an MXFP8 " + ("dense" if kind == "linear" else "MoE") + " backend"
    elif flag not in t.bases:
        why = "no such kernel for this architecture"
    else:
        why = t.bases[flag][0].kernel.is_supported(gpu, settings)[1]
        if why.startswith(flag_name):  # the kernel's own line names the flag and what to use instead
            raise Mxfp8ConfigError(why)
    raise Mxfp8ConfigError(f"{flag_name} {flag} cannot run MXFP8 on {gpu.label}: {why}; valid choices on this GPU: "
                           f"{', '.join(valid) or 'none'}")


def _select(kind: str, spec, gpu: GpuSpec, flag: str, settings: Settings, bands: bool = True) -> Plan:
    unknown = settings.disabled_kernels - set(kernel_names()) - {"precompile"}
    if unknown:
        log_once(30, f"sglang_mxfp8: {DISABLED_KERNELS_ENV} names no kernel called {', '.join(sorted(unknown))} "
                     f"(kernels: {', '.join(kernel_names())})")
    check_flag(kind, gpu, flag, settings)
    return select(spec, gpu, flag, table(kind, gpu).entries(flag), settings, bands)


def select_linear(spec: LinearSpec, gpu: GpuSpec, flag: str, settings: Settings = None, bands: bool = True) -> Plan:
    """The plan of one MXFP8 linear layer; Mxfp8ConfigError (one line) where no kernel can run it."""
    if spec.k % 32:
        raise Mxfp8ConfigError(f"{spec.name}: K={spec.k} is not a multiple of 32, so it cannot be MXFP8 on "
                               f"{gpu.label}; list it in modules_to_not_convert and keep it BF16")
    return _select("linear", spec, gpu, flag, settings or current_settings(), bands)


def select_moe(spec: MoESpec, gpu: GpuSpec, flag: str, settings: Settings = None, bands: bool = True) -> Plan:
    """The plan of one MXFP8 fused-MoE layer; Mxfp8ConfigError (one line) where no kernel can run it."""
    return _select("moe", spec, gpu, flag, settings or current_settings(), bands)


def candidates(kind: str, gpu: GpuSpec, spec, settings: Settings = None) -> List[Tuple[Entry, Kernel]]:
    """Every (entry, base kernel whose layout it reads) of ``gpu``'s ``kind`` table, any flag, that can run ``spec``:
    what ``sglang-mxfp8 bench layers --all-kernels`` times, each base kernel with itself."""
    settings = settings or current_settings()
    t = table(kind, gpu)

    def runs(e: Entry) -> bool:
        return e.kernel.is_supported(gpu, settings)[0] and e.kernel.can_implement(spec)[0]

    bases = list({e.kernel.name: e for entries in t.bases.values() for e in entries if runs(e)}.values())
    out, seen = [(e, e.kernel) for e in bases], {e.kernel.name for e in bases}
    for e in t.bands:
        base = next((b.kernel for b in bases if e.with_base in (None, b.kernel.name)
                     and e.kernel.layout_mismatch(b.kernel) is None), None)
        if base is not None and e.kernel.name not in seen and runs(e):
            out.append((e, base))
            seen.add(e.kernel.name)
    return out


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
                rank = (
                    f", [{layer.rank_n} x {layer.rank_k}] per rank"
                    if (layer.rank_n, layer.rank_k) != (layer.n, layer.k)
                    else ""
                )
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
    alone, before any layer's shape is known): the one answer to "ours or SGLang's"."""
    entries = table(kind, gpu).entries(flag)
    return bool(entries) and all(e.kernel.native for e in entries)


def markdown() -> str:
    """The kernel registry as the README's table: per GPU architecture, layer kind and flag, the base kernel (and its
    fallback) and the band kernels beside it."""
    names = {"sm90": "Hopper (SM90)", "sm100": "Blackwell (SM100/103/107)", "sm110": "SM110", "sm120": "SM120/121"}
    lines = ["| GPU | layer | flag | base kernel (fallback) | band kernels beside it |", "|---|---|---|---|---|"]
    for arch, kinds in REGISTRY.items():
        label = names[arch]  # on the architecture's first row only
        for kind, table in kinds.items():
            flags_of = {}
            for flag, bases in table.bases.items():
                flags_of.setdefault(bases, []).append(flag)
            for bases, flags in flags_of.items():
                base = bases[0].kernel
                others = [e.kernel.name for e in bases[1:]]
                bands = [f"{e.kernel.name} ({e.band()})" for e in table.planned_bands
                         if e.with_base in (None, base.name) and e.kernel.layout_mismatch(base) is None]
                lines.append(f"| {label} | {'dense' if kind == 'linear' else 'MoE'} | {', '.join(flags)} | "
                             f"{base.name}" + (f" ({', '.join(others)})" if others else "") + f" | "
                             f"{', '.join(bands) or '-'} |")
                label = ""
    return "\n".join(lines)
