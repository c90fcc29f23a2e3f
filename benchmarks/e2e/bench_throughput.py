"""Served output tokens/s and batch-1 decode latency: a Qwen3-30B-A3B-shaped model, BF16 vs MXFP8.

Full width (hidden 2048, 32 q / 4 kv heads of 128, 128 experts of 768, top-8, vocab 151936), fewer
layers (--layers, default 4), random weights; converted to MXFP8 with our converter. Each checkpoint
is served by the stock launcher with the same flags except the quantization ones (one server at a
time), and loaded with fixed-length random prompts (input_ids, ignore_eos):

- throughput at each --concurrency: 2 x concurrency requests (at least 8) with that many in flight,
  or with --round-seconds S that many clients sending requests back to back for S seconds; output
  tokens / wall time, median of --repeats rounds (each kept in e2e.json with its requests and seconds),
  after an untimed round at the same concurrency. With --window-seconds W instead: one run of that many
  clients with staggered starts, --repeats windows of W seconds in its steady state (``steady_windows``). Triton kernels (SGLang's MoE, our GEMM) and FlashInfer's SM90 GEMM compile
  on first use of a new tile config or integer specialisation, which a mixed prefill batch can hit
  late: one such stall is 1-3 s, so a single timed round can be off by several times;
- decode latency at batch 1: (time of a request with 1 + D new tokens - time with 1) / D;
- prefill latency: time to the one token of a request on a fresh prompt of the input length (nothing of it in
  SGLang's prefix cache), median of 5.

    python benchmarks/e2e/bench_throughput.py --out OUT \
        --mx "triton=--fp8-gemm-backend triton --moe-runner-backend triton" \
        --mx "flashinfer dense=--fp8-gemm-backend flashinfer_trtllm --moe-runner-backend triton"

Writes OUT/e2e.md (table, MXFP8/BF16 ratios measured in this run), OUT/e2e.json, OUT/e2e.png if matplotlib is there.
With --profile-steps N: also where a decode step spends its GPU time at each --profile-batch (default 1),
per server (SGLang's /start_profile over N decode steps of running requests, the steps the trace holds whole;
kernels summed by name; the GPU's busy time and the step period on its clock, which kernel sums cannot give when
kernels overlap), in OUT/e2e.md. With --profile-prefill N: the same for N prefill batches, each one fresh request
of the input length (not the decode step SGLang's overlap scheduler runs after each).
"""

import argparse
import bisect
import gzip
import json
import random
import re
import shlex
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from sglang_mxfp8.format.convert import convert
from sglang_mxfp8.cli.serving import Server
from sglang_mxfp8.cli.tiny_model import write_qwen3_moe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plot_speedup import plot_beside  # noqa: E402

QWEN3_30B_A3B = dict(hidden=2048, moe_intermediate=768, experts=128, top_k=8, heads=32, kv_heads=4, head_dim=128,
                     vocab=151936)


def generate(port: int, ids, new_tokens: int) -> int:
    r = requests.post(f"http://127.0.0.1:{port}/generate", json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}},
        timeout=600)
    r.raise_for_status()
    return r.json()["meta_info"]["completion_tokens"]


def measure(port: int, args) -> dict:
    rng = random.Random(0)

    def prompt(r=rng):
        return [r.randrange(1000, 150000) for _ in range(args.input_len)]

    generate(port, prompt(), 8)
    result = {}
    for c in args.concurrency:
        with ThreadPoolExecutor(c) as pool:  # warm-up round, untimed
            list(pool.map(lambda p: generate(port, p, 32), [prompt() for _ in range(c)]))
        if args.window_seconds:
            rounds = steady_windows(port, c, args, prompt)
            rates = [w["tokens"] / w["seconds"] for w in rounds]
        else:
            rates, rounds = timed_rounds(port, c, args, prompt)
        result[f"c{c}"] = statistics.median(rates)
        result[f"c{c}_runs"] = rates
        result[f"c{c}_rounds"] = rounds
    p = prompt()
    times = {n: statistics.median(request_seconds(port, p, n) for _ in range(3)) for n in (1, 1 + args.decode_tokens)}
    result["decode_ms_per_token"] = 1e3 * (times[1 + args.decode_tokens] - times[1]) / args.decode_tokens
    result["prefill_ms"] = prefill_ms(port, prompt)
    return result


