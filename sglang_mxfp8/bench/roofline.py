"""The floor under a layer's time on this GPU: the larger of the bytes it must move over the GPU's copy bandwidth and
its FLOPs over the GPU's GEMM peak in its precision, both measured in the same run (a device-to-device copy, cuBLAS
on a square GEMM), so a layer row says what fraction of that floor each kernel reaches. The bytes are the weight
(FP8 or BF16) and the activations in and out; scales and intermediates are left out (a floor, not a model)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Tuple

PEAK_SIDE = 8192  # the square GEMM whose time gives the FLOP peak
COPY_ELEMENTS = 256 << 20  # bf16 elements copied (512 MB each way), far past the L2 cache


@dataclass(frozen=True)
class Peaks:
    copy_tb_s: float  # bytes read plus bytes written per second, over 1e12
    fp8_tflops: float
    bf16_tflops: float

    def bounds_us(self, nbytes: float, flops: float, fp8: bool) -> Tuple[float, float]:
        """The least microseconds to move ``nbytes``, and to compute ``flops``."""
        peak = self.fp8_tflops if fp8 else self.bf16_tflops
        return nbytes / (self.copy_tb_s * 1e6), flops / (peak * 1e6)

    def floor_us(self, nbytes: float, flops: float, fp8: bool) -> float:
        """The least microseconds for ``nbytes`` moved and ``flops`` computed."""
        return max(self.bounds_us(nbytes, flops, fp8))

    def fractions(self, traffic_fp8: Tuple[float, float], traffic_bf16: Tuple[float, float], mxfp8_us: float,
                  bf16_us: float) -> dict:
        """A layer row's extras: each side's floor over its time, which bound sets the MXFP8 floor, and the peaks."""
        memory_us, compute_us = self.bounds_us(*traffic_fp8, True)
        fp8_floor = max(memory_us, compute_us)
        bf16_floor = self.floor_us(*traffic_bf16, False)
        bound = "memory" if memory_us >= compute_us else "compute"
        return {"roofline_mxfp8": round(fp8_floor / mxfp8_us, 4), "roofline_bf16": round(bf16_floor / bf16_us, 4),
                "floor_us": round(fp8_floor, 3), "bound": bound, "peaks": asdict(self)}


def dense_traffic(m: int, n: int, k: int, weight_bytes: int) -> Tuple[float, float]:
    """(bytes, FLOPs) of an [m, k] x [n, k]^T layer: its weight of ``weight_bytes`` per element, 16-bit activations
    in and out."""
    return weight_bytes * n * k + 2 * m * k + 2 * m * n, 2 * m * n * k


def moe_traffic(m: int, top_k: int, experts_hit: float, hidden: int, intermediate: int,
                weight_bytes: int) -> Tuple[float, float]:
    """(bytes, FLOPs) of a SiLU-gated MoE layer on ``m`` tokens: the up/gate and down weights of the experts its routing
    reaches, 16-bit tokens in and out; three GEMMs of hidden x intermediate per routed token."""
    weights = 3 * hidden * intermediate
    return weight_bytes * experts_hit * weights + 4 * m * hidden, 2 * m * top_k * weights


def measure() -> Peaks:
    """This GPU's copy bandwidth and its cuBLAS BF16 and FP8 (per-tensor scaled) GEMM rates, timed as the layers are."""
    import torch

    from .timer import gpu_us

    side = PEAK_SIDE
    a = torch.randn(side, side, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(side, side, device="cuda", dtype=torch.bfloat16)
    bf16_us = gpu_us([lambda: a @ b], rep_ms=100)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    fp8_us = gpu_us([lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16)], rep_ms=100)
    flops = 2 * side ** 3
    return Peaks(copy_tb_s=_copy_tb_s(),
                 fp8_tflops=round(flops / (fp8_us * 1e6), 1), bf16_tflops=round(flops / (bf16_us * 1e6), 1))


def _copy_tb_s() -> float:
    import torch

    from .timer import gpu_us

    src = torch.empty(COPY_ELEMENTS, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return round(2 * COPY_ELEMENTS * 2 / (gpu_us([lambda: dst.copy_(src)]) * 1e6), 3)
