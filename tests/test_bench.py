"""``sglang-mxfp8 bench``: the row schema, the reports generated from rows (and the committed ones equal to what the
committed rows give), the registry's citations, the suites and their dry run, and the served routines run against a
real HTTP peer speaking SGLang's contract, with SGLang's own ``sglang.bench_serving`` as the load."""

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from sglang_mxfp8.bench import report, rows
from sglang_mxfp8.flags import RECOMMENDED_FLAGS

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def env(run="r1", gpu="NVIDIA H100 80GB HBM3"):
    return rows.Environment(run=run, gpu=gpu, sm=90, driver="580.1", versions={"torch": "2.11.0", "sglang": None},
                            commit="abc", command="sglang-mxfp8 bench --suite quick")


def test_a_rows_ratio_is_mxfp8s_advantage_either_way():
    t = rows.measurement(env(), "layers", "layer time", "s", "--all-kernels", "us", "lower", 50.0, 100.0, tokens=16)
    s = rows.measurement(env(), "serve", "output throughput", "s", RECOMMENDED_FLAGS, "tok/s", "higher", 150.0, 100.0,
                         concurrency=16)
    assert (t.ratio, s.ratio) == (2.0, 1.5)
    assert rows.measurement(env(), "accuracy", "identical greedy sequences", "s", "", "fraction", "higher", 0.5,
                            None).ratio is None


@pytest.mark.parametrize("change,message", [
    ({"ratio": 3.0}, "'ratio': 3.0 does not follow from mxfp8 50.0 and bf16 100.0"),
    ({"routine": "speed"}, "'routine': 'speed' is none of"),
    ({"better": "faster"}, "'better': 'faster' is neither"),
    ({"tokens": "16"}, "'tokens': '16' has the wrong type"),
    ({"gpu": None}, "'gpu': None is not a str"),
    ({"colour": "blue"}, "['colour'] are not in schema 1"),
    ({"schema": 2}, "'schema': 2 (this version reads 1)"),
])
def test_schema_names_the_field_a_row_gets_wrong(change, message):
    good = asdict(rows.measurement(env(), "layers", "layer time", "s", "", "us", "lower", 50.0, 100.0))
    with pytest.raises(rows.SchemaError) as e:
        rows.validate({**good, **change})
    assert message in str(e.value)


def test_rows_append_and_load_back_and_a_bad_line_names_file_and_line(tmp_path):
    r = [rows.measurement(env(), "layers", "layer time", "s", "", "us", "lower", v, 100.0, tokens=t)
         for t, v in ((1, 40.0), (16, 80.0))]
    assert rows.append(tmp_path / "a.jsonl", r) == 2
    assert [x["tokens"] for x in rows.load(tmp_path)] == [1, 16]
    (tmp_path / "b.jsonl").write_text('{"schema": 1}\n')
    with pytest.raises(rows.SchemaError, match=r"b\.jsonl:1: row field 'run'"):
        rows.load(tmp_path)


def _served(run, time_, c_ratios, gpu="NVIDIA H100 80GB HBM3"):
    out = []
    for c, (mx, bf) in c_ratios.items():
        r = rows.measurement(env(run, gpu), "serve", "output throughput", "qwen3-30b-a3b-shaped 16 layers",
                             RECOMMENDED_FLAGS, "tok/s", "higher", mx, bf, concurrency=c)
        out.append({**asdict(r), "time": time_})
    return out


def test_current_md_keeps_each_figures_newest_run_and_says_how_to_reproduce_it():
    old = _served("old", "2026-12-01T00:00:00Z", {1: (100.0, 100.0), 16: (100.0, 100.0)})
    new = _served("new", "2026-12-06T00:00:00Z", {1: (130.0, 100.0), 16: (140.0, 100.0)})
    text = report.render_current(old + new)
    line = next(x for x in text.splitlines() if x.startswith("| output throughput"))
    assert "1.30x / 1.40x at c1 / c16" in line and "| H100 | 2026-12-06 | [1] |" in line and "1.00x" not in text
    assert "1. `sglang-mxfp8 bench --suite quick` on NVIDIA H100 80GB HBM3 (torch 2.11.0; commit abc)" in text
    assert (
        "Served by the recommended command, qwen3-30b-a3b-shaped 16 layers model: 1.30x / 1.40x BF16's output tok/s "
        "at concurrency 1 / 16 (H100, 2026-12-06)." in report.render_readme_block(old + new)
    )


