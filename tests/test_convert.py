"""Converter round trip on a tiny model built with transformers, read back through SGLang's real config classes."""

import json
import re
import shutil
from importlib.metadata import version

import pytest
import torch
from safetensors import safe_open

from conftest import doctor_plans, run_python
from sglang_mxfp8.cli import main as cli
from sglang_mxfp8.format.convert import ConvertError, convert, validate
from sglang_mxfp8.format.numerics import dequantize_mxfp8, quantize_mxfp8

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("llama-bf16")
    model.save_pretrained(out, max_shard_size="300KB")  # several shards + index
    return out


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def test_round_trip(hf_llama, tmp_path):
    dst = tmp_path / "llama-mxfp8"
    report = convert(hf_llama, dst, progress=False)
    src_t, dst_t = _tensors(hf_llama), _tensors(dst)
    assert len(list(dst.glob("*.safetensors"))) == len(list(hf_llama.glob("*.safetensors"))) > 1
    assert json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"].keys() == dst_t.keys()
    # 7 projections per layer quantized; embeddings, lm_head, norms kept
    assert len(report.quantized) == 14
    for name in report.quantized:
        q, s = dst_t[name], dst_t[name.replace(".weight", ".weight_scale_inv")]
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8 and s.shape == (q.shape[0], q.shape[1] // 32)
        ref = src_t[name].float()
        rel = ((dequantize_mxfp8(q, s) - ref).norm() / ref.norm()).item()
        assert rel < 0.035, (name, rel)  # e4m3: ~2.6% for Gaussian weights
        q2, s2 = quantize_mxfp8(src_t[name])  # same rounding as the numerics module
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
    ):
        assert torch.equal(dst_t[name].view(torch.uint8), src_t[name].view(torch.uint8))  # byte-identical
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, 32], "scale_fmt": "ue8m0",
                  "activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head", "model.embed_tokens"],
                  "scale_rounding": "ceil"}  # what a BF16 tensor sent to the server is quantized with
    assert (dst / "generation_config.json").is_file()
    assert validate(dst) == 14


def test_config_loads_through_sglang(hf_llama, tmp_path):
    dst = tmp_path / "mx"
    convert(hf_llama, dst, progress=False)
    code = (
        "import json\n"
        "from sglang.srt.layers.quantization.fp8 import Fp8Config\n"
        "import sglang.srt.layers.quantization as q\n"
        f"qc = json.load(open({str(dst / 'config.json')!r}))['quantization_config']\n"
        "for cls in (Fp8Config, q.QUANTIZATION_METHODS['mxfp8']):\n"
        "    c = cls.from_config(qc)\n"
        "    print(cls.__name__, c.use_mxfp8, c.is_checkpoint_fp8_serialized, c.weight_block_size,\n"
        "          'lm_head' in c.ignored_layers, c.get_min_capability())\n"
    )
    p = run_python(code)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["Fp8Config True True [1, 32] True 100", "Mxfp8Config True True [1, 32] True 90"]


