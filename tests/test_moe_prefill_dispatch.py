"""Which MoE layers and batches the Hopper MoE path runs on DeepGEMM's grouped GEMM, SGLang's CUTLASS grouped
MoE or the one-token GEMV, the SGLANG_MXFP8_DEEPGEMM_PREFILL_MOE, SGLANG_MXFP8_CUTLASS_PREFILL_MOE and
SGLANG_MXFP8_MOE_GEMV switches, and the CUTLASS scratch tensors (the kernels' numerics and the apply() dispatch
itself: tests/gpu)."""

import importlib.util
import sys
import types

import dataclasses

import pytest
import torch
from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig

from sglang_mxfp8 import dense, moe_hopper

QWEN3 = MoeRunnerConfig(num_experts=128, num_local_experts=128, hidden_size=2048, intermediate_size_per_partition=768,
                        top_k=8, params_dtype=torch.bfloat16)


def test_prefill_batches_take_cutlass_by_default(monkeypatch):
    monkeypatch.delenv(moe_hopper.CUTLASS_PREFILL_ENV, raising=False)
    assert moe_hopper.cutlass_prefill_min_tokens() == moe_hopper.CUTLASS_PREFILL_MIN_TOKENS == 2048
    assert moe_hopper.fused_moe_unsupported(QWEN3, ep_size=1) is None


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_prefill_switch_off(value, monkeypatch):
    monkeypatch.setenv(moe_hopper.CUTLASS_PREFILL_ENV, value)
    assert moe_hopper.cutlass_prefill_min_tokens() == 0


def test_deepgemm_switch_off(monkeypatch):
    monkeypatch.setenv(moe_hopper.DEEPGEMM_PREFILL_ENV, "0")
    assert moe_hopper.deepgemm_unavailable() == "SGLANG_MXFP8_DEEPGEMM_PREFILL_MOE=0"


