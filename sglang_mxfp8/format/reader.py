"""A safetensors checkpoint read for a refit: straight from the file into page-locked host memory by a few threads,
ahead of the loader (one copy out of the page cache; the loader's copy to the GPU is then a DMA at the link's speed),
instead of into pageable memory that the copy to the GPU stages again. Tensors come out per file in name order, as
SGLang's own iterators give them, as views of buffers that each hold a run of tensors lying back to back in the file
(16 MB, or one larger tensor): a weight's scale of a few KB costs a view, not a read of its own with its thread
hand-off, and a large tensor is read by several threads. torch's pinned-memory cache reuses a buffer once the loader
lets go of its tensors (a loader that keeps one keeps its buffer); it rounds each block up to a power of two and hands
a block out again for that size only, so every page-locked run buffer is :data:`RUN_BYTES`: a refit page-locks new
memory only for what is read ahead of the loader, and only the first time."""

from __future__ import annotations

import collections
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Deque, Iterable, Iterator, List, Tuple

import torch

DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8,
          "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}
READ_THREADS = 8
AHEAD_BYTES = 256 << 20  # read ahead of the loader at most this much (page-locked): 64 pieces for the threads
RUN_BYTES = 16 << 20  # tensors lying back to back in the file share a buffer up to this size
PIECE_BYTES = 4 << 20  # one thread's read


class UnreadableTensor(ValueError):
    """A tensor this reader does not read (a dtype it does not know): the caller reads the file another way."""


def tensor_entries(path: str) -> Tuple[List[tuple], int]:
    """(name, dtype, shape, start, end) per tensor of a safetensors file, in name order, and where its data starts."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    entries = []
    for name in sorted(k for k in header if k != "__metadata__"):
        meta = header[name]
        if meta["dtype"] not in DTYPES:
            raise UnreadableTensor(f"{path}: tensor {name} is {meta['dtype']}, which this reader does not read")
        start, end = meta["data_offsets"]
        entries.append((name, DTYPES[meta["dtype"]], tuple(meta["shape"]), start, end))
    return entries, 8 + size


def runs(entries: List[tuple], run_bytes: int) -> Iterator[Tuple[List[tuple], int, int]]:
    """(entries, start, end): consecutive entries whose data lie back to back in the file, up to ``run_bytes`` (a
    larger tensor alone), each at an offset its dtype can be viewed at."""
    run: List[tuple] = []
    start = end = 0
    for entry in entries:
        _, dtype, _, s, e = entry
        if run and (s != end or e - start > run_bytes or (s - start) % dtype.itemsize):
            yield run, start, end
            run = []
        if not run:
            start = s
        run.append(entry)
        end = e
    if run:
        yield run, start, end


def _read(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"file ended {len(view) - done} bytes early reading tensors at offset {offset}")
        done += n


def read_tensors(files: Iterable[str], pinned: bool, threads: int = READ_THREADS,
                 ahead_bytes: int = AHEAD_BYTES) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of ``files``, per file in name order; ``pinned``: in page-locked memory (needs a
    GPU)."""
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mxfp8-read") as pool:
        for path in files:
            entries, data = tensor_entries(path)
            fd = os.open(path, os.O_RDONLY)
            pending: Deque[tuple] = collections.deque()
            try:
                queued = 0
                for run, start, end in runs(entries, RUN_BYTES):
                    while pending and queued + (end - start) > ahead_bytes:
                        queued -= pending[0][2].numel()
                        yield from _tensors(*pending.popleft())
                    buf = _buffer(end - start, pinned)
                    view = memoryview(buf.numpy())[: end - start]
                    reads = [pool.submit(_read, fd, view[p:p + PIECE_BYTES], data + start + p)
                             for p in range(0, end - start, PIECE_BYTES)]
                    pending.append((run, start, buf, reads))
                    queued += end - start
                while pending:
                    yield from _tensors(*pending.popleft())
            finally:  # a loader that stopped early (a refused refit): reads not started dropped, running ones end
                for _, _, _, reads in pending:
                    for future in reads:
                        if not future.cancel():
                            future.exception()
                os.close(fd)


def _buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """Where a run of ``nbytes`` is read: page-locked, :data:`RUN_BYTES` or the one larger tensor's size."""
    if not pinned or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.empty(max(nbytes, RUN_BYTES), dtype=torch.uint8, pin_memory=True)


def _tensors(run: List[tuple], start: int, buf: torch.Tensor, reads: list) -> Iterator[Tuple[str, torch.Tensor]]:
    for future in reads:
        future.result()
    for name, dtype, shape, s, e in run:
        yield name, buf[s - start:e - start].view(dtype).reshape(shape)