def test_check_finds_reports_that_do_not_follow_from_the_rows(tmp_path):
    data = _served("new", "2026-12-06T00:00:00Z", {16: (140.0, 100.0)})
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "README.md").write_text(f"# x\n\n{report.BEGIN}\n{report.END}\n\n"
                                        f"{report.REGISTRY_BEGIN}\n{report.REGISTRY_END}\n")
    report.write(tmp_path, data)
    assert report.check(tmp_path, data) == []
    readme = (tmp_path / "README.md").read_text()
    (tmp_path / "README.md").write_text(readme + "\nIt runs 1.5x BF16 and 3000 tok/s.\n")
    assert [p.split(": ", 1)[1] for p in report.check(tmp_path, data)] == [
        "figure '1.5x' typed outside the generated block; figures come from rows",
        "figure '3000 tok/s' typed outside the generated block; figures come from rows"]
    (tmp_path / "README.md").write_text(readme.replace("1.40x", "1.45x"))
    (tmp_path / "benchmarks" / "CURRENT.md").write_text("edited\n")
    assert len(report.check(tmp_path, data)) == 2


def test_committed_reports_are_what_the_committed_rows_give():
    """CURRENT.md, the README's speed paragraph and its kernel table are generated; a figure typed into either, or a
    row edited without regenerating, fails here."""
    assert report.check(ROOT, rows.load(RESULTS)) == []


def test_reports_cite_the_newest_row_of_each_figure_whatever_order_the_rows_come_in():
    """CURRENT.md and the README paragraph from the committed rows in a fresh random order (as files could be read in
    any order) are the reports from them oldest first; a figure measured again cites its newest run."""
    import random

    data = rows.load(RESULTS)
    shuffled = list(data)
    random.Random(random.randrange(1 << 30)).shuffle(shuffled)
    assert report.render_current(shuffled) == report.render_current(data)
    assert report.summary(shuffled) == report.summary(data)
    served = [r for r in data if r["metric"] == "output throughput" and r["flags"] == RECOMMENDED_FLAGS]
    largest = max(served, key=lambda r: report.model_rank(r["shape"]))["shape"]
    newer = [{**r, "run": "later-run", "time": "2099-01-01T00:00:00Z", "mxfp8": r["mxfp8"] * 2, "ratio": r["ratio"] * 2}
             for r in served if r["shape"] == largest]
    for order in (data + newer, newer + data):
        assert any(f"{newer[0]['ratio']:.2f}x" in line for line in report.summary(order)), report.summary(order)


def test_the_readme_speaks_for_the_largest_model_measured_then_the_newest_run():
    """A quick suite's 4-layer served figures, newer than a 16-layer model's, do not replace them in the README: a
    4-layer model's step is mostly what both servers share; a real checkpoint's figures come before either."""
    def served(shape, time, ratio):
        return [{"routine": "serve", "metric": "output throughput", "shape": shape, "flags": RECOMMENDED_FLAGS,
                 "concurrency": c, "tokens": None, "kernel": None, "run": f"{shape} {time}", "time": time,
                 "gpu": "NVIDIA H100 80GB HBM3", "mxfp8": ratio, "bf16": 1.0, "ratio": ratio, "unit": "tok/s",
                 "better": "higher", "extra": {}} for c in (1, 16, 128)]

    small = served("qwen3-30b-a3b-shaped 4 layers", "2026-12-07T17:00:00Z", 0.87)
    large = served("qwen3-30b-a3b-shaped 16 layers", "2026-12-06T10:00:00Z", 1.32)
    line = report.summary(small + large)[0]
    assert "16 layers model: 1.32x / 1.32x / 1.32x" in line and "2026-12-06" in line, line
    real = served("Qwen2.5-Coder-1.5B-Instruct", "2026-12-01T00:00:00Z", 1.1)
    assert "Qwen2.5-Coder-1.5B-Instruct model: 1.10x" in report.summary(real + small + large)[0]


