"""The routines that run servers: ``serve``, ``start``, ``refit`` and ``accuracy``, BF16 then each MXFP8 variant,
one server at a time, each started by SGLang's stock launcher.

Per server, in one session: its start on caches of its own (emptied first: a fresh machine's first start), the load
at each concurrency from SGLang's own ``python -m sglang.bench_serving`` (random token ids of fixed lengths, so every
request is the same size for both servers), greedy outputs on fixed prompts (MXFP8's read against BF16's, also
teacher-forced on BF16's tokens), ``/update_weights_from_disk`` timed, and, for MXFP8, the refit-under-load check and
refits it must refuse, each then requests answered on the weights it served (:mod:`.refusals`; with --suite full also
refits alternating with a second checkpoint, each against a fresh server); then, where asked, a restart on the caches
that start left. Rows pair each MXFP8 value with BF16's.
"""

from __future__ import annotations

import array
import base64
import hashlib
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import requests

from ..flags import RECOMMENDED_FLAGS
from .models import ServedPair, negated
from .profile import CATEGORIES, profile_under_load
from .refusals import SERVER_ENV, RefitSequence, quick_steps, summary, update_weights_from_disk
from .rows import Environment, Row, measurement
from .trainer import tensor_refit

# the compile caches a server fills, each pointed at a folder of the run's own
CACHE_VARS = {"FLASHINFER_WORKSPACE_BASE": "flashinfer", "TRTLLM_DG_CACHE_DIR": "trtllm_deep_gemm",
              "DG_JIT_CACHE_DIR": "deep_gemm", "TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}
ROUTING_FLAG = "--enable-return-routed-experts"  # SGLang's routing capture, on every server of a routing run
PROFILED_DECODE_STEPS = 40
ACCURACY_PROMPTS = [[17 + 97 * i + j * (31 + i) for j in range(24)] for i in range(8)]  # fixed token ids, 24 each


@dataclass(frozen=True)
class ServeOptions:
    concurrency: Tuple[int, ...] = (1, 16, 128)
    prompts: Dict[int, int] = field(default_factory=lambda: {1: 4, 16: 32, 128: 128})  # requests per concurrency
    input_len: int = 1024
    output_len: int = 256
    prefill_len: int = 4096  # time to first token of prompts this long, one at a time (0: not measured)
    prefill_prompts: int = 4
    profile_concurrency: int = 0  # profile the prefill and decode steps of one load at this concurrency (0: none)
    mx_flags: Tuple[str, ...] = (RECOMMENDED_FLAGS,)
    server_flags: str = ""  # for every server (e.g. an attention backend this machine has)
    restart: bool = False  # start each server again on the caches its first start left
    cold_refit: bool = False  # also refit with the checkpoint's files out of the page cache
    refits: int = 3  # the median is the figure (the first refit after a start also allocates its read buffers)
    tensor_refits: bool = True  # also refit from a trainer's tensors (MXFP8 server: its MXFP8 tensors, then BF16)
    gsm8k_questions: int = 0  # 0: no gsm8k
    alternating_refits: int = 0  # MXFP8: refits alternating with a second checkpoint, each against a fresh server
    port: int = 30700
    start_timeout: int = 900


@dataclass
class Session:
    """What one server measured."""

    name: str
    flags: str
    command: str = ""
    start_s: Optional[float] = None
    restart_s: Optional[float] = None
    serve: Dict[int, dict] = field(default_factory=dict)  # concurrency -> bench_serving's result line
    prefill: Optional[dict] = None  # bench_serving's result line for long prompts, one at a time
    profile: Optional[dict] = None  # stage -> GPU time per kernel category (profile.profile_under_load)
    outputs: Optional[list] = None  # greedy outputs on ACCURACY_PROMPTS
    forced: Optional[dict] = None  # teacher-forced on BF16's outputs
    refit_s: List[float] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)  # a routine that failed on this server, and why
    cold_refit_s: Optional[float] = None
    under_load: Optional[dict] = None
    refused: Optional[dict] = None  # refits it must refuse, then requests (refusals.RefitSequence's result)
    fresh_outputs: Dict[str, list] = field(default_factory=dict)  # checkpoint -> a fresh server's prompt_outputs
    alternating: Optional[dict] = None  # alternating_refits' outputs, and the second checkpoint
    gsm8k: Optional[float] = None
    routed: Optional[list] = None  # routed experts on ACCURACY_PROMPTS
    routing: Optional[dict] = None  # routed experts against BF16's
    plan_lines: List[str] = field(default_factory=list)
    log: Optional[Path] = None  # the server's log
    refit_split: Optional[dict] = None  # where the last warm refit's time went, from the log (MXFP8 only)
    tensor_refit: Optional[dict] = None  # a whole update from a trainer's tensors of the served checkpoint's format
    bf16_tensor_refit: Optional[dict] = None  # MXFP8: from a trainer's BF16 tensors, quantized on the GPU


