"""Results as data: one JSON line per measurement, MXFP8 beside BF16 measured in the same run.

Every row carries where and how it was measured (GPU, driver, library versions, git commit, the command that
reproduces it), what (routine, metric, shape, tokens or concurrency, flags, kernel) and the two values with their
unit. ``ratio`` is MXFP8's advantage: BF16 / MXFP8 for a time (lower is better), MXFP8 / BF16 for a throughput
(higher is better), so above 1 MXFP8 is ahead either way. Reports (CURRENT.md, README) are generated from rows.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional

SCHEMA = 1
ROUTINES = ("layers", "serve", "start", "refit", "accuracy", "routing", "tests", "suite")  # "suite": its wall time
BETTER = ("lower", "higher")
LIBRARIES = {"torch": "torch", "sglang": "sglang", "flashinfer": "flashinfer-python", "triton": "triton",
             "deep_gemm": ("sgl-deep-gemm", "deep-gemm", "deep_gemm"), "sglang_mxfp8": "sglang_mxfp8"}


class SchemaError(ValueError):
    """A row that does not follow the schema (one line naming the field)."""


@dataclass(frozen=True)
class Environment:
    """Where a run measured: one per run, copied into each of its rows."""

    run: str
    gpu: str
    sm: Optional[int]
    driver: Optional[str]
    versions: Dict[str, Optional[str]]
    commit: Optional[str]
    command: str


@dataclass(frozen=True)
class Row:
    run: str
    time: str
    gpu: str
    sm: Optional[int]
    driver: Optional[str]
    versions: Dict[str, Optional[str]]
    commit: Optional[str]
    command: str
    routine: str
    metric: str
    shape: str
    flags: str
    unit: str
    better: str
    mxfp8: Optional[float]
    bf16: Optional[float]
    ratio: Optional[float]
    tokens: Optional[int] = None
    concurrency: Optional[int] = None
    kernel: Optional[str] = None
    extra: Dict[str, object] = field(default_factory=dict)
    schema: int = SCHEMA


def advantage(mxfp8: Optional[float], bf16: Optional[float], better: str) -> Optional[float]:
    """MXFP8's advantage over BF16 (above 1: MXFP8 ahead), or None without both values."""
    if mxfp8 is None or bf16 is None or mxfp8 <= 0 or bf16 <= 0:
        return None
    return bf16 / mxfp8 if better == "lower" else mxfp8 / bf16


def measurement(env: Environment, routine: str, metric: str, shape: str, flags: str, unit: str, better: str,
                mxfp8: Optional[float], bf16: Optional[float], **what) -> Row:
    """A row of ``env``'s run, measured now; the ratio follows from the two values."""
    mxfp8, bf16 = _number(mxfp8), _number(bf16)
    row = Row(run=env.run, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), gpu=env.gpu, sm=env.sm,
              driver=env.driver, versions=dict(env.versions), commit=env.commit, command=env.command,
              routine=routine, metric=metric, shape=shape, flags=flags, unit=unit, better=better,
              mxfp8=mxfp8, bf16=bf16, ratio=advantage(mxfp8, bf16, better), **what)
    validate(asdict(row))
    return row


def _number(value) -> Optional[float]:
    return None if value is None else round(float(value), 6)


_TYPES = {"schema": int, "run": str, "time": str, "gpu": str, "command": str, "routine": str, "metric": str,
          "shape": str, "flags": str, "unit": str, "better": str, "versions": dict, "extra": dict}
_OPTIONAL = {"sm": int, "driver": str, "commit": str, "mxfp8": (int, float), "bf16": (int, float),
             "ratio": (int, float), "tokens": int, "concurrency": int, "kernel": str}


def validate(row: dict) -> dict:
    """``row`` if it follows the schema, else SchemaError naming the first field that does not."""
    for name, kind in _TYPES.items():
        if not isinstance(row.get(name), kind) or isinstance(row.get(name), bool):
            raise SchemaError(f"row field {name!r}: {row.get(name)!r} is not a {kind.__name__}")
    for name, kind in _OPTIONAL.items():
        value = row.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise SchemaError(f"row field {name!r}: {value!r} has the wrong type")
    unknown = set(row) - set(_TYPES) - set(_OPTIONAL)
    if unknown:
        raise SchemaError(f"row fields {sorted(unknown)} are not in schema {SCHEMA}")
    if row["schema"] != SCHEMA:
        raise SchemaError(f"row field 'schema': {row['schema']} (this version reads {SCHEMA})")
    if row["routine"] not in ROUTINES:
        raise SchemaError(f"row field 'routine': {row['routine']!r} is none of {', '.join(ROUTINES)}")
    if row["better"] not in BETTER:
        raise SchemaError(f"row field 'better': {row['better']!r} is neither 'lower' nor 'higher'")
    expected = advantage(row["mxfp8"], row["bf16"], row["better"])
    if (expected is None) != (row["ratio"] is None) or (
        expected is not None and abs(expected - row["ratio"]) > 1e-6 * expected
    ):
        raise SchemaError(f"row field 'ratio': {row['ratio']} does not follow from mxfp8 {row['mxfp8']} and bf16 "
                          f"{row['bf16']} ({row['better']} is better)")
    return row


def append(path: Path, rows: Iterable[Row]) -> int:
    """Append ``rows`` to the JSONL file ``path`` (created with its folder); returns how many."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(asdict(r), sort_keys=True) for r in rows]
    with open(path, "a") as f:
        f.writelines(line + "\n" for line in lines)
    return len(lines)


def load(folder: Path) -> List[dict]:
    """Every row of every ``*.jsonl`` in ``folder``, validated, oldest first; SchemaError names file and line."""
    rows = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(validate(json.loads(line)))
            except (json.JSONDecodeError, SchemaError) as e:
                raise SchemaError(f"{path}:{number}: {e}") from None
    return sorted(rows, key=lambda r: r["time"])


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def _version(dist) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    for name in (dist,) if isinstance(dist, str) else dist:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def _git_commit() -> Optional[str]:
    """The package's git commit (with '-dirty' where its tracked files changed), or None outside a checkout."""
    top = Path(__file__).resolve().parents[2]
    if not (top / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(top), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(top), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("-dirty" if dirty else "")) or None


def _driver() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out[0] if out else None


def source_digest() -> str:
    """A digest of the package's Python source: which code measured, where the git commit cannot say (a copy of the
    tree, uncommitted changes)."""
    import hashlib

    package = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def environment(command: str, gpu_name: Optional[str] = None, sm: Optional[int] = None) -> Environment:
    """This machine's environment for a run of ``command`` (the GPU as given, e.g. by platform.visible_gpu())."""
    versions = {name: _version(dist) for name, dist in LIBRARIES.items()}
    versions["sglang_mxfp8_source"] = source_digest()
    return Environment(run=new_run_id(), gpu=gpu_name or "none", sm=sm, driver=_driver(), versions=versions,
                       commit=_git_commit(), command=command)