def test_agreement_on_a_generated_models_random_weights_sits_apart_from_accuracy():
    """Accuracy and routing rows of the generated model (random weights: near-ties) go under their own heading with a
    line saying why they are no accuracy; a real checkpoint's stay under Accuracy."""
    from sglang_mxfp8.bench.models import generated_name, is_generated

    assert is_generated(generated_name(16)) and not is_generated("Qwen2.5-Coder-1.5B-Instruct")
    base = next(r for r in rows.load(RESULTS) if r["routine"] == "accuracy")
    real = {**base, "metric": "top-1 agreement on BF16's tokens", "shape": "Qwen3-30B-A3B", "run": "r1"}
    random_weights = {**real, "shape": generated_name(4), "run": "r2"}
    current = report.render_current([real, random_weights])
    accuracy, near_ties = current.split("## Accuracy")[1].split("## Agreement on random weights (near-ties)")
    assert "Qwen3-30B-A3B, " in accuracy and generated_name(4) not in accuracy
    assert generated_name(4) in near_ties.split("## Runs")[0] and "nothing about MXFP8's accuracy" in near_ties


def test_rows_name_a_users_checkpoint_by_folder_architecture_and_layers(tmp_path):
    """A folder's name may say nothing of the model in it ("coder-bf16"): rows add its architecture and layers."""
    from sglang_mxfp8.bench.models import user_model_name

    folder = tmp_path / "coder-bf16"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 28}))
    assert user_model_name(folder) == "coder-bf16 (Qwen2ForCausalLM, 28 layers)"
    (folder / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                    "text_config": {"num_hidden_layers": 34}}))
    assert user_model_name(folder) == "coder-bf16 (Gemma3ForConditionalGeneration, 34 layers)"
    (folder / "config.json").write_text("{}")
    assert user_model_name(folder) == "coder-bf16"


def test_a_suites_wall_time_names_the_routines_that_did_not_finish():
    """A suite whose serve routine failed on a server took less time than the suite: its wall-time line says so."""
    from sglang_mxfp8.bench.rows import measurement

    whole, partial = (measurement(env(run), "suite", "quick suite wall time", "sglang-mxfp8 bench", "", "s", "lower",
                                  seconds, None, extra={"not_run": not_run})
                      for run, seconds, not_run in (("r1", 512.0, []),
                                                    ("r2", 431.0, ["serve on BF16", "serve on MXFP8"])))
    assert report.value_text([asdict(whole)]) == "512 s"
    assert report.value_text([asdict(partial)]) == "431 s (did not finish: serve on BF16, serve on MXFP8)"


def test_report_check_says_what_it_checked():
    """``bench report --check`` on the committed rows: exit 0 with one line naming what it compared."""
    p = _cli("bench", "report", "--check")
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [line for line in p.stdout.splitlines() if not line.startswith("RC ")]
    assert len(lines) == 1 and lines[0].startswith("bench report --check: benchmarks/CURRENT.md, README's speed "
                                                   "paragraph and kernel table are what the ") and p.stderr == ""


def test_every_registry_citation_is_a_committed_row():
    from sglang_mxfp8.kernels import registry

    have = {(r["routine"], r["shape"], r["tokens"], r["kernel"]) for r in rows.load(RESULTS)}
    cites = registry.cited_rows()
    assert cites and [c for c in cites if tuple(c) not in have] == []


def test_suites_cover_every_routine_and_quick_stays_small():
    from sglang_mxfp8.bench.run import ROUTINES, SUITES

    assert set(ROUTINES) | {"suite"} == set(rows.ROUTINES)  # "suite": a whole suite's wall time
    assert set(SUITES["full"].routines) == set(ROUTINES) - {"routing"}
    assert set(SUITES["quick"].routines) == set(ROUTINES) - {"routing", "tests"}  # `bench tests` runs the smoke subset
    quick, full = SUITES["quick"], SUITES["full"]
    assert quick.serve.concurrency == (1, 16, 128) and quick.serve.mx_flags == (RECOMMENDED_FLAGS,)
    assert quick.tests and full.tests is None and full.layers.sets == ("qwen3-30b-a3b", "llama-3-8b", "gpt-oss-20b")
    assert not quick.serve.restart and full.serve.restart and full.serve.gsm8k_questions == 1319
    assert quick.serve.gsm8k_questions == 250  # where --model has a tokenizer: never on the generated random model
    assert quick.model_layers == 4 and full.model_layers == 16  # a first start grows with the layers


