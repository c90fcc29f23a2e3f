"""The per-layer :class:`Plan` the registry builds: a base kernel, which owns the layer's weight layout and serves every
batch no other entry takes, and the band kernels before it that read the base kernel's layout; :func:`select` makes one
from a flag's priority list."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..platform import GpuSpec
from ..settings import Settings
from .base import Check, Kernel, LayerState, Mxfp8ConfigError


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
    ask for it, so taking it is announced; ``measured``: the benchmark rows behind the band or shape list; ``trial``:
    a kernel still without rows, timed by ``sglang-mxfp8 bench layers --all-kernels`` and in no plan."""

    kernel: Kernel
    min_m: int = 1
    max_m: Optional[int] = None
    with_base: Optional[str] = None
    fallback: bool = False
    measured: Tuple[Cite, ...] = field(default=(), compare=False)
    trial: bool = False

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
        """(entry, smallest, largest batch it serves) for batches of 1..max_m tokens, entries that serve none left
        out."""
        edges = sorted({1, max_m + 1} | {m for e in self.entries for m in (e.min_m, (e.max_m or max_m) + 1)
                                         if 1 <= m <= max_m + 1})
        served: Dict[int, List[int]] = {}
        for lo, nxt in zip(edges, edges[1:]):  # between two band edges one entry takes every batch
            i = next(i for i, e in enumerate(self.entries) if e.takes(lo))
            served.setdefault(i, [lo, nxt - 1])[1] = nxt - 1
        return [(self.entries[i], lo, hi) for i, (lo, hi) in sorted(served.items())]

    # -- what the layer runs -------------------------------------------------------------------------------------
    def create_buffers(self, layer: torch.nn.Module) -> LayerState:
        state = self.base.state_type()
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

