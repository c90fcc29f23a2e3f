"""Our measured fused-MoE tile configs, served through SGLang's own ``get_moe_configs``.

SGLang's ``fused_moe_triton`` package imports sgl_kernel (no CPU build), so its config module is
loaded here from its file; the GPU name and Triton version are those of the H200 image the configs
were measured on (this machine has no GPU and another Triton). The wiring inside a real server is
shown by a served run's server log (``Using MoE kernel config from ...``).
"""

import importlib.util
import json
import logging
import types
from pathlib import Path

import pytest
import sglang

from conftest import set_server_args, write_config
from sglang_mxfp8 import compat
from sglang_mxfp8.sglang.patches import moe_config as patch

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang

H200_FP8_BLOCK = "E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128, 128].json"
SGLANG_CONFIG_MODULE = next(path for path in (Path(sglang.__file__).parent.parent / f"{name.replace('.', '/')}.py"
                                             for name in compat.MOVED["moe_config"]) if path.is_file())  # by release
SGLANG_CONFIGS = SGLANG_CONFIG_MODULE.parent / "configs"


def sglang_config_module(triton_version="3.6.0", device="NVIDIA_H200"):
    path = SGLANG_CONFIG_MODULE
    spec = importlib.util.spec_from_file_location("sglang_moe_config_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.triton = types.SimpleNamespace(__version__=triton_version)
    module.get_device_name = lambda: device
    return module


def serve(model_path, **overrides):
    set_server_args(model_path=str(model_path), **overrides)


def patched(module):
    return patch.with_tuned_moe_configs(module.get_moe_configs, module)


def shipped():
    return json.loads((patch.TUNED_MOE_CONFIGS / "triton_3_6_0" / H200_FP8_BLOCK).read_text())


def test_mxfp8_launch_gets_our_measured_config(miles_ckpt, caplog):
    serve(miles_ckpt)
    module = sglang_config_module()
    assert module.get_config_file_name(128, 768, "fp8_w8a8", [128, 128]) == H200_FP8_BLOCK
    with caplog.at_level(logging.INFO, logger="sglang_mxfp8"):
        configs = patched(module)(128, 768, "fp8_w8a8", 128, 128)
    assert configs == {int(m): c for m, c in shipped().items()}
    assert configs[1] == {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                          "num_warps": 8, "num_stages": 4}
    assert "measured with Triton 3.6.0" in caplog.text and H200_FP8_BLOCK in caplog.text
    sglang_own = module.get_moe_configs(128, 768, "fp8_w8a8", 128, 128)  # SGLang's fallback to Triton 3.2's
    assert sglang_own[1]["BLOCK_SIZE_M"] == 64 and sorted(sglang_own) == sorted(configs)


@pytest.mark.parametrize("case", ["bf16_launch", "config_dir_env", "deterministic", "other_gpu", "other_triton",
                                  "down_moe"])
def test_sglang_keeps_its_choice(case, miles_ckpt, tmp_path, monkeypatch):
    serve(write_config(tmp_path / "bf16") if case == "bf16_launch" else miles_ckpt,
          enable_deterministic_inference=case == "deterministic",
          **({"attention_backend": "triton"} if case == "deterministic" else {}))  # one SGLang 0.5.23 allows for it
    if case == "config_dir_env":
        (tmp_path / "configs").mkdir()  # a config folder with none for this layer
        monkeypatch.setenv("SGLANG_MOE_CONFIG_DIR", str(tmp_path))
    module = sglang_config_module(triton_version="3.5.1" if case == "other_triton" else "3.6.0",
                                  device="NVIDIA_H100_80GB_HBM3" if case == "other_gpu" else "NVIDIA_H200")
    args = (128, 768, "fp8_w8a8", 128, 128, False, case == "down_moe")
    assert patched(module)(*args) == module.get_moe_configs(*args)


def test_config_sglang_ships_for_the_running_triton_wins(tmp_path):
    ours = patch.tuned_moe_config(H200_FP8_BLOCK, "3.6.0", str(tmp_path))
    assert ours == patch.TUNED_MOE_CONFIGS / "triton_3_6_0" / H200_FP8_BLOCK
    (tmp_path / "configs/triton_3_6_0").mkdir(parents=True)
    (tmp_path / "configs/triton_3_6_0" / H200_FP8_BLOCK).write_text("{}")
    assert patch.tuned_moe_config(H200_FP8_BLOCK, "3.6.0", str(tmp_path)) is None
    assert patch.tuned_moe_config(H200_FP8_BLOCK, "3.5.1", str(SGLANG_CONFIGS.parent)) is None


def test_shipped_configs_fit_the_block_fp8_kernel():
    for path in patch.TUNED_MOE_CONFIGS.glob("triton_*/*.json"):
        configs = json.loads(path.read_text())
        block_k = json.loads("[" + path.name.split("block_shape=[")[1].split("]")[0] + "]")[1]
        for m, c in configs.items():
            assert int(m) >= 1 and set(c) == {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M",
                                              "num_warps", "num_stages"}, (path.name, m)
            assert c["BLOCK_SIZE_K"] == block_k and all(
                c[k] & (c[k] - 1) == 0 for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "GROUP_SIZE_M", "num_warps")
            ), (path.name, m)
    # every token count SGLang's fallback file has (nearest-count lookup must not widen a measured entry)
    assert set(shipped()) == set(json.loads((SGLANG_CONFIGS / "triton_3_2_0" / H200_FP8_BLOCK).read_text()))
