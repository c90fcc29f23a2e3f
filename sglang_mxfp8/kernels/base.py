"""The interface every MXFP8 kernel implements, and the per-layer :class:`Plan` the registry builds from them.

A kernel is one class (``kernels/linear/*.py``, ``kernels/moe/*.py``) with

- ``is_supported(gpu, settings) -> (ok, why)``: the architecture, the libraries it needs, not disabled;
- ``can_implement(spec) -> (ok, why)``: the layer's shape and dtype, checked by the kernel itself;
- ``create_buffers(layer, spec, state)``: derived tensors, allocated once, kept in the layer's state object;
- ``process_weights_after_loading(layer, state, *scales)``: idempotent, in place (after every load and refit);
- ``apply(...)``: the layer's forward for the batches its plan gives it;
- ``precompile(layer, state, min_m, max_m)``: compile what batches of min_m..max_m tokens will run.

A plan holds one *base* kernel, which owns the layer's weight layout and serves every batch no other entry takes,
and any number of band kernels before it (one-token GEMVs, prefill GEMMs) that read the base kernel's layout.
"""

from __future__ import annotations

import functools
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..flags import DENSE_FLAG, MOE_FLAG  # noqa: F401 - the kernels' error lines name them
from ..platform import GpuSpec
from ..settings import DISABLED_KERNELS_ENV, Settings

logger = logging.getLogger("sglang_mxfp8")

Check = Tuple[bool, str]
OK: Check = (True, "")


class Mxfp8ConfigError(ValueError):
    """An MXFP8 layer, flag or GPU combination that cannot run (the message is one line)."""


@functools.lru_cache(maxsize=None)
def log_once(level: int, message: str) -> None:
    """Log ``message`` once per process (plans repeat per layer; their explanation need not)."""
    logger.log(level, message)


@dataclass(frozen=True)
class LinearSpec:
    """One MXFP8 linear layer as SGLang builds it (q/k/v and gate/up fused; one rank's shard)."""

    name: str
    n: int
    k: int
    dtype: torch.dtype = torch.bfloat16  # the model's activation dtype

    @property
    def shape(self) -> str:
        return f"dense [{self.n} x {self.k}]"

    def __str__(self) -> str:
        return f"{self.name} [{self.n} x {self.k}]"


@dataclass(frozen=True)
class MoESpec:
    """One MXFP8 fused-MoE layer (w13 [E, 2I, H], w2 [E, H, I]); ``intermediate``: I on this rank, after tensor
    parallelism split it ``tp`` ways. ``non_standard``: why the layer's experts are not SiLU-gated experts combined
    by the router weights on all experts of this rank (what our own MoE kernels compute), or None."""

    name: str
    experts: int
    hidden: int
    intermediate: int
    tp: int = 1
    ep: int = 1
    dtype: torch.dtype = torch.bfloat16
    non_standard: Optional[str] = None

    @property
    def shape(self) -> str:
        per_rank = f", {self.intermediate} per rank" if self.tp > 1 else ""
        return f"MoE ({self.experts} experts, hidden {self.hidden}, intermediate {self.intermediate * self.tp}{per_rank})"

    def __str__(self) -> str:
        return f"{self.name} {self.shape.removeprefix('MoE ')}"


class LayerState:
    """A layer's derived tensors and kernel objects (scales in kernel layouts, converters, scratch), allocated once.
    The storage check after each load walks it: :meth:`tensors`."""

    up_first = False  # w13 holds [up; gate] rows (FlashInfer's fused MoE layout) rather than SGLang's [gate; up]

    def tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                yield name, value
            elif hasattr(value, "__dict__"):
                for inner, t in vars(value).items():
                    if isinstance(t, torch.Tensor):
                        yield f"{name}.{inner}", t