def request_seconds(port: int, ids, new_tokens: int) -> float:
    """Wall seconds of one request, sent to answered."""
    t0 = time.perf_counter()
    generate(port, ids, new_tokens)
    return time.perf_counter() - t0


def prefill_ms(port: int, prompt, repeats: int = 5) -> float:
    """Median milliseconds to the one token of a request on a fresh prompt: its whole prefill (a prompt sent before
    would be served from SGLang's prefix cache), one sampling step and the HTTP round trip."""
    return 1e3 * statistics.median(request_seconds(port, prompt(), 1) for _ in range(repeats))


def timed_rounds(port: int, c: int, args, prompt):
    """--repeats rounds at concurrency c, each started with every client at once: --round-seconds of back-to-back
    requests per client, or 2 x c requests (at least 8); (tok/s per round, [{seconds, requests, tokens}])."""
    rates, rounds = [], []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        if args.round_seconds:
            def client(i, deadline=t0 + args.round_seconds, seed=(c, r)):
                """One of c clients: a new request as soon as its last one returns, until the deadline;
                (requests, output tokens)."""
                own = random.Random(f"{seed}/{i}")
                requests_sent = tokens = 0
                while True:
                    tokens += generate(port, prompt(own), args.output_len)
                    requests_sent += 1
                    if time.perf_counter() >= deadline:
                        return requests_sent, tokens

            with ThreadPoolExecutor(c) as pool:
                per_client = list(pool.map(client, range(c)))
            n_requests, tokens = (sum(col) for col in zip(*per_client))
        else:
            prompts = [prompt() for _ in range(max(8, 2 * c))]
            with ThreadPoolExecutor(c) as pool:
                tokens = sum(pool.map(lambda p: generate(port, p, args.output_len), prompts))
            n_requests = len(prompts)
        seconds = time.perf_counter() - t0
        rates.append(tokens / seconds)
        # its requests show whether rounds that differ in rate also differ in how many requests they finished
        rounds.append(dict(seconds=round(seconds, 3), requests=n_requests, tokens=tokens))
    return rates, rounds


def steady_windows(port: int, c: int, args, prompt) -> list:
    """Throughput at concurrency c in a steady state: c clients, client i starting i / c of --ramp-seconds after
    the first, each sending a new request as soon as its last returns, until --repeats windows of --window-seconds
    (the first opening a further ramp after the last client started) have passed. Each request's output tokens
    count toward a window in proportion to the part of the request's time (sent to answered) inside it: requests of
    one length move in waves (a batch of them prefilled together finishes together), and counting only requests
    that finish inside a window rates it by how many waves end there (2 or 3 of 128 requests in a 6 s window at
    16 layers). [{seconds, requests finished inside, tokens}] per window."""
    t0 = time.perf_counter()
    first = t0 + 2 * args.ramp_seconds
    stop = first + args.repeats * args.window_seconds
    done = [[] for _ in range(c)]  # (sent, answered, output tokens) of each client's requests

    def client(i):
        own = random.Random(f"steady/{c}/{i}")
        time.sleep(args.ramp_seconds * i / c)
        while time.perf_counter() < stop:
            sent = time.perf_counter()
            tokens = generate(port, prompt(own), args.output_len)
            done[i].append((sent, time.perf_counter(), tokens))

    with ThreadPoolExecutor(c) as pool:
        list(pool.map(client, range(c)))
    requests_ = [r for client_requests in done for r in client_requests]
    windows = []
    for k in range(args.repeats):
        start = first + k * args.window_seconds
        end = start + args.window_seconds
        tokens = sum(n * max(0.0, min(b, end) - max(a, start)) / (b - a) for a, b, n in requests_ if b > a)
        windows.append(dict(seconds=args.window_seconds, requests=sum(start <= b < end for _, b, _ in requests_),
                            tokens=round(tokens, 1)))
    return windows


