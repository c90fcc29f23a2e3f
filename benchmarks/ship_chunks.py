"""Files too large for one device command travel in chunks: one chunk per command, each in a folder of its own
(carry ROOT/cK), gathered under /tmp on the still-warm H200 (bash benchmarks/run_h200.sh recv ROOT/cK DEST).
At most 64 MiB travels with a command, the tracked tree included."""

import shutil
import subprocess
from pathlib import Path

CARRY_LIMIT = 64 * 2**20
MARGIN = 2**20


def tracked_bytes(repo: Path) -> int:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=repo, check=True, capture_output=True).stdout.split(b"\0")
    return sum((repo / n.decode()).stat().st_size for n in names if n and (repo / n.decode()).is_file())


def stage(src: Path, root: Path, chunks: int) -> None:
    """Write chunk k (1..chunks) of ``src`` alone into root/c{k}/chunk{k:02d}.bin (equal sizes, the last shorter)."""
    size = -(-src.stat().st_size // chunks)
    room = CARRY_LIMIT - tracked_bytes(Path(__file__).resolve().parents[1]) - MARGIN
    if size > room:
        raise SystemExit(f"{src}: chunks of {size} bytes leave no room for the tracked tree under 64 MiB "
                         f"({room} bytes free); use more than {chunks} chunks")
    with open(src, "rb") as f:
        for k in range(1, chunks + 1):
            folder = root / f"c{k}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            (folder / f"chunk{k:02d}.bin").write_bytes(f.read(size))
    print(f"staged {chunks} chunks of {src.name} ({size} bytes each) in {root}/c1 ... c{chunks}")