def test_the_smoke_subset_names_gpu_tests_that_exist_in_every_gpu_test_file():
    """Each term of the quick suite's -k expression selects a test of tests/gpu, and every GPU test file has one
    selected, but those that start servers, whose short version a routine runs: a renamed test or file must not drop
    out of the smoke subset unnoticed."""
    import ast

    from sglang_mxfp8.bench.run import ROUTINES, SERVED_TESTS, SMOKE_TESTS

    files = sorted((ROOT / "tests" / "gpu").glob("test_*.py"))
    assert set(SERVED_TESTS) <= {f.name for f in files} and set(SERVED_TESTS.values()) <= set(ROUTINES)
    tests = {f.name: [n.name for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.FunctionDef)
                      and n.name.startswith("test_")] for f in files if f.name not in SERVED_TESTS}
    terms = SMOKE_TESTS.split(" or ")
    assert len(tests) >= 3 and len(terms) >= 5
    for term in terms:
        assert any(term in name for names in tests.values() for name in names), f"{term!r} selects no GPU test"
    for file, names in tests.items():
        assert any(term in name for term in terms for name in names), f"the smoke subset runs nothing of {file}"


def _cli(*args, timeout=120):
    code = ("import sys, time; t = time.perf_counter(); from sglang_mxfp8.cli import main; rc = main(sys.argv[1:]); "
            "print('RC', rc, 'TORCH', 'torch' in sys.modules, 'SGLANG', 'sglang' in sys.modules, flush=True)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_dry_run_lists_each_step_without_torch_or_a_gpu(tmp_path):
    p = _cli("bench", "--dry-run", "--workdir", str(tmp_path), "--server-flags", "--attention-backend triton")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "[1] model" in out and "[2] servers" in out and "[3] layers" in out and "[4]" not in out
    assert "--dataset-name random-ids --tokenize-prompt" in out and "--max-concurrency 128" in out
    assert "time to first token: 4 prompts of 4096 tokens, one at a time" in out and "/start_profile" not in out
    assert "gsm8k (250 questions) where the model has a tokenizer" in out
    assert "launch: python -m sglang.launch_server --model-path CKPT --port 30700 --attention-backend triton" in out
    assert out.strip().endswith("RC 0 TORCH False SGLANG False")


def test_a_cold_refit_is_measured_where_asked_or_in_the_full_suite(tmp_path):
    cold = "then with the page cache dropped"
    assert cold in _cli("bench", "refit", "--cold-refit", "--dry-run", "--workdir", str(tmp_path)).stdout
    assert cold not in _cli("bench", "refit", "--dry-run", "--workdir", str(tmp_path)).stdout
    assert cold in _cli("bench", "--suite", "full", "--dry-run", "--workdir", str(tmp_path)).stdout


def test_bench_help_and_argument_errors_import_nothing_heavy():
    assert "ROUTINE" in _cli("bench", "--help").stdout
    p = _cli("bench", "--suite", "slow")
    assert p.returncode == 2 and "invalid choice: 'slow'" in p.stderr
    p = _cli("bench", "speed", "--dry-run")
    assert "no routine 'speed'" in p.stderr and "RC 2 TORCH False" in p.stdout


def test_a_model_that_is_no_checkpoint_folder_is_one_line_before_any_step(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    cases = {("--model", str(tmp_path / "missing")): f"--model {tmp_path / 'missing'}: no such folder",
             ("--model", str(tmp_path / "notes.txt")): f"--model {tmp_path / 'notes.txt'} is a file",
             ("--bf16-model", str(tmp_path)): f"--bf16-model {tmp_path}: no config.json there"}
    for (flag, path), start in cases.items():
        p = _cli("bench", flag, path, "--dry-run", "--workdir", str(tmp_path / "w"))
        assert "RC 2 TORCH False" in p.stdout, p.stdout
        assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith(f"sglang-mxfp8 bench: {start}"), p.stderr


def test_counts_are_refused_by_name_and_a_profile_concurrency_is_planned(tmp_path):
    for flag, what in (("--layers", "layers"), ("--tokens", "tokens"), ("--concurrency", "concurrent requests"),
                       ("--profile-concurrency", "concurrent requests")):
        p = _cli("bench", flag, "0", "--dry-run")
        assert p.returncode == 2 and f"argument {flag}: '0' is not a number of {what} (1 or more)" in p.stderr
    out = _cli("bench", "serve", "--layers", "4", "--profile-concurrency", "1", "--dry-run",
               "--workdir", str(tmp_path)).stdout
    assert "profile: SGLang's /start_profile by stage during a load at concurrency 1" in out
    assert "/start_profile" not in _cli("bench", "serve", "--dry-run", "--workdir", str(tmp_path)).stdout


def test_bench_without_a_gpu_is_one_line():
    p = _cli("bench", "layers")
    assert "RC 2" in p.stdout and p.stderr.strip().splitlines() == [
        "sglang-mxfp8 bench: no CUDA GPU is visible here; run it on the H100 / H200 / B200 it should measure "
        "(--dry-run shows what it would run)"]


# -- the served routines against a real HTTP peer ------------------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerServer:
    """Stands in for the stock launcher (no SGLang server runs on a CPU): tests/sglang_test_peer.py, whose greedy
    tokens shift with the checkpoint's name ending in a digit."""

    def __init__(self, name, ckpt, flags, port, log_dir, text=False, env=None, base=""):
        self.name, self.port, self.cmd, self.t0 = name, port, f"peer {ckpt} {flags}", time.time()
        self.log = Path(log_dir) / f"server_{name}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_text("[x] sglang_mxfp8: MoE (128 experts, hidden 2048, intermediate 768): 1 token: moe_gemv\n")
        shift = "5" if "mxfp8" in str(ckpt) and "same" not in str(ckpt) else "0"
        log = [str(self.log)] if "mxfp8" in str(ckpt) else []
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests/sglang_test_peer.py"), str(port), shift, "0.3",
                                      *log], env=dict(os.environ, PEER_MODEL=str(ckpt)))

    def wait(self, timeout=400):
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def test_the_second_checkpoint_for_alternating_refits_negates_every_e4m3_weight_once(tmp_path):
    """Every e4m3 tensor's sign bits flipped (its values negated, zeros and all), scales and other files as they were;
    written once, and again only when the source is newer."""
    import torch
    from safetensors.torch import load_file, save_file

    from sglang_mxfp8.bench.models import negated
    from sglang_mxfp8.format.numerics import quantize_mxfp8

    src = tmp_path / "mxfp8"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "qwen3_moe"}')
    q, s = quantize_mxfp8(torch.randn(16, 64) * torch.tensor([0.0, 1.0]).repeat(32))  # every other column zero
    save_file({"a.weight": q, "a.weight_scale_inv": s, "a.bias": torch.ones(16, dtype=torch.bfloat16)},
              str(src / "model.safetensors"))
    out = negated(src, tmp_path / "mxfp8-negated")
    got = load_file(str(out / "model.safetensors"))
    assert torch.equal(got["a.weight"].float(), -q.float()) and torch.equal(got["a.weight"].view(torch.uint8),
                                                                            q.view(torch.uint8) ^ 0x80)
    assert torch.equal(got["a.weight_scale_inv"], s)
    assert torch.equal(got["a.bias"], torch.ones(16, dtype=torch.bfloat16))
    assert (out / "config.json").read_text() == '{"model_type": "qwen3_moe"}' and not list(tmp_path.glob("*.partial"))
    written = (out / "model.safetensors").stat().st_mtime_ns
    assert negated(src, out) == out and (out / "model.safetensors").stat().st_mtime_ns == written


