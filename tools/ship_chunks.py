"""Files too large for one device command travel in chunks: one chunk per command, each in a folder of its own
(carry ROOT/cK), gathered under /tmp on the still-warm H200 (bash benchmarks/run_h200.sh recv ROOT/cK DEST).
At most 64 MiB travels with a command, the tracked tree included."""

import hashlib
import math
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CARRY_LIMIT = 64 * 2**20
MARGIN = 2**20


def sha256_of(paths) -> tuple:
    """(bytes, sha256 hex digest) of the files ``paths`` read one after another."""
    h, n = hashlib.sha256(), 0
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
                n += len(chunk)
    return n, h.hexdigest()


def exclude_from_git(folder: Path, repo: Path = REPO) -> None:
    """Keep the repo's staging ``folder`` out of git (and so out of what a command carries unless named); a clone
    may have no .git/info/exclude yet."""
    exclude = repo / ".git" / "info" / "exclude"
    entry = f"/{folder.relative_to(repo)}/"
    text = exclude.read_text() if exclude.is_file() else ""
    if entry not in text.split():
        exclude.parent.mkdir(parents=True, exist_ok=True)
        exclude.write_text(text + ("" if text.endswith("\n") or not text else "\n") + entry + "\n")


def tracked_bytes(repo: Path) -> int:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=repo, check=True, capture_output=True).stdout.split(b"\0")
    return sum((repo / n.decode()).stat().st_size for n in names if n and (repo / n.decode()).is_file())


def stage(src: Path, root: Path, chunks: int | None = None) -> None:
    """Write chunk k (1..chunks) of ``src`` alone into root/c{k}/chunk{k:02d}.bin (equal sizes, the last shorter);
    ``chunks=None``: the fewest that each leave the tracked tree room under 64 MiB."""
    room = CARRY_LIMIT - tracked_bytes(REPO) - MARGIN
    chunks = chunks or math.ceil(src.stat().st_size / room)
    size = -(-src.stat().st_size // chunks)
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
