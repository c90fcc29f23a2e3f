"""Activation inside stock SGLang: real ServerArgs, real ModelConfig, fresh interpreters (.pth hook)."""

import json

import pytest

from conftest import run_python, write_config

PREPARE = """
from sglang.srt.server_args import prepare_server_args
a = prepare_server_args(['--model-path', {path!r}, '--quantization', 'mxfp8', '--moe-runner-backend', {moe!r},
                         '--skip-tokenizer-init', '--device', 'cpu'])
print('MOE=' + a.moe_runner_backend)
"""


@pytest.mark.parametrize("moe", ["flashinfer_cutlass", "triton"])
def test_prepare_server_args_keeps_our_moe_backend(miles_ckpt, moe):
    p = run_python(PREPARE.format(path=str(miles_ckpt), moe=moe))
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"MOE={moe}" in p.stdout


def test_disable_env_restores_sglang_rewrite(miles_ckpt):
    p = run_python(PREPARE.format(path=str(miles_ckpt), moe="flashinfer_cutlass"), {"SGLANG_MXFP8_DISABLE": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "MOE=flashinfer_trtllm" in p.stdout
    assert "Overriding 'flashinfer_cutlass'" in p.stderr + p.stdout


def test_fp8_module_sees_our_dispatch_and_config():
    p = run_python(
        "import sglang.srt.layers.quantization.fp8 as fp8, sglang.srt.layers.quantization as q, sglang_mxfp8.dense as d\n"
        "print(fp8.dispatch_w8a8_mxfp8_linear.__wrapped__ is d.dispatch_w8a8_mxfp8_linear,"
        " q.QUANTIZATION_METHODS['mxfp8'].__module__, q.QUANTIZATION_METHODS['mxfp8'](is_checkpoint_fp8_serialized=True, use_mxfp8=True).get_min_capability())"
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["True", "sglang_mxfp8.quant_methods", "90"]


def test_disabled_interpreter_is_untouched():
    p = run_python(
        "import sglang.srt.layers.quantization as q; print(q.QUANTIZATION_METHODS['mxfp8'].__name__)",
        {"SGLANG_MXFP8_DISABLE": "1"},
    )
    assert p.returncode == 0 and p.stdout.strip() == "Fp8Config"


def test_hook_is_cheap_in_unrelated_interpreters():
    p = run_python("import sys; print(sorted(m for m in ('torch', 'sglang', 'sglang_mxfp8.plugin') if m in sys.modules))")
    assert p.returncode == 0 and p.stdout.strip() == "[]"


def test_model_config_reads_modelopt_mxfp8_as_mxfp8(tmp_path):
    ckpt = write_config(tmp_path / "modelopt", {"quant_method": "modelopt", "quant_algo": "MXFP8", "exclude_modules": ["lm_head"]})
    code = (
        "from sglang.srt.configs.model_config import ModelConfig\n"
        f"m = ModelConfig({str(ckpt)!r})\n"
        "print('Q=' + str(m.quantization))\n"
    )
    ours = run_python(code)
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert "Q=mxfp8" in ours.stdout
    stock = run_python(code, {"SGLANG_MXFP8_DISABLE": "1"})
    assert "Q=modelopt_fp8" in stock.stdout  # the misreading this patch fixes


def test_from_config_reads_both_flavours():
    code = (
        "import json, sglang.srt.layers.quantization as q\n"
        "C = q.QUANTIZATION_METHODS['mxfp8']\n"
        f"a = C.from_config({json.dumps({'quant_method': 'mxfp8', 'activation_scheme': 'dynamic', 'weight_block_size': [1, 32], 'modules_to_not_convert': ['lm_head']})})\n"
        "b = C.from_config({'quant_method': 'mxfp8', 'quant_algo': 'MXFP8', 'exclude_modules': ['lm_head']})\n"
        "print(a.use_mxfp8, a.scale_name, a.weight_block_size, 'model.lm_head' in a.ignored_layers)\n"
        "print(b.use_mxfp8, b.scale_name, b.weight_block_size, 'model.lm_head' in b.ignored_layers)\n"
    )
    p = run_python(code)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["True weight_scale_inv [1, 32] True", "True weight_scale [1, 32] True"]


def test_moved_patch_target_fails_loudly():
    p = run_python(
        "import sglang.srt.server_args as sa\n"
        "from sglang_mxfp8 import plugin\n"
        "class Gone: pass\n"
        "sa.ServerArgs = Gone\n"
        "plugin.patch_server_args()\n"
    )
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert "PatchTargetMissing: sglang_mxfp8 patch 'server_args.moe_kernel_config': sglang 0.5.10.post1 has no Gone._handle_moe_kernel_config" in last
    assert "SGLANG_MXFP8_DISABLE=1" in last


def test_tensor_update_postprocess_runs_our_methods_once():
    """postprocess_mxfp8_modules on a real module tree with our real linear method (CPU tensors)."""
    code = """
import torch, sglang.srt.layers.quantization as q
from sglang_mxfp8 import plugin, quant_methods
from sglang_mxfp8.dense import HopperTritonDense
from sglang_mxfp8.numerics import quantize_mxfp8
from sglang_mxfp8.resolver import Choice
cfg = q.QUANTIZATION_METHODS['mxfp8'](is_checkpoint_fp8_serialized=True, use_mxfp8=True)
m = quant_methods.Mxfp8LinearMethod(cfg, 'model.layers.0.mlp.down_proj')
m.backend = HopperTritonDense(Choice(HopperTritonDense.kernel, 't'), 'model.layers.0.mlp.down_proj')
layer = torch.nn.Module(); layer.quant_method = m
qw, s = quantize_mxfp8(torch.randn(256, 512) * torch.logspace(-2, 2, 512))
layer.weight = torch.nn.Parameter(qw.clone(), requires_grad=False)
layer.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
m.backend.create_buffers(layer, 256, 512)
model = torch.nn.Sequential(layer)
print(plugin.postprocess_mxfp8_modules(model), quant_methods.ConversionReport.layers)
plugin.postprocess_mxfp8_modules(model)
print(quant_methods.ConversionReport.layers)  # idempotent: nothing new to convert
"""
    p = run_python(code)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["1", "1", "0"]


def test_checkpoint_declares_experts(miles_ckpt, tmp_path):
    from sglang_mxfp8.checkpoint import has_experts

    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    assert has_experts(miles_ckpt) and not has_experts(dense)


def test_launch_validation_names_flag_gpu_and_choices(miles_ckpt):
    from types import SimpleNamespace

    from sglang_mxfp8.plugin import validate_launch
    from sglang_mxfp8.resolver import GpuSpec, Mxfp8ConfigError

    h200 = GpuSpec("NVIDIA H200", 90)
    args = SimpleNamespace(fp8_gemm_runner_backend="flashinfer_trtllm", moe_runner_backend="triton", model_path=str(miles_ckpt))
    validate_launch(args, h200, flashinfer=True)
    args.moe_runner_backend = "flashinfer_cutlass"  # a MoE checkpoint: the SM90 CUTLASS MoE module is not built
    with pytest.raises(Mxfp8ConfigError, match=r"flashinfer_cutlass on NVIDIA H200 \(SM90\).*40 min.*--moe-runner-backend triton"):
        validate_launch(args, h200, flashinfer=True)
    args.moe_runner_backend, args.fp8_gemm_runner_backend = "triton", "flashinfer_cutlass"
    with pytest.raises(Mxfp8ConfigError, match=r"--fp8-gemm-backend flashinfer_cutlass cannot run MXFP8 on NVIDIA H200 \(SM90\); valid choices on this GPU: auto, triton, flashinfer_trtllm"):
        validate_launch(args, h200, flashinfer=True)


def test_modelopt_mxfp8_described_only_by_hf_quant_config(tmp_path):
    ckpt = write_config(tmp_path / "modelopt-file")
    (ckpt / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.37"},
        "quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}))
    code = (
        "from sglang.srt.configs.model_config import ModelConfig\n"
        "from sglang.srt.configs.load_config import LoadConfig\n"
        "from sglang.srt.model_loader import loader\n"
        f"m = ModelConfig({str(ckpt)!r})\n"
        "c = loader.get_quant_config(m, LoadConfig(), {})\n"
        "print(m.quantization, type(c).__name__, flush=True)\n"
        "print(c.is_checkpoint_fp8_serialized, c.scale_name, 'lm_head' in c.ignored_layers)\n"
    )
    ours = run_python(code)
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert ours.stdout.splitlines() == ["mxfp8 Mxfp8Config", "True weight_scale True"]
    stock = run_python(code, {"SGLANG_MXFP8_DISABLE": "1"})
    assert stock.stdout.splitlines()[0] == "modelopt_fp8 ModelOptFp8Config"  # stock SGLang misreads it as per-tensor FP8


def test_patches_apply_once_and_keep_staticmethods():
    p = run_python(
        "import inspect\n"
        "from sglang.srt.model_loader import loader\n"
        "from sglang_mxfp8 import plugin\n"
        "plugin.patch_loader(); plugin.patch_loader()\n"
        "f = loader.DefaultModelLoader.load_weights_and_postprocess\n"
        "print(type(inspect.getattr_static(loader.DefaultModelLoader, 'load_weights_and_postprocess')).__name__,"
        " f.__sglang_mxfp8_patch__, hasattr(f.__wrapped__, '__sglang_mxfp8_patch__'))\n"
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["staticmethod", "loader.conversion_report", "False"]