@pytest.mark.parametrize("mx_name,same", [("mxfp8", False), ("mxfp8-same", True)])
def test_served_routines_pair_each_mxfp8_value_with_bf16s(tmp_path, monkeypatch, mx_name, same):
    """A whole served comparison against two peers: SGLang's own bench_serving as the load at two concurrencies, the
    start, refit and refit-under-load timings, and the accuracy read against BF16's outputs, teacher-forced too."""
    import hashlib
    import shutil

    import torch
    from safetensors.torch import save_file

    from sglang_mxfp8.bench import served
    from sglang_mxfp8.bench.models import ServedPair, write_word_tokenizer
    from sglang_mxfp8.format.numerics import quantize_mxfp8

    bf16 = tmp_path / "bf16"
    write_word_tokenizer(bf16, 1000)
    (bf16 / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "vocab_size": 1000,
                                                  "num_experts_per_tok": 2, "num_hidden_layers": 2,
                                                  "max_position_embeddings": 64 if same else 4096}))
    mx = tmp_path / mx_name  # two MXFP8 weights with their scales: bench spoils one in every way a refit is refused
    mx.mkdir()
    shutil.copy2(bf16 / "config.json", mx / "config.json")
    tensors = {}
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"):
        tensors[name], tensors[f"{name}_scale_inv"] = quantize_mxfp8(torch.randn(32, 64))
    save_file(tensors, str(mx / "model.safetensors"))
    pair = ServedPair(bf16, mx, "peer model", tokenizer=False)
    opts = served.ServeOptions(concurrency=(1, 4), prompts={1: 2, 4: 8}, input_len=32, output_len=8, prefill_len=96,
                               prefill_prompts=2, profile_concurrency=4, port=_free_port(), refits=2,
                               alternating_refits=3, tensor_refits=False)
    monkeypatch.setattr(served.Runner, "_server", lambda self, name, ckpt, flags, env: PeerServer(
        name, ckpt, flags, self.opts.port, self.work / "logs"))
    steps = []
    runner = served.Runner(env(), pair, opts, {"serve", "start", "refit", "accuracy", "routing"}, tmp_path / "work",
                           steps.append)
    recorded = []
    sessions = runner.run(recorded.extend)
    assert [s.name for s in sessions] == ["BF16", "MXFP8"]
    assert ("serve MXFP8: warm-up, concurrency 1, 4" + ("" if same else ", 96-token prompts one at a time")) in steps
    by = {(r.metric, r.concurrency): r for r in recorded}
    throughput = by[("output throughput", 4)]
    assert throughput.mxfp8 > 0 and throughput.bf16 > 0
    assert throughput.flags == f"{RECOMMENDED_FLAGS} --enable-return-routed-experts"  # what every server ran with
    assert "--dataset-name random-ids" in throughput.extra["load"] and throughput.extra["prompts"] == 8
    assert by[("decode latency, batch 1", 1)].mxfp8 > 0 and by[("first start", None)].bf16 > 0
    prefill = by.get(("time to first token, 96-token prompt", 1))
    if same:  # a model of 64 positions takes no 96-token prompt: not measured
        assert prefill is None
    else:
        assert prefill.mxfp8 > 0 and prefill.bf16 > 0
        assert "--random-input-len 96 --random-output-len 1 " in prefill.extra["load"]
    moe, dense = by[("decode GPU time per step, moe", 4)], by[("decode GPU time per step, dense", 4)]
    mx_moe, mx_dense = (0.12, 0.03) if same else (0.08, 0.02)  # the peers' kernels (tests/sglang_test_peer.py)
    assert (moe.mxfp8, moe.bf16, dense.mxfp8, dense.bf16) == (mx_moe, 0.12, mx_dense, 0.03)
    assert by[("prefill GPU time, attention", 4)].mxfp8 == 40 * 8 * 40 / 1000  # all 40 prefill steps' ms
    assert by[("decode GPU time per step, other", 4)].extra["mxfp8"]["other_kernels_ms"] == {
        "void flashinfer::norm::FusedAddRMSNormKernel<8u, bf16>": 0.005}
    warm = by[("refit from disk, page cache warm", None)]
    assert len(warm.extra["mxfp8_s"]) == len(warm.extra["bf16_s"]) == 2  # each refit's time, the median the figure
    assert warm.mxfp8 == pytest.approx(sum(warm.extra["mxfp8_s"]) / 2, abs=1e-5)
    assert 0.25 < warm.mxfp8 < 5 and warm.extra["mxfp8_server_split"] == {
        "load_s": 0.3, "read_s": 0.09, "copy_s": 0.09, "quantize_s": 0.0, "processing_s": 0.12, "check_s": 0.03,
        "layout_s": 0.09, "precompile_s": 0.0, "peak_gib": 0.25}
    peak = by[("peak memory during a refit", None)]
    assert (peak.mxfp8, peak.bf16, peak.extra) == (0.25, None, {"disk": 0.25})  # no tensor refits in this run
    load = by[("requests failed during a refit", None)].extra
    assert load["failed"] == 0 and load["equal"] == load["equal_without_refit"] == load["requests"] == 32
    assert load["refit_s"] >= 0.3 and 0 < load["in_flight_at_refit"] <= 32
    refused = by[("refits refused, then requests answered", None)]
    assert refused.mxfp8 == 1.0 and refused.bf16 is None, refused.extra
    assert refused.extra["refused"] == 4 and refused.extra["refused_answered_false"] == 4
    assert refused.extra["accepted"] == 1 and refused.extra["recompiles"] == 0
    steps = refused.extra["steps"]
    assert [s["step"] for s in steps] == ["disk:missing_scale", "disk:short_scale", "disk:nan_bf16",
                                          "disk:missing_folder", "disk:A"]
    assert "without its scale" in steps[0]["message"] and "needs a scale" in steps[1]["message"]
    assert steps[0]["weight"] in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight")
    alternating = by[("alternating refits equal to a fresh server", None)]
    assert alternating.mxfp8 == 1.0 and alternating.extra["equal"] == {"ckpt": 1, "other": 2}
    assert (tmp_path / "models" / f"{mx_name}-negated-{hashlib.sha1(str(mx.resolve()).encode()).hexdigest()[:10]}" /
            "model.safetensors").is_file()
    assert by[("identical greedy sequences", None)].mxfp8 == (1.0 if same else 0.0)
    assert by[("top-1 agreement on BF16's tokens", None)].mxfp8 == (1.0 if same else 0.0)
    assert by[("mean |logprob - BF16's| on BF16's tokens", None)].extra["tokens"] == 8 * 32
    routing = by[("routed experts equal to BF16's, per token and MoE layer", None)]
    assert routing.extra["token_layers"] == 8 * 24 * 2 and routing.bf16 is None  # 8 prompts of 24 tokens, 2 layers
    assert routing.mxfp8 == 1.0 if same else 0.5 < routing.mxfp8 < 0.9  # the peer moves every fourth token's experts
    assert routing.extra["equal_by_layer"] == [routing.mxfp8] * 2  # the peer moves them in every layer alike
    assert routing.extra["overlap"] == 1.0 if same else routing.mxfp8 <= routing.extra["overlap"] < 1.0
    overlap = by[("routed experts' top-k overlap with BF16's, per token and MoE layer", None)]
    assert overlap.mxfp8 == routing.extra["overlap"] and overlap.bf16 is None
    assert sessions[1].plan_lines == ["MoE (128 experts, hidden 2048, intermediate 768): 1 token: moe_gemv"]


