"""Activation inside stock SGLang: real ServerArgs, real ModelConfig, fresh interpreters (.pth hook); the launch
checks and builds (sglang_mxfp8.sglang.launch); refit rollback and storage checks (sglang_mxfp8.sglang.weights)."""

import json
import os
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from conftest import QWEN3_MOE_CONFIG, run_python, write_config

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang

PREPARE = """
from sglang.srt.server_args import prepare_server_args
a = prepare_server_args(['--model-path', {path!r}, '--quantization', 'mxfp8', '--moe-runner-backend', {moe!r},
                         '--skip-tokenizer-init', '--device', 'cpu'])
if hasattr(a, 'resolve_once'):  # SGLang >= 0.5.20 resolves at launch, and keeps its decisions beside the input
    from sglang.srt.arg_groups.model_override_base import resolved_view
    a.resolve_once()
    a = resolved_view(a)
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
        "import sglang.srt.layers.quantization.fp8 as fp8, sglang.srt.layers.quantization as q\n"
        "import sglang_mxfp8.sglang.quant_methods as d\n"
        "print(fp8.dispatch_w8a8_mxfp8_linear.__wrapped__ is d.dispatch_w8a8_mxfp8_linear,"
        " q.QUANTIZATION_METHODS['mxfp8'].__module__,"
        " q.QUANTIZATION_METHODS['mxfp8'](is_checkpoint_fp8_serialized=True, use_mxfp8=True).get_min_capability())"
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["True", "sglang_mxfp8.sglang.quant_methods", "90"]


def test_disabled_interpreter_is_untouched():
    p = run_python(
        "import sglang.srt.layers.quantization as q; print(q.QUANTIZATION_METHODS['mxfp8'].__name__)",
        {"SGLANG_MXFP8_DISABLE": "1"},
    )
    assert p.returncode == 0 and p.stdout.strip() == "Fp8Config"


def test_hook_is_cheap_in_unrelated_interpreters():
    p = run_python("import sys; print(sorted(m for m in ('torch', 'sglang', 'logging', 'sglang_mxfp8.sglang.patching',"
                   " 'sglang_mxfp8.sglang.launch', 'sglang_mxfp8.sglang.patches.loader') if m in sys.modules),"
                   " 'sglang_mxfp8.sglang.patches' in sys.modules)")
    assert p.returncode == 0 and p.stdout.strip() == "[] True"  # the patch list alone; their code when SGLang runs


def test_model_config_reads_modelopt_mxfp8_as_mxfp8(tmp_path):
    ckpt = write_config(
        tmp_path / "modelopt", {"quant_method": "modelopt", "quant_algo": "MXFP8", "exclude_modules": ["lm_head"]}
    )
    code = (
        "from sglang.srt.configs.model_config import ModelConfig\n"
        f"m = ModelConfig({str(ckpt)!r})\n"
        "print('Q=' + str(m.quantization))\n"
    )
    ours = run_python(code + "from sglang_mxfp8.sglang import patching\nprint(sorted(patching.KEPT))\n")
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert "Q=mxfp8" in ours.stdout
    stock = run_python(code, {"SGLANG_MXFP8_DISABLE": "1"})
    if "Q=mxfp8" in stock.stdout:  # SGLang 0.5.23 reads it right itself: its own piece is kept
        assert "['model_config.modelopt_mxfp8']" in ours.stdout
    else:
        assert "Q=modelopt_fp8" in stock.stdout and "[]" in ours.stdout  # the misreading this patch fixes


MXFP8_SECTION = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32],
                 "modules_to_not_convert": ["lm_head"]}


def test_from_config_reads_both_flavours():
    code = (
        "import json, sglang.srt.layers.quantization as q\n"
        "C = q.QUANTIZATION_METHODS['mxfp8']\n"
        f"a = C.from_config({json.dumps(MXFP8_SECTION)})\n"
        "b = C.from_config({'quant_method': 'mxfp8', 'quant_algo': 'MXFP8', 'exclude_modules': ['lm_head']})\n"
        "print(a.use_mxfp8, a.scale_name, a.weight_block_size, 'model.lm_head' in a.ignored_layers)\n"
        "print(b.use_mxfp8, b.scale_name, b.weight_block_size, 'model.lm_head' in b.ignored_layers)\n"
    )
    p = run_python(code)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["True weight_scale_inv [1, 32] True", "True weight_scale [1, 32] True"]


def test_a_patch_whose_imports_moved_leaves_sglang_importable():
    """A patch whose imports fail on this SGLang (SGLang 0.5.23 has no is_in_piecewise_cuda_graph, which our quant
    methods import; the patch function here raises what that import raises there): the patch is left out with one
    warning, and SGLang's own import, which runs the patch from the import hook, goes through (it raised before)."""
    p = run_python(
        "import logging, sys\n"
        "logging.basicConfig(level=logging.WARNING, format='LOG %(message)s', stream=sys.stdout)\n"
        "from sglang_mxfp8.sglang import patching\n"
        "from sglang_mxfp8.sglang.patches import quantization\n"
        "def moved():\n"
        "    raise ImportError(\"cannot import name 'is_in_piecewise_cuda_graph' from 'sglang.srt.compilation'\")\n"
        "quantization.register_config = moved\n"
        "import sglang.srt.layers.quantization as q\n"
        "print('stock', q.QUANTIZATION_METHODS['mxfp8'].__module__)\n"
        "print(sorted(patching.MISSING))\n"
    )
    assert p.returncode == 0, p.stderr[-3000:]
    log, stock, missing = p.stdout.splitlines()[-3:]
    assert log.startswith(f"LOG sglang_mxfp8 patch 'quantization.mxfp8_config': sglang {version('sglang')} fails it "
                          "(ImportError: cannot import name 'is_in_piecewise_cuda_graph'")
    assert log.endswith("MXFP8 checkpoints cannot be served on this SGLang, other models run as SGLang ships them")
    assert stock == "stock sglang.srt.layers.quantization.fp8" and missing == "['quantization.mxfp8_config']"


def test_moved_patch_target_leaves_sglang_stock_and_refuses_mxfp8_in_one_line():
    """A patch target this SGLang moved: one warning, SGLang imports and runs as shipped (BF16 models keep serving);
    an MXFP8 config is then refused with that line."""
    p = run_python(
        "import logging, sys\n"
        "logging.basicConfig(level=logging.WARNING, format='LOG %(message)s', stream=sys.stdout)\n"
        "import sglang.srt.configs.model_config as mc\n"
        "import sglang.srt.layers.quantization as q\n"
        "from sglang_mxfp8.sglang import patching\n"
        "from sglang_mxfp8.sglang.patches import model_config\n"
        "class Gone: pass\n"
        "mc.ModelConfig = Gone\n"
        "model_config.read_modelopt_mxfp8(); model_config.read_modelopt_mxfp8()\n"
        "print('imported', mc.ModelConfig is Gone)\n"
        "try:\n"
        "    q.QUANTIZATION_METHODS['mxfp8'](is_checkpoint_fp8_serialized=True, use_mxfp8=True)\n"
        "except patching.PatchTargetMissing as e:\n"
        "    print('refused', e)\n"
    )
    assert p.returncode == 0, p.stderr[-3000:]
    line = (
        f"sglang_mxfp8 patch 'model_config.modelopt_mxfp8': sglang {version('sglang')} has no "
        "Gone._parse_modelopt_quant_config (tested with sglang 0.5.10.post1 to 0.5.23); MXFP8 checkpoints cannot be "
        "served on this SGLang, other models run as SGLang ships them"
    )
    assert p.stdout.splitlines() == [f"LOG {line}", "imported True", f"refused {line}"]


