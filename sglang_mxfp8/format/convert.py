"""HF BF16/FP16 safetensors -> MXFP8 checkpoint in the format SGLang reads (miles-compatible).

Quantized: every 2-D ``*.weight`` whose K (last dim) is a multiple of 32, except embeddings,
lm_head, norms, routers/gates and MTP/indexer projections (the same rule as miles'
``convert_hf_to_mxfp8.py``). Written as e4m3 ``weight`` plus uint8 ``weight_scale_inv`` [N, K/32].
Shards are streamed one at a time and tensors quantized a few rows at a time: the working set is
about one input shard plus its output (1.6x a 256 MiB shard measured, benchmarks/RESULTS.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from .. import __version__, error_line
from .checkpoint import CheckpointError, read_json
from .numerics import E8M0_NAN, MX_BLOCK, ScaleRounding, quantize_mxfp8

SKIP = re.compile(r"(embed|lm_head|norm|router|mlp\.gate\.|shared_expert_gate|eh_proj|weights_proj)")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class ConvertError(CheckpointError):
    """What cannot be converted, or where the output cannot go (one line naming the file or tensor)."""


@dataclass
class ConvertReport:
    quantized: List[str] = field(default_factory=list)
    kept: List[str] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)  # the input's files in other weight formats, not copied
    shards: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


def should_quantize(name: str, t: torch.Tensor) -> bool:
    return (
        name.endswith(".weight") and t.dim() == 2 and t.dtype in FLOAT_DTYPES
        and t.shape[-1] % MX_BLOCK == 0 and not SKIP.search(name)
    )


def quantize_in_chunks(t: torch.Tensor, rounding: ScaleRounding, rows: int = 1024):
    """quantize_mxfp8 a few rows at a time, so float32 temporaries stay small next to the shard."""
    q = torch.empty(t.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty((t.shape[0], t.shape[1] // MX_BLOCK), dtype=torch.uint8)
    for r0 in range(0, t.shape[0], rows):
        q[r0 : r0 + rows], s[r0 : r0 + rows] = quantize_mxfp8(t[r0 : r0 + rows], rounding)
    return q, s


def quantization_config(not_converted: List[str]) -> Dict:
    return {
        "quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, MX_BLOCK], "scale_fmt": "ue8m0",
        "activation_scheme": "dynamic", "modules_to_not_convert": sorted(not_converted),
    }


# Files of other weight formats are not copied: the output holds the MXFP8 weights alone.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz", ".pkl")
MARKER = "mxfp8_conversion.json"  # written into every output; --force replaces only a folder that holds it


@contextlib.contextmanager
def open_shard(path: Path):
    """safe_open, with a one-line ConvertError naming the file for one that is not a whole safetensors file."""
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: corrupt, truncated or missing
        raise ConvertError(f"{path}: not a readable safetensors file ({error_line(e)})") from None
    with handle as f:
        yield f


def _shards(src: Path) -> List[str]:
    """The checkpoint's safetensors files: those its index names (plain file names in ``src`` only), else *.safetensors."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConvertError(f"{index}: no weight_map; pass a Hugging Face checkpoint folder")
        names = sorted(set(weight_map.values()))
        for name in names:
            if not isinstance(name, str) or Path(name).name != name or name in (".", "..") or not name.endswith(".safetensors"):
                raise ConvertError(f"{index}: shard {name!r} is not a plain *.safetensors file name in the checkpoint folder")
            if not (src / name).is_file():
                raise ConvertError(f"{index}: shard {name} is not in {src}")
        return names
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    if not shards:
        raise ConvertError(f"{src}: no *.safetensors files; pass a Hugging Face checkpoint folder")
    return shards


def _check_output(src: Path, dst: Path, force: bool) -> None:
    """Refuse an output that is the input, lies inside it or holds it, or holds files we did not write."""
    s, d = src.resolve(), dst.resolve()
    if s == d or s in d.parents or d in s.parents:
        raise ConvertError(f"{dst}: the output folder must be apart from the input {src} (not it, inside it, nor holding it)")
    if d.exists() and not d.is_dir():
        raise ConvertError(f"{dst} exists and is not a folder; choose a new or empty folder")
    if d.is_dir() and any(d.iterdir()):
        if not force:
            raise ConvertError(f"{dst} exists and is not empty; pass --force to replace an earlier conversion there")
        if not (d / MARKER).is_file():
            raise ConvertError(f"{dst} holds files sglang_mxfp8 did not write (no {MARKER}); --force replaces only an "
                               "earlier conversion: choose a new or empty folder")


