"""HF BF16/FP16 safetensors -> MXFP8 checkpoint in the format SGLang reads (miles-compatible).

Quantized: every 2-D ``*.weight`` whose K (last dim) is a multiple of 32, except embeddings,
lm_head, norms, routers/gates and MTP/indexer projections (the same rule as miles'
``convert_hf_to_mxfp8.py``). Written as e4m3 ``weight`` plus uint8 ``weight_scale_inv`` [N, K/32].
Shards are streamed one at a time and tensors quantized a few rows at a time: the working set is
about one input shard plus its output (1.6x a 256 MiB shard, measured).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

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


LAYER = re.compile(r"^(.*\.layers)\.(\d+)\.")
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # SGLang serves each group as one weight


class KeepBf16:
    """The layers ``--keep-bf16`` keeps BF16: a module name or glob (``lm_head``, ``model.layers.0.*``), or
    ``first:N`` / ``last:N``, the first or last N decoder layers. A module matches a pattern that names it, a
    parent of it, or globs it."""

    def __init__(self, patterns: Sequence[str], names: Iterable[str], num_layers: int = 0):
        names = list(names)
        prefixes = sorted({m.group(1) for m in map(LAYER.match, names) if m})
        globs = []
        for pattern in patterns:
            kind, _, count = pattern.partition(":")
            if kind in ("first", "last") and count:
                if not count.isdigit() or not prefixes or not num_layers:
                    raise ConvertError(f"--keep-bf16 {pattern}: needs N >= 0 and a model with numbered decoder layers "
                                       "(num_hidden_layers in config.json)")
                n = min(int(count), num_layers)
                layers = range(n) if kind == "first" else range(num_layers - n, num_layers)
                globs += [f"{prefix}.{i}" for prefix in prefixes for i in layers]
            else:
                glob = pattern.rstrip(".")
                if not any(self._match(n, (glob,)) for n in names):
                    raise ConvertError(f"--keep-bf16 {pattern}: matches no tensor of the checkpoint")
                globs.append(glob)
        self.globs = tuple(globs)
        self.patterns = tuple(patterns)

    @staticmethod
    def _match(name: str, globs: Sequence[str]) -> bool:
        module = name.rsplit(".", 1)[0]
        parts = module.split(".")
        parents = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return any(fnmatch.fnmatchcase(p, g) for g in globs for p in parents)

    def keeps(self, name: str) -> bool:
        return bool(self.globs) and self._match(name, self.globs)

    def check(self, quantizable: Iterable[str]) -> None:
        """Refuse a split SGLang cannot serve: some of a fused q/k/v or gate/up kept, or some experts of a MoE
        layer (SGLang runs all experts of a layer as one fused MoE, in one dtype)."""
        kept, quantized = set(), set()
        for name in quantizable:
            (kept if self.keeps(name) else quantized).add(name.rsplit(".", 1)[0])
        if kept and not quantized:
            raise ConvertError(f"--keep-bf16 {' '.join(self.patterns)} keeps every layer the converter would quantize "
                               f"({len(kept)} modules): nothing would be MXFP8; keep fewer layers")
        for module in sorted(kept):
            parent, leaf = module.rsplit(".", 1) if "." in module else ("", module)
            if ".experts." in module:
                layer = module.split(".experts.")[0] + ".experts."
                other = next((q for q in sorted(quantized) if q.startswith(layer)), None)
                if other:
                    raise ConvertError(f"--keep-bf16 keeps {module} but not {other}: SGLang runs a layer's experts as "
                                       f"one fused MoE in one dtype; keep all of {layer[:-1]} or none")
                continue
            for group in FUSED_SIBLINGS:
                if leaf in group:
                    other = next((f"{parent}.{s}" for s in group if f"{parent}.{s}" in quantized), None)
                    if other:
                        raise ConvertError(f"--keep-bf16 keeps {module} but not {other}: SGLang serves "
                                           f"{' + '.join(group)} as one weight; keep them together")


def quantize_in_chunks(t: torch.Tensor, rounding: ScaleRounding, rows: int = 1024, device=None):
    """quantize_mxfp8 a few rows at a time, so float32 temporaries stay small next to the shard; on ``device`` (e.g. a
    GPU) where given: the same numbers, in pure torch, faster."""
    q = torch.empty(t.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty((t.shape[0], t.shape[1] // MX_BLOCK), dtype=torch.uint8)
    for r0 in range(0, t.shape[0], rows):
        chunk = t[r0 : r0 + rows] if device is None else t[r0 : r0 + rows].to(device)
        qc, sc = quantize_mxfp8(chunk, rounding)
        q[r0 : r0 + rows], s[r0 : r0 + rows] = qc.cpu(), sc.cpu()
    return q, s


def quantization_config(not_converted: List[str], rounding: ScaleRounding = "ceil") -> Dict:
    """The checkpoint's quantization_config: SGLang's MXFP8 keys, and the scale rounding the server quantizes weights
    a trainer sends as BF16 with (SGLang ignores it)."""
    return {
        "quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, MX_BLOCK], "scale_fmt": "ue8m0",
        "activation_scheme": "dynamic", "modules_to_not_convert": sorted(not_converted), "scale_rounding": rounding,
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
    """The checkpoint's safetensors files: those its index names (plain file names in ``src`` only), else
    *.safetensors."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConvertError(f"{index}: no weight_map; pass a Hugging Face checkpoint folder")
        names = sorted(set(weight_map.values()))
        for name in names:
            if (
                not isinstance(name, str)
                or Path(name).name != name
                or name in (".", "..")
                or not name.endswith(".safetensors")
            ):
                raise ConvertError(
                    f"{index}: shard {name!r} is not a plain *.safetensors file name in the checkpoint folder"
                )
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
        raise ConvertError(
            f"{dst}: the output folder must be apart from the input {src} (not it, inside it, nor holding it)"
        )
    if d.exists() and not d.is_dir():
        raise ConvertError(f"{dst} exists and is not a folder; choose a new or empty folder")
    if d.is_dir() and any(d.iterdir()):
        written = _written_by_us(d)
        if written is None:
            raise ConvertError(f"{dst} exists, is not empty and is not an earlier conversion (no {MARKER} of ours); "
                               "choose a new or empty folder")
        if not force:
            raise ConvertError(f"{dst} holds an earlier conversion; pass --force to replace it")
        foreign = sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in d.iterdir()
                         if p.name not in written)
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise ConvertError(f"{dst} holds an earlier conversion and files sglang_mxfp8 did not write ({shown}); "
                               "--force replaces only what a conversion wrote: move them or choose another folder")