def test_tensor_update_postprocess_runs_our_methods_once():
    """postprocess_mxfp8_modules on a real module tree with our real linear method (CPU tensors)."""
    code = """
import torch, sglang.srt.layers.quantization as q
from sglang_mxfp8.sglang import quant_methods, weights
from sglang_mxfp8.format.numerics import quantize_mxfp8
from sglang_mxfp8.kernels import registry
from sglang_mxfp8.kernels.base import LinearSpec
from sglang_mxfp8.platform import GpuSpec
cfg = q.QUANTIZATION_METHODS['mxfp8'](is_checkpoint_fp8_serialized=True, use_mxfp8=True)
m = quant_methods.Mxfp8LinearMethod(cfg, 'model.layers.0.mlp.down_proj')
m.plan = registry.select_linear(LinearSpec('model.layers.0.mlp.down_proj', 256, 512), GpuSpec('NVIDIA H200', 90),
                                'triton')
layer = torch.nn.Module(); layer.quant_method = m
qw, s = quantize_mxfp8(torch.randn(256, 512) * torch.logspace(-2, 2, 512))
layer.weight = torch.nn.Parameter(qw.clone(), requires_grad=False)
layer.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
layer.mxfp8_state = m.plan.create_buffers(layer)
model = torch.nn.Sequential(layer)
import logging
logging.basicConfig(level=logging.INFO, format="LOG %(message)s", stream=__import__("sys").stdout)
print(weights.postprocess_mxfp8_modules(model), quant_methods.ConversionReport.layers)
weights.postprocess_mxfp8_modules(model)
print(quant_methods.ConversionReport.layers)  # idempotent: nothing new to convert
print(sorted(weights.mxfp8_tensors(model)))
layer.mxfp8_state.converter.block_scale = layer.mxfp8_state.converter.block_scale.clone()  # storage moved
weights.postprocess_mxfp8_modules(model)
"""
    p = run_python(code)
    assert p.returncode == 0, p.stderr[-3000:]
    out = [line for line in p.stdout.splitlines() if not line.startswith("LOG")]
    logs = [line for line in p.stdout.splitlines() if line.startswith("LOG") and ("storage" in line or "moved" in line)]
    assert out[0].split() == ["1", "1"] and out[1] == "0"
    assert "0.weight" in out[2] and "0.weight_scale_inv" in out[2] and "0.mxfp8_state.converter.block_scale" in out[2]
    assert logs[0] == "LOG sglang_mxfp8: storage of 7 MXFP8 tensors recorded at first load"
    assert logs[1] == "LOG sglang_mxfp8: storage of all 7 MXFP8 tensors unchanged since the first load"
    assert logs[2].startswith("LOG sglang_mxfp8: 1 of 7 MXFP8 tensors moved since the first load "
                              "(first: 0.mxfp8_state.converter.block_scale)")


def test_checkpoint_declares_experts(miles_ckpt, tmp_path):
    from sglang_mxfp8.format.checkpoint import has_experts

    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    assert has_experts(miles_ckpt) and not has_experts(dense)


def test_launch_validation_names_flag_gpu_and_choices(miles_ckpt):
    from dataclasses import replace

    from sglang_mxfp8.platform import GpuSpec
    from sglang_mxfp8.sglang.launch import LaunchConfig, Mxfp8LaunchError, validate_launch

    h200 = GpuSpec("NVIDIA H200", 90)
    args = LaunchConfig(model_path=str(miles_ckpt), dense_flag="flashinfer_trtllm", moe_flag="triton")
    validate_launch(args, h200)
    args = replace(args, moe_flag="flashinfer_cutlass")  # a MoE checkpoint: FlashInfer's SM90 fused MoE serves it
    validate_launch(args, h200)
    args = replace(args, moe_flag="flashinfer_trtllm")
    with pytest.raises(Mxfp8LaunchError) as e:
        validate_launch(args, h200)
    assert e.value.code == (
        "sglang_mxfp8: --moe-runner-backend flashinfer_trtllm cannot run MXFP8 on NVIDIA H200 (SM90): "
        "no such kernel for this architecture; valid choices on this GPU: auto, triton, flashinfer_cutlass"
    )
    args = replace(args, moe_flag="triton", dense_flag="flashinfer_cutlass")
    with pytest.raises(Mxfp8LaunchError) as e:
        validate_launch(args, h200)
    assert e.value.code == (
        "sglang_mxfp8: --fp8-gemm-backend flashinfer_cutlass cannot run MXFP8 on NVIDIA H200 (SM90): "
        "no such kernel for this architecture; valid choices on this GPU: auto, triton, flashinfer_trtllm"
    )


def _tiny_moe_launch(tmp_path):
    """The launch of a tiny MXFP8 Qwen3-MoE (converted from tmp_path/bf16) with FlashInfer's dense GEMM and the
    Triton MoE."""
    from sglang_mxfp8.bench.tiny_model import write_qwen3_moe
    from sglang_mxfp8.format.convert import convert
    from sglang_mxfp8.sglang.launch import LaunchConfig

    mx = tmp_path / "mx"
    convert(write_qwen3_moe(tmp_path / "bf16"), mx, progress=False)
    return LaunchConfig(model_path=str(mx), dense_flag="flashinfer_trtllm", moe_flag="triton")


def _failing_build_env(tmp_path, monkeypatch):
    """FlashInfer's workspace set to a file: the build of a JIT module fails at once, in FlashInfer's own code."""
    (tmp_path / "workspace-is-a-file").write_text("")
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "workspace-is-a-file"))
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0")  # what cuda_arch_list() reads on an H100 or H200


