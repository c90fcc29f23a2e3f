"""Direct copies: where each checkpoint tensor of an MXFP8 layer lands, learned from the load that wrote it through
SGLang's loaders, so that every later load (a refit from disk, a trainer's tensors) copies it there straight.

A refit of 16 Qwen3-30B-A3B layers carries about 12,500 MXFP8 tensors (each expert's weight and its scale), and SGLang
spends Python on each: the model's name matching against every expert's mapping, FusedMoE's loader, our load tracker.
A landing is learned only where SGLang's loaders did exactly one thing with the tensor: one ``copy_`` of it (or of a
view of it, a tensor-parallel shard) into one MXFP8 parameter, through the load tracker, and nothing else written while
the model handled it. A trainer's BF16 / FP16 / FP32 tensor for an MXFP8 weight is quantized where the weight lives
and lands with its scale, as the load tracker would do it. A tensor with another dtype or shape than the one learned
(a wrong checkpoint) goes through SGLang's loaders as before, with their checks and errors; so does every tensor of a
model whose parameters moved (the landings are views of their storage, which are then forgotten).
``SGLANG_MXFP8_DIRECT_COPIES=0`` sends every tensor through SGLang's loaders."""

from __future__ import annotations

import logging
import time
from typing import Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from ..format.numerics import MX_BLOCK
from .loads import FLOAT_WEIGHTS, LEARNING, LoadClock, LoadTracker

logger = logging.getLogger("sglang_mxfp8")


