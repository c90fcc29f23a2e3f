import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

QWEN3_MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8,
    "num_experts_per_tok": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True,
}
MILES_QUANT = {
    "quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, 32], "scale_fmt": "ue8m0",
    "activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head"],
}


def write_config(path: Path, quant=None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(QWEN3_MOE_CONFIG)
    if quant is not None:
        cfg["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def run_python(code: str, env_extra=None, timeout=240) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter of this environment (the .pth hook runs at its start)."""
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_MXFP8_DISABLE"}
    env.update(env_extra or {})
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout, cwd="/"
    )


def importable_tests_env() -> dict:
    """The environment entry that lets a run_python interpreter import conftest, keeping the PYTHONPATH it has (where
    ci/test.sh puts the newest SGLang)."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO / "tests")) if p)}


def ninja_objects(ninja: Path, compiles) -> list:
    """The objects a FlashInfer build.ninja compiles from the sources for which ``compiles(source path)`` is true."""
    rules = [line.removeprefix("build ").split(": cuda_compile ") for line in ninja.read_text().splitlines()
             if line.startswith("build ") and ": cuda_compile " in line]
    return [obj for obj, source in rules if compiles(source)]


def start_ninja(ninja: Path, objects) -> subprocess.Popen:
    """FlashInfer's own ninja rules run for ``objects`` (one job), with the CUDA headers of the environment's nvidia-*
    wheels (cublasLt.h among them) on CPATH; :func:`finish_ninja` waits for it."""
    import flashinfer

    site = Path(flashinfer.__file__).parents[1]
    includes = [str(p) for p in site.glob("nvidia/*/include") if (p / "cublasLt.h").exists()]
    ninja_bin = shutil.which("ninja") or str(Path(sys.executable).parent / "ninja")
    return subprocess.Popen([ninja_bin, "-j1", "-f", str(ninja), *objects], cwd=ninja.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, CPATH=":".join(includes)))


def finish_ninja(build: subprocess.Popen, timeout: int = 900) -> None:
    """Wait for a :func:`start_ninja` build: skip the test where this machine has no cublasLt.h, else it must pass."""
    out, _ = build.communicate(timeout=timeout)
    if "cublasLt.h: No such file" in out:
        pytest.skip("needs CUDA's cublasLt.h (nvidia-cublas) on this machine")
    assert build.returncode == 0, out[-3000:]


def set_server_args(**overrides):
    """SGLang's ServerArgs with its defaults (its __post_init__ would probe a GPU) plus ``overrides``,
    made the process's global server args, as SGLang's scheduler does."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    if hasattr(ServerArgs, "resolve_once"):  # SGLang >= 0.5.20: construction probes nothing (launchers resolve)
        if "cuda_graph_max_bs" in overrides:  # renamed cuda_graph_max_bs_decode there
            overrides["cuda_graph_max_bs_decode"] = overrides.pop("cuda_graph_max_bs")
        args = ServerArgs(**{"model_path": "dummy", "device": "cpu", **overrides})
        set_global_server_args_for_scheduler(args)
        return args
    args = object.__new__(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        if f.default is not dataclasses.MISSING:
            setattr(args, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(args, f.name, f.default_factory())
    for key, value in overrides.items():
        setattr(args, key, value)
    set_global_server_args_for_scheduler(args)
    return args


def init_fp8_gemm_config(args) -> None:
    """SGLang's FP8 GEMM backend global, from ``args`` (SGLang >= 0.5.20 takes no argument: it reads the server args
    :func:`set_server_args` published)."""
    import inspect

    from sglang.srt.layers.quantization import fp8_utils

    if inspect.signature(fp8_utils.initialize_fp8_gemm_config).parameters:
        fp8_utils.initialize_fp8_gemm_config(args)
    else:
        fp8_utils.initialize_fp8_gemm_config()


def mxfp8_linear(prefix: str, w, s):
    """A real MXFP8 linear layer as SGLang builds one: our linear method's create_weights on w's device (the backend
    that the process's --fp8-gemm-backend and GPU choose), w [N, K] e4m3 and its MXFP8 scales s copied in as the
    loader does, then the post-load processing."""
    import torch
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    from sglang_mxfp8.sglang import quant_methods as qm

    cfg = qm.Mxfp8Config.from_config({"quant_method": "mxfp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [1, 32]})
    n, k = w.shape
    layer = torch.nn.Module()
    layer.tp_group = None  # one rank: what SGLang's linear layers hold (0.5.23's block-shape check reads it)
    layer.quant_method = qm.Mxfp8LinearMethod(cfg, prefix)
    with torch.device(w.device):
        layer.quant_method.create_weights(layer, k, [n], k, n, torch.bfloat16, weight_loader=default_weight_loader)
    layer.weight.data.copy_(w)
    getattr(layer, cfg.scale_name).data.copy_(s)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.fixture
def miles_ckpt(tmp_path):
    return write_config(tmp_path / "miles", MILES_QUANT)


@pytest.fixture(autouse=True)
def fresh_settings():
    """Each test reads SGLANG_MXFP8_* as its own environment sets them (the package reads them once per process)."""
    from sglang_mxfp8 import settings

    settings.current.cache_clear()
    yield
    settings.current.cache_clear()


def doctor_plans(out: str) -> list:
    """``sglang-mxfp8 doctor``'s per-layer tables read back as one line each: "  <layer>: <band>: <kernel>; ...
    [not <kernel>: <why>; ...]", or "  <layer>: ERROR <message>" (wrapped lines joined)."""
    import re

    plans, current = [], None
    for line in out.splitlines():
        if re.match(r"  (dense|MoE) ", line):
            current = {"head": line, "bands": [], "skipped": [], "error": None, "in": None}
            plans.append(current)
        elif current is not None and line.startswith("    "):
            text = line.strip()
            if line.startswith("      ") and current["in"] in ("skip", "error", "band"):
                if current["in"] == "skip" and not line.startswith("        "):
                    current["skipped"].append(text)
                elif current["in"] == "skip":
                    current["skipped"][-1] += " " + text
                elif current["in"] == "error":
                    current["error"] += " " + text
                continue
            if text.startswith("ERROR "):
                current["error"], current["in"] = text, "error"
            elif text == "passed over:":
                current["in"] = "skip"
            else:
                band, kernel = re.split(r"\s{2,}", text)[:2]
                current["bands"].append(f"{band}: {kernel}")
                current["in"] = "band"
        else:
            current = None
    lines = []
    for p in plans:
        if p["error"]:
            lines.append(f"{p['head']}: {p['error']}")
        else:
            skipped = f" [not {'; not '.join(p['skipped'])}]" if p["skipped"] else ""
            lines.append(f"{p['head']}: {'; '.join(p['bands'])}{skipped}")
    return lines
