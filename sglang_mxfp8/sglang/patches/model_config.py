"""``model_config.*``: ModelOpt ``quant_algo: MXFP8`` read as MXFP8 (SGLang 0.5.10.post1 to 0.5.20 read it as
per-tensor FP8; 0.5.23 reads it itself, and its own reading is kept), and SGLang's note that MXFP8 "is not fully
optimized yet" (its own MXFP8 path) replaced by one line saying which kernels serve it."""

from __future__ import annotations

import functools
import logging

from ...format import checkpoint
from ..patching import KEPT, MISSING, replace, target

logger = logging.getLogger("sglang_mxfp8")

MODELOPT_MXFP8_PROBE = {"quant_method": "modelopt", "quant_algo": "MXFP8", "exclude_modules": ["lm_head"]}
SGLANG_NOTE = "mxfp8 quantization is not fully optimized yet"  # the start of SGLang's warning (0.5.10.post1 to 0.5.23)
OUR_NOTE = ("sglang_mxfp8: MXFP8 layers run sglang_mxfp8's kernels for this GPU; each layer kind's plan is logged as "
            "the model is built")


def reads_modelopt_mxfp8(parse) -> bool:
    """Whether SGLang's own ``ModelConfig._parse_modelopt_quant_config`` reads ModelOpt MXFP8 as MXFP8."""
    try:
        parsed = parse(None, dict(MODELOPT_MXFP8_PROBE))
    except Exception:  # noqa: BLE001 - a parser that needs a real ModelConfig: assume the old reading
        return False
    return isinstance(parsed, dict) and parsed.get("quant_method") == "mxfp8"


def read_modelopt_mxfp8() -> None:
    from sglang.srt.configs import model_config

    patch = "model_config.modelopt_mxfp8"
    cls = target(model_config, "ModelConfig", patch)
    original = target(cls, "_parse_modelopt_quant_config", patch) if cls is not None else None
    if original is None or getattr(original, "__sglang_mxfp8_patch__", None) == patch:
        return
    if reads_modelopt_mxfp8(original):
        KEPT[patch] = "SGLang reads ModelOpt MXFP8 itself"
        return

    def make(original):
        @functools.wraps(original)
        def _parse_modelopt_quant_config(self, quant_config_dict):
            if checkpoint.is_modelopt_mxfp8(quant_config_dict):
                return {"quant_method": "mxfp8", "quant_algo": "MXFP8"}
            return original(self, quant_config_dict)

        return _parse_modelopt_quant_config

    replace(cls, "_parse_modelopt_quant_config", patch, make)


class _SglangNote(logging.Filter):
    """Drops SGLang's MXFP8 note (and counts it); lets every other record through."""

    def __init__(self):
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(SGLANG_NOTE):
            self.dropped += 1
            return False
        return True


def without_sglangs_note(verify, module_logger: logging.Logger):
    """``ModelConfig._verify_quantization`` with SGLang's MXFP8 note replaced by ours, where every patch applied
    (else SGLang's own MXFP8 path may serve, and its note stands)."""

    @functools.wraps(verify)
    def _verify_quantization(self, *args, **kwargs):
        if MISSING:
            return verify(self, *args, **kwargs)
        note = _SglangNote()
        module_logger.addFilter(note)
        try:
            return verify(self, *args, **kwargs)
        finally:
            module_logger.removeFilter(note)
            if note.dropped:
                logger.info(OUR_NOTE)

    return _verify_quantization


def say_what_serves_mxfp8() -> None:
    from sglang.srt.configs import model_config

    patch = "model_config.mxfp8_notice"
    cls = target(model_config, "ModelConfig", patch)
    replace(cls, "_verify_quantization", patch,
            lambda original: without_sglangs_note(original, logging.getLogger(model_config.__name__)))