def test_launch_builds_each_planned_kernels_jit_module_once_in_a_process_of_its_own(tmp_path, monkeypatch, capfd):
    """The launch plans an MXFP8 MoE checkpoint with FlashInfer's dense GEMM and the Triton MoE: one build process for
    FlashInfer's GEMM module (the Triton MoE has none), started with no GPU visible, FlashInfer's target named and the
    launcher's pid; the same plans again start nothing. A build that fails is one warning line and exit status 1 (the
    server builds it when it loads the model); a kernel name the registry lacks is exit status 2."""
    from dataclasses import replace

    from sglang_mxfp8.platform import GpuSpec
    from sglang_mxfp8.sglang import launch

    args = _tiny_moe_launch(tmp_path)
    plans = launch.validate_launch(args, GpuSpec("NVIDIA H200", 90))
    assert {plan.base.name for plan in plans} == {"flashinfer_sm90", "triton_moe"} and len(plans) >= 3
    monkeypatch.setattr(launch, "_BUILDING", {})
    _failing_build_env(tmp_path, monkeypatch)
    process = launch.start_prebuilds(plans)
    environ = set()
    for _ in range(100):  # read while it imports torch (empty for a moment around its exec)
        environ = set(Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")) - {b""}
        if environ or process.poll() is not None:
            break
        time.sleep(0.05)
    assert process.args == [sys.executable, "-m", "sglang_mxfp8.kernels.jit_builds", "flashinfer_sm90"]
    assert {b"CUDA_VISIBLE_DEVICES=", b"FLASHINFER_CUDA_ARCH_LIST=9.0",
            f"SGLANG_MXFP8_LAUNCHER={os.getpid()}".encode()} <= environ
    assert launch.start_prebuilds(plans) is None and launch._BUILDING == {"flashinfer_sm90": process}
    assert process.wait(120) == 1
    assert "sglang_mxfp8: building flashinfer_sm90's JIT module at launch failed (" in capfd.readouterr().err
    assert launch.validate_launch(replace(args, model_path=str(tmp_path / "bf16")),
                                  GpuSpec("NVIDIA H200", 90)) == []  # a BF16 checkpoint: nothing of ours to build
    unknown = subprocess.run([sys.executable, "-m", "sglang_mxfp8.kernels.jit_builds", "no_such_kernel"],
                             capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "no kernel named no_such_kernel in the registry" in unknown.stderr


LAUNCHER = """
import os, sys, time
from sglang_mxfp8.platform import GpuSpec
from sglang_mxfp8.sglang.launch import LaunchConfig, start_prebuilds, validate_launch
args = LaunchConfig(model_path=sys.argv[1], dense_flag="flashinfer_trtllm", moe_flag="triton")
print(start_prebuilds(validate_launch(args, GpuSpec("NVIDIA H200", 90))).pid, flush=True)
if sys.argv[2] == "exits":
    os._exit(0)
time.sleep(600)
"""


def test_build_process_stops_with_its_launcher(tmp_path):
    """A launcher killed (SIGKILL: nothing of it runs) while its build process compiles: the build process, ninja and
    the compilers end within seconds, and nothing is built; so does one whose launcher exits before it has started.
    The compiler is a stand-in that never finishes (the test is of the processes, and needs no CUDA toolkit)."""
    import signal
    import time

    import psutil

    mx = _tiny_moe_launch(tmp_path).model_path
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "bin" / "nvcc").write_text('#!/bin/sh\n[ "$1" = --version ] && echo "Cuda compilation tools, release 12.9, '
                                       'V12.9.86" && exit 0\nexec sleep 600\n')
    (cuda / "bin" / "nvcc").chmod(0o755)
    env = dict(os.environ, FLASHINFER_WORKSPACE_BASE=str(tmp_path / "fi"), FLASHINFER_CUDA_ARCH_LIST="9.0",
               CUDA_HOME=str(cuda), FLASHINFER_NVCC=str(cuda / "bin" / "nvcc"))
    env.pop("SGLANG_MXFP8_LAUNCHER", None)
    for launcher_does in ("waits", "exits"):
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, mx, launcher_does], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env)
        child = psutil.Process(int(launcher.stdout.readline()))
        tree = [child]
        if launcher_does == "waits":
            for _ in range(600):  # until its compilers run
                tree = [child] + child.children(recursive=True)
                if any(p.name() == "sleep" for p in tree):
                    break
                time.sleep(0.2)
            assert {"ninja", "sleep"} <= {p.name() for p in tree}
            os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        gone, alive = psutil.wait_procs(tree, timeout=10)
        if child.is_running():
            alive = list({*alive, *child.children(recursive=True)})
        for process in alive:  # the test fails below; leave nothing running
            process.kill()
        assert not alive, (launcher_does, alive)
        log = launcher.stderr.read()
        assert "module ready" not in log and "failed" not in log, (launcher_does, log)  # stopped before either
        assert not list(tmp_path.glob("fi/**/*.so"))


