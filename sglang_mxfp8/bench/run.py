"""``sglang-mxfp8 bench``: the suites, the steps a run takes, its progress line, and where its rows go."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from ..flags import RECOMMENDED_FLAGS
from .layers import LayerOptions
from .served import ROUTING_FLAG, ServeOptions, bench_serving_argv

ROUTINES = ("serve", "start", "refit", "accuracy", "routing", "layers", "tests")
SERVED = ("serve", "start", "refit", "accuracy", "routing")
# routing launches every server with SGLang's routing capture on, which the other routines must not measure under:
# it runs only when named
SUITE_ROUTINES = tuple(r for r in ROUTINES if r != "routing")
REPO = Path(__file__).resolve().parents[2]  # a clone of the repository: tests/gpu and benchmarks/ beside the package
# a few minutes of the GPU tests: a dense and a MoE kernel of each Hopper family against float32, CUDA-graph replay,
# BF16 weights sent to the GPU equal to what convert writes
SMOKE_TESTS = ("test_backend_matches_reference or test_moe_gemv_matches_reference or "
               "test_cutlass_grouped_moe_matches_reference or test_triton_bias_and_cuda_graph_replay or "
               "test_the_flag_plans_the_trimmed_module_and_it_builds or test_qwen3_30b_layer_matches_float32_reference "
               "or test_masked or test_bf16_weights_sent or test_block_scale_conversion or "
               "test_gpu_quantizer or test_a_second_refit_read or test_bucket_value_checks or test_split_k_gemm")
# GPU test files that start servers, left out of the smoke subset: the routine that runs their short version instead
SERVED_TESTS = {"test_refused_refits.py": "refit", "test_refit_paths.py": "refit"}


@dataclass(frozen=True)
class Suite:
    routines: Tuple[str, ...]
    layers: LayerOptions
    serve: ServeOptions
    model_layers: int
    tests: Optional[str]  # pytest -k expression; None: every GPU test


SUITES = {
    # under 9 minutes on one H100 / H200, to fit one GPU command: each server started once on empty caches (the
    # recommended flags against BF16), on a 4-layer model (the full suite serves 16); gsm8k (250 questions) only where
    # --model is a real checkpoint with its tokenizer. The GPU tests (about 2m15s on an H100 for the smoke subset, one
    # figure) run in the full suite, or alone as `bench tests`: the figures users ask for first fit the 9 minutes
    "quick": Suite(tuple(r for r in SUITE_ROUTINES if r != "tests"), LayerOptions(tokens=(1, 16, 128, 1024, 8192)),
                   ServeOptions(gsm8k_questions=250), 4, SMOKE_TESTS),
    "full": Suite(
        SUITE_ROUTINES,
        LayerOptions(sets=("qwen3-30b-a3b", "llama-3-8b", "gpt-oss-20b")),
        ServeOptions(
            concurrency=(1, 16, 128, 512),
            prompts={1: 16, 16: 128, 128: 512, 512: 1024},
            profile_concurrency=128,
            mx_flags=(RECOMMENDED_FLAGS, "--fp8-gemm-backend auto --moe-runner-backend auto"),
            restart=True,
            cold_refit=True,
            gsm8k_questions=1319,
            alternating_refits=20,
        ),
        16,
        None,
    ),
}


@dataclass
class Step:
    name: str
    estimate_s: float
    run: Callable[[], None]
    lines: Sequence[str] = ()  # what --dry-run prints


class Progress:
    """One line per step: which routine runs, how long the run has taken and about how long is left: the estimates
    of the steps not finished, less the time the current one has run, scaled by how the finished steps compared with
    their estimates (once they amount to a minute of estimates)."""

    def __init__(self, steps: List[Step]):
        self.total, self.started = sum(s.estimate_s for s in steps), time.monotonic()
        self.done = self.done_s = 0.0  # estimates of the finished steps, and the time they took
        self.step_started = self.started
        self.count, self.index = len(steps), 0

    def begin(self) -> None:
        self.index += 1
        self.step_started = time.monotonic()

    def step(self, what: str) -> None:
        now = time.monotonic()
        rate = min(3.0, max(0.5, self.done_s / self.done)) if self.done >= 60 else 1.0
        left = max(0.0, (self.total - self.done) * rate - (now - self.step_started))
        print(f"bench [{self.index}/{self.count}] {what} | {_clock(now - self.started)} elapsed, about {_clock(left)} "
              "left", flush=True)

    def finish(self, step: Step) -> None:
        self.done += step.estimate_s
        self.done_s += time.monotonic() - self.step_started


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def served_estimate(suite: Suite, routines: Sequence[str], layers: int, sessions: int, cached_model: bool) -> float:
    serve = suite.serve
    per = 110 + 2.5 * layers  # a first start on empty caches (H100: 4 layers 127-147 s, 16 layers 121-200 s)
    if "serve" in routines:
        # sglang.bench_serving's imports once, a warm-up, then each concurrency's requests
        per += 10 + 12 + sum(2 + -(-serve.prompts.get(c, 2 * c) // c) * (serve.output_len * 0.012 + 0.004 * c)
                             for c in serve.concurrency)
        per += (2 + 0.3 * serve.prefill_prompts) if serve.prefill_len else 0
        per += 25 if serve.profile_concurrency else 0
    if "routing" in routines:
        per += 5
    alternating = 0.0
    if "refit" in routines:
        per += serve.refits * (2 + 0.6 * layers) + 20
        if serve.tensor_refits:  # BF16: one update from tensors; MXFP8: two, and a refit from disk back (a guess)
            per += (1 + 2 * (sessions > 1)) * (3 + 0.5 * layers)
        if serve.alternating_refits:  # the second checkpoint written once; per MXFP8 server, its refits and a start
            per_mx = serve.alternating_refits * (3 + 0.6 * layers) + 60 + 5.5 * layers
            alternating = 4 * layers + (sessions - 1) * per_mx
    if "start" in routines and serve.restart:
        per += 30 + 2 * layers
    # writing the model: 63 s for 16 layers on an H100
    return (0 if cached_model else 4 * layers) + per * sessions + alternating


def gpu_tests(selection: Optional[str], timeout_s: int, record: Callable[[str, dict], None]) -> None:
    """The repository's GPU tests (tests/gpu, a clone only), ``selection`` as pytest's -k; the counts as a row."""
    folder = REPO / "tests" / "gpu"
    if not folder.is_dir():
        print("bench: tests needs a clone of the repository (tests/gpu); skipped", flush=True)
        return
    argv = [sys.executable, "-m", "pytest", "-q", "-rfs", "--durations=8", str(folder)]
    argv += ["-k", selection] if selection else []
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
        out = p.stdout
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        out += f"\n(stopped after {timeout_s} s)"
    print("\n".join(out.strip().splitlines()[-24:]), flush=True)  # the slowest tests, failures, counts
    counts = {word: int(n) for n, word in _counts(out)}
    record(shlex.join(argv[1:]), counts)


def _counts(pytest_output: str):
    import re

    last = next((line for line in reversed(pytest_output.splitlines()) if " in " in line and (
        "passed" in line or "failed" in line or "error" in line)), "")
    return re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", last)


def with_overrides(suite: Suite, args) -> Suite:
    """The suite with the command line's options applied."""
    layers = suite.layers
    if args.sets:
        layers = replace(layers, sets=tuple(args.sets))
    if args.model:
        layers = replace(layers, model=args.model)
    if args.tokens:
        layers = replace(layers, tokens=tuple(args.tokens))
    if args.all_kernels:
        layers = replace(layers, all_kernels=True)
    serve = suite.serve
    if args.mx_flags:
        serve = replace(serve, mx_flags=tuple(args.mx_flags))
    if args.server_flags:
        serve = replace(serve, server_flags=args.server_flags)
    if args.concurrency:
        serve = replace(serve, concurrency=tuple(args.concurrency))
    if args.port:
        serve = replace(serve, port=args.port)
    if args.restart:
        serve = replace(serve, restart=True)
    if args.cold_refit:
        serve = replace(serve, cold_refit=True)
    if args.profile_concurrency:
        serve = replace(serve, profile_concurrency=args.profile_concurrency)
    return replace(suite, layers=layers, serve=serve, model_layers=args.layers or suite.model_layers)