def convert(src: str | Path, dst: str | Path, *, force: bool = False, rounding: ScaleRounding = "ceil",
            progress: bool = True) -> ConvertReport:
    """Convert checkpoint ``src`` into ``dst``. The input is only read. The output is written into a temporary folder
    beside ``dst`` and renamed into place once complete and validated, so an interrupted conversion leaves no folder
    that looks like a checkpoint; ``force`` replaces an earlier conversion (a folder holding our marker) only."""
    src, dst = Path(src), Path(dst)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise ConvertError(f"{src}: no config.json; pass a Hugging Face checkpoint folder")
    config = read_json(cfg_path)
    if not isinstance(config, dict):
        raise ConvertError(f"{cfg_path}: not a model config (a JSON object)")
    if config.get("quantization_config"):
        raise ConvertError(f"{src}: already quantized ({config['quantization_config'].get('quant_method')}); pass the BF16 checkpoint")
    _check_output(src, dst, force)
    shards = _shards(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        report = _write(src, work, shards, config, rounding, progress)
        (work / MARKER).write_text(json.dumps({"converted_by": f"sglang_mxfp8 {__version__}", "source": str(src.resolve()),
                                               "rounding": rounding}, indent=2))
        _replace(work, dst)
    finally:
        if work.exists():
            shutil.rmtree(work)
    return report


def _replace(work: Path, dst: Path) -> None:
    """Rename the finished ``work`` folder to ``dst``; an earlier conversion there (checked) is removed after."""
    old = None
    if dst.is_dir() and any(dst.iterdir()):
        old = dst.with_name(f".{dst.name}.replaced-{os.getpid()}")
        dst.rename(old)
    elif dst.is_dir():
        dst.rmdir()
    work.rename(dst)
    if old is not None:
        shutil.rmtree(old)


def _write(src: Path, dst: Path, shards: List[str], config: Dict, rounding: ScaleRounding, progress: bool) -> ConvertReport:
    report = ConvertReport()
    weight_map: Dict[str, str] = {}
    not_converted = set()
    with tqdm(total=len(shards), desc="convert MXFP8", unit="shard", disable=not progress) as bar:
        for shard in shards:
            out: Dict[str, torch.Tensor] = {}
            with open_shard(src / shard) as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    report.bytes_in += t.numel() * t.element_size()
                    if should_quantize(name, t):
                        q, s = quantize_in_chunks(t, rounding)
                        if bool((s == E8M0_NAN).any()):  # quantize_mxfp8 marks blocks holding NaN/Inf
                            raise ConvertError(f"{src / shard}: tensor {name} holds NaN/Inf; fix the checkpoint before converting")
                        out[name] = q
                        out[name[: -len("weight")] + "weight_scale_inv"] = s
                        report.quantized.append(name)
                    else:
                        if ".experts." in name and name.endswith(".weight") and t.dim() == 2 and t.shape[-1] % MX_BLOCK:
                            # SGLang runs all experts of a layer as one fused MoE in one dtype
                            raise ConvertError(
                                f"{src / shard}: {name} has K={t.shape[-1]}, not a multiple of {MX_BLOCK}; every expert "
                                "projection must be MXFP8 for the fused MoE, so this model cannot be converted"
                            )
                        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                            raise ConvertError(f"{src / shard}: tensor {name} (kept unquantized) holds NaN/Inf; fix the "
                                               "checkpoint before converting")
                        out[name] = t
                        report.kept.append(name)
                        if name.endswith(".weight") and t.dim() == 2:
                            not_converted.add(name[: -len(".weight")])
                    del t
            save_file(out, str(dst / shard), metadata={"format": "pt"})
            report.bytes_out += sum(t.numel() * t.element_size() for t in out.values())
            weight_map.update({n: shard for n in out})
            report.shards += 1
            del out
            bar.update(1)

    if len(shards) > 1 or (src / "model.safetensors.index.json").is_file():
        (dst / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": report.bytes_out}, "weight_map": weight_map}, indent=2)
        )
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name in ("config.json", "model.safetensors.index.json"):
            continue
        if p.name.endswith(WEIGHT_SUFFIXES):
            if not p.name.endswith(".safetensors"):
                report.skipped.append(p.name)
            continue
        shutil.copy2(p, dst / p.name)
    validate(dst)
    config["quantization_config"] = quantization_config(sorted(not_converted))
    (dst / "config.json").write_text(json.dumps(config, indent=2))  # last: a folder without it is no checkpoint
    return report


def validate(ckpt: str | Path) -> int:
    """Check every quantized weight of an MXFP8 checkpoint has a matching scale; returns their count."""
    ckpt = Path(ckpt)
    count = 0
    for shard in _shards(ckpt):
        with open_shard(ckpt / shard) as f:
            names = set(f.keys())
            for name in names:
                if not name.endswith(".weight_scale_inv"):
                    continue
                wname = name[: -len("_scale_inv")]
                if wname not in names:
                    raise ConvertError(f"{ckpt / shard}: scale {name} has no weight {wname}")
                w, s = f.get_slice(wname), f.get_slice(name)
                n, k = w.get_shape()
                if w.get_dtype() != "F8_E4M3" or s.get_dtype() != "U8" or s.get_shape() != [n, k // MX_BLOCK]:
                    raise ConvertError(
                        f"{ckpt / shard}: {wname} is {w.get_dtype()} {w.get_shape()} with scale "
                        f"{s.get_dtype()} {s.get_shape()}; expected F8_E4M3 [N, K] and U8 [N, K/32]"
                    )
                count += 1
    return count
