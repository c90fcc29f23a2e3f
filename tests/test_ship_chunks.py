"""The chunked transfer of files larger than one device command (tools/ship_chunks.py, ship_fa3.py's join):
staged chunks, moved as run_h200.sh's recv moves them, join back to the same bytes; a missing chunk is named."""

import hashlib
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import ship_chunks  # noqa: E402
import ship_fa3  # noqa: E402


def _staged(tmp_path, chunks):
    payload = os.urandom(1 << 16) * 40  # compressible, as flash_ops' fat binary is
    src = tmp_path / "lib.so.xz"
    src.write_bytes(lzma.compress(payload, preset=1))
    ship_chunks.stage(src, tmp_path / "stage", chunks)
    gathered = tmp_path / "gathered"
    gathered.mkdir()
    for k in range(1, chunks + 1):  # what `run_h200.sh recv .fa3/cK /tmp/fa3_chunks` does per command
        (chunk,) = (tmp_path / "stage" / f"c{k}").iterdir()
        shutil.move(chunk, gathered / chunk.name)
    return payload, src, gathered


def test_chunks_join_back_to_the_file(tmp_path):
    payload, src, gathered = _staged(tmp_path, 7)
    sizes = sorted(p.stat().st_size for p in gathered.iterdir())
    assert len(sizes) == 7 and sum(sizes) == src.stat().st_size and sizes[-1] - sizes[0] <= 7
    target = tmp_path / "lib.so"
    assert ship_fa3.join(gathered, target, hashlib.sha256(payload).hexdigest()) == 7
    assert target.read_bytes() == payload and not (tmp_path / "lib.so.partial").exists()


def test_a_missing_chunk_is_refused_and_nothing_installed(tmp_path):
    payload, _, gathered = _staged(tmp_path, 5)
    (gathered / "chunk05.bin").unlink()
    target = tmp_path / "lib.so"
    with pytest.raises(SystemExit, match="the 4 chunks in .* do not make lib.so .xz stream complete: False"):
        ship_fa3.join(gathered, target, hashlib.sha256(payload).hexdigest())
    assert not target.exists() and not (tmp_path / "lib.so.partial").exists()
    with pytest.raises(SystemExit, match="no chunks in"):
        ship_fa3.join(tmp_path / "stage", target)


def test_staging_refuses_chunks_too_large_for_one_command(tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(ship_chunks.CARRY_LIMIT)
    with pytest.raises(SystemExit, match="use more than 1 chunks"):
        ship_chunks.stage(big, tmp_path / "stage", 1)


def test_chunks_out_of_order_are_refused(tmp_path):
    payload, _, gathered = _staged(tmp_path, 3)
    (gathered / "chunk01.bin").rename(gathered / "chunk00.bin")
    (gathered / "chunk02.bin").rename(gathered / "chunk01.bin")
    (gathered / "chunk00.bin").rename(gathered / "chunk02.bin")
    with pytest.raises(SystemExit, match="the 3 chunks in .* do not make lib.so .xz: "):
        ship_fa3.join(gathered, tmp_path / "lib.so", hashlib.sha256(payload).hexdigest())
    assert not (tmp_path / "lib.so").exists() and not (tmp_path / "lib.so.partial").exists()


@pytest.mark.parametrize("exclude_before", [None, "*.log", "*.log\n"])
def test_staging_folder_is_kept_out_of_git(tmp_path, exclude_before):
    """A clone without .git/info/exclude (or one whose last line has no newline) still ignores the staging folder,
    so a device command does not carry the chunks it was not given."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    exclude = tmp_path / ".git" / "info" / "exclude"
    shutil.rmtree(exclude.parent, ignore_errors=True)  # git's templates may or may not have made it
    if exclude_before is not None:
        exclude.parent.mkdir()
        exclude.write_text(exclude_before)
    (tmp_path / "x.log").write_text("log")
    staging = tmp_path / ".fa3"
    (staging / "c1").mkdir(parents=True)
    (staging / "c1" / "chunk01.bin").write_bytes(b"\0" * 64)
    for _ in range(2):
        ship_chunks.exclude_from_git(staging, tmp_path)
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=tmp_path, check=True,
                            capture_output=True, text=True).stdout.split("\n")
    assert not any(".fa3" in line for line in status), status
    assert ("?? x.log" in status) == (exclude_before is None), status
    assert exclude.read_text().split().count("/.fa3/") == 1