@pytest.mark.parametrize("min_m,max_m,top_k,experts", [(1024, 8192, 8, 128), (1024, 16384, 8, 128), (1024, 8192, 4, 16)])
def test_deepgemm_moe_precompile_runs_one_batch_per_tile_config(min_m, max_m, top_k, experts):
    """DeepGEMM's grouped GEMM picks its SM90 tile config from ceil(expected rows per expert / 128): the batches run
    at load reach every such value that batches of min_m..max_m tokens can, each once (Qwen3-30B-A3B: four)."""
    ms = moe_hopper.deepgemm_moe_precompile_ms(min_m, max_m, top_k, experts)

    def bucket(m):
        return -(-(-(-m * top_k // experts)) // 128)

    assert min_m <= ms[0] and ms[-1] <= max_m
    assert sorted(bucket(m) for m in ms) == sorted({bucket(m) for m in range(min_m, max_m + 1)})
    if (max_m, top_k) == (8192, 8):
        assert ms == [1024, 2049, 4097, 6145]


@pytest.mark.skipif(importlib.util.find_spec("deep_gemm") is not None, reason="deep_gemm is installed here")
def test_deepgemm_not_installed_is_named(monkeypatch):
    monkeypatch.delenv(moe_hopper.DEEPGEMM_PREFILL_ENV, raising=False)
    assert moe_hopper.deepgemm_unavailable() == (
        "deep_gemm does not import (ModuleNotFoundError: No module named 'deep_gemm')")


def test_a_deepgemm_build_without_the_psum_layout_is_refused(monkeypatch):
    """A DeepGEMM whose contiguous grouped GEMM takes no per-expert end rows (the signature of sgl-deep-gemm 0.0.1's
    ``m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices)``) is named, not called with arguments it refuses."""
    old = types.ModuleType("deep_gemm")
    old.__version__ = "0.0.1"

    def m_grouped_fp8_gemm_nt_contiguous(lhs, rhs, out, m_indices):
        """m_grouped_fp8_gemm_nt_contiguous(arg0: tuple, arg1: tuple, arg2: torch.Tensor, arg3: torch.Tensor) -> None"""

    old.m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
    monkeypatch.setitem(sys.modules, "deep_gemm", old)
    monkeypatch.delenv(moe_hopper.DEEPGEMM_PREFILL_ENV, raising=False)
    assert moe_hopper.deepgemm_unavailable() == "deep_gemm 0.0.1 has no contiguous grouped GEMM with use_psum_layout"


@pytest.mark.parametrize("deepgemm_why,cutlass_on,expected", [
    (None, True, ("deepgemm", 1024, None)),
    ("not installed", True, ("cutlass", 2048, "not installed")),
    ("not installed", False, ("cutlass", 0, "not installed")),
])
def test_prefill_moe_choice(deepgemm_why, cutlass_on, expected, monkeypatch):
    """DeepGEMM from 1024 tokens where it can run; else the CUTLASS grouped MoE from 2048 unless switched off.
    (Sizes that are not multiples of 128 never get here: the resolver refuses the Hopper MoE, test_resolver.)"""
    monkeypatch.setattr(moe_hopper, "deepgemm_unavailable", lambda: deepgemm_why)
    monkeypatch.setenv(moe_hopper.CUTLASS_PREFILL_ENV, "1" if cutlass_on else "0")
    assert moe_hopper.prefill_moe_choice() == expected


@pytest.mark.parametrize("change,ep_size,why", [
    (dict(activation="gelu"), 1, "activation gelu"),
    (dict(is_gated=False), 1, "gated False"),
    (dict(apply_router_weight_on_input=True), 1, "router weights on the input"),
    (dict(no_combine=True), 1, "no combine"),
    (dict(gemm1_clamp_limit=7.0), 1, "clamped or scaled gate"),
    (dict(gemm1_alpha=1.702), 1, "clamped or scaled gate"),
    ({}, 2, "expert parallel size 2"),
])
def test_layers_the_cutlass_moe_cannot_compute_stay_on_triton(change, ep_size, why):
    assert why in moe_hopper.fused_moe_unsupported(dataclasses.replace(QWEN3, **change), ep_size)


def test_scratch_is_allocated_once_per_shape_and_shared_by_layers():
    a = moe_hopper.CutlassGroupedMoE(16, 512, 256, "cpu")
    b = moe_hopper.CutlassGroupedMoE(16, 512, 256, "cpu", expert_specialized=True)
    other = moe_hopper.CutlassGroupedMoE(16, 512, 128, "cpu")
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
    from sglang_mxfp8.convert import convert
    from sglang_mxfp8.tiny_model import write_qwen3_moe

    mx = tmp_path / "mx"
    convert(write_qwen3_moe(tmp_path / "bf16", **dims), mx, progress=False)
    return cli, ["doctor", "--gpu", "h200", "--model", str(mx), "--moe-runner-backend", "triton"]


def test_doctor_names_the_prefill_moe(tmp_path, capsys, monkeypatch):
    cli, doctor = _doctor_on_tiny_model(tmp_path)

    def moe_line():
        assert cli(doctor) == 0
        line = next(s for s in capsys.readouterr().out.splitlines() if "MoE experts" in s)
        assert line.startswith("  MoE experts (hidden 256, intermediate 128): hopper_triton_moe")
        return line

    monkeypatch.delenv(moe_hopper.CUTLASS_PREFILL_ENV, raising=False)
    monkeypatch.setenv(moe_hopper.DEEPGEMM_PREFILL_ENV, "0")
    assert moe_line().endswith("; batches of 2048+ tokens on SGLang's CUTLASS grouped MoE "
                               "(not DeepGEMM: SGLANG_MXFP8_DEEPGEMM_PREFILL_MOE=0)")
    monkeypatch.setattr(moe_hopper, "deepgemm_unavailable", lambda: None)  # as where deep_gemm imports
    assert moe_line().endswith("; batches of 1024+ tokens on DeepGEMM's grouped FP8 GEMM")
    monkeypatch.setattr(moe_hopper, "deepgemm_unavailable", lambda: "not installed")
    monkeypatch.setenv(moe_hopper.CUTLASS_PREFILL_ENV, "0")
    assert "grouped" not in moe_line()


def test_gemv_moe_runs_on_the_measured_shape_unless_switched_off(monkeypatch):
    monkeypatch.delenv(moe_hopper.MOE_GEMV_ENV, raising=False)
    monkeypatch.setenv(dense.GEMV_ENV, "0")  # the dense GEMV's switch is not the MoE's
    assert moe_hopper.gemv_moe_runs(2048, 768)  # Qwen3-30B-A3B
    assert not moe_hopper.gemv_moe_runs(2048, 384)  # its TP2 shard: not measured
    assert not moe_hopper.gemv_moe_runs(256, 128)
    monkeypatch.setenv(moe_hopper.MOE_GEMV_ENV, "0")
    assert not moe_hopper.gemv_moe_runs(2048, 768)


@pytest.mark.parametrize("change,ep_size", [({}, 1), (dict(activation="gelu"), 1), (dict(gemm1_alpha=1.702), 1), ({}, 2)])
def test_layers_our_moe_paths_cannot_compute_keep_every_batch_on_triton(change, ep_size):
    import sglang.srt.layers.quantization.fp8  # noqa: F401 - SGLang's module first: its patch imports quant_methods

    from sglang_mxfp8 import quant_methods as qm
    from sglang_mxfp8.resolver import HOPPER_TRITON_MOE, Choice

    method = qm.Mxfp8MoEMethod(qm.Mxfp8Config.from_config({"quant_method": "mxfp8", "activation_scheme": "dynamic",
                                                          "weight_block_size": [1, 32]}), "model.layers.0.mlp.experts")
    method.choice, method.gemv, method.prefill_min_tokens = Choice(HOPPER_TRITON_MOE, "test"), True, 2048
    layer = torch.nn.Module()
    layer.moe_ep_size = ep_size
    method.create_moe_runner(layer, dataclasses.replace(QWEN3, **change))
    supported = not change and ep_size == 1
    assert (method.gemv, method.prefill_min_tokens) == ((True, 2048) if supported else (False, 0))


def test_doctor_names_the_one_token_gemvs(tmp_path, capsys, monkeypatch):
    """Doctor names the dense GEMV on the layers, as served (q/k/v fused), of the shapes it runs on: none of the
    tiny model's, q/k/v and o of a model with Qwen3-30B-A3B's attention; the GEMV MoE only for experts of its
    measured shape; each switch removes its own."""
    from sglang_mxfp8.cli import GEMV_NOTE, MOE_GEMV

    cli, doctor = _doctor_on_tiny_model(tmp_path)
    doctor += ["--fp8-gemm-backend", "flashinfer_trtllm"]
    monkeypatch.delenv(dense.GEMV_ENV, raising=False)
    monkeypatch.delenv(moe_hopper.MOE_GEMV_ENV, raising=False)
    assert cli(doctor) == 0
    assert [s for s in capsys.readouterr().out.splitlines() if "GEMV" in s] == []
    _, wide = _doctor_on_tiny_model(tmp_path / "wide", hidden=2048, moe_intermediate=768, experts=2, layers=1,
                                    heads=32, kv_heads=4, head_dim=128)
    wide += ["--fp8-gemm-backend", "flashinfer_trtllm"]
    assert cli(wide) == 0
    lines = [s for s in capsys.readouterr().out.splitlines() if "GEMV" in s]
    assert len(lines) == 3 and all(s.endswith(GEMV_NOTE) for s in lines[:2]), lines
    assert lines[0].startswith("  dense model.layers.N.self_attn.qkv_proj [5120 x 2048] x1 (q_proj + k_proj + v_proj): "
                               "hopper_flashinfer_blockscale")
    assert lines[1].startswith("  dense model.layers.N.self_attn.o_proj [2048 x 4096] x1: hopper_flashinfer_blockscale")
    assert lines[2].startswith("  MoE experts (hidden 2048, intermediate 768): hopper_triton_moe") and lines[2].endswith(MOE_GEMV)
    monkeypatch.setenv(dense.GEMV_ENV, "0")
    assert cli(wide) == 0
    assert [s for s in capsys.readouterr().out.splitlines() if "GEMV" in s] == lines[2:]
    monkeypatch.setenv(moe_hopper.MOE_GEMV_ENV, "0")
    assert cli(wide) == 0
    assert not [s for s in capsys.readouterr().out.splitlines() if "GEMV" in s]


@pytest.mark.parametrize("tp,intermediate", [(4, 192), (8, 96)])
def test_a_tensor_parallel_split_hopper_kernels_cannot_hold_names_the_splits_that_work(tp, intermediate, monkeypatch):
    """Qwen3-30B-A3B's experts (intermediate 768) at --tp 4 / 8 on an H200: SGLang's FusedMoE hands our MoE method
    768 / tp rows per rank; the load fails in one line naming the splits whose share is a multiple of 128 and
    expert parallelism, instead of advising to keep the layer BF16."""
    import sglang.srt.layers.quantization.fp8  # noqa: F401 - SGLang's module first: its patch imports quant_methods

    from sglang_mxfp8 import quant_methods as qm
    from sglang_mxfp8.cli import KNOWN_GPUS
    from sglang_mxfp8.resolver import GpuSpec, Mxfp8ConfigError

    monkeypatch.setattr(qm, "current_gpu", lambda: GpuSpec(*KNOWN_GPUS["h200"]))
    method = qm.Mxfp8MoEMethod(qm.Mxfp8Config.from_config({"quant_method": "mxfp8", "activation_scheme": "dynamic",
                                                          "weight_block_size": [1, 32]}), "model.layers.0.mlp.experts")
    layer = torch.nn.Module()
    layer.moe_tp_size = tp
    with pytest.raises(Mxfp8ConfigError) as e:
        method.create_weights(layer, 128, 2048, intermediate, torch.bfloat16)
    assert str(e.value) == (
        f"model.layers.0.mlp.experts: intermediate size 768 split {tp} ways by tensor parallelism (--tp / --ep-size) "
        f"leaves {intermediate} per rank, not a multiple of 128, which Hopper block-FP8 MoE kernels need on NVIDIA H200 "
        "(SM90); serve with --tp / --ep-size = 1, 2, 3 or 6 (--ep-size equal to --tp keeps each expert whole on its rank)")


def test_doctor_at_tensor_and_expert_parallel_sizes(tmp_path, capsys, monkeypatch):
    """doctor --tp / --ep-size: each served layer's rank shard as SGLang's parallel linears cut it (q/k/v by heads,
    key/value heads replicated past their count), the kernels chosen on it, and the MoE per rank."""
    monkeypatch.delenv(moe_hopper.CUTLASS_PREFILL_ENV, raising=False)
    monkeypatch.setattr(moe_hopper, "deepgemm_unavailable", lambda: "not installed")
    cli, doctor = _doctor_on_tiny_model(tmp_path, hidden=2048, moe_intermediate=768, experts=2, layers=1,
                                        heads=32, kv_heads=4, head_dim=128)

    def run(*flags):
        status = cli(doctor + list(flags))
        lines = [s for s in capsys.readouterr().out.splitlines() if s.startswith(("  dense", "  MoE", "--ep"))]
        return status, lines

    status, (qkv, o, moe) = run("--tp", "4")
    assert status == 1
    assert "qkv_proj [5120 x 2048] x1 (q_proj + k_proj + v_proj), [1280 x 2048] per rank: hopper_flashinfer_blockscale" in qkv
    assert "o_proj [2048 x 4096] x1, [2048 x 1024] per rank: hopper_flashinfer_blockscale" in o
    assert moe.startswith("  MoE experts: ERROR ") and "leaves 192 per rank" in moe and "= 1, 2, 3 or 6 " in moe
    status, (qkv, o, moe) = run("--tp", "8")  # 4 key/value heads on 8 ranks: one per rank, replicated
    assert status == 1 and "[768 x 2048] per rank" in qkv and "[2048 x 512] per rank" in o and "leaves 96 per rank" in moe
    status, (qkv, o, moe) = run("--tp", "4", "--ep-size", "4")  # whole experts: neither CUTLASS prefill nor GEMV
    assert status == 0 and "[1280 x 2048] per rank" in qkv
    assert moe.endswith("(hidden 2048, intermediate 768, experts split 4 ways): hopper_triton_moe (flag triton on SM90: "
                        "SGLang's Triton fused MoE, block FP8 128x128 after lossless scale conversion)")
    status, (qkv, o, moe) = run("--tp", "2")
    assert status == 0 and "[2560 x 2048] per rank" in qkv and "[2048 x 2048] per rank" in o
    assert "(hidden 2048, intermediate 768, 384 per rank): hopper_triton_moe" in moe
    assert moe.endswith("; batches of 2048+ tokens on SGLang's CUTLASS grouped MoE (not DeepGEMM: not installed)")  # no GEMV MoE: not its shape
    status, (qkv, o, moe) = run("--tp", "3")
    assert status == 1 and qkv.endswith("ERROR model.layers.N.self_attn.qkv_proj: --tp 3 does not divide 32 attention "
                                        "heads (SGLang refuses it too)")
    assert o.endswith("--tp 3 does not divide 4096 (SGLang refuses it too)") and "256 per rank" in moe
    assert run("--tp", "4", "--ep-size", "3") == (1, ["--ep-size 3 does not divide --tp 4; SGLang's expert "
                                                     "parallelism splits the tensor-parallel ranks"])
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as e:
            cli(doctor + ["--tp", bad])
        assert e.value.code == 2 and f"argument --tp: {bad!r} is not a number of GPUs (1 or more)" in capsys.readouterr().err
