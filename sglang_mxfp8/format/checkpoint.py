"""Recognise MXFP8 checkpoints from their quantization config, and refuse tensors an MXFP8 checkpoint cannot hold
(no sglang; torch only inside the checks of tensors).

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
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

from .. import error_line

if TYPE_CHECKING:
    import torch

MX_BLOCK = 32  # elements along K per UE8M0 scale byte (OCP MX v1.0)
E8M0_NAN = 255  # the UE8M0 byte that means NaN
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


def not_a_folder(path: str | Path) -> Optional[str]:
    """Why ``path`` is no checkpoint folder (one line: a file, no such folder, no config.json there), or None."""
    folder = Path(path).expanduser()
    fix = "pass the checkpoint's folder"
    if folder.is_file():
        return f"{path} is a file; {fix}"
    if not folder.exists():
        return f"{path}: no such folder; {fix} (config.json and *.safetensors)"
    if not (folder / "config.json").is_file():
        return f"{path}: no config.json there; {fix} (config.json and *.safetensors)"
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



NAN_WEIGHT, NAN_SCALE, MISSING_SCALE = 1, 2, 4  # what a loaded row can hold that post-load processing refuses


def validate_loaded(weight: "torch.Tensor", scale: "torch.Tensor", name: str) -> "torch.Tensor":
    """Refuse checkpoint data that would compute garbage silently: NaN weights or scales, missing scales. Returns
    which 32-element blocks hold a nonzero element (bool ``[rows, K/32]``; a conversion needs it too).

    A missing scale tensor leaves SGLang's zero-initialised bytes (2**-127) under real weights. One pass over the
    weight (each block's largest magnitude byte: 0x7F is e4m3's NaN, the largest there is) and one host sync.
    """
    import torch

    k = weight.shape[-1]
    w = weight.reshape(-1, k).view(torch.uint8)
    s = scale.reshape(-1, k // MX_BLOCK)
    block_max = (w & 0x7F).reshape(w.shape[0], -1, MX_BLOCK).amax(-1)
    nonzero = block_max > 0
    flags = ((block_max == 0x7F).any(1) * NAN_WEIGHT | (s == E8M0_NAN).any(1) * NAN_SCALE
             | ((s == 0) & nonzero).any(1) * MISSING_SCALE)
    refuse_flagged_rows(flags, name)
    return nonzero


def refuse_flagged_rows(flags: "torch.Tensor", name: str) -> None:
    """Raise for the first refused row of a loaded weight, given per row the bits NAN_WEIGHT | NAN_SCALE |
    MISSING_SCALE (int ``[rows]``, as ``validate_loaded`` or the GPU scan computes them); one host sync when none."""
    if not bool(flags.any()):
        return
    rows = {bit: (flags & bit).nonzero() for bit in (NAN_SCALE, NAN_WEIGHT, MISSING_SCALE)}
    if len(rows[NAN_SCALE]):
        raise ValueError(f"{name}: scale row {int(rows[NAN_SCALE][0])} holds NaN (0xFF): the checkpoint has "
                         "non-finite values there")
    if len(rows[NAN_WEIGHT]):
        raise ValueError(f"{name}: weight row {int(rows[NAN_WEIGHT][0])} holds NaN e4m3 values; fix the checkpoint")
    raise ValueError(
        f"{name}: scale row {int(rows[MISSING_SCALE][0])} is zero under nonzero weights, as if its scale tensor was "
        "never loaded; check that the checkpoint has a weight_scale_inv (uint8 [N, K/32]) for this weight"
    )


def refused_update(named: List[Tuple[str, "torch.Tensor"]], scale_name: str = "weight_scale_inv", *,
                   where: str = "update", structure: bool = True, values: bool = True) -> Optional[str]:
    """Why a weight update sent as named tensors (SGLang's ``update_weights_from_tensor``, or a checkpoint read as
    such) must be refused before any of it is written, or None. A load writes tensor after tensor into the served
    weights, so a refusal half-way through would serve a mix; everything a post-load check would refuse is checked
    here first. ``structure``: an e4m3 weight and its UE8M0 scale ``[..., K/32]`` arrive together, scales are uint8,
    float8 weights are e4m3 (dtypes and shapes only: meta tensors do). ``values``: scale bytes are not NaN (255), e4m3
    bytes are not NaN, float tensors are finite, read on their device with one host sync."""
    import torch

    names = dict(named)
    if structure:
        for name, t in named:
            problem = _structure_problem(name, t, names, scale_name, where)
            if problem:
                return problem
    if not values:
        return None
    flags = []
    for name, what, t in checked_values(named, scale_name):
        if t.dtype == torch.uint8:
            flags.append((name, what, _any(t, lambda c: c == E8M0_NAN)))
        elif t.dtype == torch.float8_e4m3fn:
            flags.append((name, what, _any(t.view(torch.uint8), lambda c: (c & 0x7F) == 0x7F)))
        else:
            flags.append((name, what, _any(t, lambda c: ~torch.isfinite(c))))
    by_device: Dict["torch.device", list] = {}
    for flag in flags:
        by_device.setdefault(flag[2].device, []).append(flag)
    for group in by_device.values():
        for (name, what, _), bad in zip(group, torch.stack([f for _, _, f in group]).tolist()):
            if bad:
                return f"{name}: {what}"
    return None


def checked_values(named: List[Tuple[str, "torch.Tensor"]], scale_name: str = "weight_scale_inv") -> list:
    """(name, what its refusal says, tensor) of each tensor of an update whose values are checked: scales (uint8) for
    NaN bytes (255), e4m3 weights for NaN bytes, float tensors of two bytes or more for NaN and Inf."""
    import torch

    checked = []
    for name, t in named:
        if name.endswith("." + scale_name) and t.dtype == torch.uint8:
            checked.append((name, "holds NaN scale bytes (255)", t))
        elif t.dtype == torch.float8_e4m3fn:
            checked.append((name, "holds NaN e4m3 values", t))
        elif t.is_floating_point() and t.element_size() > 1:
            checked.append((name, "holds NaN or Inf", t))
    return checked


CHECK_CHUNK = 1 << 24  # elements a value check reads at a time: its temporaries stay small beside a large tensor


def _any(t, bad) -> "torch.Tensor":
    """Whether ``bad`` holds for any element of ``t``, as a tensor on its device (no host sync), read in chunks of
    :data:`CHECK_CHUNK` elements: ``isfinite`` of a 622 MB BF16 embedding allocates about twice its size at once."""
    import torch

    if t.numel() <= CHECK_CHUNK or not t.is_contiguous():
        return bad(t).any()
    return torch.stack([bad(chunk).any() for chunk in t.reshape(-1).split(CHECK_CHUNK)]).any()


def _structure_problem(name: str, t, names: dict, scale_name: str, where: str) -> Optional[str]:
    import torch

    stem = name[: -len("weight")] if name.endswith(".weight") else None
    if name.endswith("." + scale_name):
        if t.dtype != torch.uint8:
            return (f"{name}: the scale is {t.dtype}, expected torch.uint8 (UE8M0, one byte per {MX_BLOCK} weights "
                    "along K)")
        if name[: -len(scale_name)] + "weight" not in names:
            return (f"{name}: a scale without its weight {name[: -len(scale_name)]}weight in this {where}; send each "
                    "MXFP8 weight with its scale")
    elif t.dtype == torch.float8_e4m3fn:
        scale = names.get(stem + scale_name) if stem else None
        if scale is None:
            return (f"{name}: an e4m3 weight without its scale {stem or name + '.'}{scale_name} in this {where}; an "
                    "MXFP8 weight needs its uint8 [N, K/32] scale beside it")
        if scale.dtype == torch.uint8 and (t.shape[-1] % MX_BLOCK
                                           or tuple(scale.shape) != (*t.shape[:-1], t.shape[-1] // MX_BLOCK)):
            return (f"{name}: weight {list(t.shape)} needs a scale of shape {scale_shape(t.shape)} (one per {MX_BLOCK} "
                    f"along K), the {where} has {list(scale.shape)}")
    elif t.is_floating_point() and t.element_size() == 1:
        return (
            f"{name}: {t.dtype} is not an MXFP8 element type; MXFP8 weights are torch.float8_e4m3fn with a uint8 scale"
        )
    return None


SAFETENSORS_DTYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U8": "uint8", "BF16": "bfloat16",
                      "F16": "float16", "F32": "float32", "F64": "float64"}


def refused_checkpoint(folder: Path, scale_name: str, values: bool) -> Optional[str]:
    """:func:`refused_update` for a checkpoint folder before SGLang loads it: its tensors' dtypes and shapes from the
    safetensors headers (no data read), and with ``values`` their values too, one shard at a time (None where the
    folder holds no safetensors: SGLang says what is wrong with it)."""
    import torch
    from safetensors import safe_open

    shards = sorted(Path(folder).glob("*.safetensors"))
    headers = []
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                dtype = SAFETENSORS_DTYPES.get(piece.get_dtype())
                if dtype is not None:
                    headers.append((name, torch.empty(piece.get_shape(), dtype=getattr(torch, dtype), device="meta")))
    problem = refused_update(headers, scale_name, where="checkpoint", values=False)
    for shard in shards if values and problem is None else ():
        with safe_open(str(shard), "pt") as f:
            problem = refused_update([(n, f.get_tensor(n)) for n in f.keys()], scale_name, structure=False)
        if problem is not None:
            break
    return problem


def scale_shape(weight_shape) -> str:
    """The scale shape a weight of ``weight_shape`` needs, as '[256, 16]' ('[256, 15.5]' where K is no multiple)."""
    return "[" + ", ".join(f"{d:g}" for d in (*weight_shape[:-1], weight_shape[-1] / MX_BLOCK)) + "]"

