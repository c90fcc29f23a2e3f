"""bench_throughput.py's timed rounds against a real HTTP server speaking SGLang's /generate contract: what each
round records (seconds, requests, output tokens) agrees with the rate it reports, and the table shows every round."""

import importlib.util
import sys
import threading
import time
from argparse import Namespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("bench_throughput", ROOT / "benchmarks/e2e/bench_throughput.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

SECONDS_PER_TOKEN = 1e-3


class Generate(BaseHTTPRequestHandler):
    """Answers /generate after max_new_tokens x SECONDS_PER_TOKEN with that many completion tokens."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        import json

        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert len(req["input_ids"]) == 64 and req["sampling_params"]["ignore_eos"] is True
        n = req["sampling_params"]["max_new_tokens"]
        time.sleep(n * SECONDS_PER_TOKEN)
        body = json.dumps({"meta_info": {"completion_tokens": n}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def port():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Generate)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.mark.parametrize("round_seconds", [0, 0.25])
def test_each_round_records_what_its_rate_is_made_of(port, round_seconds):
    args = Namespace(concurrency=[3], repeats=2, round_seconds=round_seconds, input_len=64, output_len=20,
                     decode_tokens=20)
    result = bench.measure(port, args)
    rounds, rates = result["c3_rounds"], result["c3_runs"]
    assert len(rounds) == len(rates) == 2
    for r, rate in zip(rounds, rates):
        assert r["tokens"] == 20 * r["requests"]
        assert r["tokens"] / r["seconds"] == pytest.approx(rate, rel=1e-2)
        if round_seconds:  # 3 clients back to back until 0.25 s have passed; a request takes 20 ms or more
            assert 3 * 2 <= r["requests"] <= 3 * 13 and r["seconds"] >= round_seconds
        else:  # 2 x concurrency requests, at least 8
            assert r["requests"] == 8
    assert result["c3"] == pytest.approx(sum(rates) / 2)
    # 21 tokens take 20 x 1 ms longer than one
    assert result["decode_ms_per_token"] == pytest.approx(1e3 * SECONDS_PER_TOKEN, rel=0.5)


def test_table_cell_shows_the_median_and_every_round():
    assert bench.with_rounds({"c128": 11980.4, "c128_runs": [11980.4, 9766.2, 12253.7]}, "c128") == \
        "11980 (11980, 9766, 12254)"
