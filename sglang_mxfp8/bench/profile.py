"""Where a server's GPU time goes under load: SGLang's own profiler (``/start_profile`` by stage: torch.profiler with
GPU activity only, over a number of prefill steps and then of decode steps) while ``sglang.bench_serving`` keeps a
concurrency's requests in flight; each kernel of the traces is sorted by its name into attention, dense, MoE or other.

Kernels inside CUDA graphs have no Python caller in a trace, so names are all there is: the rules below are checked in
order (a MoE's grouped GEMM is a GEMM too; attention's decode kernels say ``grouped``), and the kernels of "other"
are listed with their times, so a reader sees what went there."""

from __future__ import annotations

import gzip
import json
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import requests

CATEGORIES = ("attention", "dense", "moe", "other")
RULES = (  # (category, lower-case name fragments); the first rule with a fragment in the name wins
    ("moe", ("moe", "expert", "topk", "top_k", "m_grouped", "groupproblemshape", "expandinputrows", "finalize",
             "silu_mul_quant")),
    ("attention", ("attn", "attention", "fwd_kernel", "fwd_grouped_kernel", "flash_fwd", "kvcache", "kv_cache",
                   "_kv_")),
    ("dense", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "matmul", "quant")),
)
STAGES = {"EXTEND": "prefill", "DECODE": "decode"}


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((cat for cat, fragments in RULES if any(f in name for f in fragments)), "other")


def kernel_times(trace: Path) -> Dict[str, float]:
    """Microseconds per kernel name in a torch.profiler chrome trace (``.json`` or ``.json.gz``)."""
    opener = gzip.open if trace.name.endswith(".gz") else open
    with opener(trace, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    times: Dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            times[e.get("name", "?")] += float(e.get("dur", 0.0))
    return dict(times)


def split(times: Dict[str, float], steps: int = 1, listed: int = 5) -> dict:
    """GPU milliseconds in each category (per step, over ``steps``), and the costliest kernels of "other"."""
    per = dict.fromkeys(CATEGORIES, 0.0)
    others = defaultdict(float)
    for name, us in times.items():
        cat = category(name)
        per[cat] += us
        if cat == "other":
            others[name] += us
    out = {f"{cat}_ms": round(per[cat] / 1000 / steps, 4) for cat in CATEGORIES}
    out["other_kernels_ms"] = {name[:120]: round(us / 1000 / steps, 4)
                               for name, us in sorted(others.items(), key=lambda kv: -kv[1])[:listed]}
    return out


def profile_under_load(port: int, load_argv: Sequence[str], out_dir: Path, steps: int = 40,
                       timeout: float = 600) -> Dict[str, dict]:
    """Start SGLang's profiler by stage, run the load (``sglang.bench_serving``'s argv), and return each stage's split
    from the traces the scheduler wrote under ``out_dir``: ``prefill``, the whole of the load's prefill in ms (up to
    ``steps`` prefill batches: the profiler stops at the first decode batch), and ``decode``, ms per step over
    ``steps`` decode steps (the load must decode more than that)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    r = requests.post(f"http://127.0.0.1:{port}/start_profile", timeout=60,
                      json={"output_dir": str(out_dir), "num_steps": steps, "activities": ["GPU"],
                            "profile_by_stage": True, "with_stack": False, "record_shapes": False})
    if r.status_code != 200:
        raise RuntimeError(f"/start_profile answered {r.status_code}: {r.text[:200]}")
    load = subprocess.run(list(load_argv), capture_output=True, text=True, timeout=timeout)
    if load.returncode != 0:
        raise RuntimeError(f"the load under the profiler failed (exit {load.returncode}): "
                           f"{(load.stderr or load.stdout).strip().splitlines()[-1:]}")
    traces = wait_for_traces(out_dir, deadline=time.monotonic() + 120)
    return {STAGES[stage]: {**split(kernel_times(path), steps if stage == "DECODE" else 1), "trace": path.name}
            for stage, path in traces.items()}


def wait_for_traces(out_dir: Path, deadline: float) -> Dict[str, Path]:
    """The prefill and decode traces, once both are written and no longer growing (the scheduler exports them after
    its last profiled step)."""
    found: Dict[str, Path] = {}
    sizes: Optional[List[int]] = None
    while time.monotonic() < deadline:
        found = {stage: p for stage in STAGES for p in out_dir.glob(f"*-{stage}.trace.json*")}
        now = [p.stat().st_size for p in found.values()]
        if len(found) == len(STAGES) and now == sizes:
            return found
        sizes = now
        time.sleep(2)
    raise RuntimeError(f"the profiler wrote {sorted(p.name for p in found.values()) or 'no trace'} in {out_dir}; "
                       "both a prefill and a decode trace were expected")