def cache_env(root: Path, fresh: bool) -> Dict[str, str]:
    """Cache variables pointing into ``root`` (emptied first where ``fresh``)."""
    if fresh and root.exists():
        shutil.rmtree(root)
    env = {var: str(root / sub) for var, sub in CACHE_VARS.items()}
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    return env


def bench_serving_argv(port: int, tokenizer: Path, concurrency: int, prompts: int, input_len: int, output_len: int,
                       out: Path) -> List[str]:
    """SGLang's serving benchmark at one concurrency: random token ids (no dataset to download), fixed lengths, the
    server's own tokenizer only to name the model."""
    return [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", "127.0.0.1",
            "--port", str(port), "--model", str(tokenizer), "--tokenizer", str(tokenizer),
            "--dataset-name", "random-ids", "--tokenize-prompt", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--random-range-ratio", "1.0", "--num-prompts", str(prompts),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--seed", "1", "--disable-tqdm",
            "--output-file", str(out)]


# sglang.bench_serving's command line run once per argv in one interpreter: its imports (transformers, torch) load
# once per server instead of once per concurrency
SERVING_RUNS = """import json, runpy, sys
for argv in json.loads(sys.argv[1]):
    sys.argv = ["sglang.bench_serving", *argv]
    runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
"""


@dataclass(frozen=True)
class ServingRun:
    """One run of ``sglang.bench_serving``: this many prompts at this concurrency, of these lengths."""

    concurrency: int
    prompts: int
    input_len: int
    output_len: int
    out: Path


def bench_serving(port: int, tokenizer: Path, runs: Sequence[ServingRun]) -> List[dict]:
    """``runs`` of ``sglang.bench_serving``, in order, in one process: each run's JSON result line (output_throughput,
    median_tpot_ms, ...) with its command."""
    argvs = [bench_serving_argv(port, tokenizer, r.concurrency, r.prompts, r.input_len, r.output_len, r.out)[3:]
             for r in runs]
    for r in runs:
        r.out.unlink(missing_ok=True)
    p = subprocess.run([sys.executable, "-c", SERVING_RUNS, json.dumps(argvs)], capture_output=True, text=True,
                       timeout=900 * len(runs))
    results = []
    for r, argv in zip(runs, argvs):
        if not r.out.is_file():
            raise RuntimeError(f"sglang.bench_serving at concurrency {r.concurrency} failed (exit {p.returncode}): "
                               f"{(p.stderr or p.stdout).strip().splitlines()[-1:]}")
        result = json.loads(r.out.read_text().splitlines()[-1])
        result["command"] = shlex.join(["-m", "sglang.bench_serving", *argv])
        results.append(result)
    return results


def generate(port: int, prompts, new_tokens: int, timeout: int = 300, **params) -> list:
    r = requests.post(f"http://127.0.0.1:{port}/generate", timeout=timeout, json={
        "input_ids": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
        **params})
    r.raise_for_status()
    return r.json()


def greedy_outputs(port: int, new_tokens: int = 32) -> list:
    """Greedy tokens and their logprobs on ACCURACY_PROMPTS."""
    out = []
    for item in generate(port, ACCURACY_PROMPTS, new_tokens, return_logprob=True):
        lp = item["meta_info"]["output_token_logprobs"]
        out.append({"ids": [t[1] for t in lp], "logprobs": [t[0] for t in lp]})
    return out


