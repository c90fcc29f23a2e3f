"""The first hour with ``sglang-mxfp8``: help, version and argument errors that import nothing heavy, every option
explained, one-line errors for a missing folder or a missing FlashInfer, converted checkpoints readable as the umask
says, a demo that says where it writes and cleans up, and SGLang's MXFP8 note replaced by what serves it."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_python

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "sglang", "flashinfer", "triton")


def cli(*args, env=None, timeout=300):
    """``sglang-mxfp8 ARGS`` in a fresh interpreter; its exit status, output, and which heavy modules it imported."""
    code = ("import sys\nfrom sglang_mxfp8.cli import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules), 'RC', rc, flush=True)")
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})}, cwd=ROOT)
    heavy, rc = p.stdout.rsplit("HEAVY ", 1)[1].split(" RC ")
    return int(rc.strip()) if rc.strip().lstrip("-").isdigit() else rc.strip(), p.stdout, p.stderr, eval(heavy)


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["convert", "--help"], ["doctor", "--help"],
                                  ["bench", "--help"], ["doctor", "--gpu"], ["convert", "only-one-arg"],
                                  ["build", "--tp", "zero"], []])
def test_help_version_and_argument_errors_import_nothing_heavy(args):
    rc, out, err, heavy = cli(*args)
    assert heavy == [], (args, heavy)
    assert rc == (0 if args and args[-1] in ("--help", "--version") else 2), (args, rc, err)


def test_the_bare_command_says_which_commands_there_are():
    rc, out, err, _ = cli()
    assert rc == 2 and "the following arguments are required: cmd" not in err
    assert err.strip().splitlines()[-1] == ("sglang-mxfp8: choose a command: convert, doctor, build, demo, bench "
                                            "(sglang-mxfp8 COMMAND --help says more)")


def test_every_option_of_every_command_says_what_it_does():
    import argparse

    from sglang_mxfp8.cli import parser

    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    silent = [f"{name} {'/'.join(a.option_strings) or a.dest}" for name, sub in commands.items() for a in sub._actions
              if not isinstance(a, argparse._HelpAction) and not a.help]
    assert silent == []


def test_the_gsm8k_benchmark_explains_its_options():
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/gsm8k/bench_sglang.py"), "--help"], capture_output=True,
                       text=True, timeout=120)
    options = [line.split()[0] for line in p.stdout.splitlines() if line.startswith("  --")]
    assert p.returncode == 0 and len(options) >= 14
    for option in options:  # an option without help is followed directly by the next option
        block = p.stdout.split(option, 1)[1].split("\n  -", 1)[0]
        assert len(block.split()) > 2, option


def test_a_folder_that_does_not_exist_is_named(tmp_path):
    missing = tmp_path / "nowhere"
    rc, out, err, _ = cli("convert", str(missing), str(tmp_path / "out"))
    assert rc == 2 and err.strip() == f"error: {missing}: no such folder; pass a Hugging Face checkpoint folder"


def test_build_without_flashinfer_is_one_line(tmp_path):
    from sglang_mxfp8.bench.tiny_model import write_qwen3_moe
    from sglang_mxfp8.format.convert import convert

    convert(write_qwen3_moe(tmp_path / "bf16"), tmp_path / "mx", progress=False)
    code = ("import sys\nsys.modules['flashinfer'] = None  # as where it is not installed\n"
            "from sglang_mxfp8.cli import main\n"
            f"sys.exit(main(['build', '--model', {str(tmp_path / 'mx')!r}, '--gpu', 'h200']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "fi")})
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [
        "sglang-mxfp8 build: flashinfer is not installed here, and the kernels of these plans compile with it: pip "
        "install flashinfer-python (pip install -e \".[serve]\" brings SGLang and FlashInfer)"]


@pytest.mark.parametrize("umask,files,folder", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_converted_checkpoints_follow_the_umask(tmp_path, umask, files, folder):
    from sglang_mxfp8.bench.tiny_model import write_qwen3_moe

    write_qwen3_moe(tmp_path / "bf16")
    code = (f"import os; os.umask({umask})\nfrom sglang_mxfp8.format.convert import convert\n"
            "from sglang_mxfp8.bench.tiny_model import write_qwen3_moe\n"
            f"write_qwen3_moe({str(tmp_path / 'demo-bf16')!r})\n"
            f"convert({str(tmp_path / 'bf16')!r}, {str(tmp_path / 'mx')!r}, progress=False)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    for written in ("mx", "demo-bf16"):  # the converter's output and the demo's BF16 model
        assert stat.S_IMODE((tmp_path / written).stat().st_mode) == folder
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / written).iterdir()}
        assert modes and set(modes.values()) == {files}, (written, modes)


@pytest.mark.parametrize("keep", [False, True])
def test_the_demo_says_where_it_writes_and_removes_it_unless_kept(tmp_path, keep):
    """On this GPU-less machine the demo runs its CPU path, in a temporary folder it names."""
    env = {"TMPDIR": str(tmp_path)}
    rc, out, err, _ = cli("demo", *(["--keep"] if keep else []), env=env)
    assert rc == 0, err[-2000:]
    first = out.splitlines()[0]
    folder = Path(first.split("writing its checkpoints to ", 1)[1].split(" (", 1)[0])
    assert folder.parent == tmp_path and folder.name.startswith("sglang_mxfp8_demo_")
    assert first.endswith("(kept)" if keep else "(removed at the end; --keep keeps them)")
    assert folder.exists() == keep


def test_sglangs_mxfp8_note_gives_way_to_what_serves_it(tmp_path):
    """A real ModelConfig of an MXFP8 checkpoint: SGLang's own "not fully optimized" note (about its own MXFP8 path)
    is not logged; ours, saying these kernels serve it, is; with the package disabled SGLang's note stands."""
    from conftest import MILES_QUANT, write_config

    ckpt = write_config(tmp_path / "mx", MILES_QUANT)
    code = (
        "import logging, sys\nlogging.basicConfig(level=logging.INFO, format='LOG %(message)s', stream=sys.stdout)\n"
        "from sglang.srt.configs.model_config import ModelConfig\n"
        f"print('Q=' + str(ModelConfig({str(ckpt)!r}).quantization))\n"
    )
    ours, stock = run_python(code), run_python(code, {"SGLANG_MXFP8_DISABLE": "1"})
    assert ours.returncode == 0 and stock.returncode == 0, ours.stderr[-2000:] + stock.stderr[-2000:]
    note = "mxfp8 quantization is not fully optimized yet"
    assert "Q=mxfp8" in ours.stdout and note not in ours.stdout + ours.stderr
    assert ("LOG sglang_mxfp8: MXFP8 layers run sglang_mxfp8's kernels for this GPU; each layer kind's plan is logged "
            "as the model is built") in ours.stdout
    assert note in stock.stdout + stock.stderr