def _written_by_us(folder: Path) -> Optional[set]:
    """The file names an earlier conversion in ``folder`` wrote (its marker included), from its own marker file (not a
    link, not in a subfolder) as convert writes it; None where ``folder`` is no conversion of ours."""
    marker = folder / MARKER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        written = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not (isinstance(written, dict) and str(written.get("converted_by", "")).startswith("sglang_mxfp8 ")):
        return None
    files = written.get("files")
    return {MARKER, *files} if isinstance(files, list) and all(isinstance(f, str) for f in files) else {MARKER}


def convert(src: str | Path, dst: str | Path, *, force: bool = False, rounding: ScaleRounding = "ceil",
            progress: bool = True, device=None, keep_bf16: Sequence[str] = ()) -> ConvertReport:
    """Convert checkpoint ``src`` into ``dst``. The input is only read. The output is written into a temporary folder
    beside ``dst`` and renamed into place once complete and validated, so an interrupted conversion leaves no folder
    that looks like a checkpoint; ``force`` replaces an earlier conversion (a folder holding our marker) only. The
    written files follow the user's umask, as every other tool's that writes a checkpoint. ``keep_bf16``: patterns
    of layers left BF16 (:class:`KeepBf16`), listed in ``modules_to_not_convert``."""
    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise ConvertError(f"{src}: no such folder; pass a Hugging Face checkpoint folder")
    if not src.is_dir():
        raise ConvertError(f"{src} is a file; pass the checkpoint's folder")
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise ConvertError(f"{src}: no config.json; pass a Hugging Face checkpoint folder")
    config = read_json(cfg_path)
    if not isinstance(config, dict):
        raise ConvertError(f"{cfg_path}: not a model config (a JSON object)")
    if config.get("quantization_config"):
        raise ConvertError(
            f"{src}: already quantized ({config['quantization_config'].get('quant_method')}); pass the BF16 checkpoint"
        )
    _check_output(src, dst, force)
    shards = _shards(src)
    headers = _headers(src, shards)
    keep = KeepBf16(keep_bf16, headers, (config.get("text_config") or config).get("num_hidden_layers", 0))
    keep.check(name for name, quantized in headers.items() if quantized)
    dst.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        report = _write(src, work, shards, config, rounding, progress, device, keep)
        (work / MARKER).write_text(
            json.dumps(
                {
                    "converted_by": f"sglang_mxfp8 {__version__}",
                    "source": str(src.resolve()),
                    "rounding": rounding,
                    "keep_bf16": list(keep.patterns),
                    "files": sorted(p.name for p in work.iterdir()),
                },
                indent=2,
            )
        )
        follow_umask(work)
        _replace(work, dst)
    finally:
        if work.exists():
            shutil.rmtree(work)
    return report


