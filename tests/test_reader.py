"""The refit reader (format.reader) against safetensors' own: every tensor of every file, bit for bit, per file in name
order, whatever its dtype and however far it reads ahead; a file it cannot read is named, and SGLang's loader reads
through it only during an MXFP8 refit (patch loader.pinned_refit_reads, the real loader module)."""

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import run_python
from sglang_mxfp8.format.numerics import quantize_mxfp8
from sglang_mxfp8.format.reader import UnreadableTensor, read_tensors, tensor_entries


def _checkpoint(root, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    files = []
    for i in range(3):
        tensors = {}
        for j in range(5):
            q, s = quantize_mxfp8(torch.randn(64 + 32 * j, 96, generator=g))
            tensors[f"layers.{i}.w{j}.weight"], tensors[f"layers.{i}.w{j}.weight_scale_inv"] = q, s
        tensors[f"layers.{i}.norm"] = torch.randn(96, generator=g).to(torch.bfloat16)
        tensors[f"layers.{i}.bias"] = torch.randn(7, generator=g)
        tensors[f"layers.{i}.ids"] = torch.randint(-5, 5, (3, 4), generator=g)
        tensors[f"layers.{i}.empty"] = torch.empty(0, 8)
        path = root / f"model-{i:05d}.safetensors"
        save_file(tensors, str(path))
        files.append(str(path))
    return files


def _safetensors(files):
    for path in files:
        with safe_open(path, "pt") as f:
            for name in sorted(f.keys()):
                yield name, f.get_tensor(name)


@pytest.mark.parametrize("ahead_bytes,run_bytes,piece_bytes",
                         [(1, 1, 7), (3000, 5000, 1000), (1 << 30, 16 << 20, 4 << 20)])
def test_the_reader_gives_what_safetensors_gives_in_name_order(tmp_path, monkeypatch, ahead_bytes, run_bytes,
                                                               piece_bytes):
    """Whatever it reads ahead, however it groups tensors into buffers and splits a buffer's read among threads."""
    from sglang_mxfp8.format import reader

    monkeypatch.setattr(reader, "RUN_BYTES", run_bytes)
    monkeypatch.setattr(reader, "PIECE_BYTES", piece_bytes)
    files = _checkpoint(tmp_path)
    got = list(read_tensors(files, pinned=False, threads=4, ahead_bytes=ahead_bytes))
    want = list(_safetensors(files))
    assert [n for n, _ in got] == [n for n, _ in want] and len(got) == 3 * 14
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b), name


def test_tensors_share_a_buffer_where_they_lie_back_to_back_at_offsets_their_dtype_can_be_viewed_at():
    from sglang_mxfp8.format.reader import runs

    u8, bf16, f32 = torch.uint8, torch.bfloat16, torch.float32
    entries = [("a", f32, (2,), 0, 8), ("b", bf16, (3,), 8, 14), ("c", u8, (3,), 14, 17), ("d", bf16, (1,), 17, 19),
               ("e", u8, (40,), 19, 59), ("f", u8, (1,), 100, 101), ("g", u8, (8,), 101, 109)]
    got = [([e[0] for e in run], start, end) for run, start, end in runs(entries, 40)]
    # d would sit at an odd offset of a's buffer; e would make d's buffer larger than 40 bytes; f does not follow e
    assert got == [(["a", "b", "c"], 0, 17), (["d"], 17, 19), (["e"], 19, 59), (["f", "g"], 100, 109)]


def test_runs_of_a_converted_checkpoint_share_buffers_so_a_read_allocates_about_its_bytes(tmp_path, monkeypatch):
    """safetensors writes by dtype, then name, so in name order an MXFP8 weight and its scale lie far apart and nearly
    every run is one tensor: a buffer per run would page-lock 16 MiB per tensor (about 50 GB for a 4-layer
    Qwen3-30B-A3B-shaped checkpoint of 3.8 GB). Runs are packed into shared buffers: what a read allocates is its
    bytes and one buffer's worth more, and the tensors are still safetensors' own."""
    from sglang_mxfp8.bench.tiny_model import write_qwen3_moe
    from sglang_mxfp8.format import reader
    from sglang_mxfp8.format.convert import convert

    monkeypatch.setattr(reader, "RUN_BYTES", 1 << 20)
    write_qwen3_moe(tmp_path / "bf16", layers=2, experts=16)
    convert(tmp_path / "bf16", tmp_path / "mx")
    files = sorted(str(p) for p in (tmp_path / "mx").glob("*.safetensors"))
    buffers, total, count = reader.Buffers(pinned=False), 0, 0
    for path in files:
        for run, start, end in reader.runs(reader.tensor_entries(path)[0], reader.RUN_BYTES):
            buffers.region(end - start)
            total, count = total + end - start, count + 1
    assert count > 150 and total > 4 << 20  # most runs one tensor; one buffer each would be 150 MiB
    assert total <= buffers.allocated <= 1.1 * total + reader.RUN_BYTES, (buffers.allocated, total)
    got = list(read_tensors(files, pinned=False, threads=4, ahead_bytes=3 << 20))
    want = list(_safetensors(files))
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for (_, a), (_, b) in zip(got, want))


