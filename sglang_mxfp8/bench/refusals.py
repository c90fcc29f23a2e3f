"""Refits an MXFP8 server must refuse, from disk and from a trainer's tensors, in a random order with accepted refits
between, and what the server does after each: it answers requests, a refused refit keeps the weights it served (the
same greedy outputs), an accepted one serves the new weights (a fresh server's outputs), and torch.compile never
recompiles (under piecewise CUDA graphs a recompiled forward captures a graph outside SGLang's capture and the
scheduler dies). The server is launched with ``TORCH_LOGS=recompiles`` (:data:`SERVER_ENV`), so dynamo names every
recompilation in its log.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import requests

from .trainer import update_weights_from_tensor

if TYPE_CHECKING:
    import torch

SERVER_ENV = {"TORCH_LOGS": "recompiles"}
RECOMPILE_LINE = "Recompiling function"  # what dynamo logs for each recompilation under TORCH_LOGS=recompiles
SCHEDULER_DIED = ("Scheduler hit an exception", "PCG capture stream is not set")

# every way a refit can be spoiled, each refused by the plugin: what it sends for one MXFP8 weight
SPOILS = {
    "missing_scale": "the e4m3 weight without its scale",
    "short_scale": "the weight with its scale one column short",
    "e5m2_weight": "the weight's bytes as float8_e5m2, with its scale",
    "nan_e4m3": "the e4m3 weight holding a NaN byte, with its scale",
    "nan_bf16": "the weight as BF16 holding a NaN, without a scale",
    "inf_fp32": "the weight as FP32 holding an Inf, without a scale",
    "missing_folder": "a folder that does not exist (from disk only: refused before loading)",
}
ACCEPTED = ("A", "B")  # the served checkpoint, and a second one of its shapes


@dataclass(frozen=True)
class Step:
    source: str  # "disk", "tensor" (named tensors) or "bucket" (a trainer's flattened bucket)
    what: str  # a SPOILS key, or an ACCEPTED checkpoint

    @property
    def refused(self) -> bool:
        return self.what in SPOILS

    def __str__(self) -> str:
        return f"{self.source}:{self.what}"


def shuffled_steps(seed: int, repeats: int = 2, sources=("disk", "tensor", "bucket"),
                   accepted_every: int = 3) -> List[Step]:
    """Every spoil from every source ``repeats`` times in a random order, an accepted refit (alternating B and A, from
    alternating sources) after every ``accepted_every`` refusals and at the end on A."""
    rng = random.Random(seed)
    refused = [Step(s, what) for s in sources for what in SPOILS if not (s != "disk" and what == "missing_folder")]
    refused = refused * repeats
    rng.shuffle(refused)
    steps: List[Step] = []
    for i, step in enumerate(refused, 1):
        steps.append(step)
        if i % accepted_every == 0:
            n = i // accepted_every
            steps.append(Step(sources[(n // 2) % len(sources)], "B" if n % 2 else "A"))
    if steps[-1] != Step(sources[0], "A"):
        steps.append(Step(sources[0], "A"))
    return steps


def quick_steps() -> List[Step]:
    """The bench's short version, from disk: the three refusals that once took a server down under piecewise CUDA
    graphs, in that order, a folder that does not exist, then an accepted refit."""
    return [Step("disk", "missing_scale"), Step("disk", "short_scale"), Step("disk", "nan_bf16"),
            Step("disk", "missing_folder"), Step("disk", "A")]


def read_checkpoint(ckpt: Path, names=None) -> Dict[str, "torch.Tensor"]:
    """The tensors ``names`` (default: all) of a checkpoint folder, in file and key order (the order a trainer sends
    them)."""
    from safetensors import safe_open

    tensors = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                if names is None or name in names:
                    tensors[name] = f.get_tensor(name)
    return tensors


def spoil_targets(ckpt: Path) -> Tuple[List[str], str]:
    """The MXFP8 weights a spoil may hit (an expert's and a dense layer's first, where the model has them) and the
    checkpoint's scale name."""
    from safetensors import safe_open

    names = set()
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            names.update(f.keys())
    scale_name = "weight_scale_inv" if any(n.endswith(".weight_scale_inv") for n in names) else "weight_scale"
    quantized = sorted(n for n in names if n.endswith(".weight") and n[: -len("weight")] + scale_name in names)
    if not quantized:
        raise RuntimeError(f"{ckpt}: no MXFP8 weight with a scale tensor; is it an MXFP8 checkpoint?")
    expert = [n for n in quantized if ".experts." in n][:1]
    dense = [n for n in quantized if ".experts." not in n and "o_proj" in n][:1]
    return (expert + dense) or quantized[:1], scale_name


def spoiled(what: str, weight_name: str, tensors: dict, scale_name: str) -> dict:
    """The tensors a refit spoiled by ``what`` (a SPOILS key) sends for ``weight_name``."""
    import torch

    from ..format.numerics import dequantize_mxfp8

    scale_key = weight_name[: -len("weight")] + scale_name
    w, s = tensors[weight_name], tensors[scale_key]
    if what == "missing_scale":
        return {weight_name: w}
    if what == "short_scale":
        return {weight_name: w, scale_key: s[..., :-1].contiguous()}
    if what == "e5m2_weight":
        return {weight_name: w.view(torch.uint8).view(torch.float8_e5m2), scale_key: s}
    if what == "nan_e4m3":
        bad = w.clone()
        bad.view(torch.uint8)[1, 3] = 0x7F
        return {weight_name: bad, scale_key: s}
    if what in ("nan_bf16", "inf_fp32"):
        x = dequantize_mxfp8(w, s).to(torch.bfloat16 if what == "nan_bf16" else torch.float32)
        x[2, 5] = float("nan") if what == "nan_bf16" else float("inf")
        return {weight_name: x}
    raise ValueError(f"unknown spoil {what!r}; one of {', '.join(SPOILS)}")