def _headers(src: Path, shards: List[str]) -> Dict[str, bool]:
    """{tensor name: whether the converter quantizes it} from the shards' headers (no tensor read)."""
    found = {}
    for shard in shards:
        with open_shard(src / shard) as f:
            for name in f.keys():
                t = f.get_slice(name)
                shape = t.get_shape()
                found[name] = (name.endswith(".weight") and len(shape) == 2 and t.get_dtype() in ("BF16", "F16", "F32")
                               and shape[-1] % MX_BLOCK == 0 and not SKIP.search(name))
    return found


def follow_umask(folder: Path) -> None:
    """Give ``folder`` and its files the modes of the user's umask (a temporary folder is created owner-only)."""
    mask = os.umask(0)
    os.umask(mask)
    folder.chmod(0o777 & ~mask)
    for path in folder.iterdir():
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


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


def _write(src: Path, dst: Path, shards: List[str], config: Dict, rounding: ScaleRounding, progress: bool,
           device=None, keep: KeepBf16 = None) -> ConvertReport:
    keep = keep or KeepBf16((), ())
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
                    if should_quantize(name, t) and not keep.keeps(name):
                        q, s = quantize_in_chunks(t, rounding, device=device)
                        if bool((s == E8M0_NAN).any()):  # quantize_mxfp8 marks blocks holding NaN/Inf
                            raise ConvertError(
                                f"{src / shard}: tensor {name} holds NaN/Inf; fix the checkpoint before converting"
                            )
                        out[name] = q
                        out[name[: -len("weight")] + "weight_scale_inv"] = s
                        report.quantized.append(name)
                    else:
                        if ".experts." in name and name.endswith(".weight") and t.dim() == 2 and t.shape[-1] % MX_BLOCK:
                            # SGLang runs all experts of a layer as one fused MoE in one dtype
                            raise ConvertError(
                                f"{src / shard}: {name} has K={t.shape[-1]}, not a multiple of {MX_BLOCK}; every "
                                "expert projection must be MXFP8 for the fused MoE, so this model cannot be converted"
                            )
                        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                            raise ConvertError(
                                f"{src / shard}: tensor {name} (kept unquantized) holds NaN/Inf; fix the "
                                "checkpoint before converting"
                            )
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
    config["quantization_config"] = quantization_config(sorted(not_converted), rounding)
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