def test_refuses_overwrite_and_bad_input(hf_llama, tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(ConvertError, match=r"config.json is a file; pass the checkpoint's folder"):
        convert(hf_llama / "config.json", dst, progress=False)
    convert(hf_llama, dst, progress=False)
    with pytest.raises(ConvertError, match="--force"):
        convert(hf_llama, dst, progress=False)
    convert(hf_llama, dst, force=True, progress=False)
    with pytest.raises(ConvertError, match="already quantized"):
        convert(dst, tmp_path / "again", progress=False)


def test_nan_weight_is_named(tmp_path):
    from safetensors.torch import save_file

    src = tmp_path / "bad"
    src.mkdir()
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    w[3, 3] = float("nan")
    save_file({"model.layers.0.mlp.down_proj.weight": w}, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    with pytest.raises(ConvertError, match="tensor model.layers.0.mlp.down_proj.weight holds NaN/Inf"):
        convert(src, tmp_path / "o", progress=False)


def test_expert_with_k_not_multiple_of_32_is_refused(tmp_path):
    """A dense layer with K % 32 != 0 stays BF16 (listed as not converted); an expert cannot."""
    from sglang_mxfp8.bench.tiny_model import write_qwen3_moe

    src = write_qwen3_moe(tmp_path / "k144", moe_intermediate=144)  # experts' down_proj: K = 144
    with pytest.raises(ConvertError, match=r"model.layers.0.mlp.experts.0.down_proj.weight has K=144, not a "
                                           r"multiple of 32; every expert projection must be MXFP8"):
        convert(src, tmp_path / "o", progress=False)


def test_cli_convert_and_doctor(hf_llama, tmp_path, capsys):
    dst = tmp_path / "cli"
    assert cli(["convert", str(hf_llama), str(dst)]) == 0
    assert cli(["convert", str(hf_llama), str(dst)]) == 2  # refuses to overwrite
    assert cli(["doctor", "--gpu", "h200", "--model", str(dst), "--fp8-gemm-backend", "flashinfer_trtllm"]) == 0
    out = capsys.readouterr().out
    plans = "\n".join(doctor_plans(out))
    assert "tensors quantized to MXFP8" in out
    assert "GPU: NVIDIA H200 (SM90)" in out
    # K=352 not % 128: FlashInfer's GEMM cannot, the Triton kernel takes it, its weight-only GEMM small batches
    assert (
        "dense model.layers.N.mlp.down_proj [128 x 352] x2: 1-16 tokens: weight_only; other batches: triton_w8a8"
        in plans
    )
    # as SGLang serves them, fused: gate 352 + up 352 rows, a multiple of 64 that neither is alone
    assert (
        "dense model.layers.N.mlp.gate_up_proj [704 x 128] x2 (gate_proj + up_proj): other batches: flashinfer_sm90"
        in plans
    )
    assert (
        "dense model.layers.N.self_attn.qkv_proj [256 x 128] x2 (q_proj + k_proj + v_proj): "
        "other batches: flashinfer_sm90"
        in plans
    )
    assert "dense model.layers.N.self_attn.o_proj [128 x 128] x2: other batches: flashinfer_sm90" in plans
    assert sum(line.startswith("  dense ") for line in out.splitlines()) == 4
    assert cli(["doctor", "--gpu", "h200", "--model", str(dst), "--fp8-gemm-backend", "flashinfer_cutlass"]) == 1
    assert "cannot run MXFP8 on NVIDIA H200 (SM90)" in capsys.readouterr().out


def test_doctor_checks_the_checkpoint_without_a_gpu(hf_llama, tmp_path, capsys, monkeypatch):
    """On a machine with no GPU, --model is still read: its format, or one line on why it is not one."""
    import sglang_mxfp8.platform

    monkeypatch.setattr(sglang_mxfp8.platform, "visible_gpu", lambda: None)  # CI has none; a GPU box must behave alike
    dst = tmp_path / "mx"
    assert cli(["convert", str(hf_llama), str(dst)]) == 0
    capsys.readouterr()
    assert cli(["doctor", "--model", str(dst)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-3:] == [
        "GPU: none visible (pass --gpu h200|b200|... to see what a GPU would run)",
        f"checkpoint: {dst} (SGLang/miles MXFP8, scales 'weight_scale_inv', 2 modules kept unquantized)",
        "  kernels per layer: pass --gpu h200|b200|... to see them",
    ]
    assert cli(["doctor", "--model", str(tmp_path / "missing")]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"{tmp_path / 'missing'}: no such folder; pass the checkpoint's folder (config.json and *.safetensors)")
    refusal = (f"{hf_llama}: not an MXFP8 checkpoint (no quant_method mxfp8 / quant_algo MXFP8); convert it first "
               "with `sglang-mxfp8 convert`")
    assert cli(["doctor", "--model", str(hf_llama)]) == 1  # the BF16 original
    assert capsys.readouterr().out.splitlines()[-1] == refusal
    assert cli(["build", "--model", str(hf_llama), "--gpu", "h200"]) == 2  # refused before anything compiles
    assert capsys.readouterr().err.splitlines() == [f"sglang-mxfp8 build: {refusal}"]


def test_doctor_names_the_dense_prefill_kernel(tmp_path, capsys, monkeypatch):
    """Layers on the FlashInfer backend: batches of 1024+ tokens on DeepGEMM where it can run, else on cuBLAS where
    K % 512 == 0 (with why not DeepGEMM), unless switched off."""
    transformers = pytest.importorskip("transformers")
    from sglang_mxfp8 import platform
    from sglang_mxfp8.ops import cublas_sm90

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    convert(tmp_path / "bf16", tmp_path / "mx", progress=False)
    args = ["doctor", "--gpu", "h200", "--model", str(tmp_path / "mx"), "--fp8-gemm-backend", "flashinfer_trtllm"]
    from sglang_mxfp8 import settings

    monkeypatch.setattr(platform, "deep_gemm_missing", lambda api, needs="": "not installed")
    monkeypatch.setattr(cublas_sm90, "unsupported", lambda: None)
    assert cli(args) == 0
    out = capsys.readouterr().out
    cublas = "1024+ tokens: cublas; other batches: flashinfer_sm90"
    plans = doctor_plans(out)
    up = next(line for line in plans if "gate_up_proj [2048 x 512] x1 (gate_proj + up_proj)" in line)
    assert cublas in up and up.endswith("; not deepgemm: not installed]")
    assert "\n".join(plans).count(cublas) == 4  # qkv, o, gate_up, down: every K a multiple of 512, every N of 128
    monkeypatch.setenv("SGLANG_MXFP8_DISABLED_KERNELS", "cublas")
    settings.current.cache_clear()
    assert cli(args) == 0 and "1024+ tokens" not in "\n".join(doctor_plans(capsys.readouterr().out))
    monkeypatch.setattr(platform, "deep_gemm_missing", lambda api, needs="": None)
    assert cli(args) == 0
    plans = "\n".join(doctor_plans(capsys.readouterr().out))
    assert plans.count("1024+ tokens: deepgemm; other batches: flashinfer_sm90") == 4


@pytest.mark.parametrize("flashinfer_here", [True, False])
def test_demo_cpu_path(tmp_path, capsys, monkeypatch, flashinfer_here):
    """The demo's CPU path shows what an H200 and a B200 server would run, with the FlashInfer SGLang installs there,
    also where this machine has none (a fresh `pip install -e .` brings no FlashInfer)."""
    from sglang_mxfp8 import platform

    monkeypatch.setattr(platform, "flashinfer_available", lambda: flashinfer_here)
    assert cli(["demo", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "56 tensors quantized" in out and "[4/4] done (CPU path)" in out
    assert (
        "NVIDIA H200 (SM90) --fp8-gemm-backend flashinfer_trtllm: qkv_proj [512 x 256]: other batches: flashinfer_sm90"
        in out
    )
    assert (
        "NVIDIA H200 (SM90) --fp8-gemm-backend flashinfer_trtllm: o_proj [256 x 256]: other batches: flashinfer_sm90"
        in out
    )
    assert "NVIDIA H200 (SM90) --moe-runner-backend auto: experts (8 experts, hidden 256, intermediate 128): " in out
    assert "other batches: triton_moe" in out
    assert platform.flashinfer_missing() == (None if flashinfer_here else
                                             "FlashInfer is not installed (pip install flashinfer-python)")


def test_tiny_model_tokenizer_travels_with_conversion(tmp_path):
    from transformers import AutoTokenizer

    from sglang_mxfp8.bench.tiny_model import write_qwen3_moe

    src = write_qwen3_moe(tmp_path / "bf16", tokenizer=True)
    convert(src, tmp_path / "mx", progress=False)
    tok = AutoTokenizer.from_pretrained(tmp_path / "mx")
    ids = tok("Question: Janet has 16 eggs.\nAnswer:")["input_ids"]
    assert 0 < max(ids) < 1024 and tok.decode(ids) == "Question: Janet has 16 eggs.\nAnswer:"


def test_doctor_reports_the_startup_hook():
    for env, expected in (
        ({}, "startup hook: active"),
        ({"SGLANG_MXFP8_DISABLE": "1"}, "startup hook: disabled by SGLANG_MXFP8_DISABLE=1"),
    ):
        p = run_python("from sglang_mxfp8.cli import main; main(['doctor', '--gpu', 'h200'])", env)
        assert p.returncode == 0, p.stderr[-2000:]
        assert expected in p.stdout


# ---- data safety: the input is only read, the output appears whole or not at all ------------------------------------

def _snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["same", "inside input", "holding input"])
def test_an_output_overlapping_the_input_is_refused_and_the_input_kept(hf_llama, tmp_path, where):
    import shutil

    src = tmp_path / "model"
    shutil.copytree(hf_llama, src)
    before = _snapshot(tmp_path)
    dst = {"same": src, "inside input": src / "mx", "holding input": tmp_path}[where]
    with pytest.raises(ConvertError, match="must be apart from the input"):
        convert(src, dst, force=True, progress=False)
    assert cli(["convert", str(src), str(dst), "--force"]) == 2
    assert _snapshot(tmp_path) == before  # nothing deleted, nothing written


def test_force_replaces_an_earlier_conversion_only(hf_llama, tmp_path):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    for force in (False, True):  # said at once, whether --force was given or not
        with pytest.raises(ConvertError, match="is not an earlier conversion"):
            convert(hf_llama, other, force=force, progress=False)
    assert (other / "keep.txt").read_text() == "mine" and len(list(other.iterdir())) == 1
    dst = tmp_path / "mx"
    convert(hf_llama, dst, progress=False)
    with pytest.raises(ConvertError, match="holds an earlier conversion; pass --force to replace it"):
        convert(hf_llama, dst, progress=False)
    (dst / "notes.txt").write_text("the user's")
    (dst / "sub").mkdir()
    (dst / "sub" / "eval.json").write_text("{}")
    before = _snapshot(tmp_path)
    with pytest.raises(ConvertError, match=r"files sglang_mxfp8 did not write \(notes.txt, sub/\); --force replaces "
                                           "only what a conversion wrote"):
        convert(hf_llama, dst, force=True, progress=False)
    assert cli(["convert", str(hf_llama), str(dst), "--force"]) == 2 and _snapshot(tmp_path) == before
    (dst / "notes.txt").unlink()
    shutil.rmtree(dst / "sub")
    convert(hf_llama, dst, force=True, progress=False)
    assert validate(dst) == 14
    assert json.loads((dst / "mxfp8_conversion.json").read_text())["source"] == str(hf_llama.resolve())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left


def _index_with(src, tmp_path, shard_name):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(src, model)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard_name
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    return model


@pytest.mark.parametrize(
    "shard_name", ["../victim/model.safetensors", "/tmp/elsewhere.safetensors", "sub/x.safetensors", "..", "model.bin"]
)
def test_shard_names_from_the_index_must_be_plain_files_of_the_input(hf_llama, tmp_path, shard_name):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "model.safetensors").write_bytes(b"another model")
    model = _index_with(hf_llama, tmp_path, shard_name)
    with pytest.raises(ConvertError, match="is not a plain \\*.safetensors file name"):
        convert(model, tmp_path / "mx", progress=False)
    assert (victim / "model.safetensors").read_bytes() == b"another model" and not (tmp_path / "mx").exists()


def test_an_interrupted_conversion_leaves_no_checkpoint(hf_llama, tmp_path, monkeypatch):
    from sglang_mxfp8.format import convert as conv

    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the user's ^C in the middle of the shards
        return save_file(tensors, path, metadata=metadata)

    from safetensors.torch import save_file
    monkeypatch.setattr(conv, "save_file", failing_save)
    with pytest.raises(KeyboardInterrupt):
        convert(hf_llama, tmp_path / "mx", progress=False)
    assert list(tmp_path.iterdir()) == []  # neither the output nor its temporary folder


def test_other_weight_files_are_not_copied_and_kept_tensors_must_be_finite(hf_llama, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(hf_llama, model)
    (model / "pytorch_model.bin").write_bytes(b"an old copy of the weights")
    (model / "tokenizer_config.json").write_text("{}")
    report = convert(model, tmp_path / "mx", progress=False)
    assert report.skipped == ["pytorch_model.bin"] and not (tmp_path / "mx" / "pytorch_model.bin").exists()
    assert (tmp_path / "mx" / "tokenizer_config.json").is_file()
    shard = next(p for p in sorted(model.glob("*.safetensors")) if "model.norm.weight" in load_file(p))
    tensors = load_file(shard)
    tensors["model.norm.weight"][7] = float("inf")
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ConvertError, match=r"tensor model.norm.weight \(kept unquantized\) holds NaN/Inf"):
        convert(model, tmp_path / "mx2", progress=False)
    assert not (tmp_path / "mx2").exists()


@pytest.mark.parametrize("damage", ["random bytes", "truncated"])
def test_corrupt_safetensors_give_one_line_in_convert_and_doctor(hf_llama, tmp_path, capsys, damage):
    import os
    import shutil

    model = tmp_path / "model"
    shutil.copytree(hf_llama, model)
    shard = sorted(model.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(os.urandom(len(data)) if damage == "random bytes" else data[: len(data) // 2])
    assert cli(["convert", str(model), str(tmp_path / "mx")]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("convert MXFP8:")]  # the bar
    assert len(lines) == 1 and lines[0].startswith(f"error: {shard}: not a readable safetensors file (")
    assert "Traceback" not in err
    assert not (tmp_path / "mx").exists()
    mx = tmp_path / "good"
    convert(hf_llama, mx, progress=False)
    shard = sorted(mx.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    assert cli(["doctor", "--gpu", "h200", "--model", str(mx)]) == 1
    out = capsys.readouterr()
    assert out.out.splitlines()[-1] == f"error: {shard}: not a readable safetensors file (" + \
        out.out.splitlines()[-1].split(" (", 1)[1] and "Traceback" not in out.out + out.err


def test_invalid_config_json_gives_one_line(hf_llama, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(hf_llama, model)
    (model / "config.json").write_text("{not json")
    assert cli(["convert", str(model), str(tmp_path / "mx")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {model / 'config.json'}: not readable JSON (JSONDecodeError")


def _someones_checkpoint(folder):
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"their weights")


@pytest.mark.parametrize("holding", [
    "someone's checkpoint",
    "a folder named like the marker",
    "the marker in a subfolder",
    "an empty marker file",
    "a marker another tool wrote",
    "a link to an earlier conversion's marker",
])
def test_force_never_replaces_a_folder_that_is_not_an_earlier_conversion(hf_llama, tmp_path, holding):
    dst = tmp_path / "out"
    _someones_checkpoint(dst)
    earlier = tmp_path / "earlier"
    convert(hf_llama, earlier, progress=False)
    marker = dst / "mxfp8_conversion.json"
    if holding == "a folder named like the marker":
        marker.mkdir()
        (marker / "x").write_text(json.dumps({"converted_by": "sglang_mxfp8 0.1.0"}))
    elif holding == "the marker in a subfolder":
        (dst / "sub").mkdir()
        (dst / "sub" / "mxfp8_conversion.json").write_bytes((earlier / "mxfp8_conversion.json").read_bytes())
    elif holding == "an empty marker file":
        marker.write_text("")
    elif holding == "a marker another tool wrote":
        marker.write_text(json.dumps({"converted_by": "another_tool 1.0"}))
    elif holding == "a link to an earlier conversion's marker":
        marker.symlink_to(earlier / "mxfp8_conversion.json")
    before = _snapshot(tmp_path)
    with pytest.raises(ConvertError, match="is not an earlier conversion"):
        convert(hf_llama, dst, force=True, progress=False)
    assert cli(["convert", str(hf_llama), str(dst), "--force"]) == 2
    assert _snapshot(tmp_path) == before  # nothing deleted, nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier", "out"]


def test_a_conversion_is_written_beside_its_destination_and_renamed_into_place(hf_llama, tmp_path, monkeypatch):
    """The partial output lives in the destination's folder (same file system: the final rename is atomic), not in
    the temporary folder, the working folder or the input's folder."""
    import os
    import shutil
    import tempfile

    from sglang_mxfp8.format import convert as conv

    elsewhere = {name: tmp_path / name for name in ("tmp", "cwd", "input", "dest")}
    for folder in elsewhere.values():
        folder.mkdir()
    src = elsewhere["input"] / "model"
    shutil.copytree(hf_llama, src)
    monkeypatch.setattr(tempfile, "tempdir", str(elsewhere["tmp"]))
    monkeypatch.setenv("TMPDIR", str(elsewhere["tmp"]))
    monkeypatch.chdir(elsewhere["cwd"])
    seen, real_replace = [], conv._replace

    def watch(work, dst):
        seen.append((work, sorted(p.name for p in work.parent.iterdir()), sorted(os.listdir(elsewhere["tmp"])),
                     sorted(os.listdir(elsewhere["cwd"])), sorted(os.listdir(elsewhere["input"]))))
        return real_replace(work, dst)

    monkeypatch.setattr(conv, "_replace", watch)
    for dst in (elsewhere["dest"] / "mx", elsewhere["dest"] / "new" / "mx"):
        convert(src, dst, progress=False)
        (work, beside, in_tmp, in_cwd, in_input) = seen[-1]
        assert work.parent == dst.parent and work.name.startswith(".mx.partial-") and beside == [work.name]
        assert (in_tmp, in_cwd, in_input) == ([], [], ["model"])
        assert validate(dst) == 14 and sorted(p.name for p in dst.parent.iterdir()) == ["mx"]


LAYER0 = ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
          "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.q_proj",
          "model.layers.0.self_attn.v_proj"]

SERVED = r"""
import json, sys
from sglang.srt.layers.quantization.utils import is_layer_skipped
from sglang_mxfp8.sglang import quant_methods

cfg = quant_methods.Mxfp8Config.from_config(json.load(open(sys.argv[1]))["quantization_config"])
fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}  # Llama's, in SGLang
for i in (0, 1):
    for module in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        print(i, module, is_layer_skipped(f"model.layers.{i}.{module}", cfg.ignored_layers, fused_mapping=fused))
"""


def test_keep_bf16_leaves_the_chosen_layers_as_they_were_and_sglang_serves_them_unquantized(hf_llama, tmp_path, capsys):
    """`--keep-bf16 first:1 --keep-bf16 lm_head`: layer 0's projections and lm_head keep the input's bytes (no scale
    tensor), layer 1's are MXFP8; modules_to_not_convert lists them, SGLang's layer skipping (which gives a layer its
    unquantized method in Mxfp8Config.get_quant_method) skips layer 0's fused layers and not layer 1's; doctor names
    them."""
    dst = tmp_path / "mx"
    assert cli(["convert", str(hf_llama), str(dst), "--keep-bf16", "first:1", "--keep-bf16", "lm_head"]) == 0
    src_t, out = _tensors(hf_llama), _tensors(dst)
    for module in LAYER0 + ["lm_head"]:
        assert out[f"{module}.weight"].dtype == torch.bfloat16 and f"{module}.weight_scale_inv" not in out
        assert torch.equal(out[f"{module}.weight"].view(torch.int16), src_t[f"{module}.weight"].view(torch.int16))
    for module in LAYER0:
        one = module.replace("layers.0", "layers.1")
        assert out[f"{one}.weight"].dtype == torch.float8_e4m3fn and out[f"{one}.weight_scale_inv"].dtype == torch.uint8
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["modules_to_not_convert"] == sorted(LAYER0 + ["lm_head", "model.embed_tokens"])
    assert json.loads((dst / "mxfp8_conversion.json").read_text())["keep_bf16"] == ["first:1", "lm_head"]
    p = run_python(SERVED.replace("sys.argv[1]", repr(str(dst / "config.json"))))
    assert p.returncode == 0, p.stderr[-3000:]
    served = [line.split() for line in p.stdout.splitlines() if line[:2] in ("0 ", "1 ")]
    modules = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    assert served == [[i, m, skipped] for i, skipped in (("0", "True"), ("1", "False")) for m in modules]
    capsys.readouterr()
    assert cli(["doctor", "--gpu", "h200", "--model", str(dst)]) == 0
    out_text = capsys.readouterr().out
    assert "BF16 (modules_to_not_convert; SGLang's own unquantized kernels): lm_head, model.embed_tokens, " \
           "model.layers.0.mlp.down_proj, model.layers.0.mlp.gate_proj, ... (9 in all)" in " ".join(out_text.split())
    assert any("model.layers.N" in line for line in doctor_plans(out_text))


@pytest.mark.parametrize(
    "patterns,message",
    [
        (
            ["model.layers.0.self_attn.q_proj"],
            "keeps model.layers.0.self_attn.q_proj but not "
            "model.layers.0.self_attn.k_proj: SGLang serves q_proj + k_proj + v_proj as one",
        ),
        (
            ["model.layers.1.mlp.up_proj"],
            "keeps model.layers.1.mlp.up_proj but not model.layers.1.mlp.gate_proj: SGLang "
            "serves gate_proj + up_proj as one weight",
        ),
        (["model.layers.7"], "--keep-bf16 model.layers.7: matches no tensor of the checkpoint"),
        (["first:x"], "--keep-bf16 first:x: needs N >= 0"),
        (["first:1", "lm_heads"], "--keep-bf16 lm_heads: matches no tensor"),
        (["first:2", "lm_heads"], "--keep-bf16 lm_heads: matches no tensor"),  # whatever a first:N before it expands to
        (["lm_heads", "first:2"], "--keep-bf16 lm_heads: matches no tensor"),
        (["first:99"], "--keep-bf16 first:99 keeps every layer the converter would quantize"),
        (
            ["last:1", "model.layers.0"],
            "--keep-bf16 last:1 model.layers.0 keeps every layer the converter would quantize",
        ),
    ],
)
def test_keep_bf16_refuses_what_sglang_cannot_serve_and_writes_nothing(hf_llama, tmp_path, patterns, message):
    with pytest.raises(ConvertError, match=re.escape(message)):
        convert(hf_llama, tmp_path / "mx", progress=False, keep_bf16=patterns)
    assert list(tmp_path.iterdir()) == []


def test_keep_bf16_takes_a_moe_layers_experts_all_or_none(tmp_path):
    from sglang_mxfp8.bench.tiny_model import write_qwen3_moe

    src = write_qwen3_moe(tmp_path / "moe", layers=3)
    with pytest.raises(ConvertError, match=re.escape(
            "--keep-bf16 keeps model.layers.0.mlp.experts.1.down_proj but not model.layers.0.mlp.experts.0.down_proj: "
            "SGLang runs a layer's experts as one fused MoE in one dtype; keep all of model.layers.0.mlp.experts")):
        convert(src, tmp_path / "a", progress=False, keep_bf16=["model.layers.0.mlp.experts.1"])
    report = convert(src, tmp_path / "b", progress=False, keep_bf16=["last:1", "model.layers.0.mlp.experts"])
    kept = json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert {m for m in kept if ".experts." in m} == {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in (0, 2)
                                                      for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")}
    assert not any(".layers.1.mlp.experts." in name for name in report.kept)
    assert "model.layers.2.self_attn.q_proj" in kept and "model.layers.1.self_attn.q_proj" not in kept


@pytest.mark.parametrize("architecture,warned", [("LlamaForCausalLM", False), ("FooBarForCausalLM", True),
                                                 ("NoSuchArchitectureForCausalLM", True)])
def test_convert_warns_of_an_architecture_sglang_has_no_class_for(hf_llama, tmp_path, capsys, architecture, warned):
    src = tmp_path / "src"
    shutil.copytree(hf_llama, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}))
    assert cli(["convert", str(src), str(tmp_path / "mx")]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert err == ([f"warning: the installed SGLang ({version('sglang')}) has no model class for {architecture}; it "
                    "may not serve this checkpoint"] if warned else [])