class Landing(NamedTuple):
    """Where one checkpoint tensor goes: ``dest``, a view of an MXFP8 parameter, takes ``source`` (size, stride and
    element offset of what SGLang copied, relative to the tensor; None: all of it); ``dtype`` and ``shape`` are the
    tensor's; ``key`` is the load tracker's record of it (the post-load check reads it), ``slot`` that record's."""

    dest: torch.Tensor
    source: Optional[Tuple[tuple, tuple, int]]
    dtype: torch.dtype
    shape: torch.Size
    tracker: LoadTracker
    slot: tuple
    key: tuple

    def put(self, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` (this landing's dtype and shape, contiguous) where it lands, and record it."""
        src = tensor if self.source is None else tensor.as_strided(self.source[0], self.source[1],
                                                                   tensor.storage_offset() + self.source[2])
        self.dest.copy_(src, non_blocking=True)  # a page-locked read: queued, and its buffer kept until done
        self.tracker.seen[self.slot][self.key] = self.shape


class _Writes(TorchFunctionMode):
    """Every write the model's loading of one tensor makes: its ``copy_`` calls (destination, source), and whether
    anything else was written in place."""

    def __init__(self):
        super().__init__()
        self.copies: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.other = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func is torch.Tensor.copy_:
            self.copies.append((args[0], args[1]))
        elif (name.endswith("_") and not name.endswith("__")) or name == "__setitem__" or "out" in kwargs:
            self.other = True
        return func(*args, **kwargs)


def _views(tensor: torch.Tensor, of: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() == of.untyped_storage().data_ptr()


def _landing(tensor: torch.Tensor, writes: _Writes, calls: list) -> Optional[Landing]:
    """The landing the model's handling of ``tensor`` shows, if it did exactly one thing: one tracked load of this
    very tensor and one copy of (a view of) it into that parameter."""
    if writes.other or len(writes.copies) != 1 or len(calls) != 1:
        return None
    same, param, copied_from, tracker, slot, key = calls[0]
    dest, src = writes.copies[0]
    if not (same and _views(dest, param) and _views(src, copied_from) and copied_from.is_contiguous()
            and tensor.is_contiguous() and dest.dtype == src.dtype == tensor.dtype and dest.shape == src.shape):
        return None
    offset = src.storage_offset() - copied_from.storage_offset()
    whole = offset == 0 and src.shape == copied_from.shape and src.is_contiguous()
    source = None if whole else (tuple(src.shape), tuple(src.stride()), offset)
    return Landing(dest, source, tensor.dtype, tensor.shape, tracker, slot, key)


QUANTIZE_RUN_ELEMENTS = 1 << 28  # a float run quantized in one pass holds at most this many elements


def _back_to_back(floats: List[tuple]) -> Iterator[List[tuple]]:
    """``floats`` in runs of tensors lying back to back in one storage, of one dtype and scale rounding, up to
    :data:`QUANTIZE_RUN_ELEMENTS` (a larger tensor alone)."""
    run: List[tuple] = []
    size = 0
    for item in floats:
        t = item[0]
        if run:
            last = run[-1][0]
            follows = (t.dtype == last.dtype and item[1].tracker.rounding == run[-1][1].tracker.rounding
                       and t.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()
                       and t.storage_offset() == last.storage_offset() + last.numel())
            if not follows or size + t.numel() > QUANTIZE_RUN_ELEMENTS:
                yield run
                run, size = [], 0
        run.append(item)
        size += t.numel()
    if run:
        yield run


class DirectLoads:
    """Stands in for a model's ``load_weights``: tensors with a landing are copied there, the rest go to the model's
    own ``load_weights`` (whose handling of each teaches a landing where it can)."""

    def __init__(self, load_weights):
        self.load_weights = load_weights
        self.landings: Dict[str, Landing] = {}
        self.storage: Dict[int, Tuple[torch.Tensor, int]] = {}  # id(parameter) -> (parameter, its data_ptr)
        self.direct = self.total = 0

    def __call__(self, weights: Iterable[Tuple[str, torch.Tensor]], *args, **kwargs):
        self._forget_moved()
        self.direct = self.total = 0
        if isinstance(weights, (list, tuple)):  # a tensor update: SGLang's models take it as a list
            floats: List[tuple] = []
            rest = [(name, t) for name, t in weights if not self._copied(name, t, floats)]
            self._quantize(floats)
            result = self.load_weights(rest, *args, **kwargs)
        else:
            stream = self._learning(weights)
            try:
                result = self.load_weights(stream, *args, **kwargs)
            finally:
                stream.close()  # a load that raised: its learning ends here, not when the generator is collected
        if self.direct:
            logger.info("sglang_mxfp8: %d of %d tensors of this load copied straight where they land", self.direct,
                        self.total)
        return result

    def _copied(self, name: str, tensor: torch.Tensor, floats: Optional[list] = None) -> bool:
        """Copy ``tensor`` to its landing; False where it has none, or differs from the tensor it was learned from
        (other than a trainer's float tensor, on the device of an MXFP8 weight whose scale's landing is known too:
        that one is quantized, as the load tracker would, and both copied; queued on ``floats`` where given)."""
        self.total += 1
        landing = self.landings.get(name)
        if landing is None or tensor.shape != landing.shape or not tensor.is_contiguous():
            return False
        if tensor.dtype == landing.dtype:
            start = time.perf_counter()
            landing.put(tensor)
            LoadClock.copy_s += time.perf_counter() - start
        else:
            scale = self._scale_landing(name, tensor, landing)
            if scale is None:
                return False
            if floats is None:
                self._quantize([(tensor, landing, scale)])
            else:
                floats.append((tensor, landing, scale))
        self.direct += 1
        return True

    def _scale_landing(self, name: str, tensor: torch.Tensor, landing: Landing) -> Optional[Landing]:
        """The landing of the scale of the MXFP8 weight ``name``, where ``tensor`` is a trainer's float tensor for it
        on the weight's device and that scale's landing is known."""
        if not (tensor.dtype in FLOAT_WEIGHTS and landing.dtype == torch.float8_e4m3fn and name.endswith("weight")
                and tensor.device == landing.dest.device):
            return None
        scale = self.landings.get(name[: -len("weight")] + landing.tracker.scale_name)
        want = (*tensor.shape[:-1], tensor.shape[-1] // MX_BLOCK)
        return scale if scale is not None and scale.dtype == torch.uint8 and scale.shape == want else None

    @staticmethod
    def _quantize(floats: List[tuple]) -> None:
        """Quantize (tensor, landing, scale landing) items and copy both where they land: tensors lying back to back
        (a trainer's flattened bucket) in one pass over all of them, since no MX block of 32 crosses a row, let alone
        a tensor (a Triton launch per tensor cost more than its work)."""
        if not floats:
            return
        from ..format.numerics import quantize_mxfp8 as quantize_on_host
        from ..ops.mxfp8_quant import quantize_mxfp8 as quantize_on_gpu

        for run in _back_to_back(floats):
            first, rounding = run[0][0], run[0][1].tracker.rounding
            total = sum(t.numel() for t, _, _ in run)
            blocks = first.as_strided((total // MX_BLOCK, MX_BLOCK), (MX_BLOCK, 1))  # every tensor of the run
            with LoadClock.quantizing(first.device):
                q, s = (quantize_on_gpu if first.is_cuda else quantize_on_host)(blocks, rounding)
            q, s = q.view(-1), s.view(-1)
            start, at = time.perf_counter(), 0
            for t, landing, scale in run:
                n = t.numel()
                landing.put(q[at:at + n].view(t.shape))
                scale.put(s[at // MX_BLOCK:(at + n) // MX_BLOCK].view(scale.shape))
                at += n
            LoadClock.copy_s += time.perf_counter() - start

    def _learning(self, weights) -> Iterator[Tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if self._copied(name, tensor):
                continue
            writes, calls = _Writes(), []
            LEARNING.tensor, LEARNING.calls = tensor, calls
            try:
                with writes:
                    yield name, tensor  # the model loads it before it asks for the next
            finally:
                LEARNING.tensor = LEARNING.calls = None
            landing = _landing(tensor, writes, calls)
            if landing is not None:
                self.landings[name] = landing
                param = calls[0][1]
                self.storage[id(param)] = (param, param.data_ptr())

    def _forget_moved(self) -> None:
        moved = [p for p, ptr in self.storage.values() if p.data_ptr() != ptr]
        if moved:
            logger.warning("sglang_mxfp8: %d MXFP8 parameters moved since their tensors' landings were learned; "
                           "this load goes through SGLang's loaders", len(moved))
            self.landings.clear()
            self.storage.clear()


def copy_directly(model: torch.nn.Module) -> None:
    """Make ``model.load_weights`` a :class:`DirectLoads` (once)."""
    from ..settings import current

    if current().direct_copies and not isinstance(model.__dict__.get("load_weights"), DirectLoads):
        model.load_weights = DirectLoads(model.load_weights)
