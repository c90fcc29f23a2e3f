"""The checkpoints the served routines compare: a BF16 model and its MXFP8 conversion.

Either the user's (``--model``: a BF16 Hugging Face checkpoint, converted here once; or an MXFP8 one with its BF16
twin, ``--bf16-model``), or a generated Qwen3-30B-A3B-shaped model of ``--layers`` layers with random weights and a
word-level tokenizer over its whole vocabulary (SGLang's ``bench_serving`` needs one; every token id decodes to a
non-empty word, so streamed output counts every token). Both are cached under the work folder and reused.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

# Qwen3-30B-A3B's layer shapes (hidden 2048, 128 experts of intermediate 768, top-8; 32 query and 4 key/value heads)
QWEN3_30B_A3B = dict(hidden=2048, moe_intermediate=768, experts=128, top_k=8, heads=32, kv_heads=4, head_dim=128,
                     vocab=151936)


def generated_name(layers: int) -> str:
    """What rows call the generated model of ``layers`` layers."""
    return f"qwen3-30b-a3b-shaped {layers} layers"


def generated_layers(name: str) -> Optional[int]:
    """The layers of the generated model that rows call ``name`` (:func:`generated_name`); None for any other model."""
    found = re.fullmatch(r"qwen3-30b-a3b-shaped (\d+) layers", name)
    return int(found.group(1)) if found else None


def is_generated(name: str) -> bool:
    """Whether rows of model ``name`` were measured on the generated model's random weights."""
    return generated_layers(name) is not None


class ModelError(ValueError):
    """A --model / --bf16-model the served routines cannot compare (one line)."""


@dataclass(frozen=True)
class ServedPair:
    bf16: Path
    mxfp8: Path
    name: str  # what the rows call the model
    tokenizer: bool  # a real tokenizer: gsm8k can run


