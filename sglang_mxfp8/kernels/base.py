"""The interface every MXFP8 kernel implements (the per-layer plan the registry builds from them: :mod:`.plan`).

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

import dataclasses
import functools
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Tuple

import torch

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
        return (
            f"MoE ({self.experts} experts, hidden {self.hidden}, intermediate {self.intermediate * self.tp}{per_rank})"
        )

    def __str__(self) -> str:
        return f"{self.name} {self.shape.removeprefix('MoE ')}"


class LayerState:
    """A layer's derived tensors and kernel objects (scales in kernel layouts, converters, scratch), allocated once.
    Each family of base kernels declares its own as a slotted dataclass (its ``state_type``), so a kernel writes only
    the fields its family has. The storage check after each load walks it: :meth:`tensors`."""

    __slots__ = ()

    def tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for field in dataclasses.fields(self):
            name, value = field.name, getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                yield name, value
            elif hasattr(value, "__dict__"):
                for inner, t in vars(value).items():
                    if isinstance(t, torch.Tensor):
                        yield f"{name}.{inner}", t


@dataclass(frozen=True)
class WeightLayout:
    """The weight layout a kernel writes (as a plan's base) or reads (as a band kernel): every kernel of a plan reads
    the one its base wrote, so nothing is converted or stored twice."""

    scale_rows: Optional[int] = None  # Hopper float32 scale blocks: 1 (row x 128 columns), 128 (128x128); None: any
    up_first: bool = False  # MoE w13 as [up; gate] rows (SGLang's loader reads load_up_proj_weight_first)
    either_w13_order: bool = False  # a band MoE kernel reading w13 in the base's order (state.up_first)

    def mismatch(self, base: "WeightLayout", base_name: str) -> Optional[str]:
        """Why a kernel reading this layout cannot run beside the base ``base_name`` writing ``base``, or None."""
        if self.scale_rows not in (None, base.scale_rows):
            return f"reads {self.scale_rows}-row weight scale blocks; {base_name} writes {base.scale_rows}"
        if base.up_first and not (self.up_first or self.either_w13_order):
            return f"reads w13 as [gate; up]; {base_name} loads it as [up; gate]"
        if self.up_first and not (base.up_first or self.either_w13_order):
            return f"reads w13 as [up; gate]; {base_name} loads it as [gate; up]"
        return None


class Kernel(ABC):
    """One MXFP8 kernel. Subclasses must say which layers they can run (:meth:`can_implement`) and run them
    (:meth:`apply`); the rest has defaults."""

    name = ""  # what SGLANG_MXFP8_DISABLED_KERNELS and the plans call it
    title = ""  # what it is, in a few words
    archs: Tuple[str, ...] = ()  # GpuSpec.arch values it runs on
    layout = WeightLayout()  # what it writes as a base kernel, reads as a band kernel
    state_type: type = LayerState  # as a base kernel: the layer state its family's kernels fill
    native = False  # SGLang's own method runs the layer (this package only chooses it)

    def is_supported(self, gpu: GpuSpec, settings: Settings) -> Check:
        if gpu.arch not in self.archs:
            return False, f"runs on {'/'.join(self.archs)}, not {gpu.label}"
        if self.name in settings.disabled_kernels:
            return False, f"{DISABLED_KERNELS_ENV} lists it"
        why = self.missing(gpu)
        return (False, why) if why else OK

    def missing(self, gpu: GpuSpec) -> Optional[str]:
        """Why a library or build this kernel needs is not here, or None."""
        return None

    @abstractmethod
    def can_implement(self, spec) -> Check:
        """Whether this kernel runs the layer ``spec`` describes (its shape and dtype), and why not in one line."""

    @abstractmethod
    def apply(self, layer, state: "LayerState", x: torch.Tensor, *args):
        """The layer's forward for the batches its plan gives this kernel."""

    def layout_mismatch(self, base: "Kernel") -> Optional[str]:
        """Why this band kernel cannot read the weight layout ``base`` writes, or None."""
        return self.layout.mismatch(base.layout, base.name)

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
    scales_output = False  # applies the router's routed_scaling_factor itself (what its output holds, not a layout)

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
