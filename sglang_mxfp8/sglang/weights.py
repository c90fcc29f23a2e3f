"""The model's MXFP8 tensors around each load: their storage checked (CUDA graphs keep pointers), post-load
processing run again after weights arrive other than from disk, a failed refit from disk rolled back to the
checkpoint being served, and torch's global state (what torch.compile guards on) kept across every weight update."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, Tuple

import torch

from ..format.checkpoint import refused_checkpoint
from ..compat import model_runner_of

FROM_TENSORS = "_sglang_mxfp8_served_from_tensors"  # set on the model runner: the weights served came as tensors


class _RefitReads(threading.local):
    active = False  # this thread is refitting an MXFP8 model from disk: its checkpoint is read page-locked


REFIT_READS = _RefitReads()


@contextlib.contextmanager
def refit_reads(active: bool = True):
    """With ``active`` (an MXFP8 model's refit), the safetensors files the block loads are read by
    ``format.reader.read_tensors`` (loader.pinned_refit_reads); any other model's refit reads as SGLang ships."""
    REFIT_READS.active = active
    try:
        yield
    finally:
        REFIT_READS.active = False

logger = logging.getLogger("sglang_mxfp8")


def mxfp8_modules(model) -> Iterator[Tuple[str, torch.nn.Module]]:
    """(name, module) of every layer of ``model`` one of our MXFP8 methods serves."""
    from .quant_methods import Mxfp8LinearMethod, Mxfp8MoEMethod

    for name, module in model.named_modules():
        if isinstance(getattr(module, "quant_method", None), (Mxfp8LinearMethod, Mxfp8MoEMethod)):
            yield name, module


def mxfp8_tensors(model) -> dict:
    """Every tensor our methods own in ``model``: parameters, buffers and the tensors of each layer's state."""
    found = {}
    for mod_name, module in mxfp8_modules(model):
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            found[f"{mod_name}.{name}"] = t
        state = getattr(module, "mxfp8_state", None)
        for name, t in (state.tensors() if state is not None else ()):
            found[f"{mod_name}.mxfp8_state.{name}"] = t
    return found


_REFIT_KERNELS_WARM = set()


def warm_refit_kernels(model) -> None:
    """Compile, once per device and process, the Triton kernels a trainer's weight update runs (a bucket's value checks,
    the quantizer of BF16 tensors at the checkpoint's scale rounding), so the first update does not wait seconds for
    the compiler; a kernel that does not build is left to the update (which says so)."""
    from .. import error_line
    from ..ops import mxfp8_quant, value_checks

    first = next(((m.mxfp8_loads.rounding, p.device) for _, m in mxfp8_modules(model)
                  if getattr(m, "mxfp8_loads", None) is not None
                  for p in m.parameters(recurse=False) if p.is_cuda), None)
    if first is None or first in _REFIT_KERNELS_WARM:
        return
    _REFIT_KERNELS_WARM.add(first)
    rounding, device = first
    start = time.perf_counter()
    try:
        flat = torch.zeros(96, dtype=torch.uint8, device=device)
        value_checks.bad_tensors(flat, [flat[:8].view(dtype) for dtype in value_checks.KINDS])
        for rows in (16, 17):  # the block count a multiple of 16 or not: Triton compiles each once
            mxfp8_quant.quantize_mxfp8(torch.zeros(rows, 32, dtype=torch.bfloat16, device=device), rounding)
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - a compiler failure: the update's own fallback says what happens
        logger.warning("sglang_mxfp8: weight-update kernels not compiled ahead (%s)", error_line(e, 200))
        return
    logger.info("sglang_mxfp8: weight-update kernels compiled in %.1f s", time.perf_counter() - start)


def check_storage(model) -> None:
    """Log whether every MXFP8 tensor kept its storage since the first load (CUDA graphs hold pointers)."""
    now = {name: t.data_ptr() for name, t in mxfp8_tensors(model).items()}
    if not now:
        return
    first = getattr(model, "_sglang_mxfp8_storage", None)
    if first is None:
        model._sglang_mxfp8_storage = now
        logger.info("sglang_mxfp8: storage of %d MXFP8 tensors recorded at first load", len(now))
        return
    moved = [name for name, ptr in now.items() if first.get(name) != ptr]
    if moved:
        logger.warning("sglang_mxfp8: %d of %d MXFP8 tensors moved since the first load (first: %s); captured "
                       "CUDA graphs would read stale memory", len(moved), len(now), moved[0])
    else:
        logger.info("sglang_mxfp8: storage of all %d MXFP8 tensors unchanged since the first load", len(now))


def scale_name_of(model) -> Optional[str]:
    """The checkpoint name of the scales of ``model``'s MXFP8 layers (None: the model has none)."""
    return next((module.quant_method.quant_config.scale_name for _, module in mxfp8_modules(model)), None)


def postprocess_mxfp8_modules(model) -> int:
    """Run post-load processing of every sglang_mxfp8 method in ``model`` (after weights sent as tensors), and log
    where the update's time went: its copies since the last post-processing, then this; returns how many ran."""
    from .loads import LoadClock
    from .quant_methods import ConversionReport

    ConversionReport.reset()  # the copies since the last post-processing stay on LoadClock
    start = time.perf_counter()
    count = 0
    for _, module in mxfp8_modules(model):
        module.quant_method.process_weights_after_loading(module)
        count += 1
    if ConversionReport.total:
        logger.info(ConversionReport.line())
        copied_s = LoadClock.copy_s + LoadClock.quantize_s()
        logger.info(ConversionReport.time_line(time.perf_counter() - start + copied_s, "tensor update"))
    LoadClock.reset()
    check_storage(model)
    return count


@contextlib.contextmanager
def torch_state_kept(what: str):
    """torch's global state as it was before the block, whatever the block did or raised: torch.compile guards on it
    (default dtype, grad mode, ...), and a change recompiles SGLang's piecewise CUDA graphs at the next forward, where
    they cannot be captured. The default dtype and grad mode are put back; any other change is logged by name."""
    from torch._C._dynamo.guards import GlobalStateGuard

    guard, dtype, grad = GlobalStateGuard(), torch.get_default_dtype(), torch.is_grad_enabled()
    try:
        yield
    finally:
        if not guard.check():
            changed = guard.reason().strip()
            torch.set_default_dtype(dtype)
            torch.set_grad_enabled(grad)
            if not guard.check():
                logger.error("sglang_mxfp8: %s changed torch's global state (%s); torch.compile will recompile the "
                             "piecewise CUDA graphs", what, guard.reason().strip())
            else:
                logger.warning("sglang_mxfp8: %s changed torch's global state (%s); put back", what, changed)


def refit_rollback(original):
    """Wrap ``ModelRunner.update_weights_from_disk``: a failed refit reloads the checkpoint being served, and the
    served checkpoint stays the one a later rollback reloads, whether the refit raised or answered False; torch's
    global state is kept (:func:`torch_state_kept`)."""

    @functools.wraps(original)
    def update_weights_from_disk(self, model_path, load_format, *args, **kwargs):
        with torch_state_kept("/update_weights_from_disk"):
            return _refit_or_roll_back(original, self, model_path, load_format, *args, **kwargs)

    return update_weights_from_disk


def _refit_or_roll_back(original, self, model_path, load_format, *args, **kwargs):
    """One refit from disk, the checkpoint checked before SGLang loads it (its headers; its values too where the
    weights served came as tensors, which no rollback could reload); on a failure SGLang could not roll back from, the
    served checkpoint reloaded."""
    runner = model_runner_of(self)
    served_path, served_format = self.model_config.model_path, runner.server_args.load_format
    from_tensors = getattr(runner, FROM_TENSORS, False)
    scale_name = scale_name_of(runner.model)
    local, problem = Path(model_path).expanduser(), None
    if scale_name is not None and local.is_dir():
        problem = refused_checkpoint(local, scale_name, values=from_tensors)
    elif scale_name is not None and model_path.startswith(("/", "./", "../", "~")):
        # a path, never a Hugging Face repo id: SGLang would try to download it (and say so as a network error)
        problem = (f"{model_path} is a file; pass the checkpoint's folder" if local.exists() else
                   f"no folder {model_path} on this machine")
    if problem is not None:
        logger.error("sglang_mxfp8: refit from %s refused before loading: %s", model_path, problem)
        return False, f"Failed to update weights: {problem}. Nothing was loaded; the previous weights keep serving."
    try:
        with refit_reads(scale_name is not None):
            ok, message = original(self, model_path, load_format, *args, **kwargs)
        if not ok:  # refused before loading (no such folder, another loader): nothing was read, and SGLang left
            self.model_config.model_path = served_path  # the bad path as the one a later rollback re-reads
        else:
            setattr(runner, FROM_TENSORS, False)
        return ok, message
    except Exception as e:  # noqa: BLE001 - SGLang's own rollback re-read model_path and failed again
        logger.error("sglang_mxfp8: refit from %s failed (%s); reloading %s", model_path, e, served_path)
        try:
            with refit_reads(scale_name is not None):
                ok, message = original(self, served_path, served_format, *args, **kwargs)
        except Exception as again:  # noqa: BLE001 - named below with both paths
            ok, message = False, str(again).splitlines()[0] if str(again) else type(again).__name__
        if not ok:
            raise RuntimeError(f"refit from {model_path} failed ({e}) and so did the rollback to "
                               f"{served_path} ({message}); the weights in memory are inconsistent") from e
        setattr(runner, FROM_TENSORS, False)
        lost = (" The weights last sent as tensors are on no disk: this checkpoint serves now." if from_tensors
                else "")
        return False, f"Failed to update weights: {e}. Rolled back to {served_path}.{lost}"
