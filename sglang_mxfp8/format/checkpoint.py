"""Recognise MXFP8 checkpoints from their quantization config (no torch, no sglang).

Two formats are MXFP8:
- SGLang / miles: ``quantization_config = {quant_method: mxfp8, fmt: e4m3, weight_block_size: [1, 32],
  scale_fmt: ue8m0, activation_scheme: dynamic, modules_to_not_convert: [...]}``; tensors
  ``weight`` (e4m3) and ``weight_scale_inv`` (uint8 [N, K/32]).
- NVIDIA ModelOpt: ``quant_algo: MXFP8`` (in ``quantization_config`` with ``quant_method: modelopt``,
  or under ``quantization`` in ``hf_quant_config.json``); tensors ``weight`` and ``weight_scale``.
  SGLang 0.5.10.post1 reads any ``quant_algo`` containing "FP8" as per-tensor ``modelopt_fp8``,
  which is wrong for these.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from .. import error_line

MILES = "mxfp8"
MODELOPT = "modelopt"
SCALE_NAME = {MILES: "weight_scale_inv", MODELOPT: "weight_scale"}
# What an SGLang / miles MXFP8 quantization_config may say, field by field (an absent field takes the MXFP8 value)
MILES_FIELDS = {"fmt": ("e4m3", "float8_e4m3fn"), "scale_fmt": ("ue8m0", "e8m0"), "weight_block_size": ([1, 32],),
                "activation_scheme": ("dynamic",)}


class CheckpointError(ValueError):
    """A checkpoint this package cannot read as it declares itself (one line naming the file or field)."""


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({error_line(e)})") from None


def _module_list(section: Mapping[str, Any], key: str, where: str) -> List[str]:
    value = section.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{where}.{key} must be a list of module names, not {type(value).__name__} "
                              f"{str(value)[:60]!r}; fix the checkpoint's config")
    return list(value)


@dataclass(frozen=True)
class Mxfp8Format:
    flavor: str  # MILES or MODELOPT
    ignored: List[str] = field(default_factory=list)

    @property
    def scale_name(self) -> str:
        return SCALE_NAME[self.flavor]


def _modelopt_section(cfg: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    section = cfg.get("quantization", cfg)
    return section if isinstance(section, Mapping) else None


def is_modelopt_mxfp8(cfg: Mapping[str, Any]) -> bool:
    section = _modelopt_section(cfg)
    return bool(section) and str(section.get("quant_algo") or "").upper() == "MXFP8"


def detect_mxfp8(cfg: Optional[Mapping[str, Any]]) -> Optional[Mxfp8Format]:
    """The MXFP8 flavour of a quantization config dict, or None if it is not MXFP8."""
    if not cfg:
        return None
    if is_modelopt_mxfp8(cfg):
        return Mxfp8Format(MODELOPT, _module_list(_modelopt_section(cfg), "exclude_modules", "quantization"))
    if "mxfp8" in str(cfg.get("quant_method") or "").lower():
        for key, allowed in MILES_FIELDS.items():
            value = cfg.get(key)
            if value is not None and value not in allowed:
                raise CheckpointError(
                    f"quantization_config.{key} = {value!r}: MXFP8 is {allowed[0]!r} (e4m3 values, one ue8m0 scale per "
                    "1x32 block); this checkpoint is not MXFP8 as it declares, so fix its config or re-export it")
        key = "ignored_layers" if cfg.get("ignored_layers") is not None else "modules_to_not_convert"
        return Mxfp8Format(MILES, _module_list(cfg, key, "quantization_config"))
    return None


def read_quant_config(model_dir: str | Path) -> Optional[Dict[str, Any]]:
    """``quantization_config`` from config.json, else hf_quant_config.json, else None."""
    d = Path(model_dir)
    cfg_path = d / "config.json"
    if cfg_path.is_file():
        cfg = read_json(cfg_path)
        q = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
        if q:
            return q
    hf_quant = d / "hf_quant_config.json"
    if hf_quant.is_file():
        return read_json(hf_quant)
    return None


def detect_checkpoint(model_dir: str | Path) -> Optional[Mxfp8Format]:
    return detect_mxfp8(read_quant_config(model_dir))


MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def has_experts(model_dir: str | Path) -> bool:
    """Whether config.json (or its text_config) declares routed experts."""
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        return False
    cfg = read_json(cfg_path)
    return any((c or {}).get(k) for c in (cfg, cfg.get("text_config")) for k in MOE_KEYS)
