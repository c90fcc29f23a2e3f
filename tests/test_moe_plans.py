"""MoE plans where SGLang builds them: which layers our own MoE kernels (GEMV, DeepGEMM and CUTLASS prefill) can
compute, the shared CUTLASS scratch, DeepGEMM's precompile batches, TP splits, and what doctor prints (the kernels'
numerics and the apply() dispatch itself: tests/gpu)."""

import dataclasses

import pytest
import torch
from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig

from conftest import doctor_plans

from sglang_mxfp8 import platform
from sglang_mxfp8.ops import cublas_sm90
from sglang_mxfp8.kernels.base import Mxfp8ConfigError
from sglang_mxfp8.kernels.moe.common import non_standard
from sglang_mxfp8.kernels.moe.cutlass_grouped import CutlassGroupedMoE
from sglang_mxfp8.ops.deepgemm_sm90 import grouped_precompile_ms
from sglang_mxfp8.platform import GpuSpec

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang

QWEN3 = MoeRunnerConfig(num_experts=128, num_local_experts=128, hidden_size=2048, intermediate_size_per_partition=768,
                        top_k=8, params_dtype=torch.bfloat16)
H200 = GpuSpec("NVIDIA H200", 90)


@pytest.fixture
def no_deep_gemm(monkeypatch):
    monkeypatch.setattr(platform, "deep_gemm_missing", lambda api, needs="": "not installed")
    monkeypatch.setattr(cublas_sm90, "unsupported", lambda: None)