def test_gsm8k_routine_reads_the_benchmarks_accuracy_line(tmp_path):
    """The accuracy routine's gsm8k step: benchmarks/gsm8k/bench_sglang.py against a server (the gsm8k test peer,
    which answers every even question right)."""
    from sglang_mxfp8.bench.served import gsm8k

    port = _free_port()
    peer = subprocess.Popen([sys.executable, str(ROOT / "tests/gsm8k_test_peer.py"), str(port)])
    try:
        PeerServer.wait(type("P", (), {"port": port})())
        assert gsm8k(port, 40, tmp_path) == 0.5
    finally:
        peer.terminate()
        peer.wait()


def test_a_trainers_buckets_hold_the_checkpoints_tensors_in_order_each_within_its_size(tmp_path):
    """The tensor refit sends a checkpoint as a trainer does: every tensor once, in file and key order, grouped in
    buckets no larger than the bound unless one tensor alone is, or an MXFP8 weight's scale joins its weight's."""
    import torch
    from safetensors.torch import save_file

    from sglang_mxfp8.bench.trainer import buckets

    g = torch.Generator().manual_seed(3)
    sizes = [int(n) for n in torch.randint(1, 400, (40,), generator=g)] + [3000]
    for i, part in enumerate((sizes[:25], sizes[25:])):
        save_file({f"t{i}.{j:02d}": torch.randn(n, generator=g) for j, n in enumerate(part)},
                  str(tmp_path / f"model-{i}.safetensors"))
    got = list(buckets(tmp_path, bucket_bytes=4096))
    names = [n for group in got for n, _ in group]
    assert names == [f"t0.{j:02d}" for j in range(25)] + [f"t1.{j:02d}" for j in range(16)]
    sizes_of = [sum(t.numel() * 4 for _, t in group) for group in got]
    assert all(s <= 4096 for s, group in zip(sizes_of, got) if len(group) > 1) and sizes_of[-1] == 12000
    assert all(a + b[0][1].numel() * 4 > 4096 for a, b in zip(sizes_of, got[1:]))  # each bucket as full as it fits
    from sglang_mxfp8.format.numerics import quantize_mxfp8

    pairs = {}
    for i in range(6):
        pairs[f"e{i}.weight"], pairs[f"e{i}.weight_scale_inv"] = quantize_mxfp8(torch.randn(32, 64, generator=g))
    mx = tmp_path / "mx"
    mx.mkdir()
    save_file(pairs, str(mx / "model.safetensors"))
    got = [[n for n, _ in group] for group in buckets(mx, bucket_bytes=2100)]  # one weight (2048 B) a bucket
    assert [n for group in got for n in group] == sorted(pairs) and all(
        group == [group[0], group[0] + "_scale_inv"] for group in got), got


