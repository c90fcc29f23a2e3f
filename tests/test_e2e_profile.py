"""Helpers of benchmarks/e2e/bench_throughput.py: the kernel-time summary it reads from SGLang's profiler trace, its
variant specs, and its timed rounds, prefill latency and prefill profile against a real HTTP server speaking SGLang's
/generate and /start_profile contract (what each round records agrees with the rate it reports; the table shows every
round; a prefill is timed and profiled on prompts the server has not seen)."""

import gzip
import importlib.util
import json
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
ARGMAX = "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>"


def test_kernel_times_per_step_sorted_with_total():
    step = [{"name": "moe_gemm", "ts": 0.0, "dur": 30.0}] * 2 + [{"name": "act_quant", "ts": 0.0, "dur": 2.5}] * 4 + \
           [{"name": "argmax", "ts": 0.0, "dur": 4.0}]
    rows = bench.kernel_times([(0.0, 100.0, step)] * 4)
    assert [r[0] for r in rows] == ["moe_gemm", "act_quant", "argmax", "all kernels"]
    assert rows[0][1:] == (2.0, 60.0)
    assert rows[1][1:] == (4.0, 10.0)
    assert rows[-1][1] == pytest.approx(7.0) and rows[-1][2] == pytest.approx(74.0)
    timeline = {"steps": 4, "busy_us": 50.0}
    table = bench.profile_tables({"MXFP8": {"kernels": rows, "timeline": timeline, "what": "decode step"}}, top=2)
    assert "| moe_gemm | 2.0 | 60.0 |" in table and "| all kernels | 7.0 | 74.0 |" in table
    assert not any("argmax" in line for line in table)


def test_variant_spec_leading_assignments_are_the_servers_environment():
    env, flags = bench.split_env("SGLANG_MXFP8_WEIGHT_ONLY=0 A_B='x y' --fp8-gemm-backend triton --json-model-override-args '{\"a\": 1}'")
    assert env == {"SGLANG_MXFP8_WEIGHT_ONLY": "0", "A_B": "x y"}
    assert flags == "--fp8-gemm-backend triton --json-model-override-args '{\"a\": 1}'"
    assert bench.split_env("--flag X=1") == ({}, "--flag X=1")  # a value after a flag stays a flag value


def test_whole_steps_run_from_argmax_to_argmax_and_leave_cut_steps_out():
    """Three argmaxes close steps at 40, 140 and 240 us: two whole steps; the kernels up to the first argmax (a step
    the window began inside) and after the last (one it stopped inside) are left out; a kernel belongs to the step
    its end falls in."""
    events = [{"name": "cut_before", "ts": 0.0, "dur": 10.0}, {"name": ARGMAX, "ts": 36.0, "dur": 4.0},
              {"name": "gemm", "ts": 35.0, "dur": 20.0},  # starts before the first argmax ends: the first step's
              {"name": ARGMAX, "ts": 136.0, "dur": 4.0}, {"name": "gemm", "ts": 150.0, "dur": 20.0},
              {"name": ARGMAX, "ts": 236.0, "dur": 4.0}, {"name": "cut_after", "ts": 250.0, "dur": 10.0}]
    steps = bench.whole_steps(events)
    assert [(a, b, [e["name"] for e in ev]) for a, b, ev in steps] == [(40.0, 140.0, ["gemm", ARGMAX]),
                                                                       (140.0, 240.0, ["gemm", ARGMAX])]
    assert bench.step_busy_us(steps[0]) == pytest.approx(15.0 + 4.0)  # the gemm counted from the step's start
    rows = bench.kernel_times(steps)
    assert rows[0] == ("gemm", 1.0, 20.0) and rows[-1] == ("all kernels", 2.0, 24.0)
    assert bench.whole_steps(events[:2]) == []