def teacher_forced(port: int, reference: list) -> dict:
    """This server's own top token and logprob at each of ``reference``'s greedy tokens, with the reference's
    tokens as the input: how often its greedy choice agrees, and how far its logprobs are, token by token."""
    agree = total = 0
    diffs = []
    for prompt, ref in zip(ACCURACY_PROMPTS, reference):
        item = generate(port, [prompt + ref["ids"]], 1, return_logprob=True, logprob_start_len=len(prompt),
                        top_logprobs_num=1)[0]["meta_info"]
        mine = item["input_token_logprobs"][-len(ref["ids"]):]
        tops = item["input_top_logprobs"][-len(ref["ids"]):]
        for (lp, token, *_), top, ref_lp in zip(mine, tops, ref["logprobs"]):
            if lp is None or not top or ref_lp is None:  # a position SGLang gives no logprob for
                continue
            agree += top[0][1] == token
            total += 1
            diffs.append(abs(lp - ref_lp))
    if not total:
        raise RuntimeError("the server returned no input logprobs for the reference tokens")
    return {"agreement": agree / total, "mean_abs_logprob_diff": statistics.fmean(diffs), "tokens": total}


def _text_config(ckpt: Path) -> dict:
    """The checkpoint's config.json, its text model's part where it has one."""
    config = json.loads((ckpt / "config.json").read_text())
    return config.get("text_config") or config


def experts_per_token(ckpt: Path) -> int:
    """The checkpoint's top-k (num_experts_per_tok)."""
    top_k = _text_config(ckpt).get("num_experts_per_tok")
    if not top_k:
        raise RuntimeError(f"{ckpt}/config.json has no num_experts_per_tok: routing needs a MoE model")
    return int(top_k)


def routed_layers(ckpt: Path) -> Optional[int]:
    """Layers per token in a routing capture: the checkpoint's hidden layers where each is a MoE layer, else None."""
    config = _text_config(ckpt)
    if (
        config.get("mlp_only_layers")
        or config.get("decoder_sparse_step", 1) != 1
        or config.get("first_k_dense_replace")
    ):
        return None
    return config.get("num_hidden_layers")


def routed_experts(port: int, top_k: int) -> list:
    """What SGLang's routing capture returns for each of ACCURACY_PROMPTS (one token generated): per prompt, the
    sorted experts of each (token, MoE layer), in the capture's order."""
    out = []
    for item in generate(port, ACCURACY_PROMPTS, 1, return_routed_experts=True):
        data = item["meta_info"].get("routed_experts")
        if not data:
            raise RuntimeError(f"the server returned no routed experts (is it launched with {ROUTING_FLAG}?)")
        ids = array.array("i", base64.b64decode(data))  # int32, as SGLang encodes them
        out.append([tuple(sorted(ids[i:i + top_k])) for i in range(0, len(ids), top_k)])
    return out


def same_routing(mine: list, reference: list, layers: Optional[int] = None) -> dict:
    """How often MXFP8's captured experts of a (token, layer) are BF16's (a near tie of router scores may differ), the
    mean share of each top-k set they have in common, and with the capture's ``layers`` (tokens x layers per prompt)
    the equal share per layer: the first layer sees only the attention's quantization, later ones every earlier
    layer's difference too."""
    pairs = [(a, b) for m, r in zip(mine, reference) for a, b in zip(m, r)]
    if not pairs or any(len(m) != len(r) for m, r in zip(mine, reference)):
        raise RuntimeError("MXFP8's and BF16's routing captures differ in length: "
                           f"{[len(m) for m in mine]} against {[len(r) for r in reference]}")
    out = {"equal": sum(a == b for a, b in pairs) / len(pairs), "token_layers": len(pairs), "prompts": len(reference),
           "overlap": sum(len(set(a) & set(b)) / len(b) for a, b in pairs) / len(pairs)}
    if layers and all(len(r) % layers == 0 for r in reference):
        by_layer = [[a == b for m, r in zip(mine, reference) for a, b in zip(m[li::layers], r[li::layers])]
                    for li in range(layers)]
        out["equal_by_layer"] = [round(sum(x) / len(x), 4) for x in by_layer]
    return out