class BenchRun:
    """One ``sglang-mxfp8 bench`` run: its steps in order (the served comparison: model, then one session per server;
    layers; GPU tests), what they hand one another (environment, checkpoints), its rows and its progress."""

    def __init__(self, suite: Suite, routines: Sequence[str], args):
        self.suite, self.routines, self.args = suite, list(routines), args
        self.work = Path(args.workdir)
        self.command = "sglang-mxfp8 bench " + shlex.join(args.argv)
        self.env = self.results = self.pair = self.progress = None
        self.rows: List[dict] = []
        self.not_run: List[str] = []  # steps, and routines inside a step, that did not finish
        self.started = time.monotonic()
        self.served = [r for r in self.routines if r in SERVED]
        self.steps = self._steps()

    def deadline(self) -> float:
        return self.started + self.args.time_limit if self.args.time_limit else float("inf")

    def step(self, what: str) -> None:
        """A progress line for what the current step does now."""
        self.progress.step(what)

    def record(self, new_rows) -> None:
        from dataclasses import asdict

        from . import report, rows

        rows.append(self.results, new_rows)
        dicts = [asdict(r) for r in new_rows]
        self.rows.extend(dicts)
        if dicts:
            print(report.table(dicts), flush=True)

    # -- the steps -----------------------------------------------------------------------------------------------------
    def _steps(self) -> List[Step]:
        steps: List[Step] = []
        if self.served:
            steps += [self._model_step(), self._servers_step()]
        if "layers" in self.routines:
            from . import layers as layer_routine

            layers = self.suite.layers
            steps.append(Step("layers", layer_routine.estimate_s(layers), self._layers, layer_routine.describe(layers)))
        if "tests" in self.routines:
            steps.append(Step("tests", 135 if self.suite.tests else 900, self._tests,
                              ["GPU tests: python -m pytest -q tests/gpu" + (
                                  f" -k {shlex.quote(self.suite.tests)}" if self.suite.tests else "")]))
        return steps

    def _model_step(self) -> Step:
        args, suite = self.args, self.suite
        if args.model:
            from ..format.checkpoint import detect_checkpoint

            describe = (f"model: {args.model} (MXFP8) and the BF16 checkpoint it was converted from, {args.bf16_model}"
                        if detect_checkpoint(Path(args.model)) is not None else
                        f"model: {args.model} (BF16) and its MXFP8 conversion (written into the work folder once)")
            cached = True
        else:
            folder = self.work / "models" / f"qwen3-30b-a3b-shaped-{suite.model_layers}l-seed0"
            cached = (folder / "mxfp8" / "config.json").is_file()
            describe = (f"model: a random Qwen3-30B-A3B-shaped model of {suite.model_layers} layers and its MXFP8 "
                        f"conversion in {folder} ({'written already' if cached else 'written once'})")
        return Step("model", 3 if cached else 4 * suite.model_layers, self._model, [describe])

    def _model(self) -> None:
        from . import models

        args = self.args
        self.pair = (models.from_user(args.model, args.bf16_model, self.work / "models") if args.model
                     else models.generated(self.work / "models", self.suite.model_layers))

    def _servers_step(self) -> Step:
        serve, served = self.suite.serve, self.served
        sessions = ["BF16"] + [f"MXFP8 ({flags})" for flags in serve.mx_flags]
        lines = [f"servers, one at a time, each first on empty caches of its own: {', '.join(sessions)}",
                 f"  launch: python -m sglang.launch_server --model-path CKPT --port {serve.port} "
                 f"{serve.server_flags} [MXFP8: backend flags]".replace("  [", " ["),
                 f"  routines: {', '.join(served)}"]
        if "serve" in served:
            lines += [f"  load at concurrency {c}: python -m " + shlex.join(bench_serving_argv(
                serve.port, Path("BF16_CKPT"), c, serve.prompts.get(c, 2 * c), serve.input_len, serve.output_len,
                Path("OUT.jsonl"))[2:]) for c in serve.concurrency]
            if serve.prefill_len:
                lines.append(f"  time to first token: {serve.prefill_prompts} prompts of {serve.prefill_len} tokens, "
                             "one at a time")
            if serve.profile_concurrency:
                lines.append(f"  profile: SGLang's /start_profile by stage during a load at concurrency "
                             f"{serve.profile_concurrency}; GPU time in attention, dense, MoE and other kernels")
        if "accuracy" in served:
            gsm8k = (f"; gsm8k ({serve.gsm8k_questions} questions) where the model has a tokenizer"
                     if serve.gsm8k_questions else "")
            lines.append("  accuracy: greedy outputs on 8 fixed prompts, MXFP8's read against BF16's and "
                         f"teacher-forced on them{gsm8k}")
        if "routing" in served:
            lines.append(f"  routing: every server launched with {ROUTING_FLAG}; the experts captured on 8 prompts, "
                         "MXFP8's against BF16's")
        if "refit" in served:
            lines.append(f"  refit: /update_weights_from_disk x{serve.refits}"
                         + (", then with the page cache dropped" if serve.cold_refit else "")
                         + ("; a whole update from a trainer's tensors (MXFP8: its MXFP8, then its BF16 tensors)"
                            if serve.tensor_refits else "")
                         + "; MXFP8: 32 requests in flight during a refit, then refits it must refuse (a weight "
                           "without its scale, a scale one column short, BF16 holding a NaN, a missing folder), each "
                           "followed by requests, and an accepted one"
                         + (f", then {serve.alternating_refits} refits alternating with its weights negated, "
                            "each against a fresh server" if serve.alternating_refits else ""))
        estimate = served_estimate(self.suite, served, self.suite.model_layers, len(sessions), True)
        return Step("servers", estimate, self._servers, lines)

    def _servers(self) -> None:
        from .served import Runner

        if self.pair is None:
            raise RuntimeError("no checkpoints to serve (the model step failed)")
        runner = Runner(self.env, self.pair, self.suite.serve, set(self.served), self.work / self.env.run, self.step)
        try:
            runner.run(self.record)
        finally:
            self.not_run += runner.failed

    def _layers(self) -> None:
        import os

        from . import layers as layer_routine
        from .served import cache_env

        mx_caches = self.work / self.env.run / "caches" / "MXFP8"  # FlashInfer's modules this run's server built
        os.environ.update(cache_env(mx_caches if mx_caches.is_dir() else self.work / "caches" / "layers", fresh=False))
        layer_routine.run(self.env, self.suite.layers, self.deadline(), self.record)

    def _tests(self) -> None:
        from .rows import measurement

        def test_row(command, counts):
            self.record([measurement(self.env, "tests", "GPU tests passed", "tests/gpu", "", "tests", "higher",
                                     counts.get("passed", 0), None, extra={"counts": counts, "command": command})])

        gpu_tests(self.suite.tests, int(max(60.0, min(self.deadline() - time.monotonic(), 3600.0))), test_row)

    # -- running -------------------------------------------------------------------------------------------------------
    def dry_run(self) -> None:
        print(f"{self.command}: {len(self.steps)} steps, about {_clock(sum(s.estimate_s for s in self.steps))} on one "
              "H100 / H200")
        for i, s in enumerate(self.steps, 1):
            print(f"[{i}] {s.name} (about {_clock(s.estimate_s)})")
            for line in s.lines:
                print(f"    {line}")
        print(f"rows to {Path(self.args.results_dir) / 'RUN_ID.jsonl'}; logs and plots to "
              f"{self.work / 'RUN_ID'}")

    def run(self, gpu) -> int:
        from . import report, rows

        self.env = rows.environment(self.command, gpu.name, gpu.sm)
        self.results = Path(self.args.results_dir) / f"{self.env.run}.jsonl"
        print(f"bench: run {self.env.run} on {gpu.label}; rows to {self.results}", flush=True)
        self.progress = Progress(self.steps)
        for step in self.steps:
            self.progress.begin()
            if time.monotonic() + step.estimate_s > self.deadline():
                self.not_run.append(step.name)
                self.step(f"{step.name}: not started, the --time-limit would pass first")
                continue
            self.step(step.name)
            try:
                step.run()
            except Exception as e:  # noqa: BLE001 - one routine failing leaves the others' rows
                print(f"bench: {step.name} failed: {type(e).__name__}: {e}", flush=True)
                self.not_run.append(step.name)
            self.progress.finish(step)
        wall_s = time.monotonic() - self.started
        if not self.args.routines:  # the whole suite: how long it took, first starts on empty caches included
            from .rows import measurement

            self.record([measurement(self.env, "suite", f"{self.args.suite} suite wall time", "sglang-mxfp8 bench", "",
                                     "s", "lower", wall_s, None,
                                     extra={"steps": [s.name for s in self.steps], "not_run": self.not_run,
                                            "model_layers": self.suite.model_layers})])
        print(f"bench: {len(self.rows)} rows in {self.results} ({_clock(wall_s)})"
              + (f"; not run: {', '.join(self.not_run)}" if self.not_run else ""), flush=True)
        for path in report.plot(self.rows, self.work / self.env.run):
            print(f"bench: plot {path}", flush=True)
        return 1 if self.not_run else 0