def test_step_timeline_counts_overlapping_kernels_once_and_the_idle_gap_in_the_period(tmp_path):
    """Three steps between four argmaxes, 100 us apart: a GEMV (10 us) whose dependent launch (20 us) starts
    5 us into it, then the argmax (4 us): 34 us of kernel time per step, 29 us of busy GPU."""
    events = [{"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 900.0}]
    for step in range(4):
        t = 1000.0 + 100.0 * step
        events += [{"cat": "kernel", "name": "up", "ts": t, "dur": 10.0},
                   {"cat": "kernel", "name": "down", "ts": t + 5.0, "dur": 20.0},
                   {"cat": "kernel", "name": ARGMAX, "ts": t + 30.0, "dur": 4.0}]
    trace = tmp_path / "t.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    steps = bench.whole_steps(bench.trace_kernels(trace))
    timeline = bench.step_timeline(steps)
    assert timeline == {"steps": 3, "busy_us": pytest.approx(29.0), "period_us": pytest.approx(100.0)}
    assert bench.step_timeline(steps, consecutive=False) == {"steps": 3, "busy_us": pytest.approx(29.0)}
    rows = bench.kernel_times(steps)
    assert rows[-1][2] == pytest.approx(34.0)  # the kernel sum per step
    table = bench.profile_tables({"MXFP8": {"kernels": rows, "timeline": timeline, "what": "decode step"}})
    assert "busy 29.0 us per step" in table[-1] and "takes 100.0 us" in table[-1]


SECONDS_PER_TOKEN = 1e-3
PREFILL_SECONDS = 5e-3  # a prompt not seen before (SGLang serves a repeated one from its prefix cache)


class Generate(BaseHTTPRequestHandler):
    """Answers /generate after max_new_tokens x SECONDS_PER_TOKEN, plus PREFILL_SECONDS for a prompt it has not seen,
    with that many completion tokens. /start_profile as SGLang's: the next num_steps batches are written to
    output_dir as a trace when the batch after them arrives."""

    def log_message(self, *args):
        pass

    def _answer(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        if self.path == "/start_profile":
            server.profile = dict(left=req["num_steps"], dir=Path(req["output_dir"]), events=[])
            return self._answer({"success": True})
        assert len(req["input_ids"]) == server.input_len and req["sampling_params"]["ignore_eos"] is True
        n = req["sampling_params"]["max_new_tokens"]
        fresh = tuple(req["input_ids"]) not in server.seen
        server.seen.add(tuple(req["input_ids"]))
        # its batches: the prefill (a GEMM over a new prompt), then n decode steps (the last one the overlap
        # scheduler's, run before it sees the request finished), each closed by the greedy argmax
        for kernels in [[("prefill_gemm", 300.0)] * fresh] + [[("decode", 10.0)]] * n:
            profile = server.profile
            if profile and profile["left"] == 0:  # the batch after the last profiled one: the trace is written
                with gzip.open(profile["dir"] / "peer.trace.json.gz", "wt") as f:
                    json.dump({"traceEvents": profile["events"]}, f)
                server.profile = None
            elif profile:
                profile["left"] -= 1
                ts = 1000.0 * len(profile["events"])
                for name, dur in kernels + [(ARGMAX, 4.0)]:
                    profile["events"].append({"cat": "kernel", "name": name, "ts": ts, "dur": dur})
                    ts += dur
        time.sleep(n * SECONDS_PER_TOKEN + fresh * PREFILL_SECONDS)
        self._answer({"meta_info": {"completion_tokens": n}})


def peer(input_len: int):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Generate)
    server.seen, server.profile, server.input_len = set(), None, input_len
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def port():
    server = peer(64)
    yield server.server_address[1]
    server.shutdown()


@pytest.mark.parametrize("round_seconds", [0, 0.25])
def test_each_round_records_what_its_rate_is_made_of(port, round_seconds):
    args = Namespace(concurrency=[3], repeats=2, round_seconds=round_seconds, window_seconds=0, input_len=64,
                     output_len=20, decode_tokens=20)
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
    # 21 tokens take 20 x 1 ms longer than one (the prompt repeated: no prefill after the first)
    assert result["decode_ms_per_token"] == pytest.approx(1e3 * SECONDS_PER_TOKEN, rel=0.5)
    # one token on a fresh prompt: its prefill and one token (6 ms of sleep, so never less), plus the HTTP round trip
    # (1-2 ms here, up to 9 ms seen on a busy 2-core machine); a cached prompt would read 5 ms less, the five
    # requests summed 30 ms or more, the 21-token request 20 ms more
    assert 6.0 <= result["prefill_ms"] < 20.0


def test_steady_windows_rate_the_requests_inside_each(port):
    """3 clients started over 0.3 s, two 0.5 s windows from 0.6 s on: a 20 ms request each time, so at most 3 x 20
    tokens per 20 ms, 1500 per window (the client threads' own overhead makes it fewer, never more); each window's
    rate is its tokens over its length, and the windows' median is the reported rate."""
    args = Namespace(concurrency=[3], repeats=2, round_seconds=0, window_seconds=0.5, ramp_seconds=0.3,
                     input_len=64, output_len=20, decode_tokens=20)
    t0 = time.perf_counter()
    result = bench.measure(port, args)
    windows, rates = result["c3_rounds"], result["c3_runs"]
    assert len(windows) == len(rates) == 2
    for w, rate in zip(windows, rates):
        assert w["seconds"] == 0.5 and 750 <= w["tokens"] <= 1500 and 30 <= w["requests"] <= 75
        assert rate == w["tokens"] / 0.5
    assert result["c3"] == pytest.approx(sum(rates) / 2)
    assert time.perf_counter() - t0 >= 0.6 + 2 * 0.5


def test_steady_windows_do_not_count_waves(port):
    """Clients started together with requests longer than a window's part: 3 requests of 200 ms each finish together
    every 200 ms, so 0.3 s windows see one or two waves end (600 or 1200 tokens by finished requests); by each
    request's share of time inside the window, every window holds 3 x 0.3 s of generation: 900 tokens at most,
    nearly that in each (the clients' gaps between requests are short)."""
    args = Namespace(concurrency=[3], repeats=4, round_seconds=0, window_seconds=0.3, ramp_seconds=0.0,
                     input_len=64, output_len=200, decode_tokens=20)
    windows = bench.steady_windows(port, 3, args, lambda r=None: [1] * 64)
    finished = [w["requests"] for w in windows]
    assert set(finished) <= {0, 3, 6} and len(set(finished)) > 1  # whole waves end inside a window: uneven counts
    assert all(800 <= w["tokens"] <= 900 for w in windows), windows


def test_table_cell_shows_the_median_and_every_round():
    assert bench.with_rounds({"c128": 11980.4, "c128_runs": [11980.4, 9766.2, 12253.7]}, "c128") == \
        "11980 (11980, 9766, 12254)"


def test_prefill_profile_reads_one_fresh_prompt_per_batch_and_leaves_the_decode_steps_out(tmp_path):
    """3 prefill batches profiled: each holds the new prompt's prefill kernels once (a repeated prompt would come
    from the prefix cache and hold none); the decode step after each is left out and said so; the table reports the
    GPU's busy time, not the client's period."""
    server = peer(32)
    try:
        profile = bench.profile_prefill(server.server_address[1], 3, tmp_path / "trace", input_len=32)
    finally:
        server.shutdown()
    rows = {name: (calls, us) for name, calls, us in profile["kernels"]}
    assert rows == {"prefill_gemm": (1.0, 300.0), ARGMAX: (1.0, 4.0), "all kernels": (2.0, 304.0)}
    assert profile["timeline"] == {"steps": 3, "busy_us": pytest.approx(304.0)} and profile["left_out"] == 4
    table = bench.profile_tables({"MXFP8, prefill": profile})
    assert "GPU time of one prefill batch of 32 tokens, MXFP8, prefill (top 12 kernels by time):" in table
    assert any("busy 304.0 us per step" in line and "4 shorter steps" in line for line in table)
    assert not any("argmax to argmax" in line for line in table)