def write_word_tokenizer(out: Path, vocab: int) -> None:
    """A word-level tokenizer whose token i is the word ``t<i>``, for every id of the model's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(out)


def _layers_of(ckpt: Path) -> Optional[int]:
    cfg = ckpt / "config.json"
    return json.loads(cfg.read_text()).get("num_hidden_layers") if cfg.is_file() else None


def generated_bytes(layers: int) -> Tuple[int, int]:
    """Bytes on disk of the generated model of ``layers`` layers: (BF16, its MXFP8 conversion). Embeddings, the output
    head, norms and the router stay BF16; attention and expert weights become e4m3 with one scale byte per 32."""
    d = QWEN3_30B_A3B
    h, hd = d["hidden"], d["head_dim"]
    kept = 2 * d["vocab"] * h + h  # embeddings, output head, final norm
    layer_kept = d["experts"] * h + 2 * h + 2 * hd  # router, two norms, q/k norms
    layer_mx = (2 * d["heads"] + 2 * d["kv_heads"]) * hd * h + 3 * d["experts"] * d["moe_intermediate"] * h
    bf16 = 2 * (kept + layers * (layer_kept + layer_mx))
    mxfp8 = 2 * (kept + layers * layer_kept) + layers * (layer_mx + layer_mx // 32)
    return bf16, mxfp8


def _check_disk(folder: Path, layers: int, need: int) -> None:
    """Refuse, before writing anything, a generated model the disk under ``folder`` cannot hold."""
    where = next(p for p in (folder, *folder.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if need <= free:
        return
    per_layer = sum(generated_bytes(1)) - sum(generated_bytes(0))
    fits = max(0, (free - sum(generated_bytes(0))) // per_layer)
    raise ModelError(f"--layers {layers}: the generated model and its MXFP8 conversion need {need / 1e9:.1f} GB more "
                     f"on disk, {where} has {free / 1e9:.1f} GB free (enough for {fits} layers); pass --layers {fits} "
                     "or a --workdir on a larger disk")


def generated(root: Path, layers: int, seed: int = 0) -> ServedPair:
    """A Qwen3-30B-A3B-shaped model of ``layers`` layers (random weights drawn on the GPU) and its MXFP8 conversion
    (quantized on the GPU, the converter's numbers), written once under ``root`` and reused; refused first where the
    disk cannot hold them."""
    from .tiny_model import write_qwen3_moe
    from ..format.convert import convert

    folder = Path(root) / f"qwen3-30b-a3b-shaped-{layers}l-seed{seed}"
    bf16, mx = folder / "bf16", folder / "mxfp8"
    need_bf16, need_mx = generated_bytes(layers)
    _check_disk(folder, layers, (need_bf16 if _layers_of(bf16) != layers else 0)
                + (need_mx if _layers_of(mx) != layers else 0))
    if _layers_of(bf16) != layers or not (bf16 / "tokenizer.json").is_file():
        print(f"bench: writing a random Qwen3-30B-A3B-shaped model of {layers} layers to {bf16}", flush=True)
        write_qwen3_moe(bf16, seed=seed, layers=layers, device="cuda", **QWEN3_30B_A3B)
        write_word_tokenizer(bf16, QWEN3_30B_A3B["vocab"])
    if _layers_of(mx) != layers or (mx.stat().st_mtime < (bf16 / "model.safetensors").stat().st_mtime):
        print(f"bench: converting it to MXFP8 in {mx}", flush=True)
        convert(bf16, mx, force=True, device="cuda")
    return ServedPair(bf16, mx, generated_name(layers), tokenizer=False)


def user_model_name(path: Path) -> str:
    """What rows call the user's checkpoint: its folder with its architecture and layers (a folder's name may say
    neither)."""
    cfg = json.loads((path / "config.json").read_text())
    layers = (cfg.get("text_config") or cfg).get("num_hidden_layers")
    about = [a for a in ((cfg.get("architectures") or [None])[0], f"{layers} layers" if layers else None) if a]
    return f"{path.name} ({', '.join(about)})" if about else path.name


def from_user(model: str, bf16_model: Optional[str], root: Path) -> ServedPair:
    """The user's checkpoint and its twin: a BF16 checkpoint is converted into ``root`` (once); an MXFP8 one needs
    ``bf16_model``, the checkpoint it was converted from."""
    from ..format.checkpoint import detect_checkpoint

    path = Path(model)
    if not (path / "config.json").is_file():
        raise ModelError(f"--model {model}: no config.json there; pass a Hugging Face checkpoint folder")
    tokenizer = any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    if detect_checkpoint(path) is not None:
        if not bf16_model or not (Path(bf16_model) / "config.json").is_file():
            raise ModelError(
                f"--model {model} is MXFP8: pass the BF16 checkpoint it was converted from as --bf16-model "
                "(every figure is MXFP8 against BF16 in the same run)"
            )
        return ServedPair(Path(bf16_model), path, user_model_name(path), tokenizer)
    from ..format.convert import MARKER, convert

    mx = Path(root) / f"{path.resolve().name}-mxfp8"
    marker = mx / MARKER
    if not marker.is_file() or json.loads(marker.read_text()).get("source") != str(path.resolve()):
        print(f"bench: converting {model} to MXFP8 in {mx}", flush=True)
        convert(path, mx, force=True, device="cuda")
    return ServedPair(path, mx, user_model_name(path), tokenizer)


def negated(mx: Path, out: Path) -> Path:
    """A second MXFP8 checkpoint of ``mx``'s shapes for alternating refits: every e4m3 tensor negated (sign bits
    flipped, scales kept), the other files copied. Written once into ``out`` (rewritten when ``mx`` is newer)."""
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = sorted(mx.glob("*.safetensors"))
    newest = max(f.stat().st_mtime for f in shards)
    if (out / "config.json").is_file() and all((out / f.name).is_file() and (out / f.name).stat().st_mtime >= newest
                                               for f in shards):
        return out
    print(f"bench: writing {mx} with its weights negated to {out} (a second checkpoint to refit to)", flush=True)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for f in mx.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, partial / f.name)
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            tensors, metadata = {n: f.get_tensor(n) for n in f.keys()}, f.metadata()
        for n, t in tensors.items():
            if t.dtype == torch.float8_e4m3fn:
                tensors[n] = (t.view(torch.uint8) ^ 0x80).view(torch.float8_e4m3fn)
        save_file(tensors, str(partial / shard.name), metadata=metadata)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out