def main(args) -> int:
    if args.routines == ["report"]:
        return report_main(args)
    unknown = [r for r in args.routines if r not in ROUTINES]
    if unknown:
        print(f"sglang-mxfp8 bench: no routine {unknown[0]!r}; routines: {', '.join(ROUTINES)}, or 'report'",
              file=sys.stderr)
        return 2
    from ..format.checkpoint import not_a_folder

    for flag, path in (("--model", args.model), ("--bf16-model", args.bf16_model)):
        problem = path and not_a_folder(path)  # before any step: a typo costs no server start and no traceback
        if problem:
            print(f"sglang-mxfp8 bench: {flag} {problem}", file=sys.stderr)
            return 2
    suite = with_overrides(SUITES[args.suite], args)
    bench = BenchRun(suite, [r for r in ROUTINES if r in (args.routines or suite.routines)], args)
    if args.dry_run:
        bench.dry_run()
        return 0
    from ..platform import visible_gpu

    gpu = visible_gpu()
    if gpu is None:
        print("sglang-mxfp8 bench: no CUDA GPU is visible here; run it on the H100 / H200 / B200 it should measure "
              "(--dry-run shows what it would run)", file=sys.stderr)
        return 2
    return bench.run(gpu)


def report_main(args) -> int:
    from . import report, rows

    folder = Path(args.results_dir)
    if not (REPO / "benchmarks").is_dir():
        print(f"sglang-mxfp8 bench report: {REPO} is no clone of the repository (no benchmarks/); it regenerates "
              "the repository's CURRENT.md and README", file=sys.stderr)
        return 2
    data = rows.load(folder)
    if args.check:
        problems = report.check(REPO, data)
        for line in problems:
            print(line, file=sys.stderr)
        if not problems:
            print(f"bench report --check: benchmarks/CURRENT.md, README's speed paragraph and kernel table are what "
                  f"the {len(data)} rows in {folder} and the registry give; no figure typed outside them")
        return 1 if problems else 0
    for path in report.write(REPO, data):
        print(f"bench report: wrote {path} from {len(data)} rows in {folder}")
    return 0