class Kernel(ABC):
    """One MXFP8 kernel. Subclasses must say which layers they can run (:meth:`can_implement`) and run them
    (:meth:`apply`); the rest has defaults."""

    name = ""  # what SGLANG_MXFP8_DISABLED_KERNELS and the plans call it
    title = ""  # what it is, in a few words
    archs: Tuple[str, ...] = ()  # GpuSpec.arch values it runs on
    # Hopper: rows of the float32 weight scale blocks it reads (1: per row x 128 columns, 128: 128x128 blocks);
    # a base kernel writes them, a band kernel needs the base kernel's; None: any (or a layout of its own)
    scale_rows: Optional[int] = None
    native = False  # SGLang's own method runs the layer (this package only chooses it)

    def is_supported(self, gpu: GpuSpec, settings: Settings) -> Check:
        if gpu.arch not in self.archs:
            return False, f"runs on {'/'.join(self.archs)}, not {gpu.label}"
        if self.name in settings.disabled_kernels:
            return False, f"{DISABLED_KERNELS_ENV} lists it"
        why = self.missing(gpu) or (None if self.name in settings.enabled_kernels else self.opt_in(gpu))
        return (False, why) if why else OK

    def missing(self, gpu: GpuSpec) -> Optional[str]:
        """Why a library or build this kernel needs is not here, or None."""
        return None

    def opt_in(self, gpu: GpuSpec) -> Optional[str]:
        """Why this kernel runs only where SGLANG_MXFP8_ENABLED_KERNELS names it (not yet run on ``gpu``'s kind of
        GPU), as one line saying how to turn it on; None for a kernel the registry picks by itself."""
        return None

    @abstractmethod
    def can_implement(self, spec) -> Check:
        """Whether this kernel runs the layer ``spec`` describes (its shape and dtype), and why not in one line."""

    @abstractmethod
    def apply(self, layer, state: "LayerState", x: torch.Tensor, *args):
        """The layer's forward for the batches its plan gives this kernel."""

    def layout_mismatch(self, base: "Kernel") -> Optional[str]:
        """Why this band kernel cannot read the weight layout ``base`` writes, or None."""
        if self.scale_rows not in (None, base.scale_rows):
            return f"reads {self.scale_rows}-row weight scale blocks; {base.name} writes {base.scale_rows}"
        return None

    def create_buffers(self, layer: torch.nn.Module, spec, state: LayerState) -> None:
        pass

    def process_weights_after_loading(self, layer: torch.nn.Module, state: LayerState, *scales: torch.Tensor):
        """The base kernel's: the loaded weight(s) and their MXFP8 scales into its layout; returns ConversionStats
        (or a list of them)."""
        return None

    def precompile(self, layer: torch.nn.Module, state: LayerState, min_m: int, max_m: int) -> Optional[int]:
        return None

    def prebuild(self) -> None:
        """Compile, CPU only, the JIT module this kernel loads (into the library's cache), so that a launch can
        start it in the background before the model loads."""

    def compile_ahead(self, spec, min_m: int, max_m: int, num_sms: int, jobs: Optional[int] = None) -> int:
        """Compile, CPU only, the kernels this kernel would compile on first use for batches of min_m..max_m tokens of
        a layer (into the library's cache, where a server reads them back); returns how many it compiled."""
        return 0

    def __repr__(self) -> str:
        return self.name



def with_jit_modules(kernels: Iterable[Kernel]) -> List[Kernel]:
    """Each of ``kernels`` that builds a JIT module (its own :meth:`Kernel.prebuild`), once."""
    return list({k.name: k for k in kernels if type(k).prebuild is not Kernel.prebuild}.values())