def with_rounds(result: dict, key: str) -> str:
    """'median (round, round, ...)' of one server's tok/s at one concurrency."""
    return f"{result[key]:.0f} (" + ", ".join(f"{r:.0f}" for r in result[key + "_runs"]) + ")"


def stream_until(port: int, ids, new_tokens: int, at: int, reached: threading.Event) -> int:
    """Generate as a stream; set ``reached`` once ``at`` tokens are out (or the request ends)."""
    done = 0
    try:
        with requests.post(f"http://127.0.0.1:{port}/generate", stream=True, timeout=600, json={
                "input_ids": ids, "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    done = json.loads(line[len(b"data: "):])["meta_info"]["completion_tokens"]
                    if done >= at:
                        reached.set()
    finally:
        reached.set()
    return done


def profile_decode(port: int, steps: int, trace_dir: Path, batch: int = 1, at_token: int = 256) -> dict:
    """Over ``steps`` decode steps of ``batch`` running requests: "kernels", [(kernel, calls per step, us per
    step)] then a total row (``kernel_times``), and "timeline" (``step_timeline``).

    Profiling starts when the requests have generated ``at_token`` tokens, so every server is profiled at
    the same KV length (attention time grows with it; a wall-clock wait would favour the slower server).
    """
    trace_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 150000) for _ in range(64)] for _ in range(batch)]
    reached = threading.Event()
    with ThreadPoolExecutor(batch) as pool:
        # 64-token prompts: the whole batch is prefilled together, so all requests stay in step
        running = [pool.submit(stream_until, port, prompts[0], at_token + 4 * steps, at_token, reached)]
        running += [pool.submit(generate, port, ids, at_token + 4 * steps) for ids in prompts[1:]]
        if not reached.wait(timeout=300):
            raise RuntimeError(f"no {at_token} tokens within 300 s")
        requests.post(f"http://127.0.0.1:{port}/start_profile", timeout=60, json={
            "output_dir": str(trace_dir), "num_steps": steps, "activities": ["GPU"]}).raise_for_status()
        for r in running:
            r.result()
    return read_profile(trace_dir, "decode step")