def identical_sequences(outputs: list, reference: list) -> float:
    return sum(a["ids"] == b["ids"] for a, b in zip(outputs, reference)) / len(reference)


def drop_page_cache(ckpt: Path) -> None:
    """Ask the kernel to drop the checkpoint's files from the page cache (POSIX_FADV_DONTNEED)."""
    for path in ckpt.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def refit_seconds(port: int, ckpt: Path) -> float:
    start = time.perf_counter()
    ok, answer = update_weights_from_disk(port, ckpt)
    seconds = time.perf_counter() - start
    if not ok:
        raise RuntimeError(f"/update_weights_from_disk {ckpt} answered {answer}")
    return seconds


def refit_under_load(port: int, ckpt: Path, requests_n: int = 32, new_tokens: int = 128,
                     refit_after_s: float = 0.2) -> dict:
    """``requests_n`` greedy requests sent at once, three times: alone, alone again (the control: how many outputs a
    second identical run reproduces, batch composition differing between runs), then with ``/update_weights_from_disk``
    of the same checkpoint sent ``refit_after_s`` after them. None may fail; each should equal its output without the
    refit as often as the control does. How many were still decoding when the refit was sent is counted."""
    prompts = [[11 + 7 * i + 3 * j for j in range(64)] for i in range(requests_n)]

    def run_all(during: Optional[Callable[[], None]] = None) -> Tuple[list, list]:
        results: list = [None] * requests_n
        ended = [float("inf")] * requests_n

        def one(i):
            try:
                item = generate(port, [prompts[i]], new_tokens)[0]
                results[i] = item.get("output_ids", item.get("text"))
            except (requests.RequestException, KeyError, ValueError) as e:
                results[i] = e
            ended[i] = time.monotonic()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(requests_n)]
        for t in threads:
            t.start()
        if during is not None:
            time.sleep(refit_after_s)
            during()
        for t in threads:
            t.join()
        return results, ended

    def same(a, b):
        return sum(not isinstance(x, Exception) and x == y for x, y in zip(a, b))

    alone, _ = run_all()
    again, _ = run_all()
    refit: dict = {}

    def do_refit():
        refit["sent"] = time.monotonic()
        refit["seconds"] = refit_seconds(port, ckpt)

    loaded, ended = run_all(do_refit)
    return {"requests": requests_n, "new_tokens": new_tokens, "failed": sum(isinstance(r, Exception) for r in loaded),
            "equal": same(alone, loaded), "equal_without_refit": same(alone, again),
            "in_flight_at_refit": sum(t > refit["sent"] for t in ended), "refit_s": refit.get("seconds")}


def prompt_outputs(port: int, new_tokens: int = 16) -> list:
    """Greedy token ids on ACCURACY_PROMPTS, sent as one request (the same batch every time)."""
    return [item["output_ids"] for item in generate(port, ACCURACY_PROMPTS, new_tokens)]


def alternating_refits(port: int, ckpt: Path, other: Path, refits: int) -> dict:
    """``refits`` refits from disk alternating ``other`` and ``ckpt`` (ending on ``ckpt``), the greedy outputs on fixed
    prompts after each, by checkpoint; the caller compares them with fresh servers' outputs."""
    outputs: Dict[str, list] = {"ckpt": [], "other": []}
    for i in range(refits + refits % 2):
        which = "other" if i % 2 == 0 else "ckpt"
        refit_seconds(port, other if which == "other" else ckpt)
        if i < refits:
            outputs[which].append(prompt_outputs(port))
    return outputs


_LOAD_TIME = re.compile(r"sglang_mxfp8: (load|tensor update) took ([\d.]+) s: reading ([\d.]+) s, copying into the "
                        r"MXFP8 weights ([\d.]+) s, quantizing float tensors ([\d.]+) s, MXFP8 post-load processing "
                        r"([\d.]+) s \(checks ([\d.]+) s, kernel layouts ([\d.]+) s\), kernel precompilation "
                        r"([\d.]+) s; peak GPU memory ([\d.]+) GiB above its start")
LOAD_SPLIT = ("load_s", "read_s", "copy_s", "quantize_s", "processing_s", "check_s", "layout_s", "precompile_s",
              "peak_gib")