def test_the_cuda_toolchain_is_completed_from_pip_or_what_it_lacks_named(tmp_path, monkeypatch):
    """A toolkit with nvcc's runtime headers only: cuBLAS's and NVRTC's headers come from the nvidia-* pip packages
    where this Python has them (CPATH), libnvrtc.so is linked by its unversioned name from theirs (LIBRARY_PATH), and
    what is found nowhere is named, one line each, with where to get it."""
    from sglang_mxfp8.ops import cuda_toolchain

    toolkit = tmp_path / "cuda"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    pip_headers = {h for h in cuda_toolchain.HEADERS for d in cuda_toolchain._pip_cuda_folders("include")
                   if (d / h).is_file()}
    env = {"CPATH": "/somewhere/else"}
    missing = cuda_toolchain.prepare(env, tmp_path / "links")
    for header, package in cuda_toolchain.HEADERS.items():
        named = [line for line in missing if line.startswith(header)]
        assert (named == []) == (header in pip_headers), (header, missing)
        assert all(f"pip install {package}" in line for line in named)
    if pip_headers:
        assert env["CPATH"].endswith(os.pathsep + "/somewhere/else") and all(
            any((Path(d) / h).is_file() for d in env["CPATH"].split(os.pathsep)) for h in pip_headers)
    nvrtc = tmp_path / "links" / "libnvrtc.so"
    assert nvrtc.is_symlink() == (not any(line.startswith("libnvrtc.so") for line in missing))
    if nvrtc.is_symlink():
        assert nvrtc.resolve().name.startswith("libnvrtc.so.") and str(tmp_path / "links") in env["LIBRARY_PATH"]
    assert all("\n" not in line and " (" in line for line in missing)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p) / "nvidia").is_dir()])
    bare = cuda_toolchain.prepare({}, tmp_path / "links2")
    assert [line.split(" ")[0] for line in bare][:2] == ["cublasLt.h", "nvrtc.h"]