def test_launch_args_are_read_before_sglang_as_sglangs_parser_reads_them():
    """The arguments the launch's builds depend on, read from the command line before SGLang is imported, equal what
    the running SGLang's own parser reads (its defaults too); a command line whose arguments may come from a
    config file, or which SGLang will refuse, is left to SGLang."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from types import SimpleNamespace

    from sglang_mxfp8.sglang.launch import LAUNCH_ARGS, LaunchConfig

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    older = {"tp_size": "tensor_parallel_size", "ep_size": "expert_parallel_size"}  # SGLang 0.5.10.post1's names
    for argv in (["--model-path", "/m"],
                 ["--model", "/m", "--tp", "2", "--ep", "4", "--quantization", "mxfp8"],
                 ["--host", "0.0.0.0", "--model-path=/m", "--tp-size=4", "--expert-parallel-size", "2",
                  "--fp8-gemm-backend", "flashinfer_trtllm", "--moe-runner-backend=flashinfer_cutlass", "--port", "3"],
                 ["--mem-fraction-static", "0.8", "--tensor-parallel-size", "8", "--ep-size", "8", "--model", "/m",
                  "--moe-runner-backend", "triton", "--fp8-gemm-backend=triton"]):
        theirs = parser.parse_args(argv)
        read = SimpleNamespace(**{dest: getattr(theirs, dest, getattr(theirs, older.get(dest, dest), None))
                                  for dest, _, _ in LAUNCH_ARGS})
        assert LaunchConfig.from_argv(argv) == LaunchConfig.from_server_args(read), argv
    assert LaunchConfig.from_argv(["--model-path", "/m", "--config", "c.yaml"]) is None
    assert LaunchConfig.from_argv(["--config=c.yaml"]) is None
    assert LaunchConfig.from_argv(["--model-path", "/m", "--tp-size", "two"]) is None
    assert LaunchConfig.from_argv(["--model-path"]) is None


def test_launch_builds_start_before_sglang_parses_only_for_an_mxfp8_launch(tmp_path, monkeypatch):
    """From the command line alone: a launch of an MXFP8 checkpoint on a Hopper GPU starts its build process and marks
    the environment its children inherit, so none of them starts another; a BF16 checkpoint, a launch without a model
    path, one with a config file or one that will be refused starts nothing. No GPU here: the test names an H200."""
    from sglang_mxfp8 import platform
    from sglang_mxfp8.platform import GpuSpec
    from sglang_mxfp8.sglang import launch

    mx = _tiny_moe_launch(tmp_path).model_path
    _failing_build_env(tmp_path, monkeypatch)
    monkeypatch.setattr(launch, "_BUILDING", {})
    monkeypatch.setattr(platform, "visible_gpu", lambda: GpuSpec("NVIDIA H200", 90))
    monkeypatch.setenv("SGLANG_MXFP8_LAUNCHER", "")  # removed again after the test
    flags = ["--fp8-gemm-backend", "flashinfer_trtllm", "--moe-runner-backend", "triton"]
    for argv in (
        [],
        flags,
        ["--model-path", str(tmp_path / "bf16")] + flags,
        ["--model-path", mx, "--config", "x.yaml"],
        ["--model-path", mx, "--fp8-gemm-backend", "flashinfer_cutlass"],
    ):  # refused on Hopper
        os.environ.pop("SGLANG_MXFP8_LAUNCHER", None)
        monkeypatch.setattr(sys, "argv", ["launch_server.py"] + argv)
        assert launch.start_launch_builds() is None and launch._BUILDING == {}, argv
    os.environ.pop("SGLANG_MXFP8_LAUNCHER", None)
    monkeypatch.setattr(sys, "argv", ["launch_server.py", "--model-path", mx] + flags)
    process = launch.start_launch_builds()
    assert process.args[-1] == "flashinfer_sm90" and os.environ["SGLANG_MXFP8_LAUNCHER"] == str(os.getpid())
    assert launch.start_launch_builds() is None  # a child of the launcher, or the launcher again: nothing more
    assert process.wait(120) == 1  # the workspace is a file: the build fails at once


def test_launch_builds_run_before_sglangs_server_args_executes(tmp_path):
    """In a fresh interpreter whose command line launches an MXFP8 checkpoint: the startup hook runs the early builds
    before SGLang's server_args module executes (no GPU here: it marks the launcher and starts nothing), and not with
    SGLANG_MXFP8_DISABLE=1."""
    mx = _tiny_moe_launch(tmp_path).model_path
    code = ("import os, sys\n"
            "from sglang_mxfp8.sglang.patches import server_args\n"
            "marks = []\n"
            "server_args.start_launch_builds = lambda: marks.append('sglang.srt.server_args' in sys.modules and\n"
            "    hasattr(sys.modules['sglang.srt.server_args'], 'ServerArgs'))\n"
            "import sglang.srt.server_args\n"
            "print('MARKS', marks)\n")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("SGLANG_MXFP8_LAUNCHER", None)
    for disable, expected in (("0", "MARKS [False]"), ("1", "MARKS []")):
        p = subprocess.run([sys.executable, "-c", code, "--model-path", mx], capture_output=True, text=True,
                           env=dict(env, SGLANG_MXFP8_DISABLE=disable), timeout=300, cwd="/")
        assert p.returncode == 0 and expected in p.stdout, p.stderr[-2000:]


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
    # SGLang up to 0.5.20 misreads it as per-tensor FP8; 0.5.23 reads MXFP8 (with its own Blackwell-only config class)
    assert stock.stdout.splitlines()[0] in ("modelopt_fp8 ModelOptFp8Config", "mxfp8 Fp8Config")


def test_patches_apply_once_and_keep_staticmethods():
    p = run_python(
        "import inspect\n"
        "from sglang.srt.model_loader import loader\n"
        "from sglang_mxfp8.sglang.patches import loader as patch\n"
        "patch.report_each_load(); patch.report_each_load()\n"
        "f = loader.DefaultModelLoader.load_weights_and_postprocess\n"
        "print(type(inspect.getattr_static(loader.DefaultModelLoader, 'load_weights_and_postprocess')).__name__,"
        " f.__sglang_mxfp8_patch__, hasattr(f.__wrapped__, '__sglang_mxfp8_patch__'))\n"
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["staticmethod", "loader.conversion_report", "False"]


# One MXFP8 linear layer with our real method (and a BF16 norm beside it) in a model SGLang's loader fills by name,
# as the refit runners below build it.
SERVED_LINEAR = """
cfg = q.QUANTIZATION_METHODS["mxfp8"](is_checkpoint_fp8_serialized=True, use_mxfp8=True)
method = quant_methods.Mxfp8LinearMethod(cfg, "layer")
method.plan = registry.select_linear(LinearSpec("layer", 256, 512), GpuSpec("NVIDIA H200", 90), "triton")
layer = torch.nn.Module(); layer.quant_method = method
layer.weight = torch.nn.Parameter(torch.empty(256, 512, dtype=torch.float8_e4m3fn), requires_grad=False)
layer.weight_scale_inv = torch.nn.Parameter(torch.empty(256, 16, dtype=torch.uint8), requires_grad=False)
layer.mxfp8_loads = LoadTracker("layer", {"": (layer.weight, layer.weight_scale_inv)})
layer.mxfp8_state = method.plan.create_buffers(layer)

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = layer
        self.norm = torch.nn.Parameter(torch.ones(512, dtype=torch.bfloat16), requires_grad=False)
    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            getattr(params[name], "weight_loader", default_weight_loader)(params[name], t)
"""

REFIT_RUNNER = """
import ast, dataclasses, gc, logging, sys, types, torch
import sglang

class LoadTimes(logging.Handler):  # the line each load logs on where its time went, as bench refit reads it
    def emit(self, record):
        if record.getMessage().startswith("sglang_mxfp8: load took"):
            print("TIME", record.getMessage())

logging.getLogger("sglang_mxfp8").addHandler(LoadTimes())
logging.getLogger("sglang_mxfp8").setLevel(logging.INFO)
from sglang.srt.model_loader.loader import DefaultModelLoader, get_model_loader
from sglang.srt.model_loader.utils import set_default_torch_dtype
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.srt.utils import get_available_gpu_memory

def load_stock_update_weights_from_disk():
    try:  # SGLang >= 0.5.17: a WeightUpdater of the model runner's own, importable on the CPU
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
        fn = WeightUpdater.update_weights_from_disk
        return getattr(fn, "__wrapped__", fn), WeightUpdater
    except ImportError:
        pass
    # model_runner.py imports sgl_kernel (no CPU build): take SGLang's method itself from its source file
    path = Path(sglang.__file__).parent / "srt/model_executor/model_runner.py"
    cls = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "ModelRunner")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "update_weights_from_disk")
    scope = dict(torch=torch, gc=gc, logger=logging.getLogger("stock"), LoadConfig=LoadConfig, Optional=Optional,
                 Callable=Callable, DefaultModelLoader=DefaultModelLoader, get_model_loader=get_model_loader,
                 set_default_torch_dtype=set_default_torch_dtype, get_available_gpu_memory=get_available_gpu_memory)
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), scope)
    return scope["update_weights_from_disk"], None

