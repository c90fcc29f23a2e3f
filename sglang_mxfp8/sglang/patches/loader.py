"""``loader.*``: a ModelOpt MXFP8 checkpoint described only by hf_quant_config.json gets :class:`Mxfp8Config`
(SGLang's ``get_quant_config`` finds no quantization_config in config.json and would build an online-quantization
config for it); an MXFP8 model's tensors copied straight where they land once a load has shown where
(:mod:`..direct`); and after each (re)load one line on what the conversion changed and whether every MXFP8 tensor
kept its storage."""

from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import Path

from ...format import checkpoint
from ..patching import replace, target

logger = logging.getLogger("sglang_mxfp8")


def read_hf_quant_config() -> None:
    from sglang.srt.model_loader import loader

    from ..quant_methods import Mxfp8Config

    def make(original):
        @functools.wraps(original)
        def get_quant_config(model_config, load_config, packed_modules_mapping, *args, **kwargs):
            hf_quant = Path(model_config.model_path) / "hf_quant_config.json"
            if (model_config.quantization == "mxfp8" and hf_quant.is_file()
                    and getattr(model_config.hf_config, "quantization_config", None) is None):
                cfg = json.loads(hf_quant.read_text())
                if checkpoint.is_modelopt_mxfp8(cfg):
                    return Mxfp8Config.from_config({**cfg, "packed_modules_mapping": packed_modules_mapping})
            return original(model_config, load_config, packed_modules_mapping, *args, **kwargs)

        return get_quant_config

    replace(loader, "get_quant_config", "loader.modelopt_mxfp8_file", make)


def report_each_load() -> None:
    from sglang.srt.model_loader import loader

    from ..direct import copy_directly
    from ..loads import LoadClock
    from ..quant_methods import ConversionReport
    from ..weights import check_storage, mxfp8_modules, warm_refit_kernels

    cls = target(loader, "DefaultModelLoader", "loader.conversion_report")

    def make(original):
        @functools.wraps(original)
        def load_weights_and_postprocess(model, weights, target_device):
            ConversionReport.reset()
            LoadClock.reset()
            for module in model.modules():  # a failed load before this one may have left records behind
                tracker = getattr(module, "mxfp8_loads", None)
                if tracker is not None:
                    tracker.reset()
            if next(mxfp8_modules(model), None) is not None:
                copy_directly(model)
            start = time.perf_counter()
            original(model, weights, target_device)
            if ConversionReport.total:
                logger.info(ConversionReport.line())
                logger.info(ConversionReport.time_line(time.perf_counter() - start))
            LoadClock.reset()  # a tensor update's line counts its own copies only
            check_storage(model)
            warm_refit_kernels(model)

        return load_weights_and_postprocess

    replace(cls, "load_weights_and_postprocess", "loader.conversion_report", make)


def read_refits_pinned() -> None:
    """A refit of an MXFP8 model from disk reads its checkpoint with :func:`...format.reader.read_tensors` (page-locked
    where a GPU is, several reads ahead of the loader) wherever SGLang would read safetensors files; any other load, or
    a file with a dtype the reader does not know, reads as shipped."""
    import torch
    from sglang.srt.model_loader import loader

    from ...format.reader import Buffers, UnreadableTensor, read_tensors, tensor_entries
    from ..weights import REFIT_READS

    def make(original):
        @functools.wraps(original)
        def weights_iterator(hf_weights_files, *args, **kwargs):
            if REFIT_READS.active:
                try:
                    for path in hf_weights_files:
                        tensor_entries(path)
                except UnreadableTensor as e:
                    logger.info("sglang_mxfp8: %s; SGLang reads this refit's files", e)
                else:
                    pinned = torch.cuda.is_available()
                    buffers = Buffers(pinned)
                    tensors = read_tensors(list(hf_weights_files), pinned=pinned, buffers=buffers)
                    return _page_locking_logged(tensors, buffers) if pinned else tensors
            return original(hf_weights_files, *args, **kwargs)

        return weights_iterator

    for name in ("buffered_multi_thread_safetensors_weights_iterator", "safetensors_weights_iterator"):
        if hasattr(loader, name):
            replace(loader, name, f"loader.pinned_refit_reads.{name}", make)


def _page_locking_logged(tensors, buffers):
    """``tensors``, then one line where the read page-locked new memory (torch keeps it for the next refits: the
    first refit after a start pays for it), and a warning where refit reads reached their cap on page-locking."""
    import torch

    def alloc_s() -> float:
        stats = getattr(torch.cuda, "host_memory_stats", None)
        return (stats() if stats else {}).get("host_alloc_time.total", 0) / 1e6

    before = alloc_s()
    try:
        yield from tensors  # closing or finishing it ends the read first: buffers.grown is known below
    finally:
        if buffers.grown > 0:
            logger.info("sglang_mxfp8: this refit page-locked %.0f MiB of new read buffers in %.2f s (kept for the "
                        "next refits; waited %d times for queued copies to free cached ones)", buffers.grown / 2**20,
                        alloc_s() - before, buffers.settled)
        if buffers.pageable:
            logger.warning("sglang_mxfp8: refit reads have page-locked their cap of %.0f MiB and found no free "
                           "page-locked buffer for %.0f MiB of this refit, read into pageable memory instead",
                           buffers.pinned_cap / 2**20, buffers.pageable / 2**20)
