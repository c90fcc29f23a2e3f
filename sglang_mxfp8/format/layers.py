"""An MXFP8 checkpoint's quantized layers as SGLang serves them: q/k/v and gate/up fused into one weight, each
tensor-parallel rank's shard (read from the safetensors headers only)."""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

from .checkpoint import MOE_KEYS

FUSED_AS_SERVED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                   "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


class ShardError(ValueError):
    """A tensor-parallel split SGLang refuses for this layer (one line)."""


def layer_kinds(ckpt: Path) -> "OrderedDict[str, Tuple[str, int, int, int]]":
    """Quantized tensors grouped by kind (name without layer/expert numbers): (role, N, K, count)."""
    from .convert import _shards, open_shard

    kinds: "OrderedDict[str, list]" = OrderedDict()
    for shard in _shards(ckpt):
        with open_shard(ckpt / shard) as f:
            names = set(f.keys())
            for name in sorted(names):
                if not name.endswith((".weight_scale_inv", ".weight_scale")):
                    continue
                wname = name.rsplit(".", 1)[0] + ".weight"
                if wname not in names:
                    continue
                n, k = f.get_slice(wname).get_shape()
                kind = re.sub(r"\.\d+\.", ".N.", wname.rsplit(".", 1)[0])
                entry = kinds.setdefault(kind, ["experts" if ".experts." in wname else "dense", n, k, 0])
                entry[3] += 1
    return OrderedDict((k, tuple(v)) for k, v in kinds.items())


def served_dense_layers(dense: Dict[str, Tuple[int, int, int]]) -> "OrderedDict[str, Tuple[int, int, int, List[str]]]":
    """Checkpoint layer kinds {kind: (N, K, count)} as SGLang builds them, where the kernel is chosen: q/k/v and
    gate/up each one weight, N summed; {served kind: (N, K, count, the checkpoint kinds' last names)}."""
    served: "OrderedDict[str, list]" = OrderedDict()
    for kind, (n, k, count) in dense.items():
        prefix, leaf = kind.rsplit(".", 1)
        entry = served.setdefault(f"{prefix}.{FUSED_AS_SERVED.get(leaf, leaf)}", [0, k, count, []])
        entry[0] += n
        entry[3].append(leaf)
    return OrderedDict((name, tuple(v)) for name, v in served.items())


def per_rank(name: str, n: int, k: int, tp: int, config: dict) -> Tuple[int, int]:
    """(N, K) of one tensor-parallel rank's shard of a served dense layer, as SGLang's parallel linears split it:
    q/k/v by heads (key/value heads replicated when there are fewer than ranks), gate/up by rows, o and down by
    columns; a layer of another name whole."""
    leaf = name.rsplit(".", 1)[1]
    if tp == 1 or leaf not in ("qkv_proj", "gate_up_proj", "o_proj", "down_proj"):
        return n, k
    if leaf == "qkv_proj":
        heads, kv_heads = (
            config["num_attention_heads"],
            config.get("num_key_value_heads", config["num_attention_heads"]),
        )
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        if heads % tp:
            raise ShardError(f"{name}: --tp {tp} does not divide {heads} attention heads (SGLang refuses it too)")
        if kv_heads % tp if kv_heads >= tp else tp % kv_heads:
            raise ShardError(f"{name}: neither of --tp {tp} and {kv_heads} key/value heads divides the other "
                             "(SGLang refuses it too)")
        return (heads // tp + 2 * max(1, kv_heads // tp)) * head_dim, k
    split = n if leaf == "gate_up_proj" else k
    if split % tp:
        raise ShardError(f"{name}: --tp {tp} does not divide {split} (SGLang refuses it too)")
    return (split // tp, k) if leaf == "gate_up_proj" else (n, split // tp)


@dataclass(frozen=True)
class ServedDense:
    name: str
    n: int  # the whole layer
    k: int
    count: int
    parts: Tuple[str, ...]  # the checkpoint's weights fused into it (q_proj, k_proj, v_proj)
    rank_n: int  # one rank's shard
    rank_k: int


@dataclass(frozen=True)
class ServedExperts:
    name: str
    experts: int
    hidden: int
    intermediate: int  # the whole expert
    tp: int  # ways tensor parallelism splits each expert's intermediate size (--tp / --ep-size)
    ep: int


def model_config(ckpt: Path) -> dict:
    from .checkpoint import read_json

    config = read_json(ckpt / "config.json")
    return config.get("text_config") or config


def served_layers(ckpt: Path, tp: int = 1, ep: int = 1) -> List[object]:
    """Each served layer kind of an MXFP8 checkpoint at --tp / --ep-size: ServedDense, ServedExperts, or a
    ShardError where SGLang refuses the split."""
    config = model_config(ckpt)
    experts: Dict[str, Tuple[int, int, int]] = {}
    dense: Dict[str, Tuple[int, int, int]] = {}
    for kind, (role, n, k, count) in layer_kinds(ckpt).items():
        (experts if role == "experts" else dense)[kind] = (n, k, count)
    out: List[object] = []
    for name, (n, k, count, parts) in served_dense_layers(dense).items():
        try:
            rn, rk = per_rank(name, n, k, tp, config)
            order = list(FUSED_AS_SERVED)
            parts = tuple(sorted(parts, key=lambda p: order.index(p) if p in order else 0))
            out.append(ServedDense(name, n, k, count, parts, rn, rk))
        except ShardError as e:
            out.append(e)
    if experts:
        hidden = next(k for kind, (n, k, c) in experts.items() if not kind.endswith("down_proj"))
        inter = next(k for kind, (n, k, c) in experts.items() if kind.endswith("down_proj"))
        prefix = next(iter(experts)).split(".experts.")[0] + ".experts"
        count = next((config.get(key) for key in MOE_KEYS if config.get(key)), 0)
        moe_tp = tp // ep  # SGLang: experts split ep ways, each expert's rows tp / ep ways
        if inter % moe_tp:
            out.append(ShardError(f"{prefix}: --tp / --ep-size {moe_tp} does not divide the experts' intermediate "
                                  f"size {inter} (SGLang refuses it too)"))
        else:
            out.append(ServedExperts(prefix, count, hidden, inter, moe_tp, ep))
    return out


def model_dtype(ckpt: Path) -> str:
    config = model_config(ckpt)
    return "float16" if (config.get("torch_dtype") or config.get("dtype")) == "float16" else "bfloat16"

