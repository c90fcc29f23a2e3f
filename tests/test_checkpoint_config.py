"""An MXFP8 quantization config is read as it declares itself, field by field: what is not MXFP8 [1, 32] e4m3/ue8m0,
or a module list that is not a list, is refused in one line naming the field, at launch as in doctor."""

import json
import subprocess
import sys

import pytest

from conftest import MILES_QUANT, write_config
from sglang_mxfp8.format.checkpoint import CheckpointError, detect_mxfp8

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang


@pytest.mark.parametrize("field,value", [("weight_block_size", [128, 128]), ("weight_block_size", [1, 16]),
                                         ("fmt", "e5m2"), ("scale_fmt", "fp32"), ("activation_scheme", "static")])
def test_fields_that_are_not_mxfp8_are_named(field, value):
    with pytest.raises(
        CheckpointError, match=rf"^quantization_config\.{field} = {value!r}: MXFP8 is ".replace("[", r"\[")
    ):
        detect_mxfp8({**MILES_QUANT, field: value})


@pytest.mark.parametrize("key", ["modules_to_not_convert", "ignored_layers"])
def test_a_module_list_given_as_a_string_is_refused_not_split_into_characters(key):
    cfg = {k: v for k, v in MILES_QUANT.items() if k != "modules_to_not_convert"}
    with pytest.raises(CheckpointError, match=rf"quantization_config\.{key} must be a list of module names, not str"):
        detect_mxfp8({**cfg, key: "lm_head"})
    assert detect_mxfp8({**cfg, key: ["lm_head"]}).ignored == ["lm_head"]
    with pytest.raises(CheckpointError, match=r"quantization\.exclude_modules must be a list of module names, not str"):
        detect_mxfp8({"quantization": {"quant_algo": "MXFP8", "exclude_modules": "lm_head"}})


def test_the_mxfp8_spellings_in_use_are_accepted():
    fmt = detect_mxfp8({**MILES_QUANT, "fmt": "float8_e4m3fn", "scale_fmt": "e8m0"})
    assert fmt.ignored == ["lm_head"] and fmt.scale_name == "weight_scale_inv"
    assert detect_mxfp8({"quant_method": "mxfp8"}).ignored == []  # every field absent: MXFP8's values


def test_launch_stops_in_one_line_on_a_config_that_is_not_mxfp8(tmp_path):
    ckpt = write_config(tmp_path / "bad", {**MILES_QUANT, "weight_block_size": [128, 128]})
    code = ("from sglang.srt.server_args import ServerArgs\n"
            f"a = ServerArgs(model_path={str(ckpt)!r}, device='cpu')\n"
            "getattr(a, 'resolve_once', lambda: None)()\n")  # SGLang >= 0.5.20 resolves at launch
    env = {"PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd="/",
                       env={**__import__("os").environ, **env})
    assert p.returncode == 1, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1] == (
        "sglang_mxfp8: quantization_config.weight_block_size = [128, 128]: MXFP8 is [1, 32] (e4m3 values, one ue8m0 "
        "scale per 1x32 block); this checkpoint is not MXFP8 as it declares, so fix its config or re-export it")
    assert "Traceback" not in p.stderr


