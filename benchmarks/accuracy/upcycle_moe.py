"""Upcycle a dense Qwen2 checkpoint into a Qwen2-MoE whose output stays close to the dense model's.

The dense MLP becomes the shared expert (its gate weight 0, so sigmoid = 0.5, and its down_proj
scaled by 2 to undo that); EXPERTS small routed experts (random, down_proj scaled by --routed-std)
are added with top-K routing, so the routed path really runs while the real weights carry accuracy.
``--check`` compares last-token logits of both models on CPU (transformers) for a few prompts.

    python benchmarks/accuracy/upcycle_moe.py DENSE_BF16 OUT [--experts 8 --top-k 2 --moe-intermediate 1024] [--check]
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PROMPTS = ["Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
           "How many clips did Natalia sell altogether in April and May?\nAnswer:", "def fibonacci(n):", "The capital of France is"]


def upcycle(dense: Path, out: Path, experts: int, top_k: int, inter: int, routed_std: float, seed: int) -> Path:
    cfg = json.loads((dense / "config.json").read_text())
    h = cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(dense.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as src:
            for name in src.keys():
                t = src.get_tensor(name)
                if ".mlp." not in name:
                    tensors[name] = t
                    continue
                prefix, proj = name.split(".mlp.")
                if proj == "down_proj.weight":
                    t = (t.float() * 2).to(t.dtype)  # shared_expert_gate = 0 -> sigmoid 0.5
                tensors[f"{prefix}.mlp.shared_expert.{proj}"] = t
                if proj == "gate_proj.weight":
                    tensors[f"{prefix}.mlp.shared_expert_gate.weight"] = torch.zeros(1, h, dtype=t.dtype)
                    tensors[f"{prefix}.mlp.gate.weight"] = (torch.randn(experts, h, generator=g) * 0.02).to(t.dtype)
                    for e in range(experts):
                        q = f"{prefix}.mlp.experts.{e}."
                        tensors[q + "gate_proj.weight"] = (torch.randn(inter, h, generator=g) * 0.02).to(t.dtype)
                        tensors[q + "up_proj.weight"] = (torch.randn(inter, h, generator=g) * 0.02).to(t.dtype)
                        tensors[q + "down_proj.weight"] = (torch.randn(h, inter, generator=g) * routed_std).to(t.dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.update({
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "num_experts": experts,
        "num_experts_per_tok": top_k, "moe_intermediate_size": inter,
        "shared_expert_intermediate_size": cfg["intermediate_size"], "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": False, "output_router_logits": False,
    })
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for p in dense.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(p, out / p.name)
    return out


@torch.no_grad()
def check(dense: Path, moe: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dense)
    a = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.bfloat16)
    b = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.bfloat16)
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        la, lb = a(ids).logits[0, -1].float(), b(ids).logits[0, -1].float()
        cos = torch.nn.functional.cosine_similarity(la, lb, dim=0).item()
        top = (la.topk(5).indices == lb.topk(5).indices).float().mean().item()
        print(f"{prompt[:40]!r}: top-1 {'same' if la.argmax() == lb.argmax() else 'DIFFERENT'}, "
              f"top-5 overlap {top:.1f}, logits cosine {cos:.4f}, max |diff| {(la - lb).abs().max():.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dense")
    ap.add_argument("out")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-intermediate", type=int, default=1024)
    ap.add_argument("--routed-std", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    out = upcycle(Path(args.dense), Path(args.out), args.experts, args.top_k, args.moe_intermediate, args.routed_std, args.seed)
    print(f"wrote {out}")
    if args.check:
        check(Path(args.dense), out)


if __name__ == "__main__":
    main()
