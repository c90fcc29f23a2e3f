"""What SGLang's loader wrote into each MXFP8 layer since its last post-load step: the load tracker wraps every
parameter's ``weight_loader`` (the SGLang seam a load passes through), refuses a tensor of the wrong dtype or a scale
of the wrong shape before it is copied, quantizes a trainer's float tensor where the parameter lives, and tells
post-load processing whether a weight arrived without its scale."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Dict, Optional

import torch

from ..format.checkpoint import scale_shape
from ..format.numerics import MX_BLOCK, ScaleRounding, quantize_mxfp8

FLOAT_WEIGHTS = (torch.bfloat16, torch.float16, torch.float32)  # a trainer's weights, quantized on arrival


class LoadClock:
    """Seconds one load spent in the MXFP8 parameters' loaders, summed over layers (the load's time line reads them):
    copying tensors into the parameters, and quantizing a trainer's float tensors first (the quantizing kernels' GPU
    time, read without waiting on each); and the GPU memory allocated since the reset, at its peak, above what was
    allocated then."""

    copy_s = 0.0
    _quantize_s = 0.0
    _events: list = []
    _allocated = 0

    @classmethod
    def reset(cls) -> None:
        cls.copy_s = cls._quantize_s = 0.0
        cls._events = []
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
            cls._allocated = torch.cuda.memory_allocated()

    @classmethod
    def peak_gib(cls) -> float:
        """GiB allocated above the reset's, at the peak since (0 without a GPU)."""
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return 0.0
        return max(0, torch.cuda.max_memory_allocated() - cls._allocated) / 2**30

    @classmethod
    @contextlib.contextmanager
    def quantizing(cls, device: torch.device):
        """Count the block's work as quantizing: on a GPU its kernels' time between two events, on the host the
        block's."""
        if device.type != "cuda":
            start = time.perf_counter()
            yield
            cls._quantize_s += time.perf_counter() - start
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        cls._events.append((begin, end))

    @classmethod
    def quantize_s(cls) -> float:
        """Seconds spent quantizing since the reset (waits for the last quantizing kernel)."""
        if cls._events:
            cls._events[-1][1].synchronize()
            cls._quantize_s += sum(begin.elapsed_time(end) for begin, end in cls._events) / 1e3
            cls._events = []
        return cls._quantize_s

class _Learning(threading.local):
    """The tensor the model is loading now while :mod:`.direct` learns where tensors land, and the load tracker's calls
    with it (None: nothing is being learned)."""

    tensor: Optional[torch.Tensor] = None
    calls: Optional[list] = None


LEARNING = _Learning()