def load_times(line: str, what: str = "load") -> Optional[dict]:
    """Where one load's time went, from the line the plugin logs after it (None for another line); ``what``: "load"
    (from disk) or "tensor update"."""
    m = _LOAD_TIME.search(line)
    if m is None or m.group(1) != what:
        return None
    return dict(zip(LOAD_SPLIT, map(float, m.groups()[1:])))


def last_load_times(log: Path, what: str = "load") -> Optional[dict]:
    """The newest load's time split from a server log; None where the server logs none (a BF16 model)."""
    found = [t for t in (load_times(line, what) for line in log.read_text(errors="replace").splitlines()) if t]
    return found[-1] if found else None


def plan_lines(log: Path) -> List[str]:
    """The plugin's plan lines from a server log (what each layer kind runs)."""
    return [line.split("sglang_mxfp8: ", 1)[1].strip() for line in log.read_text(errors="replace").splitlines()
            if "sglang_mxfp8: " in line and ("dense [" in line or "MoE (" in line)][:8]


class Runner:
    """Runs the sessions of one served comparison and turns them into rows."""

    def __init__(self, env: Environment, pair: ServedPair, opts: ServeOptions, routines: set, work: Path,
                 step: Callable[[str], None]):
        self.env, self.pair, self.opts, self.routines, self.work, self.step = env, pair, opts, routines, work, step
        self.bf16: Optional[Session] = None
        self.failed: List[str] = []  # "routine on server" that did not finish (a suite's wall-time row names them)

    def _server(self, name: str, ckpt: Path, flags: str, env: Dict[str, str]):
        from .serving import Server

        return Server(name.replace(" ", "_").replace("/", "_"), str(ckpt), f"{self.opts.server_flags} {flags}".strip(),
                      self.opts.port, self.work / "logs", text=True, env=env, base="")

    def session(self, name: str, ckpt: Path, flags: str) -> Session:
        if "routing" in self.routines:
            flags = f"{flags} {ROUTING_FLAG}".strip()
        s = Session(name, flags)
        # a first start is timed on empty caches of its own; without the start routine they are kept between runs
        folder = (self.work if "start" in self.routines else self.work.parent) / "caches" / name.replace(" ", "_")
        caches = cache_env(folder, fresh="start" in self.routines)
        if "refit" in self.routines:  # the refusals count torch.compile's recompilations in the log
            caches.update(SERVER_ENV)
        self.step(f"start {name}")
        server = self._server(name, ckpt, flags, caches)
        s.command = server.cmd
        try:
            server.wait(timeout=self.opts.start_timeout)
            s.start_s = time.time() - server.t0
            s.log, s.plan_lines = server.log, plan_lines(server.log)
            for routine, run in (("serve", lambda: self._serve(s, name)), ("accuracy", lambda: self._accuracy(s, name)),
                                 ("routing", lambda: self._routing(s, name)),
                                 ("refit", lambda: self._refit(s, name, ckpt))):
                if routine not in self.routines:
                    continue
                try:
                    run()
                except Exception as e:  # noqa: BLE001 - one routine failing on a server leaves the others' figures
                    s.errors.append(f"{routine}: {type(e).__name__}: {e}")
                    self.failed.append(f"{routine} on {name}")
                    print(f"bench: {routine} on {name} failed: {type(e).__name__}: {e}", flush=True)
        finally:
            server.stop()
        if s.alternating is not None:
            second = s.alternating["second"]
            self.step(f"start {name} on {second.name} (fresh, for the alternating refits)")
            fresh = self._server(name + " second checkpoint", second, flags, cache_env(folder, fresh=False))
            try:
                fresh.wait(timeout=self.opts.start_timeout)
                s.fresh_outputs["other"] = prompt_outputs(self.opts.port)
            finally:
                fresh.stop()
        if "start" in self.routines and self.opts.restart:
            self.step(f"restart {name}")
            again = self._server(name + " restart", ckpt, flags, cache_env(folder, fresh=False))
            try:
                again.wait(timeout=self.opts.start_timeout)
                s.restart_s = time.time() - again.t0
            finally:
                again.stop()
        return s

    def _serve(self, s: Session, name: str) -> None:
        port, tag = self.opts.port, name.replace(" ", "_")
        top, work = max(self.opts.concurrency), self.work
        runs = [ServingRun(top, top, self.opts.input_len, 16, work / f"warmup_{tag}.jsonl")]
        runs += [ServingRun(c, self.opts.prompts.get(c, 2 * c), self.opts.input_len, self.opts.output_len,
                            work / f"serve_{tag}_c{c}.jsonl") for c in self.opts.concurrency]
        what = f"warm-up, concurrency {', '.join(map(str, self.opts.concurrency))}"
        positions = _text_config(self.pair.bf16).get("max_position_embeddings")
        long_prompts = bool(self.opts.prefill_len) and (positions is None or self.opts.prefill_len < positions)
        if self.opts.prefill_len and not long_prompts:
            print(f"bench: {self.pair.name} takes {positions} positions, no {self.opts.prefill_len}-token prompt; time "
                  "to first token of long prompts not measured", flush=True)
        if long_prompts:
            runs.append(ServingRun(1, self.opts.prefill_prompts, self.opts.prefill_len, 1,
                                   work / f"prefill_{tag}.jsonl"))
            what += f", {self.opts.prefill_len}-token prompts one at a time"
        self.step(f"serve {name}: {what}")
        results = bench_serving(port, self.pair.bf16, runs)
        s.serve = dict(zip(self.opts.concurrency, results[1:]))
        if long_prompts:
            s.prefill = results[-1]
        c = self.opts.profile_concurrency
        if c:
            self.step(f"serve {name}: profiled at concurrency {c}")
            argv = bench_serving_argv(port, self.pair.bf16, c, c, self.opts.input_len, PROFILED_DECODE_STEPS + 24,
                                      self.work / f"profile_{tag}.jsonl")
            s.profile = profile_under_load(port, argv, self.work / "profiles" / tag, steps=PROFILED_DECODE_STEPS)
            s.profile["load"] = shlex.join(argv[1:])

    def _accuracy(self, s: Session, name: str) -> None:
        self.step(f"accuracy {name}")
        s.outputs = greedy_outputs(self.opts.port)
        if self.opts.gsm8k_questions and self.pair.tokenizer:
            s.gsm8k = gsm8k(self.opts.port, self.opts.gsm8k_questions, self.work)
        if self.bf16 is not None and self.bf16.outputs is not None:
            s.forced = teacher_forced(self.opts.port, self.bf16.outputs)

    def _routing(self, s: Session, name: str) -> None:
        self.step(f"routing {name}")
        s.routed = routed_experts(self.opts.port, experts_per_token(self.pair.bf16))
        if self.bf16 is not None and self.bf16.routed is not None:
            s.routing = same_routing(s.routed, self.bf16.routed, routed_layers(self.pair.bf16))

    def _refit(self, s: Session, name: str, ckpt: Path) -> None:
        self.step(f"refit {name}")
        mx = self.bf16 is not None
        if mx and self.opts.alternating_refits:
            s.fresh_outputs["ckpt"] = prompt_outputs(self.opts.port)  # before any refit: a fresh server's
        s.refit_s = [refit_seconds(self.opts.port, ckpt) for _ in range(self.opts.refits)]
        s.refit_split = last_load_times(s.log) if s.log is not None else None
        if self.opts.cold_refit:
            drop_page_cache(ckpt)
            s.cold_refit_s = refit_seconds(self.opts.port, ckpt)
        if mx:  # the checks are of MXFP8's in-place refit and its rollback
            s.under_load = refit_under_load(self.opts.port, ckpt)
            s.refused = RefitSequence(self.opts.port, {"A": ckpt}, s.log, self.work / "refusals",
                                      prompt_outputs).run(quick_steps())
        if self.opts.tensor_refits:
            self.step(f"refit {name}: from a trainer's tensors")
            s.tensor_refit = self._tensor_refit(s, ckpt)
            if mx:
                s.bf16_tensor_refit = self._tensor_refit(s, self.pair.bf16)
                refit_seconds(self.opts.port, ckpt)  # served from disk again, as the steps after expect
        if mx and self.opts.alternating_refits:
            other = negated(ckpt, self.work.parent / "models" /
                            f"{ckpt.name}-negated-{hashlib.sha1(str(ckpt.resolve()).encode()).hexdigest()[:10]}")
            self.step(f"refit {name}: {self.opts.alternating_refits} refits alternating with {other.name}")
            s.alternating = {"second": other, **alternating_refits(self.opts.port, ckpt, other,
                                                                  self.opts.alternating_refits)}

    def _tensor_refit(self, s: Session, ckpt: Path) -> dict:
        """One whole update from ``ckpt``'s tensors as a trainer sends them, and the server's split of it."""
        result = tensor_refit(self.opts.port, ckpt)
        time.sleep(1)  # the server's log line of the update's post-processing
        return {**result, "server_split": last_load_times(s.log, "tensor update") if s.log is not None else None}

    def run(self, record: Callable[[List[Row]], None]) -> List[Session]:
        self.bf16 = None
        self.bf16 = self.session("BF16", self.pair.bf16, "")
        sessions = [self.bf16]
        for i, flags in enumerate(self.opts.mx_flags):
            name = "MXFP8" if len(self.opts.mx_flags) == 1 else f"MXFP8 {i + 1}"
            try:
                mx = self.session(name, self.pair.mxfp8, flags)
            except Exception as e:  # noqa: BLE001 - a server that did not start: the next variant still runs
                print(f"bench: {name} ({flags}) failed: {type(e).__name__}: {e}", flush=True)
                self.failed.append(f"server {name}")
                continue
            record(self.rows(mx))
            sessions.append(mx)
        return sessions

    def rows(self, mx: Session) -> List[Row]:
        """MXFP8 session ``mx`` against the BF16 session, as rows."""
        b, env, shape, flags = self.bf16, self.env, self.pair.name, mx.flags
        rows = []

        def row(routine, metric, unit, better, mxv, bfv, **what):
            if mxv is not None or bfv is not None:
                rows.append(measurement(env, routine, metric, shape, flags, unit, better, mxv, bfv, **what))

        if "start" in self.routines:
            row("start", "first start", "s", "lower", mx.start_s, b.start_s,
                extra={"to": "/health_generate", "caches": "empty, the run's own"})
            row("start", "restart", "s", "lower", mx.restart_s, b.restart_s, extra={"caches": "the first start's"})
        for c, result in mx.serve.items():
            base = b.serve.get(c)
            if base is None:
                continue
            extra = {"input_len": self.opts.input_len, "output_len": self.opts.output_len,
                     "prompts": self.opts.prompts.get(c, 2 * c), "load": result["command"]}
            row("serve", "output throughput", "tok/s", "higher", result["output_throughput"],
                base["output_throughput"], concurrency=c, extra=extra)
            if c == 1:
                row("serve", "decode latency, batch 1", "ms/token", "lower", result["median_tpot_ms"],
                    base["median_tpot_ms"], concurrency=1, extra=extra)
                row("serve", "time to first token, one request", "ms", "lower", result["median_ttft_ms"],
                    base["median_ttft_ms"], concurrency=1, extra=extra)
        if mx.prefill and b.prefill:
            row("serve", f"time to first token, {self.opts.prefill_len}-token prompt", "ms", "lower",
                mx.prefill["median_ttft_ms"], b.prefill["median_ttft_ms"], concurrency=1,
                extra={"input_len": self.opts.prefill_len, "output_len": 1, "prompts": self.opts.prefill_prompts,
                       "load": mx.prefill["command"]})
        if mx.profile and b.profile:
            c = self.opts.profile_concurrency
            for stage, metric, unit in (("prefill", "prefill GPU time", "ms"),
                                        ("decode", "decode GPU time per step", "ms/step")):
                for cat in CATEGORIES:
                    row("serve", f"{metric}, {cat}", unit, "lower", mx.profile[stage][f"{cat}_ms"],
                        b.profile[stage][f"{cat}_ms"], concurrency=c,
                        extra={"input_len": self.opts.input_len, "prompts": c, "load": mx.profile["load"],
                               "mxfp8": mx.profile[stage], "bf16": b.profile[stage]})
        if mx.refit_s and b.refit_s:
            row("refit", "refit from disk, page cache warm", "s", "lower", statistics.median(mx.refit_s),
                statistics.median(b.refit_s), extra={"refits": len(mx.refit_s), "mxfp8_s": mx.refit_s,
                                                     "bf16_s": b.refit_s, "mxfp8_server_split": mx.refit_split})
        row("refit", "refit from disk, page cache cold", "s", "lower", mx.cold_refit_s, b.cold_refit_s)
        if b.tensor_refit is not None:
            for metric, refit in (("update_weights_from_tensor, MXFP8 tensors", mx.tensor_refit),
                                  ("update_weights_from_tensor, BF16 tensors", mx.bf16_tensor_refit)):
                if refit is not None:
                    row("refit", metric, "s", "lower", refit["seconds"], b.tensor_refit["seconds"],
                        extra={"mxfp8": refit, "bf16": b.tensor_refit, "mxfp8_server_split": refit["server_split"]})
        peaks = {source: split["peak_gib"] for source, split in (
            ("disk", mx.refit_split), ("MXFP8 tensors", (mx.tensor_refit or {}).get("server_split")),
            ("BF16 tensors", (mx.bf16_tensor_refit or {}).get("server_split"))) if split and "peak_gib" in split}
        if peaks:  # what the MXFP8 server allocated above its holding between refits, at the peak, per source
            row("refit", "peak memory during a refit", "GiB", "lower", max(peaks.values()), None, extra=peaks)
        if mx.under_load is not None:
            row("refit", "requests failed during a refit", "requests", "lower", mx.under_load["failed"], None,
                extra=mx.under_load)
        if mx.refused is not None:
            row("refit", "refits refused, then requests answered", "fraction", "higher",
                mx.refused["steps_ok"] / mx.refused["steps_sent"], None,
                extra={**mx.refused, "summary": summary(mx.refused)})
        if mx.alternating is not None and len(mx.fresh_outputs) == 2:
            equal = {k: sum(o == mx.fresh_outputs[k] for o in mx.alternating[k]) for k in ("ckpt", "other")}
            refits = len(mx.alternating["ckpt"]) + len(mx.alternating["other"])
            row("refit", "alternating refits equal to a fresh server", "fraction", "higher",
                sum(equal.values()) / refits, None,
                extra={"refits": refits, "equal": equal, "second_checkpoint": "every e4m3 weight negated"})
        if mx.outputs is not None and b.outputs is not None:
            row("accuracy", "identical greedy sequences", "fraction", "higher",
                identical_sequences(mx.outputs, b.outputs), None, extra={"prompts": len(ACCURACY_PROMPTS),
                                                                         "tokens": len(b.outputs[0]["ids"])})
        if mx.forced is not None:
            row("accuracy", "top-1 agreement on BF16's tokens", "fraction", "higher", mx.forced["agreement"], None,
                extra=mx.forced)
            row("accuracy", "mean |logprob - BF16's| on BF16's tokens", "nats", "lower",
                mx.forced["mean_abs_logprob_diff"], None, extra=mx.forced)
        row("accuracy", "gsm8k accuracy", "fraction", "higher", mx.gsm8k, b.gsm8k,
            extra={"questions": self.opts.gsm8k_questions})
        if mx.routing is not None:
            row("routing", "routed experts equal to BF16's, per token and MoE layer", "fraction", "higher",
                mx.routing["equal"], None, extra=mx.routing)
            row("routing", "routed experts' top-k overlap with BF16's, per token and MoE layer", "fraction", "higher",
                mx.routing["overlap"], None, extra=mx.routing)
        return rows


def gsm8k(port: int, questions: int, work: Path) -> Optional[float]:
    """benchmarks/gsm8k/bench_sglang.py against the running server, where this is a checkout that has it."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gsm8k" / "bench_sglang.py"
    if not script.is_file():
        print("bench: gsm8k needs benchmarks/gsm8k/bench_sglang.py (a clone of the repository); skipped", flush=True)
        return None
    p = subprocess.run([sys.executable, str(script), "--num-questions", str(questions), "--num-shots", "8",
                        "--parallel", "128", "--port", str(port), "--result-file", str(work / "gsm8k.jsonl")],
                       capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("Accuracy:")), None)
    return float(line.split()[1]) if line else None
