"""The offline gsm8k benchmark: answer extraction, prompts, scoring, and a run against a real HTTP peer."""

import contextlib
import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_sglang", ROOT / "benchmarks/gsm8k/bench_sglang.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_shipped_data_is_complete():
    test = bench.read_jsonl(bench.DATA / "test.jsonl")
    train = bench.read_jsonl(bench.DATA / "train.jsonl")
    assert (len(test), len(train)) == (1319, 7473)
    assert bench.label_of(test[0]) == 18 and bench.label_of(test[-1]) == 14
    assert all(bench.label_of(x) != bench.INVALID for x in test)


@pytest.mark.parametrize(
    "text,value",
    [(" She makes 9 * 2 = $18 a day.", 18), ("1,234 apples and then 5,000", 5000), ("no number", bench.INVALID),
     ("#### 72", 72), ("answer: 007", bench.INVALID)],
)
def test_answer_extraction_matches_sglang(text, value):
    assert bench.get_answer_value(text) == value


def test_prompts_use_train_shots_and_sglang_format():
    test = bench.read_jsonl(bench.DATA / "test.jsonl")[:3]
    shots = bench.read_jsonl(bench.DATA / "train.jsonl")[:2]
    prompts = bench.build_prompts(test, shots)
    assert prompts[0].startswith("Question: " + shots[0]["question"] + "\nAnswer: " + shots[0]["answer"] + "\n\n")
    assert prompts[1].endswith("Question: " + test[1]["question"] + "\nAnswer:")
    assert prompts[0].count("Question: ") == 3
    assert all(t["question"] not in prompts[0].rsplit("Question: ", 1)[0] for t in test)  # no leakage


def test_score():
    assert bench.score([1, 2, bench.INVALID, 4], [1, 3, 5, 4]) == {"accuracy": 0.5, "invalid": 0.25}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _peer(*peer_args):
    """The test peer serving on a free port (yields the port), stopped afterwards."""
    port = _free_port()
    peer = subprocess.Popen([sys.executable, str(ROOT / "tests/gsm8k_test_peer.py"), str(port), *peer_args])
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        yield port
    finally:
        peer.terminate()
        peer.wait()


def _run_against_peer(tmp_path, *peer_args):
    with _peer(*peer_args) as port:
        result_file = tmp_path / "r.jsonl"
        record = bench.main(["--num-questions", "40", "--num-shots", "3", "--parallel", "8", "--port", str(port),
                             "--result-file", str(result_file), "--retries", "0"])
    return record, result_file


def test_end_to_end_against_http_peer(tmp_path, capsys):
    record, result_file = _run_against_peer(tmp_path)
    out = capsys.readouterr().out
    assert "Accuracy: 0.500" in out and "Invalid: 0.250" in out
    assert "Latency: " in out and "Output throughput: " in out
    line = json.loads(result_file.read_text().splitlines()[-1])
    assert line["accuracy"] == 0.5 and line["num_requests"] == 40 and line["other"]["shots_from"] == "train"
    assert record["accuracy"] == 0.5 and record["failed_requests"] == 0 and "Failed requests: 0" in out


def test_failed_request_is_counted_not_fatal(tmp_path, capsys):
    record, _ = _run_against_peer(tmp_path, "4")  # question 4 (answered correctly otherwise) gets HTTP 500
    out = capsys.readouterr().out
    assert record["failed_requests"] == 1 and "Failed requests: 1 (first: " in out
    assert record["accuracy"] == 0.475 and record["answers"][4] == bench.INVALID


def test_an_answer_that_is_not_sglangs_json_is_a_failed_request(tmp_path, capsys):
    """A 200 answer without SGLang's text field counts as a failed request; the run still scores and writes results."""
    record, result_file = _run_against_peer(tmp_path, "4", "garbage")
    out = capsys.readouterr().out
    assert record["failed_requests"] == 1 and "not SGLang's /generate answer" in out
    assert record["accuracy"] == 0.475 and json.loads(result_file.read_text().splitlines()[-1])["failed_requests"] == 1


def test_a_server_that_is_not_sglang_is_refused(tmp_path):
    """Another server answering 200 on the port: one error, exit 2, nothing scored (not accuracy 0 and exit 0)."""
    with _peer("-1", "not_sglang") as port:
        p = subprocess.run([sys.executable, str(ROOT / "benchmarks/gsm8k/bench_sglang.py"), "--num-questions", "2",
                            "--port", str(port), "--retries", "0", "--result-file", str(tmp_path / "r.jsonl")],
                           capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Accuracy" not in p.stdout and not (tmp_path / "r.jsonl").exists()
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: the server at http://127.0.0.1:{port} is not SGLang: its /get_model_info answered "
        "'\"<html>welcome</html>\"', not SGLang's JSON with a model_path; pass the --host/--port of an SGLang server")


def test_server_down_is_one_clear_error():
    port = _free_port()
    with pytest.raises(bench.ServerDown, match=f"no SGLang server answers at http://127.0.0.1:{port}"):
        bench.main(["--num-questions", "2", "--port", str(port), "--retries", "0"])


def test_platinum_without_local_file_says_why():
    with pytest.raises(SystemExit, match="cannot be downloaded here"):
        bench.main(["--platinum", "--num-questions", "2"])


def test_server_refuses_a_port_already_serving():
    """A leftover server on the port would answer health checks meant for ours."""
    from sglang_mxfp8.bench.serving import Server

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} already has a server"):
            Server("x", "/nonexistent", "", port, "/tmp")