class LinearKernel(Kernel):
    def apply(self, layer, state: LayerState, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        out = self.gemm(layer, state, x2, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @abstractmethod
    def gemm(self, layer, state: LayerState, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x [M, K] contiguous -> [M, N]."""


class MoEKernel(Kernel):
    up_proj_first = False  # as a base kernel: w13 loaded as [up; gate] (SGLang's loader reads load_up_proj_weight_first)
    any_w13_order = False  # as a band kernel: reads w13 in either order (the base's, from state.up_first)
    scales_output = False  # applies the router's routed_scaling_factor itself

    def layout_mismatch(self, base: Kernel) -> Optional[str]:
        why = super().layout_mismatch(base)
        if why is None and getattr(base, "up_proj_first", False) and not (self.up_proj_first or self.any_w13_order):
            why = f"reads w13 as [gate; up]; {base.name} loads it as [up; gate]"
        return why

    def create_runner(self, layer, state: LayerState, moe_runner_config) -> None:
        pass

    def apply(self, layer, state: LayerState, x: torch.Tensor, dispatch_output, moe_runner_config) -> torch.Tensor:
        topk_weights, topk_ids, _ = dispatch_output.topk_output
        out = self.experts(layer, state, x, topk_weights, topk_ids)
        if not self.scales_output and moe_runner_config.routed_scaling_factor is not None:
            out *= moe_runner_config.routed_scaling_factor
        return out

    @abstractmethod
    def experts(self, layer, state: LayerState, x, topk_weights, topk_ids) -> torch.Tensor:
        """x [M, H], the routing [M, top_k] -> the layer's output [M, H]."""


class NativeKernel(Kernel):
    """A kernel SGLang's own method runs: this package only chooses it, so it never runs through a plan."""

    native = True

    def apply(self, layer, state, x, *args):
        raise RuntimeError(f"{self.name}: SGLang's own method runs this layer, not a sglang_mxfp8 plan")


class Cite(NamedTuple):
    """A benchmark row behind a registry choice (``benchmarks/results/*.jsonl``): routine, shape, tokens, kernel."""

    routine: str
    shape: str
    tokens: int
    kernel: str


@dataclass(frozen=True)
class Entry:
    """One line of a registry priority list: a kernel for batches of min_m..max_m tokens (None: no upper bound).
    ``with_base``: used only beside that base kernel (a band measured against it); ``fallback``: the flag did not
    ask for it, so taking it is announced; ``measured``: the benchmark rows behind the band or shape list."""

    kernel: Kernel
    min_m: int = 1
    max_m: Optional[int] = None
    with_base: Optional[str] = None
    fallback: bool = False
    measured: Tuple[Cite, ...] = field(default=(), compare=False)

    @property
    def is_base(self) -> bool:
        return self.min_m == 1 and self.max_m is None

    def takes(self, m: int) -> bool:
        return self.min_m <= m and (self.max_m is None or m <= self.max_m)

    def band(self) -> str:
        if self.is_base:
            return "other batches"
        if self.max_m is None:
            return f"{self.min_m}+ tokens"
        return f"{self.min_m} token" if self.min_m == self.max_m == 1 else (
            f"{self.min_m}-{self.max_m} tokens" if self.min_m != self.max_m else f"{self.min_m} tokens")


@dataclass(frozen=True)
class Plan:
    """The kernels of one layer, per batch size: ``entries`` in priority order, the base kernel last."""

    spec: Any
    gpu: GpuSpec
    flag: str
    entries: Tuple[Entry, ...]
    skipped: Tuple[Tuple[Entry, str], ...] = field(default=(), compare=False)

    @property
    def base(self) -> Kernel:
        return self.entries[-1].kernel

    @property
    def fallback(self) -> bool:
        return self.entries[-1].fallback

    def kernel_for(self, m: int) -> Kernel:
        return next(e.kernel for e in self.entries if e.takes(m))

    def bands(self) -> Dict[str, str]:
        """{band: kernel name}, e.g. {"1 token": "gemv", "1024+ tokens": "deepgemm", "other batches": ...}."""
        return {e.band(): e.kernel.name for e in self.entries}

    def ranges(self, max_m: int) -> List[Tuple[Entry, int, int]]:
        """(entry, smallest, largest batch it serves) for batches of 1..max_m tokens, entries that serve none left out."""
        edges = sorted({1, max_m + 1} | {m for e in self.entries for m in (e.min_m, (e.max_m or max_m) + 1)
                                         if 1 <= m <= max_m + 1})
        served: Dict[int, List[int]] = {}
        for lo, nxt in zip(edges, edges[1:]):  # between two band edges one entry takes every batch
            i = next(i for i, e in enumerate(self.entries) if e.takes(lo))
            served.setdefault(i, [lo, nxt - 1])[1] = nxt - 1
        return [(self.entries[i], lo, hi) for i, (lo, hi) in sorted(served.items())]

    # -- what the layer runs -------------------------------------------------------------------------------------
    def create_buffers(self, layer: torch.nn.Module) -> LayerState:
        state = LayerState()
        for e in reversed(self.entries):  # the base kernel's layout first: band kernels read it
            e.kernel.create_buffers(layer, self.spec, state)
        return state

    def process_weights_after_loading(self, layer: torch.nn.Module, state: LayerState, *scales: torch.Tensor):
        return self.base.process_weights_after_loading(layer, state, *scales)

    def precompile(self, layer: torch.nn.Module, state: LayerState, max_m: int) -> None:
        for e, lo, hi in self.ranges(max_m):
            e.kernel.precompile(layer, state, lo, hi)

    def apply(self, layer, state: LayerState, x: torch.Tensor, *args):
        """The only batch-size dispatch: the first entry whose band holds this batch's tokens runs it."""
        return self.kernel_for(x.numel() // x.shape[-1]).apply(layer, state, x, *args)

    # -- what it says ------------------------------------------------------------------------------------------------
    def table(self, width: int = 100, indent: str = "    ") -> List[str]:
        """The plan as a short table for a terminal of ``width`` columns: the kernel of each batch band, then each
        kernel passed over and why."""
        import textwrap

        served = {id(e) for e, _, _ in self.ranges(1 << 20)}
        rows = []
        for e in self.entries:
            note = e.kernel.title + (", as a fallback" if e.fallback else "")
            if e is self.entries[-1] and id(e) not in served:
                note = "owns the weight layout; every batch goes to a kernel above"
            rows.append((e.band(), e.kernel.name, note))
        band_w = max(len(r[0]) for r in rows)
        name_w = max(len(r[1]) for r in rows)
        lines = []
        for band, name, note in rows:
            head = f"{indent}{band:<{band_w}}  {name:<{name_w}}  "
            lines += textwrap.wrap(note, width, initial_indent=head, subsequent_indent=" " * len(head)) or [head]
        if self.skipped:
            lines.append(f"{indent}passed over:")
            for e, why in self.skipped:
                lines += textwrap.wrap(f"{e.kernel.name}: {why}", width, initial_indent=indent + "  ",
                                       subsequent_indent=indent + "    ")
        return lines

    def explain(self, skipped: bool = True, with_spec: bool = True) -> str:
        """One line: the kernel per batch band, then (``skipped``) why each kernel passed over was."""
        runs = "; ".join(f"{e.band()}: {e.kernel.name}" for e in self.entries)
        line = f"{runs} ({self.base.title}{', as a fallback' if self.fallback else ''})"
        line = f"{self.spec}: {line}" if with_spec else line
        if skipped and self.skipped:
            line += " [not " + "; not ".join(f"{e.kernel.name}: {why}" for e, why in self.skipped) + "]"
        return line


def select(spec, gpu: GpuSpec, flag: str, candidates: Sequence[Entry], settings: Settings, bands: bool = True) -> Plan:
    """The plan for ``spec`` from one priority list: the base is the first whole-range entry that is supported and
    can implement the layer; before it, every band entry that is, that reads the base kernel's scale layout and,
    where it names one, sits beside its base kernel (``bands=False``: the base alone, no band kernel probed).
    Raises Mxfp8ConfigError when no base kernel can run."""
    verdicts: Dict[int, Check] = {}

    def verdict(e: Entry) -> Check:
        if id(e) not in verdicts:
            ok, why = e.kernel.is_supported(gpu, settings)
            verdicts[id(e)] = e.kernel.can_implement(spec) if ok else (ok, why)
        return verdicts[id(e)]

    base_at = next((i for i, e in enumerate(candidates) if e.is_base and verdict(e)[0]), None)
    if base_at is None:
        reasons = "; ".join(f"{e.kernel.name}: {verdict(e)[1]}" for e in candidates if e.is_base)
        raise Mxfp8ConfigError(f"{spec}: no MXFP8 kernel for this layer on {gpu.label} with flag {flag} ({reasons})"
                               + ("" if "; " in reasons else "; keep this layer BF16 (modules_to_not_convert)"))
    base = candidates[base_at]
    chosen, skipped = [], []
    for e in candidates[:base_at] if bands else ():
        if e.with_base not in (None, base.kernel.name):
            continue
        taken = next((c for c in chosen if c.min_m <= e.min_m and (c.max_m is None or (
            e.max_m is not None and e.max_m <= c.max_m))), None)
        if taken is not None:
            if taken.kernel.name != e.kernel.name:
                skipped.append((e, f"its batches go to {taken.kernel.name}"))
            continue
        ok, why = verdict(e)
        mismatch = e.kernel.layout_mismatch(base.kernel) if ok else None
        if mismatch:
            ok, why = False, mismatch
        (chosen.append(e) if ok else skipped.append((e, why)))
    return Plan(spec, gpu, flag, tuple(chosen) + (base,), tuple(skipped))


_PRECOMPILED: set = set()


def precompile_batches(key: tuple, label: str, ms: Sequence[int], device, make: Callable[[int], Any],
                       run: Callable[[Any, int], None]) -> Optional[int]:
    """Run ``run(inputs, m)`` once per batch size in ``ms`` (``inputs = make(max(ms))``), so that every tile config
    those batches select is compiled now rather than when a served batch first needs it; once per ``key`` and
    process. Frees its inputs before SGLang sizes its KV cache from the free memory. Returns how many ran, or None."""
    if key in _PRECOMPILED or not ms:
        return None
    _PRECOMPILED.add(key)
    from tqdm import tqdm

    start = time.perf_counter()
    inputs = make(max(ms))
    for m in tqdm(ms, desc=f"sglang_mxfp8: {label}", leave=False):
        run(inputs, m)
    torch.cuda.synchronize(device)
    del inputs
    torch.cuda.empty_cache()
    logger.info("sglang_mxfp8: %s: ran %d batch sizes (%d..%d tokens) in %.1f s", label, len(ms), min(ms), max(ms),
                time.perf_counter() - start)
    return len(ms)


def compile_before_flashinfer(shape, configs) -> None:
    """Compile the kernels of ``shape`` at ``configs`` that FlashInfer's cache lacks with concurrent nvcc processes
    (SGLANG_MXFP8_COMPILE_JOBS; 0: none), before running batches makes FlashInfer compile them one after another;
    any failure leaves them to FlashInfer, with one warning."""
    from ..ops.flashinfer_jit import tile_configs
    from ..settings import current as current_settings

    jobs = current_settings().compile_jobs
    if jobs == 0:
        return
    try:
        tile_configs.compile_tile_configs(shape, configs, jobs)
    except (tile_configs.KernelCompileError, OSError) as e:
        log_once(30, f"sglang_mxfp8: FlashInfer SM90 GEMM kernels not compiled concurrently ({e}); FlashInfer "
                     "compiles them itself, one after another")