from pathlib import Path
from typing import Callable, Optional
from safetensors.torch import save_file
import sglang.srt.layers.quantization as q
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang_mxfp8.sglang import quant_methods, weights
from sglang_mxfp8.format.numerics import quantize_mxfp8
from sglang_mxfp8.sglang.loads import LoadTracker
from sglang_mxfp8.kernels import registry
from sglang_mxfp8.kernels.base import LinearSpec
from sglang_mxfp8.platform import GpuSpec

root = Path(sys.argv[1])
stock, WeightUpdater = load_stock_update_weights_from_disk()
patched = weights.refit_rollback(stock)
torch.manual_seed(0)
ckpts = {}
for name in ("A", "B"):
    qw, s = quantize_mxfp8(torch.randn(256, 512) * torch.logspace(-2, 2, 512))
    ckpts[name] = {"layer.weight": qw, "layer.weight_scale_inv": s}
bad = dict(ckpts["A"]); w = bad["layer.weight"].clone(); w.view(torch.uint8)[3, 5] = 0x7F; bad["layer.weight"] = w
ckpts["nan_weight"] = bad
ckpts["missing_scale"] = {"layer.weight": ckpts["B"]["layer.weight"]}
ckpts["wrong_scale_shape"] = {"layer.weight": ckpts["B"]["layer.weight"],
                              "layer.weight_scale_inv": ckpts["B"]["layer.weight_scale_inv"][:, :-1].contiguous()}
for name, tensors in ckpts.items():
    (root / name).mkdir()
    save_file(tensors, str(root / name / "model.safetensors"))

SERVED_LINEAR

if hasattr(ServerArgs, "resolve_once"):  # SGLang >= 0.5.20: construction probes nothing; publishing reads the config
    (root / "A" / "config.json").write_text(sys.argv[2])
    server_args = ServerArgs(model_path=str(root / "A"), device="cpu")
else:
    server_args = object.__new__(ServerArgs)  # SGLang's defaults; __post_init__ would probe a GPU
    for f in dataclasses.fields(ServerArgs):
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            setattr(server_args, f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
    server_args.model_path = str(root / "A")
set_global_server_args_for_scheduler(server_args)
runner = types.SimpleNamespace(
    device="cpu", gpu_id=0, model=Model(), load_config=LoadConfig(), server_args=server_args,
    model_config=types.SimpleNamespace(model_path=str(root / "A"), revision=None, dtype=torch.bfloat16,
                                       quantization=None,
                                       hf_config=types.SimpleNamespace(architectures=["Qwen3ForCausalLM"])))

target = runner
if WeightUpdater is not None:  # the real WeightUpdater SGLang builds for its model runner
    target = WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=runner.model_config,
                           custom_weight_loaders={},
                           get_model=lambda: runner.model, update_model_fields=lambda *a, **k: None,
                           recapture_cuda_graph=lambda: None, get_model_runner=lambda: runner)

def state():
    return layer.weight.view(torch.uint8).clone(), layer.mxfp8_state.converter.block_scale.clone()

compiles = []  # torch.compile guards on torch's global state (the default dtype among it): a change recompiles


@torch.compile(backend=lambda gm, example: compiles.append(gm) or gm.forward, fullgraph=True)
def compiled(x):
    return x * 2 + 1


compiled(torch.ones(4))

def refit(name, fn=patched):
    try:
        ok, message = fn(target, str(root / name), "auto")
    except Exception as e:
        ok, message = "raised", str(e).splitlines()[0]
    compiled(torch.ones(4))
    print(name, ok, runner.model_config.model_path.rsplit("/", 1)[-1], "|", message.splitlines()[0])
    print("STATE", name, torch.get_default_dtype(), len(compiles))

refit("A"); state_a = state(); refit("B"); state_b = state()
assert not torch.equal(state_a[0], state_b[0])
for name in ("nan_weight", "missing_scale", "wrong_scale_shape"):
    refit(name)
    assert all(torch.equal(x, y) for x, y in zip(state(), state_b)), name