def profile_prefill(port: int, steps: int, trace_dir: Path, input_len: int) -> dict:
    """As ``profile_decode`` over ``steps`` prefill batches, each one request for one token on a fresh prompt of
    ``input_len`` tokens, sent one after the other (the period between batches is the client's, not reported).
    SGLang's overlap scheduler runs a decode step after each such prefill (before it sees the request finished):
    the profile spans two batches per request, and the decode steps are left out (``read_profile``)."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random("prefill profile")
    requests.post(f"http://127.0.0.1:{port}/start_profile", timeout=60, json={
        "output_dir": str(trace_dir), "num_steps": 2 * steps + 2, "activities": ["GPU"]}).raise_for_status()
    for _ in range(2 * steps + 3):  # until the profiler stops (at the batch after its last step) and writes
        if any(trace_dir.glob("*.trace.json.gz")):
            break
        generate(port, [rng.randrange(1000, 150000) for _ in range(input_len)], 1)
    return read_profile(trace_dir, f"prefill batch of {input_len} tokens", prefill=True)


def read_profile(trace_dir: Path, what: str, prefill: bool = False) -> dict:
    """The profile SGLang writes to ``trace_dir`` after its last step, over its whole steps (``whole_steps``):
    "kernels" (``kernel_times``), "timeline" (``step_timeline``), "what" one step is. ``prefill``: the steps of
    prefill batches alone, told apart from the batch-1 decode steps between them by GPU busy time (above half the
    longest step's; a prefill runs the model over its whole prompt), and "left_out", how many steps that left out."""
    for _ in range(60):
        traces = sorted(trace_dir.glob("*.trace.json.gz"))
        if traces:
            break
        time.sleep(1)
    else:
        raise RuntimeError(f"no trace in {trace_dir}")
    time.sleep(2)
    steps = whole_steps(trace_kernels(traces[-1]))
    if not steps:
        raise RuntimeError(f"{traces[-1]} holds fewer than two greedy argmax kernels: its steps cannot be told apart")
    profile = {"what": what}
    if prefill:
        busy = [step_busy_us(step) for step in steps]
        kept = [step for step, us in zip(steps, busy) if us > max(busy) / 2]
        profile["left_out"], steps = len(steps) - len(kept), kept
    return dict(profile, kernels=kernel_times(steps), timeline=step_timeline(steps, consecutive=not prefill))


def trace_kernels(trace: Path) -> list:
    """The GPU kernel events of a torch profiler trace (.json.gz)."""
    return [e for e in json.load(gzip.open(trace))["traceEvents"] if e.get("cat") == "kernel"]


def whole_steps(kernels: list) -> list:
    """Kernel events split into the steps the trace holds whole: [(start, end, events)] from one greedy argmax's end
    to the next's (the sampler's argmax closes each forward batch), a kernel in the step its end falls in. Kernels up
    to the first argmax or after the last belong to steps the window cut, and are left out."""
    ends = sorted(e["ts"] + e.get("dur", 0.0) for e in kernels if "ArgMaxOps" in e["name"])
    steps = [(start, end, []) for start, end in zip(ends, ends[1:])]
    for e in kernels:
        j = bisect.bisect_left(ends, e["ts"] + e.get("dur", 0.0))
        if 1 <= j <= len(steps):
            steps[j - 1][2].append(e)
    return steps


def step_busy_us(step) -> float:
    """The time some kernel of the step runs, in the step's span (overlapping kernels, such as programmatic
    dependent launches, count once; the kernel sum counts them twice)."""
    start, end, events = step
    busy, reach = 0.0, start
    for e in sorted(events, key=lambda e: e["ts"]):
        lo, hi = max(e["ts"], reach), min(e["ts"] + e.get("dur", 0.0), end)
        if hi > lo:
            busy, reach = busy + hi - lo, hi
    return busy


def kernel_times(steps: list) -> list:
    """[(kernel, calls per step, us per step)] over ``steps`` (``whole_steps``), by time, then a total."""
    by_name = {}
    for _, _, events in steps:
        for e in events:
            calls, us = by_name.get(e["name"], (0, 0.0))
            by_name[e["name"]] = (calls + 1, us + e.get("dur", 0.0))
    n = len(steps)
    rows = sorted(((name, c / n, us / n) for name, (c, us) in by_name.items()), key=lambda r: -r[2])
    return rows + [("all kernels", sum(r[1] for r in rows), sum(r[2] for r in rows))]


def step_timeline(steps: list, consecutive: bool = True) -> dict:
    """Over ``steps`` (``whole_steps``), on the GPU's clock: "busy_us" per step (``step_busy_us``) and, where the
    steps are ``consecutive``, "period_us": from one step's greedy argmax to the next (busy time plus the time the GPU
    waits for the host)."""
    timeline = {"steps": len(steps), "busy_us": sum(map(step_busy_us, steps)) / len(steps)}
    if consecutive:
        timeline["period_us"] = (steps[-1][1] - steps[0][0]) / len(steps)
    return timeline


def profile_tables(profiles: dict, top: int = 12) -> list:
    lines = []
    for name, profile in profiles.items():
        rows, timeline, what = profile["kernels"], profile["timeline"], profile["what"]
        lines += ["", f"GPU time of one {what}, {name} (top {top} kernels by time):", "",
                  "| kernel | calls/step | us/step |", "|---|---|---|"]
        for kernel, calls, us in rows[:top] + rows[-1:]:
            lines.append(f"| {kernel[:90]} | {calls:.1f} | {us:.1f} |")
        busy = (f"Over {timeline['steps']} whole steps: the GPU is busy {timeline['busy_us']:.1f} us per step "
                "(overlapping kernels counted once)")
        if "period_us" in timeline:
            busy += (f", a step takes {timeline['period_us']:.1f} us on the GPU's clock (argmax to argmax; the rest "
                     "the GPU waits for the host)")
        if profile.get("left_out"):
            busy += f"; {profile['left_out']} shorter steps between them (batch-1 decode steps) left out"
        lines += ["", busy + "."]
    return lines


def layer_count(ckpt: Path):
    """Layers of the checkpoint already in ``ckpt`` (None if there is none): a kept one is reused only at the same depth."""
    cfg = ckpt / "config.json"
    return json.loads(cfg.read_text())["num_hidden_layers"] if cfg.is_file() else None


def split_env(flags: str):
    """'KEY=VALUE ... --flag ...' -> ({KEY: VALUE}, '--flag ...'): leading assignments set the server's environment."""
    words = shlex.split(flags)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, shlex.join(words)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", default="/tmp/e2e")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--flags", default="--cuda-graph-max-bs 128", help="both servers")
    ap.add_argument("--mx", action="append", metavar="NAME=FLAGS",
                    help="an MXFP8 server variant (repeatable), FLAGS may start with KEY=VALUE environment "
                         "settings; default: triton dense and MoE")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per concurrency (median reported)")
    ap.add_argument("--round-seconds", type=float, default=0,
                    help="timed rounds of this length: c clients each send a new request as soon as the last "
                         "returns, until then (a 1-3 s stall weighs less than in a short round); 0: each round "
                         "is a fixed 2 x c requests (at least 8)")
    ap.add_argument("--window-seconds", type=float, default=0,
                    help="measure each concurrency in a steady state instead of rounds: --repeats windows of this "
                         "length in one run of clients with staggered starts (see steady_windows)")
    ap.add_argument("--ramp-seconds", type=float, default=4.0,
                    help="with --window-seconds: the clients' starts spread over this long, and as long again "
                         "before the first window")
    ap.add_argument("--decode-tokens", type=int, default=512)
    ap.add_argument("--port", type=int, default=30600)
    ap.add_argument("--profile-steps", type=int, default=0, help="also profile this many decode steps per --profile-batch")
    ap.add_argument("--profile-batch", type=int, nargs="+", default=[1], help="decode batch sizes to profile")
    ap.add_argument("--profile-prefill", type=int, default=0, metavar="N",
                    help="also profile N prefill batches of one fresh --input-len request each")
    ap.add_argument("--prepare-only", action="store_true",
                    help="write and convert the checkpoints in --workdir, then exit (a deep model's preparation "
                         "can take a command of its own; a later run at the same --layers reuses them)")
    args = ap.parse_args()
    if args.window_seconds and args.round_seconds:
        ap.error("--window-seconds measures in windows of one run, --round-seconds in rounds: give one of them")
    out, work = Path(args.out), Path(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    bf16, mx = work / "bf16", work / "mxfp8"
    fresh = layer_count(bf16) != args.layers
    if fresh:
        write_qwen3_moe(bf16, layers=args.layers, device="cuda", **QWEN3_30B_A3B)
    if fresh or layer_count(mx) != args.layers:
        convert(bf16, mx, force=True)
    if args.prepare_only:
        print(f"{bf16} and {mx}: {args.layers} layers, ready", flush=True)
        return

    variants = [("BF16", bf16, args.flags, {})]
    for spec in args.mx or ["triton=--fp8-gemm-backend triton --moe-runner-backend triton"]:
        name, flags = spec.split("=", 1)
        env, flags = split_env(flags)
        variants.append((f"MXFP8 {name}", mx, f"{args.flags} {flags}", env))
    results, commands, profiles = {}, {}, {}
    for name, ckpt, flags, env in variants:
        s = Server(name.replace(" ", "_"), str(ckpt), flags, args.port, out, env=env)
        commands[name] = s.cmd
        try:
            s.wait(timeout=900)
            results[name] = measure(args.port, args)
            print(name, results[name], flush=True)
            for batch in args.profile_batch if args.profile_steps else ():
                key = f"{name}, batch {batch}"
                try:
                    profiles[key] = profile_decode(args.port, args.profile_steps,
                                                   work / "traces" / f"{name}_b{batch}".replace(" ", "_"), batch)
                    print("\n".join(profile_tables({key: profiles[key]})), flush=True)
                except (RuntimeError, requests.RequestException) as e:  # keep the throughput numbers
                    print(f"{key}: decode profile failed: {e}", flush=True)
            if args.profile_prefill:
                key = f"{name}, prefill"
                try:
                    profiles[key] = profile_prefill(args.port, args.profile_prefill,
                                                    work / "traces" / f"{name}_prefill".replace(" ", "_"), args.input_len)
                    print("\n".join(profile_tables({key: profiles[key]})), flush=True)
                except (RuntimeError, requests.RequestException) as e:
                    print(f"{key}: prefill profile failed: {e}", flush=True)
        finally:
            s.stop()
        (out / "e2e.json").write_text(json.dumps({"results": results, "commands": commands, "args": vars(args),
                                                    "profiles": profiles}, indent=1))

    b = results["BF16"]
    mx_names = [n for n in results if n != "BF16"]
    lines = [f"Qwen3-30B-A3B-shaped, {args.layers} layers, random weights; input {args.input_len}, output "
             f"{args.output_len} tokens (ignore_eos); one server at a time, same run; output tok/s (ratio to BF16), "
             + (f"median of {args.repeats} windows of {args.window_seconds:g} s in one run of back-to-back requests per "
              f"client, the clients' starts spread over {args.ramp_seconds:g} s; a request's tokens count toward a window "
              "by the share of its time inside it. Each window in brackets."
              if args.window_seconds else
              f"median of {args.repeats} rounds of " + (f"{args.round_seconds:g} s of back-to-back requests per client."
                                                        if args.round_seconds else "2 x concurrency requests.")
              + " Each round in brackets."),
             "", "| concurrency | BF16 tok/s | " + " | ".join(f"{n} tok/s (ratio)" for n in mx_names) + " |",
             "|---" * (2 + len(mx_names)) + "|"]
    for c in args.concurrency:
        k = f"c{c}"
        lines.append(f"| {c} | {with_rounds(b, k)} | " + " | ".join(
            f"{with_rounds(results[n], k)} ({results[n][k] / b[k]:.2f}x)" for n in mx_names) + " |")
    ms = {n: r["decode_ms_per_token"] for n, r in results.items()}
    prefill = {n: r["prefill_ms"] for n, r in results.items()}
    lines += ["", "decode latency at batch 1, ms/token: BF16 " + f"{ms['BF16']:.2f}; " + "; ".join(
        f"{n} {ms[n]:.2f} ({ms['BF16'] / ms[n]:.2f}x speed)" for n in mx_names),
              "", f"prefill latency of one fresh {args.input_len}-token request (time to its one token, median of 5), "
              f"ms: BF16 {prefill['BF16']:.1f}; " + "; ".join(
                  f"{n} {prefill[n]:.1f} ({prefill['BF16'] / prefill[n]:.2f}x speed)" for n in mx_names),
              "", *[f"- {k}: `{v}`" for k, v in commands.items()], *profile_tables(profiles)]
    table = "\n".join(lines)
    (out / "e2e.md").write_text(table + "\n")
    print(table)
    plot_beside(out / "e2e.md", "Served output tok/s, MXFP8 / BF16 (same run)", target=1.4)


if __name__ == "__main__":
    main()