class LoadTracker:
    """Which shards SGLang's loader wrote into a weight and into its scale since the last post-load step.

    A refit checkpoint that lacks a scale tensor (or has a scale without its weight) leaves the previous
    tensor in memory, and nothing in memory tells that apart from a good load; only the loader's calls
    do. The tracker wraps each parameter's ``weight_loader`` and records a key per call (shard and
    expert ids) with the tensor's shape; a scale whose shape does not fit its weight ([N, K] ->
    [N, K/32]) or a tensor of the wrong dtype is refused before it is copied; :meth:`check` compares
    the two key sets and then forgets them.

    A BF16, FP16 or FP32 tensor for an MXFP8 weight (a trainer's weights, through SGLang's
    ``update_weights_from_tensor``) is quantized where the parameter lives, with the converter's numbers and the
    checkpoint's scale rounding, and loaded as the weight and its scale a checkpoint would have held: what
    ``sglang-mxfp8 convert`` writes for that tensor, nothing of the float tensor kept.
    """

    def __init__(self, name: str, pairs: Dict[str, tuple], scale_name: str = "weight_scale_inv",
                 rounding: ScaleRounding = "ceil"):
        """``pairs``: label -> (weight parameter, scale parameter), e.g. {"": (w, s)} or {"w13": ...};
        ``scale_name``: the scale's name in the checkpoint; ``rounding``: the scale rounding its converter used."""
        self.name, self.pairs, self.scale_name, self.rounding = name, pairs, scale_name, rounding
        self.seen: Dict[tuple, Dict[tuple, torch.Size]] = {}
        for label, (weight, scale) in pairs.items():
            for kind, param in (("weight", weight), ("scale", scale)):
                self._wrap(param, (label, kind))

    def _wrap(self, param: torch.nn.Parameter, slot: tuple) -> None:
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        attr = "_weight_loader" if hasattr(param, "_weight_loader") else "weight_loader"
        original: Callable = getattr(param, attr, None) or default_weight_loader
        seen = self.seen.setdefault(slot, {})
        expected = param.dtype
        label, kind = slot
        partner = (label, "scale" if kind == "weight" else "weight")
        tensor = self._weight_name(label)

        def weight_loader(p, loaded_weight, *args, **kwargs):
            if kind == "weight" and loaded_weight.dtype in FLOAT_WEIGHTS and expected == torch.float8_e4m3fn:
                return self._load_quantized(label, p, loaded_weight, args, kwargs)
            if loaded_weight.dtype != expected:  # copy_ would cast it silently into garbage
                raise ValueError(
                    f"{tensor}{'' if kind == 'weight' else ' scale'}: checkpoint tensor is {loaded_weight.dtype}, "
                    f"expected {expected} for an MXFP8 checkpoint; convert the BF16 checkpoint with "
                    "`sglang-mxfp8 convert`"
                )
            # the tensor's own name (args holding a '.') differs between weight and scale; ids do not
            key = tuple(a for a in args if not (isinstance(a, str) and "." in a))
            key += tuple(kwargs.get(k) for k in ("shard_id", "loaded_shard_id", "expert_id"))
            seen[key] = loaded_weight.shape
            other = self.seen[partner].get(key)
            if other is not None:
                w, sc = (loaded_weight.shape, other) if kind == "weight" else (other, loaded_weight.shape)
                if w[-1] % MX_BLOCK or tuple(sc) != (*w[:-1], w[-1] // MX_BLOCK):
                    raise ValueError(
                        f"{tensor}{_ids([key])}: weight {list(w)} needs a scale of shape {scale_shape(w)} (one per "
                        f"{MX_BLOCK} along K), the checkpoint has {list(sc)}"
                    )
            start, given = time.perf_counter(), loaded_weight
            if p.is_cuda and not loaded_weight.is_cuda and loaded_weight.is_pinned():
                # a page-locked read (format.reader): its copy to the GPU queued, not waited for, so the loader's next
                # tensor overlaps it (torch's pinned allocator keeps the buffer until the copy is done)
                loaded_weight = loaded_weight.to(p.device, non_blocking=True)
            if LEARNING.calls is not None:
                LEARNING.calls.append((given is LEARNING.tensor, p, loaded_weight, self, slot, key))
            try:
                return original(p, loaded_weight, *args, **kwargs)
            finally:
                LoadClock.copy_s += time.perf_counter() - start

        setattr(param, attr, weight_loader)

    def _load_quantized(self, label: str, param, loaded_weight: torch.Tensor, args: tuple, kwargs: dict):
        """A float tensor for an MXFP8 weight: quantized on the parameter's device, then the weight and its scale
        loaded through their own (wrapped) loaders with the same shard and expert ids, the scale under its name."""
        if loaded_weight.shape[-1] % MX_BLOCK:
            raise ValueError(f"{self._weight_name(label)}: a {loaded_weight.dtype} tensor of shape "
                             f"{list(loaded_weight.shape)} cannot be MXFP8 (K not a multiple of {MX_BLOCK}); keep this "
                             "layer BF16 (modules_to_not_convert)")
        with LoadClock.quantizing(param.device):
            src = loaded_weight.to(param.device)
            if src.is_cuda:  # one Triton pass, byte for byte the torch steps below (tests/gpu checks every BF16 value)
                from ..ops.mxfp8_quant import quantize_mxfp8 as quantize_on_gpu

                q, scale = quantize_on_gpu(src, self.rounding)
            else:
                q, scale = quantize_mxfp8(src, self.rounding)
        scale_param = self.pairs[label][1]
        # the tensor's name, where the loader takes one (a MoE's "...experts.w13_weight"): its scale's
        scale_args = tuple(a[: -len("weight")] + self.scale_name if isinstance(a, str) and a.endswith("weight") else a
                           for a in args)
        scale_param.weight_loader(scale_param, scale, *scale_args, **kwargs)
        return param.weight_loader(param, q, *args, **kwargs)

    def _weight_name(self, label: str) -> str:
        return f"{self.name}.{label}_weight" if label else f"{self.name}.weight"

    def check(self) -> None:
        """Raise if a weight shard was loaded without its scale, or the other way round; then reset."""
        try:
            for (label, kind), loaded in self.seen.items():
                if kind != "weight":
                    continue
                keys, scales = set(loaded), set(self.seen[(label, "scale")])
                tensor = self._weight_name(label)
                if keys - scales:
                    raise ValueError(
                        f"{tensor}: the checkpoint loaded this weight{_ids(keys - scales)} without its scale "
                        "tensor; an MXFP8 weight needs its uint8 [N, K/32] scale in the same load"
                    )
                if scales - keys:
                    raise ValueError(
                        f"{tensor}: the checkpoint loaded the scale{_ids(scales - keys)} without the weight; "
                        "load both together"
                    )
        finally:
            self.reset()

    def reset(self) -> None:
        """Forget recorded loads (also those of a load that raised before its post-processing ran)."""
        for keys in self.seen.values():
            keys.clear()


def _ids(keys) -> str:
    """' (shards ...)' naming up to three shard/expert keys; empty for an unsharded tensor."""
    named = sorted((tuple(x for x in k if x is not None) for k in keys), key=str)
    named = [k for k in named if k]
    if not named:
        return ""
    more = f" and {len(named) - 3} more" if len(named) > 3 else ""
    return " (shards " + ", ".join(str(k) for k in named[:3]) + more + ")"

