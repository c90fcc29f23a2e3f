"""Get FlashAttention 3 (sgl_kernel's ``flash_ops``; SGLang's default attention backend for Qwen3-MoE and Llama on
Hopper) onto the H200.

The .gpu wheelhouse leaves sglang-kernel's flash_ops.abi3.so out (1.76 GB, built for sm80, sm86 and sm90a), so
the served benchmarks ran with ``--attention-backend triton``. xz shrinks it to 308 MB, which travels in six chunks
of 51 MB, one per device command, gathered under /tmp on the still-warm machine, then joined, checked against
the pinned wheel's digest and put beside sgl_kernel's other ops:

    python tools/ship_fa3.py stage      # on this machine: .fa3/c1 ... .fa3/c6 (xz: 9 min on 2 cores)
    bash benchmarks/run_h200.sh recv .fa3/c1 /tmp/fa3_chunks     # carry .fa3/c1; then c2 ... c6, back to back
    bash benchmarks/run_h200.sh fa3-install                       # carry .gpu: join, check, install, import
    E2E_FLAGS="--attention-backend fa3" bash benchmarks/run_h200.sh e2e     # both servers on FA3
"""

import argparse
import hashlib
import importlib.util
import lzma
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ship_chunks  # noqa: E402

WHEEL = "sglang-kernel==0.4.4"  # the version .gpu/sgl_kernel_sm90.tgz holds (../shared/gpu/make-wheelhouse.sh)
MEMBER = "sgl_kernel/flash_ops.abi3.so"
SIZE = 1_758_623_416
SHA256 = "f579d97c3489e0513156879079165d29860b98f47b3470529a3bfe26a9b2acaf"
STAGE = ROOT / ".fa3"


def stage() -> None:
    STAGE.mkdir(exist_ok=True)
    ship_chunks.exclude_from_git(STAGE)
    so = STAGE / "flash_ops.abi3.so"
    if not so.is_file() or so.stat().st_size != SIZE:
        wheels = STAGE / "wheel"
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--platform", "manylinux2014_x86_64", "-d", str(wheels), WHEEL],
                       check=True)
        with zipfile.ZipFile(next(wheels.glob("sglang_kernel-*.whl"))) as z, open(so, "wb") as out:
            with z.open(MEMBER) as f:
                while chunk := f.read(1 << 24):
                    out.write(chunk)
    digest = ship_chunks.sha256_of([so])[1]
    if digest != SHA256:
        raise SystemExit(f"{so}: sha256 {digest}, expected {SHA256} ({WHEEL})")
    xz = STAGE / "flash_ops.abi3.so.xz"
    if not xz.is_file():
        print(f"compressing {so.name} ({SIZE / 2**30:.2f} GiB) with xz -6 on every core", flush=True)
        subprocess.run(["xz", "-6", "-T0", "-k", "-f", str(so)], check=True)
    ship_chunks.stage(xz, STAGE)


def join(chunks: Path, target: Path, sha256: str = SHA256) -> int:
    """Join chunks/chunk*.bin in order through xz into ``target`` if they make the file of digest ``sha256``
    (written beside it first, renamed when whole); returns the chunk count."""
    parts = sorted(chunks.glob("chunk*.bin"))
    if not parts:
        raise SystemExit(f"no chunks in {chunks}: send them first (bash benchmarks/run_h200.sh recv .fa3/cK {chunks})")
    partial = target.with_name(target.name + ".partial")
    decompressor, h = lzma.LZMADecompressor(), hashlib.sha256()
    try:
        with open(partial, "wb") as out:
            for part in parts:
                data = decompressor.decompress(part.read_bytes())
                h.update(data)
                out.write(data)
        whole = decompressor.eof and h.hexdigest() == sha256
        why = f"xz stream complete: {decompressor.eof}"
    except lzma.LZMAError as e:
        whole, why = False, f"xz: {e}"
    if not whole:
        partial.unlink()
        raise SystemExit(f"the {len(parts)} chunks in {chunks} do not make {target.name} ({why}); "
                         "send every chunk of one stage")
    partial.rename(target)
    return len(parts)


def install(chunks: Path) -> None:
    """On the H200: put flash_ops beside sgl_kernel's other ops and import it."""
    target = Path(importlib.util.find_spec("sgl_kernel").submodule_search_locations[0]) / "flash_ops.abi3.so"
    n = join(chunks, target)
    import torch
    from sgl_kernel.flash_attn import is_fa3_supported

    print(f"{target}: installed from {n} chunks; FA3 on {torch.cuda.get_device_name()}: {is_fa3_supported()}")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("stage")
    sub.add_parser("install").add_argument("chunks", type=Path, nargs="?", default=Path("/tmp/fa3_chunks"))
    args = ap.parse_args()
    stage() if args.cmd == "stage" else install(args.chunks)


if __name__ == "__main__":
    main()