def write_folder(ckpt: Path, tensors: dict, folder: Path) -> Path:
    """``tensors`` as a checkpoint folder beside ``ckpt``'s config (a partial checkpoint: SGLang loads what is
    there)."""
    from safetensors.torch import save_file

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    shutil.copy2(ckpt / "config.json", folder / "config.json")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def update_weights_from_disk(port: int, ckpt: Path) -> Tuple[bool, str]:
    """SGLang's refit endpoint: whether it succeeded, and its answer (HTTP status: message)."""
    r = requests.post(f"http://127.0.0.1:{port}/update_weights_from_disk", json={"model_path": str(ckpt)}, timeout=900)
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    ok = r.status_code == 200 and bool(body.get("success", False))
    return ok, f"{r.status_code}: {body.get('message', r.text[:200])}"


def _count(log: Path, needle: str) -> int:
    return log.read_text(errors="replace").count(needle) if log.is_file() else 0


@dataclass
class RefitSequence:
    """Runs steps against one server on checkpoint A (``ckpts``: {"A": path, "B": path})."""

    port: int
    ckpts: Dict[str, Path]
    log: Path  # the server's log
    work: Path  # where spoiled folders are written
    outputs: Callable[[int], list]  # greedy outputs on fixed prompts
    seed: int = 0

    def _outputs(self) -> list:
        """``outputs`` on an empty prefix cache: SGLang flushes it after an accepted refit only, and a cached prefix
        runs other kernel shapes, whose rounding can flip a near-tie of random weights."""
        r = requests.post(f"http://127.0.0.1:{self.port}/flush_cache", timeout=60)
        r.raise_for_status()
        return self.outputs(self.port)

    def run(self, steps: List[Step], fresh: Optional[Dict[str, list]] = None) -> dict:
        """Each step's result, and the totals the row reports. ``fresh``: fresh servers' outputs by checkpoint
        (A's defaults to this server's own before the first step)."""
        rng = random.Random(self.seed)
        targets, scale_name = spoil_targets(self.ckpts["A"])
        originals = read_checkpoint(
            self.ckpts["A"], {n for t in targets for n in (t, t[: -len("weight")] + scale_name)}
        )
        reference = dict(fresh or {})
        before = self._outputs()
        reference.setdefault("A", before)
        recompiles0 = _count(self.log, RECOMPILE_LINE)
        results = []
        for i, step in enumerate(steps):
            weight = rng.choice(targets)
            try:
                ok, message = self._send(step, weight, originals, scale_name, i)
            except requests.RequestException as e:
                ok, message = None, f"no answer: {e}"
            try:
                after = self._outputs()
            except requests.RequestException as e:
                after = None
                message += f" | requests after it failed: {e}"
            if step.refused:
                as_expected = after is not None and after == before
            elif step.what in reference:
                as_expected = after == reference[step.what]
            else:  # the first acceptance of a checkpoint no fresh server was started on: it must differ from A
                as_expected = after is not None and after != reference["A"]
                reference[step.what] = after
            results.append({"step": str(step), "weight": weight if step.what != "missing_folder" else None,
                            "success": ok, "expected_success": not step.refused, "answered": after is not None,
                            "outputs_as_expected": as_expected,
                            "recompiles": _count(self.log, RECOMPILE_LINE) - recompiles0, "message": message[:300]})
            if after is None:
                break
            before = after
        refused = [r for r in results if not r["expected_success"]]
        ok = [r["answered"] and r["outputs_as_expected"] and r["success"] == r["expected_success"] for r in results]
        return {"steps": results, "steps_sent": len(steps), "steps_ok": sum(ok), "refused": len(refused),
                "refused_answered_false": sum(r["success"] is False for r in refused),
                "accepted": len(results) - len(refused),
                "answered": sum(r["answered"] for r in results),
                "outputs_as_expected": sum(r["outputs_as_expected"] for r in results),
                "recompiles": results[-1]["recompiles"] if results else 0,
                "scheduler_died": any(_count(self.log, line) for line in SCHEDULER_DIED),
                "all_ok": sum(ok) == len(steps) and (not results or results[-1]["recompiles"] == 0)}

    def _send(self, step: Step, weight: str, originals: dict, scale_name: str, i: int) -> Tuple[bool, str]:
        if step.what == "missing_folder":
            return update_weights_from_disk(self.port, self.work / f"missing-{i}")
        if not step.refused:
            if step.source == "disk":
                return update_weights_from_disk(self.port, self.ckpts[step.what])
            return update_weights_from_tensor(self.port, list(read_checkpoint(self.ckpts[step.what]).items()),
                                              bucket=step.source == "bucket")
        sent = spoiled(step.what, weight, originals, scale_name)
        if step.source == "disk":
            return update_weights_from_disk(self.port, write_folder(self.ckpts["A"], sent,
                                                                    self.work / f"spoiled-{i}-{step.what}"))
        return update_weights_from_tensor(self.port, list(sent.items()), bucket=step.source == "bucket")


def summary(result: dict) -> str:
    """One line: refits refused, then requests answered."""
    return (f"{result['refused']} refits refused ({result['refused_answered_false']} answered success: false), "
            f"{result['accepted']} accepted; requests answered after {result['answered']} of "
            f"{result['refused'] + result['accepted']}, outputs as expected after {result['outputs_as_expected']}; "
            f"{result['recompiles']} recompilations" + ("; the scheduler died" if result["scheduler_died"] else ""))


def dump(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=1))