def test_a_generated_model_the_disk_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    """The sizes are those the bench's trainer sent for the 4-layer model on an H100 (BF16 and MXFP8 bytes); a model
    too large for the work folder's disk is refused at once, with the layers that fit."""
    from sglang_mxfp8.bench.models import ModelError, generated, generated_bytes

    assert generated_bytes(4) == (6229628928, 3816069120)
    bf16_48, mx_48 = generated_bytes(48)
    assert 61e9 < bf16_48 < 61.1e9 and 32e9 < mx_48 < 32.2e9  # Qwen3-30B-A3B's 48 layers: 93 GB for both
    with pytest.raises(ModelError, match=r"--layers 100000: .* need [\d.]+ GB more on disk, .* GB free \(enough for "
                                         r"\d+ layers\); pass --layers \d+ or a --workdir on a larger disk"):
        generated(tmp_path / "work", 100000)
    assert list(tmp_path.iterdir()) == []


def test_layer_rows_say_what_fraction_of_the_floor_each_side_reaches():
    """The floor under a layer (bench.roofline): a 5120x2048 FP8 weight at 16 tokens over an H100's 3.35 TB/s is 3.2 us
    with its activations, memory-bound; 8192 tokens of Qwen3-30B-A3B's MoE at 800 TFLOPS are compute-bound at 0.77
    ms; the report prints each point's fraction, MXFP8 then BF16, and nothing where a row lacks it."""
    from sglang_mxfp8.bench.roofline import Peaks, dense_traffic, moe_traffic
    from sglang_mxfp8.bench.rows import measurement

    h100 = Peaks(copy_tb_s=3.35, fp8_tflops=800.0, bf16_tflops=400.0)
    nbytes, flops = dense_traffic(16, 5120, 2048, 1)
    assert nbytes == 5120 * 2048 + 2 * 16 * 2048 + 2 * 16 * 5120 and flops == 2 * 16 * 5120 * 2048
    assert abs(h100.floor_us(nbytes, flops, True) - 3.2) < 0.05
    fractions = h100.fractions(dense_traffic(16, 5120, 2048, 1), dense_traffic(16, 5120, 2048, 2), 8.4, 9.7)
    assert fractions["bound"] == "memory" and abs(fractions["roofline_mxfp8"] - 3.2 / 8.4) < 0.01
    assert abs(fractions["roofline_bf16"] - 6.36 / 9.7) < 0.01 and fractions["peaks"]["copy_tb_s"] == 3.35
    moe = moe_traffic(8192, 8, 128, 2048, 768, 1)
    assert moe[1] == 6 * 8192 * 8 * 2048 * 768 and moe[0] == 128 * 3 * 2048 * 768 + 4 * 8192 * 2048
    big = h100.fractions(moe, moe_traffic(8192, 8, 128, 2048, 768, 2), 1545.0, 1597.0)
    assert big["bound"] == "compute" and 770 < big["floor_us"] < 776
    assert abs(big["roofline_mxfp8"] - 773.1 / 1545) < 1e-3
    assert abs(big["roofline_bf16"] - 1546.2 / 1597) < 1e-3
    points = [asdict(measurement(env("r1"), "layers", "layer time", "qkv_proj [5120 x 2048]", "--fp8-gemm-backend x",
                                 "us", "lower", us, bf16, tokens=m, kernel="k",
                                 extra=h100.fractions(dense_traffic(m, 5120, 2048, 1), dense_traffic(m, 5120, 2048, 2),
                                                      us, bf16)))
              for m, us, bf16 in ((16, 8.4, 9.7), (128, 9.2, 9.7))]
    assert report.value_text(points) == "1.15x / 1.05x at 16 tok / 128 tok; k; roofline 38% / 40% (BF16 65% / 70%)"
    del points[1]["extra"]["roofline_mxfp8"]
    assert report.value_text(points) == "1.15x / 1.05x at 16 tok / 128 tok; k"