@pytest.mark.parametrize(
    "min_m,max_m,top_k,experts", [(1024, 8192, 8, 128), (1024, 16384, 8, 128), (1024, 8192, 4, 16)]
)
def test_deepgemm_moe_precompile_runs_one_batch_per_tile_config(min_m, max_m, top_k, experts):
    """DeepGEMM's grouped GEMM picks its SM90 tile config from ceil(expected rows per expert / 128): the batches run
    at load reach every such value that batches of min_m..max_m tokens can, each once (Qwen3-30B-A3B: four)."""
    ms = grouped_precompile_ms(min_m, max_m, top_k, experts)

    def bucket(m):
        return -(-(-(-m * top_k // experts)) // 128)

    assert min_m <= ms[0] and ms[-1] <= max_m
    assert sorted(bucket(m) for m in ms) == sorted({bucket(m) for m in range(min_m, max_m + 1)})
    if (max_m, top_k) == (8192, 8):
        assert ms == [1024, 2049, 4097, 6145]


@pytest.mark.parametrize("change,ep_size,why", [
    (dict(activation="gelu"), 1, "activation gelu"),
    (dict(is_gated=False), 1, "gated False"),
    (dict(apply_router_weight_on_input=True), 1, "router weights on the input"),
    (dict(no_combine=True), 1, "no combine"),
    (dict(gemm1_clamp_limit=7.0), 1, "clamped or scaled gate"),
    (dict(gemm1_alpha=1.702), 1, "clamped or scaled gate"),
    ({}, 2, "expert parallel size 2"),
])
def test_layers_our_moe_kernels_cannot_compute_are_named(change, ep_size, why):
    assert non_standard(QWEN3, 1) is None
    assert why in non_standard(dataclasses.replace(QWEN3, **change), ep_size)


def test_scratch_is_allocated_once_per_shape_and_shared_by_layers():
    a = CutlassGroupedMoE(16, 512, 256, "cpu")
    b = CutlassGroupedMoE(16, 512, 256, "cpu", expert_specialized=True)
    other = CutlassGroupedMoE(16, 512, 128, "cpu")
    assert a.scratch is b.scratch and other.scratch is not a.scratch
    assert (a.enable_es, b.enable_es) == ((False, False), (True, True))
    s = a.scratch
    assert s["a1_strides"].tolist() == [512] * 16 and s["c1_strides"].tolist() == [512] * 16  # x rows, w13 rows
    assert s["a2_strides"].tolist() == [256] * 16 and s["c2_strides"].tolist() == [512] * 16  # act rows, out rows
    assert other.scratch["c1_strides"].tolist() == [256] * 16 and other.scratch["a2_strides"].tolist() == [128] * 16
    assert s["expert_offsets"].shape == (17,) and s["problem_sizes1"].shape == s["problem_sizes2"].shape == (16, 3)
    assert all(s[n].shape == (16,) and s[n].dtype == torch.int64 for n in ("a_ptrs", "b_ptrs", "out_ptrs"))


def _doctor_on_tiny_model(tmp_path, **dims):
    """`sglang-mxfp8 doctor` arguments for an H200 and a converted tiny Qwen3-MoE (``dims``: its config's
    sizes), and the CLI entry point."""
    from sglang_mxfp8.cli import main as cli
    from sglang_mxfp8.bench.tiny_model import write_qwen3_moe
    from sglang_mxfp8.format.convert import convert

    mx = tmp_path / "mx"
    convert(write_qwen3_moe(tmp_path / "bf16", **dims), mx, progress=False)
    return cli, ["doctor", "--gpu", "h200", "--model", str(mx), "--moe-runner-backend", "triton"]


def _method(monkeypatch):
    import sglang.srt.layers.quantization.fp8  # noqa: F401 - SGLang's module first: its patch imports quant_methods

    from sglang_mxfp8.sglang import quant_methods as qm

    monkeypatch.setattr(qm, "current_gpu", lambda: H200)
    return qm, qm.Mxfp8MoEMethod(
        qm.Mxfp8Config.from_config(
            {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32]}
        ),
        "model.layers.0.mlp.experts",
    )


def test_doctor_names_the_prefill_moe(tmp_path, capsys, monkeypatch, no_deep_gemm):
    cli, doctor = _doctor_on_tiny_model(tmp_path)
    from sglang_mxfp8 import settings

    def moe_line():
        settings.current.cache_clear()
        assert cli(doctor) == 0
        line = next(s for s in doctor_plans(capsys.readouterr().out) if s.startswith("  MoE"))
        assert line.startswith("  MoE model.layers.N.mlp.experts (hidden 256, intermediate 128): ")
        return line

    assert "2048+ tokens: cutlass_moe; other batches: triton_moe" in moe_line()
    assert moe_line().endswith("; not deepgemm_moe: not installed]")
    monkeypatch.setenv("SGLANG_MXFP8_DISABLED_KERNELS", "cutlass_moe")
    assert ": other batches: triton_moe" in moe_line()
    settings.current.cache_clear()


@pytest.mark.parametrize(
    "change,ep_size", [({}, 1), (dict(activation="gelu"), 1), (dict(gemm1_alpha=1.702), 1), ({}, 2)]
)
def test_layers_our_moe_kernels_cannot_compute_keep_every_batch_on_triton(change, ep_size, monkeypatch, no_deep_gemm):
    """SGLang hands the runner config to create_moe_runner; where it was not known at create_weights, a layer our
    own kernels cannot compute is planned again with the Triton fused MoE alone."""
    from sglang_mxfp8.kernels import registry
    from sglang_mxfp8.kernels.base import MoESpec
    from sglang_mxfp8.kernels.moe.common import HopperMoEState

    qm, method = _method(monkeypatch)
    layer = torch.nn.Module()
    layer.moe_ep_size, layer.mxfp8_state = ep_size, HopperMoEState()
    method.plan = registry.select_moe(MoESpec(method.prefix, 128, 2048, 768, ep=ep_size), H200, "auto")
    assert len(method.plan.entries) == (3 if ep_size == 1 else 1)
    monkeypatch.setattr(method.plan.base, "create_runner", lambda *a: None)  # SGLang's runner needs a GPU
    method.create_moe_runner(layer, dataclasses.replace(QWEN3, **change))
    supported = not change and ep_size == 1
    assert (len(method.plan.entries) > 1) == supported
    assert method.plan.base.name == "triton_moe"


def test_doctor_names_the_one_token_gemvs(tmp_path, capsys, monkeypatch, no_deep_gemm):
    """Doctor names the dense GEMV on the layers, as served (q/k/v fused), of the shapes it runs on: none of the
    tiny model's, q/k/v and o of a model with Qwen3-30B-A3B's attention; the GEMV MoE only for experts of its
    measured shape; disabling one kernel removes it alone."""
    from sglang_mxfp8 import settings

    cli, doctor = _doctor_on_tiny_model(tmp_path)
    doctor += ["--fp8-gemm-backend", "flashinfer_trtllm"]
    assert cli(doctor) == 0
    assert [s for s in doctor_plans(capsys.readouterr().out) if "gemv;" in s] == []
    _, wide = _doctor_on_tiny_model(tmp_path / "wide", hidden=2048, moe_intermediate=768, experts=2, layers=1,
                                    heads=32, kv_heads=4, head_dim=128)
    wide += ["--fp8-gemm-backend", "flashinfer_trtllm"]

    def gemv_lines():
        settings.current.cache_clear()
        assert cli(wide) == 0
        return [s for s in doctor_plans(capsys.readouterr().out) if "1 token:" in s]

    lines = gemv_lines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("  dense model.layers.N.self_attn.qkv_proj [5120 x 2048] x1 (q_proj + k_proj + v_proj): "
                               "1 token: gemv; 1024+ tokens: cublas; other batches: flashinfer_sm90")
    assert lines[1].startswith("  dense model.layers.N.self_attn.o_proj [2048 x 4096] x1: 1 token: gemv;")
    assert lines[2].startswith("  MoE model.layers.N.mlp.experts (hidden 2048, intermediate 768): 1 token: moe_gemv;")
    monkeypatch.setenv("SGLANG_MXFP8_DISABLED_KERNELS", "gemv")
    assert gemv_lines() == lines[2:]
    monkeypatch.setenv("SGLANG_MXFP8_DISABLED_KERNELS", "gemv,moe_gemv")
    assert gemv_lines() == []
    settings.current.cache_clear()


@pytest.mark.parametrize("tp,intermediate", [(4, 192), (8, 96)])
def test_a_tensor_parallel_split_off_the_128_grid_without_the_masked_moe_names_the_splits_that_work(
        tp, intermediate, monkeypatch):
    """Qwen3-30B-A3B's experts (intermediate 768) at --tp 4 / 8 on an H200: SGLang's FusedMoE hands our MoE method
    768 / tp rows per rank, off the 128 grid, which the masked W8A8 MoE serves (test_registry). With it disabled, the
    load fails in one line naming the splits whose share is a multiple of 128 and expert parallelism."""
    monkeypatch.setenv("SGLANG_MXFP8_DISABLED_KERNELS", "triton_w8a8_moe")  # read fresh: conftest's fresh_settings
    qm, method = _method(monkeypatch)
    layer = torch.nn.Module()
    layer.moe_tp_size = tp
    with pytest.raises(Mxfp8ConfigError) as e:
        method.create_weights(layer, 128, 2048, intermediate, torch.bfloat16)
    assert str(e.value).endswith(
        f"(triton_moe: intermediate size 768 split {tp} ways by tensor parallelism (--tp / --ep-size) leaves "
        f"{intermediate} per rank, not a multiple of 128, which SGLang's block-FP8 Triton MoE needs; serve with --tp / "
        "--ep-size = 1, 2, 3 or 6 (--ep-size equal to --tp keeps each expert whole on its rank); triton_w8a8_moe: "
        "SGLANG_MXFP8_DISABLED_KERNELS lists it)")
    assert str(e.value).startswith("model.layers.0.mlp.experts (128 experts, hidden 2048, intermediate 768, "
                                   f"{intermediate} per rank): no MXFP8 kernel for this layer on NVIDIA H200 (SM90)")


def test_doctor_at_tensor_and_expert_parallel_sizes(tmp_path, capsys, no_deep_gemm):
    """doctor --tp / --ep-size: each served layer's rank shard as SGLang's parallel linears cut it (q/k/v by heads,
    key/value heads replicated past their count), the kernels chosen on it, and the MoE per rank."""
    cli, doctor = _doctor_on_tiny_model(tmp_path, hidden=2048, moe_intermediate=768, experts=2, layers=1,
                                        heads=32, kv_heads=4, head_dim=128)

    def run(*flags):
        status = cli(doctor + list(flags))
        out = capsys.readouterr().out
        return status, doctor_plans(out) + [s for s in out.splitlines() if s.startswith("--ep")]

    status, (qkv, o, moe) = run("--tp", "4")  # 192 rows per rank, off the 128 grid: the masked MoE
    assert status == 0
    assert ("qkv_proj [5120 x 2048] x1 (q_proj + k_proj + v_proj), [1280 x 2048] per rank: 1024+ tokens: cublas; "
            "other batches: flashinfer_sm90") in qkv
    assert "o_proj [2048 x 4096] x1, [2048 x 1024] per rank: 1024+ tokens: cublas; other batches: flashinfer_sm90" in o
    assert moe.startswith("  MoE model.layers.N.mlp.experts (hidden 2048, intermediate 768, 192 per rank): other "
                          "batches: triton_w8a8_moe [")
    status, (qkv, o, moe) = run("--tp", "8")  # 4 key/value heads on 8 ranks: one per rank, replicated
    assert status == 0 and "[768 x 2048] per rank" in qkv and "[2048 x 512] per rank" in o
    assert "96 per rank): other batches: triton_w8a8_moe [" in moe
    status, (qkv, o, moe) = run("--tp", "4", "--ep-size", "4")  # whole experts: neither CUTLASS prefill nor GEMV
    assert status == 0 and "[1280 x 2048] per rank" in qkv
    assert moe.endswith("(hidden 2048, intermediate 768, experts split 4 ways): other batches: triton_moe [not "
                        "moe_gemv: expert parallel size 4; not deepgemm_moe: not installed; not cutlass_moe: expert "
                        "parallel size 4]")
    status, (qkv, o, moe) = run("--tp", "2")
    assert status == 0 and "[2560 x 2048] per rank" in qkv and "[2048 x 2048] per rank" in o
    assert "(hidden 2048, intermediate 768, 384 per rank): 2048+ tokens: cutlass_moe; other batches: triton_moe" in moe
    assert "not moe_gemv: hidden 2048 / intermediate 384 is not a shape it measured faster on" in moe
    status, (qkv, o, moe) = run("--tp", "3")
    assert status == 1 and qkv.endswith("ERROR model.layers.N.self_attn.qkv_proj: --tp 3 does not divide 32 attention "
                                        "heads (SGLang refuses it too)")
    assert o.endswith("--tp 3 does not divide 4096 (SGLang refuses it too)") and "256 per rank" in moe
    assert run("--tp", "4", "--ep-size", "3") == (1, ["--ep-size 3 does not divide --tp 4; SGLang's expert "
                                                     "parallelism splits the tensor-parallel ranks"])
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as e:
            cli(doctor + ["--tp", bad])
        assert (
            e.value.code == 2
            and f"argument --tp: {bad!r} is not a number of GPUs (1 or more)" in capsys.readouterr().err
        )


def test_precompile_batches_route_every_token_to_distinct_experts_over_all_of_them():
    """The batch the MoE kernels' precompile runs: BF16 zeros, top-k distinct experts per token, every expert used
    once the batch has enough tokens, router weights summing to 1."""
    from sglang_mxfp8.kernels.moe.common import routed_batch

    x, weights, ids = routed_batch(2048, 128, 8, "cpu")(40)
    assert x.shape == (40, 2048) and x.dtype == torch.bfloat16 and not x.any()
    assert ids.shape == weights.shape == (40, 8) and ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert all(len(set(row.tolist())) == 8 for row in ids) and set(ids.flatten().tolist()) == set(range(128))
    assert torch.allclose(weights.sum(-1), torch.ones(40))


def test_every_moe_kernel_takes_the_precompile_batch_in_the_order_routed_batch_makes_it():
    """experts_on_first_rows passes routed_batch's (x, topk_weights, topk_ids) positionally to each kernel's experts."""
    import inspect

    from sglang_mxfp8.kernels.registry import all_kernels

    moe = [k for k in all_kernels() if hasattr(k, "experts")]
    assert len(moe) >= 5
    for kernel in moe:
        params = list(inspect.signature(kernel.experts).parameters)
        assert params == ["layer", "state", "x", "topk_weights", "topk_ids"], (kernel.name, params)


def test_every_hopper_moe_flag_we_serve_leaves_sglangs_routing_in_the_form_it_captures():
    """SGLang's routing capture (--enable-return-routed-experts) records top-k ids where its TopK computes them in the
    standard form (select_experts); a runner backend that is Triton-kernels, FlashInfer TRT-LLM or FlashInfer MXFP4
    makes TopK hand the router logits over unrouted instead. No Hopper MoE flag that our kernels serve is one of
    those, on either SGLang release (the launch keeps the flag as given: test_patches); tests/gpu checks the captured
    experts against the BF16 server's."""
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    from sglang_mxfp8.cli.doctor import KNOWN_GPUS
    from sglang_mxfp8.flags import MOE_FLAGS
    from sglang_mxfp8.kernels import registry

    for gpu in ("h100", "h200"):
        spec = GpuSpec(*KNOWN_GPUS[gpu])
        ours = [flag for flag in MOE_FLAGS if registry.table("moe", spec).entries(flag)
                and not registry.native("moe", spec, flag)]
        assert ours == ["auto", "triton", "flashinfer_cutlass"], ours
        for flag in ours:
            backend = MoeRunnerBackend(flag)
            assert not (backend.is_triton_kernels() or backend.is_flashinfer_trtllm() or backend.is_flashinfer_mxfp4())
