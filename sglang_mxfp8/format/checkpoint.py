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

MILES = "mxfp8"
MODELOPT = "modelopt"
SCALE_NAME = {MILES: "weight_scale_inv", MODELOPT: "weight_scale"}


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
        section = _modelopt_section(cfg)
        return Mxfp8Format(MODELOPT, list(section.get("exclude_modules") or []))
    if "mxfp8" in str(cfg.get("quant_method") or "").lower():
        ignored = cfg.get("ignored_layers") or cfg.get("modules_to_not_convert") or []
        return Mxfp8Format(MILES, list(ignored))
    return None


def read_quant_config(model_dir: str | Path) -> Optional[Dict[str, Any]]:
    """``quantization_config`` from config.json, else hf_quant_config.json, else None."""
    d = Path(model_dir)
    cfg_path = d / "config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        q = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
        if q:
            return q
    hf_quant = d / "hf_quant_config.json"
    if hf_quant.is_file():
        return json.loads(hf_quant.read_text())
    return None


def detect_checkpoint(model_dir: str | Path) -> Optional[Mxfp8Format]:
    return detect_mxfp8(read_quant_config(model_dir))


MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def has_experts(model_dir: str | Path) -> bool:
    """Whether config.json (or its text_config) declares routed experts."""
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        return False
    cfg = json.loads(cfg_path.read_text())
    return any((c or {}).get(k) for c in (cfg, cfg.get("text_config")) for k in MOE_KEYS)