def test_doctor_and_launch_refuse_the_same_moe_flag(tmp_path, capsys):
    """doctor --gpu h200 --moe-runner-backend flashinfer_trtllm on a MoE checkpoint says what the launch says."""
    from sglang_mxfp8.cli import main as cli
    from sglang_mxfp8.bench.tiny_model import write_qwen3_moe
    from sglang_mxfp8.format.convert import convert
    from sglang_mxfp8.platform import GpuSpec
    from sglang_mxfp8.sglang.launch import LaunchConfig, Mxfp8LaunchError, validate_launch

    mx = tmp_path / "mx"
    convert(write_qwen3_moe(tmp_path / "bf16"), mx, progress=False)
    assert cli(["doctor", "--gpu", "h200", "--model", str(mx), "--moe-runner-backend", "flashinfer_trtllm"]) == 1
    out = capsys.readouterr().out
    moe = " ".join(out[out.index("\n  MoE"):].split())  # the MoE layer's line and its wrapped plan or error below it
    args = LaunchConfig(model_path=str(mx), moe_flag="flashinfer_trtllm")
    with pytest.raises(Mxfp8LaunchError) as e:
        validate_launch(args, GpuSpec("NVIDIA H200", 90))
    assert f"(hidden 256, intermediate 128) ERROR {e.value.message}" in moe
    assert "valid choices on this GPU: auto, triton, flashinfer_cutlass" in moe
    assert all(len(line) <= 100 for line in out.splitlines() if line.startswith("  "))  # a 100-column terminal
    assert json.loads((mx / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp8"


# ModelOpt's quant_algo values of other recipes (hf_quant_config.json spells them upper-case), and names that merely
# contain "MXFP8" or "FP8": none of them is MXFP8, and reading one as MXFP8 would serve another format's bytes.
OTHER_MODELOPT_ALGOS = ["FP8", "FP8_PB_WO", "FP8_PC_PT", "FP8_BLOCK", "NVFP4", "NVFP4_AWQ", "MXFP4", "W4A8_AWQ",
                        "W4A8_NVFP4_FP8", "W4A8_MXFP4_FP8", "INT8_SQ", "INT4_AWQ", "MIXED_PRECISION", "W4A8_MXFP8",
                        "MXFP8_MXFP4", "NOT_MXFP8", "MXFP", "", None, 8]


@pytest.mark.parametrize("algo", OTHER_MODELOPT_ALGOS)
@pytest.mark.parametrize("where", ["config.json", "hf_quant_config.json"])
def test_a_modelopt_checkpoint_of_another_recipe_is_never_read_as_mxfp8(algo, where):
    section = {"quant_algo": algo, "exclude_modules": ["lm_head"]}
    cfg = {"quant_method": "modelopt", **section} if where == "config.json" else {"quantization": section}
    assert detect_mxfp8(cfg) is None


@pytest.mark.parametrize("algo", ["MXFP8", "mxfp8", "MxFp8"])
def test_modelopt_mxfp8_is_read_in_any_case(algo):
    assert detect_mxfp8({"quantization": {"quant_algo": algo, "exclude_modules": ["lm_head"]}}).ignored == ["lm_head"]
    assert detect_mxfp8({"quant_method": "modelopt", "quant_algo": algo}).scale_name == "weight_scale"


def test_sglang_reads_a_modelopt_fp8_checkpoint_as_modelopt_fp8_with_this_package_active(tmp_path):
    """The patched ModelConfig hands every other ModelOpt recipe to SGLang's own reading."""
    from conftest import run_python

    algos = ["FP8", "FP8_PB_WO", "NVFP4", "MXFP8"]
    code = "from sglang.srt.configs.model_config import ModelConfig\n"
    for algo in algos:
        ckpt = write_config(tmp_path / algo, {"quant_method": "modelopt", "quant_algo": algo,
                                              "exclude_modules": ["lm_head"]})
        code += f"print({algo!r}, ModelConfig({str(ckpt)!r}).quantization)\n"
    ours, stock = run_python(code), run_python(code, {"SGLANG_MXFP8_DISABLE": "1"})
    assert ours.returncode == 0 and stock.returncode == 0, (ours.stderr + stock.stderr)[-3000:]
    ours, stock = (dict(line.split() for line in p.stdout.splitlines()[-len(algos):]) for p in (ours, stock))
    assert ours["MXFP8"] == "mxfp8" and stock["FP8"] == "modelopt_fp8"
    assert {a: ours[a] for a in algos[:-1]} == {a: stock[a] for a in algos[:-1]}  # SGLang's own reading, untouched
