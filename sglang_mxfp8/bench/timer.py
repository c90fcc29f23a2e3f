"""The one GPU timer of the benchmarks: Triton's ``do_bench_cudagraph`` (the calls replayed from a CUDA graph, as
SGLang's decode graphs run a model, so no host launch cost is counted), over enough distinct weight copies that the
weights stream from HBM rather than the L2 cache, as a model's layers do one after another."""

from __future__ import annotations

import math
from typing import Callable, Sequence

WORKING_SET = 256 << 20  # bytes of weights per timed call sequence: several times an H100/H200's 50 MB L2


def copies_for(weight_bytes: int, most: int = 64) -> int:
    """How many distinct copies of a weight of ``weight_bytes`` a timed sequence cycles through."""
    return min(most, max(1, math.ceil(WORKING_SET / max(1, weight_bytes))))


def gpu_us(calls: Sequence[Callable[[], object]], rep_ms: int = 40) -> float:
    """Median microseconds per call of ``calls``, run one after another inside CUDA graphs."""
    from triton.testing import do_bench_cudagraph

    def run_all():
        for call in calls:
            call()

    return do_bench_cudagraph(run_all, rep=rep_ms, return_mode="median") * 1e3 / len(calls)


def relative_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float32; NaN where ``out`` holds a NaN or an infinity."""
    out = out.float()
    return ((out - ref).norm() / ref.norm()).item()
