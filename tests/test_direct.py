"""Direct copies (sglang/direct.py): a model whose ``load_weights`` matches names the way SGLang's Qwen3-MoE does and
calls SGLang's loaders' conventions (default_weight_loader, FusedMoE's per-expert rows, a tensor-parallel shard), with
the real load tracker; what its loaders write is compared with what the direct copies write."""

import pytest
import torch

from sglang_mxfp8.format.numerics import quantize_mxfp8
from sglang_mxfp8.settings import current

pytestmark = pytest.mark.sglang

E, I, H = 3, 32, 64  # experts, intermediate rows, hidden


def _expert_rows(param, loaded_weight, weight_name, shard_id=None, expert_id=None):
    """FusedMoE's convention: w1 into the first half of w13's rows, w3 the second, w2 whole."""
    rows = loaded_weight.shape[0]
    start = rows if shard_id == "w3" else 0
    param.data[expert_id].narrow(0, start, rows).copy_(loaded_weight)


def _second_shard(param, loaded_weight):
    """A column-parallel loader on rank 1 of 2: the second half of the checkpoint tensor's rows."""
    rows = param.shape[0]
    param.data.copy_(loaded_weight.narrow(0, rows, rows))


class TinyMoE(torch.nn.Module):
    """One dense MXFP8 layer loaded as a tensor-parallel shard, one MXFP8 MoE, one plain norm; ``tied``: the dense
    weight's checkpoint tensor also fills a second parameter (as tied weights do)."""

    def __init__(self, tied=False, device="cpu"):
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        from sglang_mxfp8.sglang.loads import LoadTracker

        super().__init__()
        p = lambda *shape, dtype: torch.nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device),  # noqa: E731
                                                     requires_grad=False)
        self.dense_w, self.dense_s = p(H // 2, H, dtype=torch.float8_e4m3fn), p(H // 2, H // 32, dtype=torch.uint8)
        self.w13, self.s13 = p(E, 2 * I, H, dtype=torch.float8_e4m3fn), p(E, 2 * I, H // 32, dtype=torch.uint8)
        self.w2, self.s2 = p(E, H, I, dtype=torch.float8_e4m3fn), p(E, H, I // 32, dtype=torch.uint8)
        self.norm = p(H, dtype=torch.bfloat16)
        self.shadow = p(H, H, dtype=torch.float8_e4m3fn)
        for param in (self.dense_w, self.dense_s):
            param.weight_loader = _second_shard
        for param in (self.w13, self.s13, self.w2, self.s2):
            param.weight_loader = _expert_rows
        self.norm.weight_loader = self.shadow.weight_loader = default_weight_loader
        self.trackers = [LoadTracker("model.layers.0.self_attn.qkv_proj", {"": (self.dense_w, self.dense_s)}),
                         LoadTracker("model.layers.0.mlp.experts", {"w13": (self.w13, self.s13),
                                                                    "w2": (self.w2, self.s2)})]
        self.tied = tied
        self.handled = []  # names the model's own load_weights saw

    def load_weights(self, weights):
        params = {"qkv.weight": self.dense_w, "qkv.weight_scale_inv": self.dense_s, "norm.weight": self.norm}
        for name, tensor in weights:
            self.handled.append(name)
            if name.startswith("experts."):
                _, e, proj, kind = name.split(".")
                param = getattr(self, ("w2" if proj == "down_proj" else "w13") if kind == "weight" else
                                ("s2" if proj == "down_proj" else "s13"))
                shard = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
                param.weight_loader(param, tensor, name, shard_id=shard, expert_id=int(e))
            else:
                params[name].weight_loader(params[name], tensor)
                if self.tied and name == "qkv.weight":
                    self.shadow.weight_loader(self.shadow, tensor)

    def check(self):
        for tracker in self.trackers:
            tracker.check()


def _checkpoint(seed, drop=()):
    g = torch.Generator().manual_seed(seed)
    ckpt = {}

    def mx(name, rows, k):
        q, s = quantize_mxfp8(torch.randn(rows, k, generator=g))
        ckpt[name + ".weight"], ckpt[name + ".weight_scale_inv"] = q, s

    mx("qkv", H, H)
    for e in range(E):
        mx(f"experts.{e}.gate_proj", I, H), mx(f"experts.{e}.up_proj", I, H), mx(f"experts.{e}.down_proj", H, I)
    ckpt["norm.weight"] = torch.randn(H, generator=g).bfloat16()
    return {k: v for k, v in sorted(ckpt.items()) if k not in drop}


def _expected(ckpt):
    """Each parameter as the checkpoint fills it, from the checkpoint's tensors directly."""
    u8 = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    want = {"dense_w": u8(ckpt["qkv.weight"])[H // 2:], "dense_s": ckpt["qkv.weight_scale_inv"][H // 2:],
            "norm": ckpt["norm.weight"]}
    for param, part in (("w13", ".weight"), ("s13", ".weight_scale_inv")):
        want[param] = torch.stack([torch.cat([u8(ckpt[f"experts.{e}.gate_proj{part}"]),
                                              u8(ckpt[f"experts.{e}.up_proj{part}"])]) for e in range(E)])
    want["w2"] = torch.stack([u8(ckpt[f"experts.{e}.down_proj.weight"]) for e in range(E)])
    want["s2"] = torch.stack([ckpt[f"experts.{e}.down_proj.weight_scale_inv"] for e in range(E)])
    return want


def _assert_holds(model, ckpt):
    for name, want in _expected(ckpt).items():
        got = getattr(model, name).data.cpu()
        got = got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got
        assert torch.equal(got, want), name


def _model(tied=False, device="cpu"):
    from sglang_mxfp8.sglang.direct import copy_directly

    model = TinyMoE(tied, device)
    copy_directly(model)
    return model


MXFP8_TENSORS = 2 + E * 6


def test_a_refit_copies_every_mxfp8_tensor_where_the_first_load_put_it():
    model = _model()
    first = _checkpoint(1)
    model.load_weights(iter(first.items()))  # a load from disk: SGLang's iterator
    model.check()
    _assert_holds(model, first)
    assert len(model.handled) == len(first)
    assert len(model.load_weights.landings) == MXFP8_TENSORS  # the norm is no MXFP8 tensor: never direct

    for seed, as_list in ((2, False), (3, True)):  # a refit from disk, then a trainer's tensors
        model.handled.clear()
        ckpt = _checkpoint(seed)
        model.load_weights(list(ckpt.items()) if as_list else iter(ckpt.items()))
        assert model.handled == ["norm.weight"]
        assert model.load_weights.direct == MXFP8_TENSORS and model.load_weights.total == len(ckpt)
        model.check()  # the direct copies are recorded for the post-load check
        _assert_holds(model, ckpt)


def test_direct_copies_keep_the_load_trackers_refusals():
    model = _model()
    model.load_weights(iter(_checkpoint(1).items()))
    model.check()

    model.load_weights(iter(_checkpoint(2, drop={"experts.1.up_proj.weight_scale_inv"}).items()))
    with pytest.raises(ValueError, match=r"experts\.w13_weight: the checkpoint loaded this weight \(shards "
                                         r"\('w3', 1\)\) without its scale tensor"):
        model.check()

    bad = _checkpoint(3)
    bad["experts.2.down_proj.weight"] = bad["experts.2.down_proj.weight"].view(torch.int8)
    model.handled.clear()
    with pytest.raises(ValueError, match=r"experts\.w2_weight: checkpoint tensor is torch.int8"):
        model.load_weights(list(bad.items()))
    assert "experts.2.down_proj.weight" in model.handled  # another dtype goes through SGLang's loaders

    wrong_scale = _checkpoint(4)
    wrong_scale["experts.0.gate_proj.weight_scale_inv"] = torch.zeros(I, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"experts\.w13_weight \(shards \('w1', 0\)\): weight \[32, 64\] needs a "
                                         r"scale of shape \[32, 2\]"):
        model.load_weights(iter(wrong_scale.items()))
    assert torch._C._len_torch_function_stack() == 0  # the load that raised left no learning behind
    model.trackers[1].reset()


def test_a_trainers_bf16_tensor_is_quantized_where_it_lands():
    model = _model()
    model.load_weights(iter(_checkpoint(1).items()))
    model.check()
    g = torch.Generator().manual_seed(5)
    bf16 = (torch.randn(H, I, generator=g) * 0.1).bfloat16()
    ckpt = _checkpoint(2)
    del ckpt["experts.1.down_proj.weight"], ckpt["experts.1.down_proj.weight_scale_inv"]
    model.handled.clear()
    model.load_weights([*ckpt.items(), ("experts.1.down_proj.weight", bf16)])
    model.check()
    assert model.handled == ["norm.weight"]
    q, s = quantize_mxfp8(bf16.float())
    assert torch.equal(model.w2[1].view(torch.uint8), q.view(torch.uint8)) and torch.equal(model.s2[1], s)
    assert model.load_weights.landings["experts.1.down_proj.weight"].dtype == torch.float8_e4m3fn


def test_a_tensor_sglang_loads_twice_is_never_copied_directly():
    model = _model(tied=True)
    model.load_weights(iter(_checkpoint(1).items()))
    assert "qkv.weight" not in model.load_weights.landings
    assert len(model.load_weights.landings) == MXFP8_TENSORS - 1
    model.handled.clear()
    ckpt = _checkpoint(2)
    model.load_weights(iter(ckpt.items()))
    assert torch.equal(model.shadow.view(torch.uint8), ckpt["qkv.weight"].view(torch.uint8))
    assert model.handled == ["norm.weight", "qkv.weight"]


def test_parameters_that_moved_are_loaded_through_sglang_and_learned_again(caplog):
    model = _model()
    model.load_weights(iter(_checkpoint(1).items()))
    model.check()
    model.w2.data = torch.zeros_like(model.w2)  # what must never happen: the old landings point at freed storage
    model.handled.clear()
    ckpt = _checkpoint(2)
    model.load_weights(iter(ckpt.items()))
    model.check()
    assert "parameters moved" in caplog.text
    assert len(model.handled) == len(ckpt)
    _assert_holds(model, ckpt)
    assert len(model.load_weights.landings) == MXFP8_TENSORS


def test_direct_copies_can_be_switched_off(monkeypatch):
    from sglang_mxfp8.sglang.direct import DirectLoads

    monkeypatch.setenv("SGLANG_MXFP8_DIRECT_COPIES", "0")
    current.cache_clear()
    try:
        model = _model()
        assert not isinstance(model.__dict__.get("load_weights"), DirectLoads)
    finally:
        monkeypatch.undo()
        current.cache_clear()
    assert isinstance(_model().__dict__.get("load_weights"), DirectLoads)


def bf16_update_quantized_where_it_lands(device, bucket=False):
    """A trainer's update of BF16 weights only (no scales) after a checkpoint load: every MXFP8 weight and its scale
    hold what the CPU quantizer writes for it, and the model's loaders saw only the norm. ``bucket``: the tensors are
    views of one flat tensor, as SGLang rebuilds a trainer's flattened bucket (quantized in runs of back-to-back
    tensors; runs split at the norm, which is no MXFP8 weight, and at a few thousand elements here)."""
    model = _model(device=device)
    model.load_weights(iter(_checkpoint(1).items()))
    model.check()
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    trainer = {name: (torch.randn(t.shape, generator=g) * torch.logspace(-4, 2, t.shape[-1])).bfloat16()
               for name, t in _checkpoint(2).items() if name.endswith(".weight") and t.dtype == torch.float8_e4m3fn}
    trainer["norm.weight"] = torch.randn(H, generator=g).bfloat16()
    sent = [(name, t.to(device)) for name, t in trainer.items()]
    if bucket:
        flat = torch.cat([t.reshape(-1) for _, t in sent])
        sent, at = [], 0
        for name, t in trainer.items():
            sent.append((name, flat[at:at + t.numel()].view(t.shape)))
            at += t.numel()
    model.handled.clear()
    model.load_weights(sent)
    model.check()
    assert model.handled == ["norm.weight"]
    want = {"norm.weight": trainer["norm.weight"]}
    for name, t in trainer.items():
        if name != "norm.weight":
            want[name], want[name + "_scale_inv"] = quantize_mxfp8(t.float(), "ceil")
    _assert_holds(model, want)


@pytest.mark.parametrize("bucket", [False, True])
def test_a_trainers_bf16_update_is_quantized_where_it_lands(monkeypatch, bucket):
    from sglang_mxfp8.sglang import direct

    monkeypatch.setattr(direct, "QUANTIZE_RUN_ELEMENTS", 3 * I * H)
    bf16_update_quantized_where_it_lands("cpu", bucket)


def test_back_to_back_runs_split_where_tensors_do_not_follow():
    from sglang_mxfp8.sglang.direct import _back_to_back

    class Tracker:
        def __init__(self, rounding):
            self.rounding = rounding

    landing = lambda rounding: type("L", (), {"tracker": Tracker(rounding)})()  # noqa: E731
    flat = torch.zeros(1024, dtype=torch.bfloat16)
    other = torch.zeros(64, dtype=torch.bfloat16)
    items = [(flat[0:64], landing("ceil")), (flat[64:128], landing("ceil")), (flat[160:224], landing("ceil")),
             (flat[224:288], landing("floor")), (other, landing("floor")), (flat[288:352].float(), landing("floor"))]
    runs = list(_back_to_back([(t, lnd, None) for t, lnd in items]))
    assert [len(r) for r in runs] == [2, 1, 1, 1, 1]