refit("A"); assert all(torch.equal(x, y) for x, y in zip(state(), state_a))
refit("does_not_exist")  # refused before SGLang sees it (SGLang would take the path for a Hugging Face repo id)
(root / "empty").mkdir()
refit("empty")  # a folder without weights: SGLang answers False without raising, the bad path already set
refit("nan_weight"); assert all(torch.equal(x, y) for x, y in zip(state(), state_a))
refit("nan_weight", stock)
setattr(runner, weights.FROM_TENSORS, True)  # as after an accepted update_weights_from_tensor: no disk holds them
before = state(); refit("nan_weight"); assert all(torch.equal(x, y) for x, y in zip(state(), before))  # values first
setattr(runner, weights.FROM_TENSORS, False)
import shutil
shutil.copy(root / "nan_weight" / "model.safetensors", root / "A" / "model.safetensors")  # the served one spoiled too
refit("B"); refit("A")  # B served; A, spoiled now, refused and B kept
shutil.copy(root / "nan_weight" / "model.safetensors", root / "B" / "model.safetensors")
refit("nan_weight")  # the rollback to B raises in turn
shutil.rmtree(root / "B")
refit("nan_weight")  # the rollback to B finds no folder
""".replace("SERVED_LINEAR\n", SERVED_LINEAR)


def test_failed_refit_rolls_back_to_the_served_checkpoint(tmp_path):
    """Real SGLang update_weights_from_disk + loader on real safetensors files, our real linear method (CPU)."""
    p = subprocess.run(
        [sys.executable, "-c", REFIT_RUNNER, str(tmp_path), json.dumps(QWEN3_MOE_CONFIG)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd="/",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [line for line in p.stdout.splitlines() if not line.startswith(("TIME ", "STATE "))]
    # a refit, refused or not, leaves torch's default dtype (the model's is bfloat16 here) and so never recompiles
    states = [line.split()[2:] for line in p.stdout.splitlines() if line.startswith("STATE ")]
    assert len(states) == 15 and all(state == ["torch.float32", "1"] for state in states), states
    assert lines[0].startswith("A True A |") and lines[1].startswith("B True B |")
    from sglang_mxfp8.bench.served import load_times

    times = [load_times(line) for line in p.stdout.splitlines() if line.startswith("TIME ")]
    assert len(times) >= 3  # A, B, A again (and the rollbacks)
    for t in times:
        assert t["processing_s"] > 0 and t["precompile_s"] == 0 and t["quantize_s"] == 0  # CPU: nothing to compile
        assert 0 < t["check_s"] + t["layout_s"] <= t["processing_s"] + 0.002  # (copies of a few KB show 0.000 s)
        assert abs(t["load_s"] - t["read_s"] - t["copy_s"] - t["processing_s"]) < 0.004
    assert lines[2].startswith("nan_weight False B | Failed to update weights: layer: weight row 3 holds NaN")
    assert lines[2].endswith(f"Rolled back to {tmp_path / 'B'}.")
    # what the checkpoint's headers show is refused before anything is loaded
    nothing = "Nothing was loaded; the previous weights keep serving."
    assert lines[3].startswith(
        "missing_scale False B | Failed to update weights: layer.weight: an e4m3 weight "
        "without its scale layer.weight_scale_inv in this checkpoint"
    ) and lines[3].endswith(nothing)
    assert lines[4].startswith("wrong_scale_shape False B | Failed to update weights: layer.weight: weight "
                               "[256, 512] needs a scale of shape [256, 16] (one per 32 along K), the checkpoint "
                               "has [256, 15]") and lines[4].endswith(nothing)
    assert lines[5].startswith("A True A |")
    # a refit SGLang refuses without raising leaves the served path in place, so the next failure rolls back to it
    assert lines[6] == (f"does_not_exist False A | Failed to update weights: no folder {tmp_path / 'does_not_exist'} "
                        f"on this machine. {nothing}")
    assert lines[7].startswith("empty False A | Failed to get weights iterator"), lines[7]
    assert lines[8].startswith("nan_weight False A |") and lines[8].endswith(f"Rolled back to {tmp_path / 'A'}.")
    # stock SGLang: its rollback re-reads the bad path, fails again and raises out of the scheduler call
    assert lines[9].startswith("nan_weight raised nan_weight | layer: weight row 3 holds NaN")
    assert (
        lines[10]
        == f"nan_weight False nan_weight | Failed to update weights: layer.weight: holds NaN e4m3 values. {nothing}"
    )
    assert lines[11].startswith("B True B |") and lines[12].startswith("A False B |")
    # a rollback that fails too, by raising or by answering False, is an error naming both paths
    for line in lines[13:15]:
        assert line.startswith("nan_weight raised ") and f"refit from {tmp_path / 'nan_weight'} failed" in line, line
        assert f"and so did the rollback to {tmp_path / 'B'} (" in line and "inconsistent" in line, line


def test_every_patch_finds_its_target_on_this_sglang():
    """CI runs this with the oldest and the newest supported SGLang: every patch lands (or keeps SGLang's own piece)
    wherever that release keeps its target. ModelRunner needs sgl_kernel on 0.5.10.post1 (no CPU build): there the
    weight-update patches are checked on GPU machines only."""
    p = run_python(
        "import importlib, logging, sys\n"
        "logging.basicConfig(level=logging.WARNING, format='LOG %(message)s', stream=sys.stdout)\n"
        "from sglang_mxfp8.sglang import patching\n"
        "for m in ('sglang.srt.server_args', 'sglang.srt.configs.model_config', 'sglang.srt.layers.quantization',\n"
        "          'sglang.srt.model_loader.loader'):\n"
        "    importlib.import_module(m)\n"
        "try:\n"
        "    importlib.import_module('sglang.srt.model_executor.model_runner')\n"
        "    runner = 'imported'\n"
        "except ImportError as e:\n"
        "    runner = 'needs ' + str(e.name)\n"
        "print('RUNNER', runner)\n"
        "print('APPLIED', sorted(patching.APPLIED))\n"
        "print('KEPT', sorted(patching.KEPT))\n"
        "print('MISSING', patching.MISSING)\n"
    )
    assert p.returncode == 0, p.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines() if line.split(" ", 1)[0] in
                 ("RUNNER", "APPLIED", "KEPT", "MISSING"))
    assert lines["MISSING"] == "{}" and "LOG" not in p.stdout, p.stdout
    applied, kept = eval(lines["APPLIED"]), eval(lines["KEPT"])
    expected = {"server_args.moe_kernel_config", "model_config.modelopt_mxfp8", "model_config.mxfp8_notice",
                "quantization.mxfp8_config",
                "quantization.dense_dispatch", "loader.modelopt_mxfp8_file", "loader.conversion_report"}
    if lines["RUNNER"] == "imported":
        expected |= {"model_runner.refit_rollback", "model_runner.tensor_update_postprocess",
                     "model_runner.tensor_update_postprocess.forward"}
    else:
        assert lines["RUNNER"].startswith("needs sgl_kernel"), lines["RUNNER"]
    assert expected <= set(applied) | set(kept), expected - set(applied) - set(kept)


@pytest.mark.parametrize("version, warns", [("0.5.9", True), ("0.5.10", True), ("0.5.10.post1", False),
                                            ("0.5.11", False), ("0.5.17", False), ("0.5.23", False),
                                            ("0.5.23.post1", True), ("0.5.100", True), ("0.5.3", True),
                                            ("0.6.0", True), ("0.10.0", True), ("unknown", True)])
def test_a_release_outside_the_tested_range_gets_one_warning(version, warns):
    from sglang_mxfp8 import compat

    line = compat.check_tested_range(version)
    assert (line is not None) == warns
    if warns:
        assert line == (f"sglang_mxfp8: sglang {version} is outside the tested range 0.5.10.post1 to 0.5.23; patching "
                        "it wherever its targets exist")


def test_a_probe_takes_the_first_location_that_has_what_the_patch_needs(monkeypatch):
    """sglang_object walks a moved target's locations oldest first and skips one that lacks the method a patch wraps
    (ModelRunner exists on every release; its weight updates moved to WeightUpdater in 0.5.17)."""
    from sglang_mxfp8 import compat

    monkeypatch.setitem(compat.MOVED, "probe_under_test", ("json:JSONDecoder", "json.gone:Nothing", "json:JSONEncoder"))
    import json

    assert compat.sglang_object("probe_under_test") is json.JSONDecoder
    assert compat.sglang_object("probe_under_test", has="encode") is json.JSONEncoder
    with pytest.raises(
        ImportError, match="found none of json:JSONDecoder, json.gone:Nothing, json:JSONEncoder with dump"
    ):
        compat.sglang_object("probe_under_test", has="dump")


@pytest.mark.parametrize("first", ["sglang_mxfp8.sglang.quant_methods", "sglang.srt.layers.linear",
                                   "sglang.srt.layers.quantization.fp8", "sglang_mxfp8.sglang.weights"])
def test_the_quantization_patches_apply_whatever_is_imported_first(first):
    """quant_methods imports SGLang's quantization package, whose import applies the patches that hand SGLang
    quant_methods' classes: imported first, they wait for it instead of failing on a half-imported module."""
    p = run_python(f"import {first}\n"
                   "import sglang.srt.layers.quantization as q, sglang.srt.layers.quantization.fp8 as fp8\n"
                   "from sglang_mxfp8.sglang import patching, quant_methods as qm\n"
                   "print(patching.MISSING, sorted(a for a in patching.APPLIED if a.startswith('quantization.')),"
                   " q.QUANTIZATION_METHODS['mxfp8'] is qm.Mxfp8Config,"
                   " fp8.dispatch_w8a8_mxfp8_linear.__wrapped__ is qm.dispatch_w8a8_mxfp8_linear)")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines()[-1] == "{} ['quantization.dense_dispatch', 'quantization.mxfp8_config'] True True"


TENSOR_RUNNER = """
import ast, dataclasses, sys, types, torch
from pathlib import Path
from typing import List, Optional, Tuple, Union
import sglang
import sglang.srt.layers.quantization as q
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.utils import MultiprocessingSerializer, dynamic_import
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from sglang_mxfp8.bench.refusals import SPOILS, spoiled
from sglang_mxfp8.format.numerics import quantize_mxfp8
from sglang_mxfp8.sglang.loads import LoadTracker
from sglang_mxfp8.kernels import registry
from sglang_mxfp8.kernels.base import LinearSpec
from sglang_mxfp8.platform import GpuSpec
from sglang_mxfp8.sglang import quant_methods
from sglang_mxfp8.sglang.patches import model_runner as patches
from sglang_mxfp8.sglang.weights import postprocess_mxfp8_modules

# SGLang 0.5.10.post1's own ModelRunner.update_weights_from_tensor and the helpers it calls, from its source
# (model_runner.py imports sgl_kernel, which has no CPU build)
path = Path(sglang.__file__).parent / "srt/model_executor/model_runner.py"
tree = ast.parse(path.read_text())
runner_cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelRunner")
body = [n for n in tree.body if getattr(n, "name", None) in ("_unwrap_tensor", "_model_load_weights_direct",
                                                            "LocalSerializedTensor")]
body += [n for n in runner_cls.body if isinstance(n, ast.FunctionDef)
         and n.name in ("update_weights_from_tensor", "_update_weights_from_flattened_bucket")]
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
scope = dict(torch=torch, List=List, Optional=Optional, Tuple=Tuple, Union=Union, dataclass=dataclasses.dataclass,
             MultiprocessingSerializer=MultiprocessingSerializer, default_weight_loader=default_weight_loader,
             monkey_patch_torch_reductions=monkey_patch_torch_reductions, dynamic_import=dynamic_import,
             FlattenedTensorBucket=FlattenedTensorBucket, FlattenedTensorMetadata=FlattenedTensorMetadata)
exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), scope)
update = patches._checked_and_marking(scope["update_weights_from_tensor"])

torch.manual_seed(0)
SERVED_LINEAR

runner = types.SimpleNamespace(device="cpu", tp_rank=0, model=Model(),
                               server_args=types.SimpleNamespace(custom_weight_loader=[]))
runner._update_weights_from_flattened_bucket = types.MethodType(scope["_update_weights_from_flattened_bucket"], runner)
ckpt = {}
for name in ("A", "B"):
    w = torch.randn(256, 512) * torch.logspace(-2, 2, 512)
    qw, s = quantize_mxfp8(w)
    ckpt[name] = {"layer.weight": qw, "layer.weight_scale_inv": s,
                  "norm": torch.full((512,), 2.0, dtype=torch.bfloat16)}

def state():
    converted = layer.mxfp8_state.converter.block_scale
    return layer.weight.view(torch.uint8).clone(), converted.clone(), runner.model.norm.clone()

def send(tensors, bucket=False):
    runner._sglang_mxfp8_pending = False
    if bucket:  # as a trainer sends a bucket: one flat tensor and each tensor's place in it
        b = FlattenedTensorBucket(named_tensors=list(tensors.items()))
        payload = {"flattened_tensor": b.get_flattened_tensor(), "metadata": b.get_metadata()}
        ok, message = update(runner, payload, "flattened_bucket")
    else:
        ok, message = update(runner, list(tensors.items()))
    if runner._sglang_mxfp8_pending:
        postprocess_mxfp8_modules(runner.model)
    return ok, message

print("A", *send(ckpt["A"])); a = state()
assert getattr(runner, "_sglang_mxfp8_served_from_tensors", False)
print("B", *send(ckpt["B"])); b = state()
assert not torch.equal(a[0], b[0])
for what in SPOILS:
    if what == "missing_folder":
        continue
    tensors = {"norm": ckpt["A"]["norm"], **spoiled(what, "layer.weight", ckpt["A"], "weight_scale_inv")}
    for bucket in (False, True):
        ok, message = send(tensors, bucket)
        print(what + "/bucket" * bucket, ok, all(torch.equal(x, y) for x, y in zip(state(), b)), message)
print("A", *send(ckpt["A"], bucket=True)); print("back to A", all(torch.equal(x, y) for x, y in zip(state(), a)))
print("dtype", torch.get_default_dtype())
""".replace("SERVED_LINEAR\n", SERVED_LINEAR)


def _runner_updates_from_tensor() -> bool:
    """Whether this SGLang's ModelRunner itself updates weights from tensors (<= 0.5.14), as its source says."""
    import sglang

    return "def _unwrap_tensor" in (Path(sglang.__file__).parent / "srt/model_executor/model_runner.py").read_text()


@pytest.mark.skipif(not _runner_updates_from_tensor(),
                    reason="this SGLang keeps update_weights_from_tensor on a WeightUpdater that needs a server's "
                           "runtime context; the GPU test (tests/gpu/test_refused_refits.py) covers it there")
def test_a_spoiled_tensor_update_is_refused_before_anything_is_written():
    """Real SGLang update_weights_from_tensor (0.5.10.post1's source) wrapped by the patch, our real linear method
    (CPU), named tensors and a trainer's flattened bucket: each spoiled update answers success: false naming the
    tensor, writes nothing (the BF16 tensor sent beside it neither), and the accepted updates around it are served."""
    p = subprocess.run([sys.executable, "-c", TENSOR_RUNNER], capture_output=True, text=True, timeout=240, cwd="/")
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0] == "A True Success" and lines[1] == "B True Success"
    refused = dict((line.split(" ", 1)[0], line.split(" ", 3)[1:]) for line in lines[2:14])
    kinds = {"missing_scale", "short_scale", "e5m2_weight", "nan_e4m3", "nan_bf16", "inf_fp32"}
    assert set(refused) == kinds | {f"{k}/bucket" for k in kinds}
    for what, (ok, kept, message) in refused.items():
        assert ok == "False" and kept == "True", (what, message)
        assert message.startswith("Failed to update weights: layer.weight") and message.endswith(
            "Nothing of this update was loaded; the previous weights keep serving."), message
    for way in ("", "/bucket"):
        assert "without its scale" in refused["missing_scale" + way][2]
        assert "[256, 15]" in refused["short_scale" + way][2]
        assert "float8_e5m2" in refused["e5m2_weight" + way][2] and "NaN e4m3" in refused["nan_e4m3" + way][2]
        assert "NaN or Inf" in refused["nan_bf16" + way][2] and "NaN or Inf" in refused["inf_fp32" + way][2]
    assert lines[14:] == ["A True Success", "back to A True", "dtype torch.float32"]


