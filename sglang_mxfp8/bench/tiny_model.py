"""A small random-init Qwen3-MoE checkpoint in Hugging Face layout (BF16), for tests and the demo.

Random weights are enough to compare kernels (greedy tokens and logprobs of BF16 vs MXFP8) and to
exercise every path (attention projections, router, experts, refit) without a model hub.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..format.convert import follow_umask


def qwen3_moe_config(hidden=256, moe_intermediate=128, experts=8, top_k=2, layers=2, heads=4, kv_heads=2,
                     head_dim=64, vocab=1024) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
        "intermediate_size": 4 * hidden, "moe_intermediate_size": moe_intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_experts": experts, "num_experts_per_tok": top_k, "vocab_size": vocab,
        "max_position_embeddings": 40960, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    }


TOKENIZER_CORPUS = [
    "Question: Janet has 16 eggs. She eats 3 and bakes with 4. How many are left?",
    "Answer: 16 - 3 - 4 = 9. She sells 9 eggs for $2 each, so she makes 9 * 2 = 18 dollars. #### 18",
    "The quick brown fox jumps over the lazy dog 0123456789 times + - * / = ( ) $ % , . ? !",
]


def write_tokenizer(out: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer (trained on a few lines, offline) so servers can take text prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TOKENIZER_CORPUS * 10, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>").save_pretrained(
        out
    )


def write_qwen3_moe(out: str | Path, seed: int = 0, std: float = 0.05, tokenizer: bool = False, device: str = "cpu",
                    **dims) -> Path:
    """Write config.json + model.safetensors (+ a tokenizer) of a random Qwen3-MoE; returns the folder.
    device: where the random numbers are drawn ("cuda" writes a full-width model in seconds, not minutes;
    the values then differ from the CPU ones for the same seed)."""
    cfg = qwen3_moe_config(**dims)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(seed)
    h, inter, e, hd = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"], cfg["head_dim"]
    nq, nkv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]

    def rnd(*shape, scale=std):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16).cpu()

    t = {
        "model.embed_tokens.weight": rnd(vocab, h, scale=1.0),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": rnd(vocab, h),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[p + "self_attn.q_proj.weight"] = rnd(nq * hd, h)
        t[p + "self_attn.k_proj.weight"] = rnd(nkv * hd, h)
        t[p + "self_attn.v_proj.weight"] = rnd(nkv * hd, h)
        t[p + "self_attn.o_proj.weight"] = rnd(h, nq * hd)
        t[p + "self_attn.q_norm.weight"] = torch.ones(hd, dtype=torch.bfloat16)
        t[p + "self_attn.k_norm.weight"] = torch.ones(hd, dtype=torch.bfloat16)
        t[p + "mlp.gate.weight"] = rnd(e, h)
        for j in range(e):
            q = f"{p}mlp.experts.{j}."
            t[q + "gate_proj.weight"] = rnd(inter, h)
            t[q + "up_proj.weight"] = rnd(inter, h)
            t[q + "down_proj.weight"] = rnd(h, inter)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    if tokenizer:
        write_tokenizer(out, vocab)
    follow_umask(out)  # safetensors writes its files owner-only
    return out
