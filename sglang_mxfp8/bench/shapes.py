"""The layer shapes the ``layers`` routine times: named sets of real models' dense and MoE layers as SGLang builds
them (q/k/v and gate/up fused), or the shapes of a checkpoint (``--model``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class DenseShape:
    model: str
    layer: str
    n: int
    k: int

    def __str__(self) -> str:
        return f"{self.model} {self.layer} [{self.n} x {self.k}]"


@dataclass(frozen=True)
class MoEShape:
    model: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int

    def __str__(self) -> str:
        return f"{self.model} MoE E{self.experts} H{self.hidden} I{self.intermediate} top-{self.top_k}"


def _attention(model: str, hidden: int, heads: int, kv_heads: int, head_dim: int) -> List[DenseShape]:
    return [DenseShape(model, "qkv_proj", (heads + 2 * kv_heads) * head_dim, hidden),
            DenseShape(model, "o_proj", hidden, heads * head_dim)]


SETS: Dict[str, Tuple[List[DenseShape], Optional[MoEShape]]] = {
    "qwen3-30b-a3b": (_attention("qwen3-30b-a3b", 2048, 32, 4, 128), MoEShape("qwen3-30b-a3b", 128, 2048, 768, 8)),
    "llama-3-8b": (_attention("llama-3-8b", 4096, 32, 8, 128) + [
        DenseShape("llama-3-8b", "gate_up_proj", 2 * 14336, 4096), DenseShape("llama-3-8b", "down_proj", 4096, 14336)],
        None),
    # gpt-oss-20b's experts are timed as SiLU-gated experts (its clamped SwiGLU runs SGLang's own MoE)
    "gpt-oss-20b": (_attention("gpt-oss-20b", 2880, 64, 8, 64), MoEShape("gpt-oss-20b", 32, 2880, 2880, 4)),
}


def from_checkpoint(ckpt: Path) -> Tuple[List[DenseShape], Optional[MoEShape]]:
    """The served layer shapes of an MXFP8 checkpoint (one tensor-parallel rank of one), read from its headers."""
    from ..format.layers import ServedDense, ServedExperts, model_config, served_layers

    name = Path(ckpt).name
    dense, moe = [], None
    top_k = next((v for k, v in model_config(ckpt).items() if k in ("num_experts_per_tok", "moe_topk", "top_k")), 0)
    for layer in served_layers(Path(ckpt)):
        if isinstance(layer, ServedDense):
            dense.append(DenseShape(name, layer.name.rsplit(".", 1)[-1], layer.n, layer.k))
        elif isinstance(layer, ServedExperts):
            moe = MoEShape(name, layer.experts, layer.hidden, layer.intermediate, int(top_k) or 8)
    return dense, moe