def test_torch_state_kept_puts_back_what_torch_compile_guards_on(caplog):
    """A block that changes the default dtype and grad mode and then raises leaves both as they were, with one
    warning naming what changed; a block that changes nothing logs nothing."""
    import torch

    from sglang_mxfp8.sglang.weights import torch_state_kept

    with caplog.at_level("WARNING", logger="sglang_mxfp8"):
        with pytest.raises(RuntimeError, match="refused"):
            with torch_state_kept("a refit"):
                torch.set_default_dtype(torch.bfloat16)
                torch.set_grad_enabled(False)
                raise RuntimeError("refused")
        assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
        with torch_state_kept("a quiet refit"):
            pass
    assert [r.getMessage() for r in caplog.records] == [
        "sglang_mxfp8: a refit changed torch's global state (grad_mode default_dtype); put back"]


def test_sglangs_set_default_torch_dtype_restores_the_dtype_when_its_block_raises():
    """On every supported SGLang, the loader's set_default_torch_dtype (patched where SGLang restores only on return)
    leaves the default dtype as it was when a load raises inside it, also where SGLang imported it by name."""
    p = run_python(
        "import torch\n"
        "from sglang.srt.model_loader import loader, utils\n"
        "from sglang_mxfp8.sglang import patching\n"
        "from sglang_mxfp8.sglang.patches.loader_utils import PATCH, restores_on_error\n"
        "print(restores_on_error(utils.set_default_torch_dtype), loader.set_default_torch_dtype is "
        "utils.set_default_torch_dtype, PATCH in patching.APPLIED or PATCH in patching.KEPT)\n"
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines()[-1] == "True True True"


def test_every_weight_update_entry_point_of_this_sglang_is_post_processed():
    """Every way this SGLang's model runner takes new weights (update_weights_from_* / load_weights_from_*, as its
    source defines them) is one the patch post-processes, and where the runner imports here, each is wrapped on its
    own: an entry point left out would serve stale kernel layouts after an RL weight sync through it."""
    p = run_python(
        "import re, sglang\n"
        "from pathlib import Path\n"
        "from sglang_mxfp8.sglang import patching\n"
        "from sglang_mxfp8.sglang.patches.model_runner import OTHER_UPDATES, PATCH\n"
        "root = Path(sglang.__file__).parent / 'srt/model_executor'\n"
        "names = set()\n"
        "for f in (root / 'model_runner.py', root / 'model_runner_components/weight_updater.py'):\n"
        "    if f.exists():\n"
        "        names |= set(re.findall(r'^    def ((?:update|load)_weights_from_\\w+)\\(', f.read_text(), re.M))\n"
        "print('NAMES', sorted(names))\n"
        "print('UNCOVERED', sorted(names - {'update_weights_from_disk'} - set(OTHER_UPDATES)))\n"
        "try:\n"
        "    import sglang.srt.model_executor.model_runner\n"
        "    from sglang_mxfp8.compat import sglang_object\n"
        "    updates = sglang_object('weight_updates', has='update_weights_from_disk')\n"
        "    marks = {n: getattr(getattr(updates, n), '__sglang_mxfp8_patch__', None) for n in sorted(names)}\n"
        "except ImportError as e:\n"
        "    marks = 'needs ' + str(e.name)\n"
        "print('MARKS', marks)\n"
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in p.stdout.splitlines() if line.split(" ", 1)[0] in ("NAMES", "UNCOVERED",
                                                                                                "MARKS"))
    names = eval(out["NAMES"])
    assert {"update_weights_from_disk", "update_weights_from_tensor"} <= set(names) and out["UNCOVERED"] == "[]"
    if out["MARKS"].startswith("needs "):  # 0.5.10.post1's ModelRunner imports sgl_kernel: no CPU build
        assert out["MARKS"] == "needs sgl_kernel", out["MARKS"]
        return
    expected = {n: ("model_runner.refit_rollback" if n == "update_weights_from_disk" else
                    "model_runner.tensor_update_postprocess" if n == "update_weights_from_tensor" else
                    f"model_runner.tensor_update_postprocess.{n}") for n in names}
    assert eval(out["MARKS"]) == expected


def test_an_mxfp8_refit_from_a_path_that_is_no_folder_is_refused_before_loading(monkeypatch, tmp_path):
    """A refit of an MXFP8 model from a path (absolute, relative, or under ~) that holds no folder answers
    success: false naming it, and SGLang's loader is never called (it would take the path for a Hugging Face repo id
    and answer with a network error); a repo id still goes to SGLang."""
    import types

    from sglang_mxfp8.sglang import weights

    called = []
    monkeypatch.setattr(weights, "scale_name_of", lambda model: "weight_scale_inv")
    runner = types.SimpleNamespace(model=None, model_config=types.SimpleNamespace(model_path=str(tmp_path / "A")),
                                   server_args=types.SimpleNamespace(load_format="auto"))
    refit = weights.refit_rollback(lambda self, path, fmt: called.append(path) or (True, "Succeeded"))
    (tmp_path / "weights.safetensors").write_bytes(b"")
    file = str(tmp_path / "weights.safetensors")
    cases = [(p, f"no folder {p} on this machine") for p in (str(tmp_path / "gone"), "./gone", "~/gone")]
    for path, problem in cases + [(file, f"{file} is a file; pass the checkpoint's folder")]:
        ok, message = refit(runner, path, "auto")
        assert not ok and message == f"Failed to update weights: {problem}. Nothing was loaded; the previous weights " \
                                     "keep serving.", message
        assert runner.model_config.model_path == str(tmp_path / "A")
    assert called == [] and refit(runner, "org/model", "auto") == (True, "Succeeded") and called == ["org/model"]


@pytest.mark.parametrize("mxfp8", [True, False])
def test_only_an_mxfp8_models_refit_reads_page_locked(monkeypatch, tmp_path, mxfp8):
    """The refit wrapper turns the page-locked reads on for the load of an MXFP8 model's refit (and its rollback)
    only: a BF16 model's refit reads as SGLang ships, and after either the reads are SGLang's again."""
    import types

    from sglang_mxfp8.sglang import weights

    seen = []

    def original(self, model_path, load_format):
        seen.append(weights.REFIT_READS.active)
        if model_path.endswith("bad"):
            raise ValueError("refused after loading")
        return True, "Succeeded"

    monkeypatch.setattr(weights, "scale_name_of", lambda model: "weight_scale_inv" if mxfp8 else None)
    for name in ("B", "bad"):
        (tmp_path / name).mkdir()
    runner = types.SimpleNamespace(model=None, model_config=types.SimpleNamespace(model_path=str(tmp_path / "A")),
                                   server_args=types.SimpleNamespace(load_format="auto"))
    refit = weights.refit_rollback(original)
    assert refit(runner, str(tmp_path / "B"), "auto") == (True, "Succeeded")
    ok, message = refit(runner, str(tmp_path / "bad"), "auto")  # fails while loading: the rollback reloads B
    assert not ok and "Rolled back to" in message
    assert seen == [mxfp8] * 3 and weights.REFIT_READS.active is False