def test_a_loader_that_stops_early_leaves_no_read_running(tmp_path):
    files = _checkpoint(tmp_path, seed=1)
    it = read_tensors(files, pinned=False, threads=4, ahead_bytes=1 << 20)
    first = [next(it) for _ in range(3)]
    it.close()  # a refused refit: SGLang's loader raises and drops the iterator
    assert [n for n, _ in first] == [n for n, _ in list(_safetensors(files))[:3]]


def test_a_dtype_it_does_not_read_and_a_short_file_are_named(tmp_path):
    path = tmp_path / "odd.safetensors"
    header = json.dumps({"x": {"dtype": "C64", "shape": [2], "data_offsets": [0, 16]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(UnreadableTensor, match=r"odd.safetensors: tensor x is C64"):
        tensor_entries(str(path))
    short = tmp_path / "short.safetensors"
    save_file({"w": torch.ones(64)}, str(short))
    short.write_bytes(short.read_bytes()[:-10])
    with pytest.raises(OSError, match="file ended 10 bytes early"):
        list(read_tensors([str(short)], pinned=False))


@pytest.mark.sglang
def test_sglangs_loader_reads_through_it_during_an_mxfp8_refit_only(tmp_path):
    files = _checkpoint(tmp_path, seed=2)
    p = run_python(
        "import json, sys, torch\n"
        "from sglang.srt.model_loader import loader\n"
        "from sglang_mxfp8.sglang import patching\n"
        "from sglang_mxfp8.sglang.weights import refit_reads\n"
        f"files = {files!r}\n"
        "def names(it): return [n for n, _ in it]\n"
        "stock = list(loader.buffered_multi_thread_safetensors_weights_iterator(files, max_workers=2))\n"
        "with refit_reads():\n"
        "    ours = loader.buffered_multi_thread_safetensors_weights_iterator(files, max_workers=2)\n"
        "    kind = type(ours).__name__, ours.__qualname__ if hasattr(ours, '__qualname__') else ''\n"
        "    ours = list(ours)\n"
        "same = [a == b and torch.equal(x.view(torch.uint8), y.view(torch.uint8))\n"
        "        for (a, x), (b, y) in zip(sorted(stock, key=lambda t: t[0]), sorted(ours, key=lambda t: t[0]))]\n"
        "plain = loader.safetensors_weights_iterator(files)\n"
        "name = 'loader.pinned_refit_reads.buffered_multi_thread_safetensors_weights_iterator'\n"
        "print(json.dumps(dict(patched=name in patching.APPLIED, ours=kind[1], n=len(ours),\n"
        "                      same=all(same) and len(same) == 42, after=getattr(plain, '__qualname__', ''))))\n"
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"patched": True, "ours": "read_tensors", "n": 42, "same": True,
                   "after": "safetensors_weights_iterator"}, got


def test_refit_reads_page_lock_from_free_cached_blocks_then_up_to_their_cap_then_read_pageable(monkeypatch):
    """Whatever keeps a refit's buffers alive, the page-locked pool grows by at most the cap over all reads of the
    process; a free cached block is taken whatever the growth. torch's pool statistics (allocated_bytes, active_bytes)
    are stood in for here: this machine has no GPU to page-lock with."""
    from sglang_mxfp8.format import reader

    pool = {"owned": 5 << 30, "active": 5 << 30}  # 5 GiB page-locked by others, all in use
    monkeypatch.setattr(reader, "pinned_pool", lambda: (pool["owned"], pool["active"]))
    monkeypatch.setattr(reader, "_GROWN", [0])
    first = reader.Buffers(pinned=True, pinned_cap=64 << 20)
    assert first.pin(16 << 20) and first.pin(64 << 20) and not first.pin((64 << 20) + 1)
    pool["owned"] += 48 << 20  # this read page-locked 48 MiB, all in use
    pool["active"] += 48 << 20
    assert first.pin(16 << 20) and not first.pin(17 << 20)
    first.done()
    pool["active"] -= 48 << 20  # the loader let go: 48 MiB cached and free
    second = reader.Buffers(pinned=True, pinned_cap=64 << 20)
    assert second.pin(48 << 20) and not second.pin(49 << 20)  # free blocks, then 16 MiB of growth left at most
    pool["active"] += 48 << 20
    assert second.pin(16 << 20) and not second.pin(17 << 20)
    assert not reader.Buffers(pinned=False).pin(1)


def test_past_a_gigabyte_of_growth_a_read_waits_for_its_queued_copies_before_each_new_buffer(monkeypatch):
    """torch serves a pinned block again only once the copies queued from it are done; past the settle point a read
    waits for them (the stream's synchronize, stood in for here) before asking for each new buffer."""
    from sglang_mxfp8.format import reader

    pool = {"owned": 0}
    monkeypatch.setattr(reader, "pinned_pool", lambda: (pool["owned"], pool["owned"]))
    monkeypatch.setattr(reader, "_GROWN", [0])
    monkeypatch.setattr(reader.torch, "empty", lambda n, dtype, pin_memory: torch.zeros(n, dtype=dtype))
    waits = []
    buffers = reader.Buffers(pinned=True, pinned_cap=1 << 40, settle_after=32 << 20, settle=lambda: waits.append(1))
    for _ in range(4):  # each new 16 MiB buffer grows the pool by its size
        buffers.region(reader.RUN_BYTES)
        pool["owned"] += reader.RUN_BYTES
    assert buffers.settled == len(waits) == 2 and buffers.pageable == 0  # the third and the fourth waited
