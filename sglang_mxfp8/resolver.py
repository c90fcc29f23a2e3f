"""Which kernel each MXFP8 layer gets: a pure function of GPU, flags, FlashInfer and shape.

Nothing here touches a GPU or SGLang, so every row of the decision table is unit-tested on CPU.
``resolve_dense`` / ``resolve_moe`` return the kernel and a reason; an impossible request raises
:class:`Mxfp8ConfigError` with one line naming the flag, the GPU and the valid choices on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

DENSE_FLAG = "--fp8-gemm-backend"
MOE_FLAG = "--moe-runner-backend"

# Dense kernels.
HOPPER_TRITON = "hopper_triton_w8a8"  # ours: Triton FP8 GEMM, 1x128 act x 1x128 (per row) weight scales
HOPPER_FLASHINFER = "hopper_flashinfer_blockscale"  # FlashInfer fp8_blockscale_gemm_sm90, 128x128 weight scales
SM100_FLASHINFER_TRTLLM = "flashinfer_trtllm_mxfp8"  # FlashInfer mm_mxfp8(backend="trtllm")
SM100_FLASHINFER_CUTLASS = "flashinfer_cutlass_mxfp8"  # FlashInfer mm_mxfp8(backend="cutlass")
SGLANG_TRITON_MXFP8 = "sglang_triton_mxfp8"  # SGLang's Triton tl.dot_scaled kernel (tcgen05 / SM120)

# MoE kernels.
HOPPER_TRITON_MOE = "hopper_triton_moe"  # SGLang's Triton fused MoE, block FP8 128x128 after conversion
HOPPER_FLASHINFER_CUTLASS_MOE = "hopper_flashinfer_cutlass_moe"  # cutlass_fused_moe DeepSeek block-scale
SM100_FLASHINFER_CUTLASS_MOE = "flashinfer_cutlass_mxfp8_moe"  # cutlass_fused_moe MXFP8 x MXFP8 (ours)
SGLANG_NATIVE_MOE = "sglang_native_mxfp8_moe"  # SGLang's own flashinfer_trtllm(_routed) / cutlass paths

DENSE_FLAG_CHOICES = ("auto", "triton", "flashinfer_trtllm", "flashinfer_cutlass")
MOE_FLAG_CHOICES = ("auto", "triton", "flashinfer_cutlass", "flashinfer_trtllm", "flashinfer_trtllm_routed", "cutlass")

SM100_FAMILY = (100, 103, 107)
SM120_FAMILY = (120, 121)
MIN_CAPABILITY = 90


class Mxfp8ConfigError(ValueError):
    """An MXFP8 flag combination that cannot run on this GPU (message is one line)."""


@dataclass(frozen=True)
class GpuSpec:
    name: str
    sm: int  # major * 10 + minor

    @property
    def label(self) -> str:
        return f"{self.name} (SM{self.sm})"

    @classmethod
    def from_capability(cls, name: str, capability: Tuple[int, int]) -> "GpuSpec":
        return cls(name=name, sm=capability[0] * 10 + capability[1])


@dataclass(frozen=True)
class Choice:
    kernel: str
    reason: str
    fallback_from: Optional[str] = None  # the flag value that could not be honoured for this shape

    def __str__(self) -> str:
        return f"{self.kernel} ({self.reason})"


def dense_flag_choices(gpu: GpuSpec, flashinfer: bool) -> Tuple[str, ...]:
    """Values of --fp8-gemm-backend that can run MXFP8 dense layers on ``gpu``."""
    if gpu.sm == 90:
        return ("auto", "triton") + (("flashinfer_trtllm",) if flashinfer else ())
    if gpu.sm in SM100_FAMILY:
        return ("auto", "triton") + (("flashinfer_trtllm", "flashinfer_cutlass") if flashinfer else ())
    if gpu.sm in SM120_FAMILY:
        return ("auto", "triton") + (("flashinfer_cutlass",) if flashinfer else ())
    if gpu.sm == 110:
        return ("auto", "flashinfer_cutlass") if flashinfer else ()
    return ()


def moe_flag_choices(gpu: GpuSpec, flashinfer: bool) -> Tuple[str, ...]:
    """Values of --moe-runner-backend that can run MXFP8 MoE layers on ``gpu``."""
    if gpu.sm == 90:
        return ("auto", "triton") + (("flashinfer_cutlass",) if flashinfer else ())
    if gpu.sm in SM100_FAMILY:
        fi = ("flashinfer_cutlass", "flashinfer_trtllm", "flashinfer_trtllm_routed") if flashinfer else ()
        return ("auto", "cutlass") + fi
    return ()


def _unsupported_gpu(gpu: GpuSpec) -> Mxfp8ConfigError:
    return Mxfp8ConfigError(
        f"MXFP8 checkpoints need an FP8 tensor-core path; {gpu.label} has none in sglang_mxfp8 "
        f"(Hopper SM90 or Blackwell SM100/103/107/110/120/121 required): serve the BF16 checkpoint instead"
    )


def _bad_flag(flag: str, value: str, gpu: GpuSpec, valid: Tuple[str, ...], why: str) -> Mxfp8ConfigError:
    return Mxfp8ConfigError(
        f"{flag} {value} cannot run MXFP8 on {gpu.label}: {why}; valid choices on this GPU: {', '.join(valid)}"
    )


def hopper_cutlass_moe_unavailable(gpu: GpuSpec) -> str:
    return (
        f"{MOE_FLAG} flashinfer_cutlass on {gpu.label}: FlashInfer's SM90 fused_moe module is a JIT build of 181 "
        f"objects (about 40 min on 16 cores) that sglang_mxfp8 does not start at launch; use {MOE_FLAG} triton "
        "(the same block-FP8 weights, SGLang's Triton fused MoE)"
    )


def check_supported_gpu(gpu: GpuSpec) -> None:
    if gpu.sm < MIN_CAPABILITY or not dense_flag_choices(gpu, flashinfer=True):
        raise _unsupported_gpu(gpu)


def resolve_dense(
    gpu: GpuSpec, flag: str, *, flashinfer: bool, n: int, k: int, layer: str = "layer", bf16: bool = True
) -> Choice:
    """Kernel for one MXFP8 linear layer with weight [n, k] (``bf16``: the model's activation dtype is bf16)."""
    check_supported_gpu(gpu)
    valid = dense_flag_choices(gpu, flashinfer)
    if flag not in DENSE_FLAG_CHOICES:
        raise _bad_flag(DENSE_FLAG, flag, gpu, valid, "not an MXFP8 dense backend")
    if flag not in valid:
        why = "FlashInfer is not installed (pip install flashinfer-python)" if not flashinfer and flag.startswith("flashinfer") else "no such kernel for this architecture"
        raise _bad_flag(DENSE_FLAG, flag, gpu, valid, why)
    if k % 32:
        raise Mxfp8ConfigError(
            f"{layer}: K={k} is not a multiple of 32, so it cannot be MXFP8 on {gpu.label}; "
            "list it in modules_to_not_convert and keep it BF16"
        )

    if gpu.sm == 90:
        # auto: fp8_blockscale_gemm_sm90 measured faster than our Triton kernel at every shape and M
        # benchmarked on the H200 (benchmarks/RESULTS.md), so it is preferred wherever it applies.
        fi_ok = k % 128 == 0 and n % 64 == 0
        if flag == "flashinfer_trtllm" or (flag == "auto" and flashinfer):
            if fi_ok:
                return Choice(HOPPER_FLASHINFER, f"flag {flag} on SM90: FlashInfer fp8_blockscale_gemm_sm90, BF16 in, 128x128 weight scales")
            return Choice(HOPPER_TRITON, f"fp8_blockscale_gemm_sm90 needs K%128==0 and N%64==0 (N={n}, K={k}); using our Triton W8A8 kernel", fallback_from=flag)
        return Choice(HOPPER_TRITON, f"flag {flag} on SM90: Triton W8A8 FP8 GEMM with 1x128 activation and per-row 1x128 weight scales")

    if gpu.sm in SM100_FAMILY:
        cutlass_ok = flashinfer and n >= 128 and k >= 128
        if flag == "flashinfer_trtllm":
            if k % 256 == 0 and n >= 128 and bf16:
                return Choice(SM100_FLASHINFER_TRTLLM, "flag flashinfer_trtllm: mm_mxfp8 trtllm, shuffled weight, 8x4 activation scales")
            if cutlass_ok:
                why = f"K%256==0 and N>=128 (N={n}, K={k})" if bf16 else "bf16 output (this model runs in fp16)"
                return Choice(SM100_FLASHINFER_CUTLASS, f"mm_mxfp8 trtllm needs {why}; using mm_mxfp8 cutlass", fallback_from=flag)
            return Choice(SGLANG_TRITON_MXFP8, f"mm_mxfp8 needs N,K>=128 (N={n}, K={k}); using SGLang's Triton MXFP8 kernel", fallback_from=flag)
        if flag == "flashinfer_cutlass" or (flag == "auto" and cutlass_ok):
            if cutlass_ok:
                return Choice(SM100_FLASHINFER_CUTLASS, f"flag {flag}: mm_mxfp8 cutlass, 128x4 swizzled scales")
            return Choice(SGLANG_TRITON_MXFP8, f"mm_mxfp8 needs N,K>=128 (N={n}, K={k}); using SGLang's Triton MXFP8 kernel", fallback_from=flag)
        return Choice(SGLANG_TRITON_MXFP8, f"flag {flag}: SGLang's Triton tl.dot_scaled kernel")

    if gpu.sm in SM120_FAMILY:
        if flag == "flashinfer_cutlass" or (flag == "auto" and flashinfer and n >= 128 and k >= 128):
            if n >= 128 and k >= 128:
                return Choice(SM100_FLASHINFER_CUTLASS, f"flag {flag}: mm_mxfp8 cutlass on SM12x")
            return Choice(SGLANG_TRITON_MXFP8, f"mm_mxfp8 needs N,K>=128 (N={n}, K={k}); using SGLang's Triton MXFP8 kernel", fallback_from=flag)
        return Choice(SGLANG_TRITON_MXFP8, f"flag {flag}: SGLang's Triton tl.dot_scaled kernel (native on SM120)")

    # SM110: only FlashInfer CUTLASS lists it.
    if n >= 128 and k >= 128:
        return Choice(SM100_FLASHINFER_CUTLASS, f"flag {flag}: mm_mxfp8 cutlass (the only MXFP8 GEMM listing SM110)")
    raise Mxfp8ConfigError(f"{layer}: mm_mxfp8 needs N,K>=128 (N={n}, K={k}) and {gpu.label} has no other MXFP8 GEMM; keep this layer BF16")


def _moe_size_error(layer: str, name: str, dim: int, multiple: int, needs: str, fix: str, tp: int) -> Mxfp8ConfigError:
    """A MoE size that is not a multiple of what the kernels need. Where tensor parallelism split the intermediate
    size ``tp`` ways, the fix is another split (those that work are listed) or expert parallelism, which keeps each
    expert whole."""
    ways = [str(t) for t in range(1, 17) if dim * tp % t == 0 and (dim * tp // t) % multiple == 0]
    if tp > 1 and name == "intermediate size" and ways:
        listed = ", ".join(ways[:-1]) + " or " + ways[-1] if len(ways) > 1 else ways[0]
        return Mxfp8ConfigError(
            f"{layer}: intermediate size {dim * tp} split {tp} ways by tensor parallelism (--tp / --ep-size) leaves "
            f"{dim} per rank, not a multiple of {multiple}, {needs}; serve with --tp / --ep-size = {listed} (--ep-size "
            f"equal to --tp keeps each expert whole on its rank)")
    full = f"{name} {dim * tp}, {dim} per rank," if tp > 1 and name == "intermediate size" else f"{name} {dim}"
    return Mxfp8ConfigError(f"{layer}: {full} is not a multiple of {multiple}, {needs}; {fix}")


def resolve_moe(gpu: GpuSpec, flag: str, *, flashinfer: bool, hidden: int, intermediate: int, layer: str = "experts",
                tp: int = 1) -> Choice:
    """Kernel for one MXFP8 fused-MoE layer (w13 [E, 2I, H], w2 [E, H, I]); ``intermediate``: I on this rank,
    after tensor parallelism split it ``tp`` ways (SGLang's MoE tensor-parallel size)."""
    check_supported_gpu(gpu)
    valid = moe_flag_choices(gpu, flashinfer)
    if not valid:
        raise Mxfp8ConfigError(
            f"{MOE_FLAG} {flag}: no MXFP8 MoE kernel exists for {gpu.label} "
            "(FlashInfer's and SGLang's MXFP8 MoE kernels are SM100/103/107 only, ours SM90): serve the BF16 checkpoint"
        )
    if flag not in MOE_FLAG_CHOICES:
        raise _bad_flag(MOE_FLAG, flag, gpu, valid, "not an MXFP8 MoE backend")
    if flag not in valid:
        why = "FlashInfer is not installed (pip install flashinfer-python)" if not flashinfer and flag.startswith("flashinfer") else "no such kernel for this architecture"
        raise _bad_flag(MOE_FLAG, flag, gpu, valid, why)
    if gpu.sm == 90:  # 128x128 blocks after the scale conversion; a multiple of 128 is one of 32 as well
        multiple, needs, fix = (128, f"which Hopper block-FP8 MoE kernels need on {gpu.label}",
                                "keep this MoE layer BF16 (modules_to_not_convert)")
    else:
        multiple, needs, fix = 32, "the MXFP8 scale block", f"MXFP8 MoE cannot hold it on {gpu.label}"
    for name, dim in (("hidden size", hidden), ("intermediate size", intermediate)):
        if dim % multiple:
            raise _moe_size_error(layer, name, dim, multiple, needs, fix, tp)

    if gpu.sm == 90:
        if flag == "flashinfer_cutlass":
            return Choice(HOPPER_FLASHINFER_CUTLASS_MOE, "flag flashinfer_cutlass on SM90: cutlass_fused_moe DeepSeek FP8 block-scale, 128x128 scales, [up; gate] order")
        return Choice(HOPPER_TRITON_MOE, f"flag {flag} on SM90: SGLang's Triton fused MoE, block FP8 128x128 after lossless scale conversion")
    if flag == "flashinfer_cutlass":
        if intermediate % 128 or hidden % 128:
            raise Mxfp8ConfigError(
                f"{layer}: FlashInfer CUTLASS MXFP8 MoE pads gate and up to 128 rows each; hidden {hidden} and "
                f"intermediate {intermediate} must be multiples of 128 on {gpu.label}; use {MOE_FLAG} flashinfer_trtllm"
            )
        return Choice(SM100_FLASHINFER_CUTLASS_MOE, "flag flashinfer_cutlass: cutlass_fused_moe MXFP8 x MXFP8, [up; gate] order")
    native = "flashinfer_trtllm" if flag == "auto" else flag
    return Choice(SGLANG_NATIVE_MOE, f"flag {flag}: SGLang's own MXFP8 MoE runner ({native})")
