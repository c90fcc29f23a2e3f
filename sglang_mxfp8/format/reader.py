"""A safetensors checkpoint read for a refit: straight from the file into page-locked host memory by a few threads,
ahead of the loader (one copy out of the page cache; the loader's copy to the GPU is then a DMA at the link's speed),
instead of into pageable memory that the copy to the GPU stages again. Tensors come out per file in name order, as
SGLang's own iterators give them, as views of buffers that each hold a run of tensors lying back to back in the file
(16 MB, or one larger tensor): a weight's scale of a few KB costs a view, not a read of its own with its thread
hand-off, and a large tensor is read by several threads.

Name order is not file order (safetensors writes by dtype, then name: an MXFP8 weight and its scale lie far apart),
so most runs are one tensor; runs are packed one after another into shared :data:`RUN_BYTES` buffers, and what is
read ahead is counted in buffer bytes. torch's pinned-memory cache reuses a buffer once the loader lets go of its
tensors; it rounds each block up to a power of two and hands a block out again for that size only, so every shared
buffer is :data:`RUN_BYTES`: a refit page-locks new memory only for what is read ahead of the loader (and for tensors
larger than a buffer), and only the first time."""

from __future__ import annotations

import collections
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Deque, Iterable, Iterator, List, Optional, Tuple

import torch

DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8,
          "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}
READ_THREADS = 8
AHEAD_BYTES = 256 << 20  # read ahead of the loader at most this much (page-locked): 64 pieces for the threads
RUN_BYTES = 16 << 20  # tensors lying back to back in the file share a buffer up to this size
PIECE_BYTES = 4 << 20  # one thread's read
PINNED_GROWTH_CAP = 4 << 30  # refit reads grow torch's page-locked pool by this much at most, whatever keeps buffers
PINNED_SETTLE_AFTER = 1 << 30  # past this growth in one read, wait for the queued copies before each new buffer
_GROWN = [0]  # bytes by which refit reads of this process grew the pool so far


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


def read_tensors(files: Iterable[str], pinned: bool, threads: int = READ_THREADS, ahead_bytes: int = AHEAD_BYTES,
                 buffers: Optional["Buffers"] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of ``files``, per file in name order; ``pinned``: in page-locked memory (needs a
    GPU); ``buffers``: where they are read (what it allocated can be asked afterwards)."""
    buffers = buffers or Buffers(pinned)
    try:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mxfp8-read") as pool:
            for path in files:
                entries, data = tensor_entries(path)
                fd = os.open(path, os.O_RDONLY)
                pending: Deque[tuple] = collections.deque()
                try:
                    queued = 0
                    for run, start, end in runs(entries, RUN_BYTES):
                        new = buffers.new_bytes(end - start)
                        while pending and queued + new > ahead_bytes:
                            queued -= pending[0][4]
                            yield from _tensors(*pending.popleft()[:4])
                        region = buffers.region(end - start)
                        view = memoryview(region.numpy())
                        reads = [pool.submit(_read, fd, view[p:p + PIECE_BYTES], data + start + p)
                                 for p in range(0, end - start, PIECE_BYTES)]
                        pending.append((run, start, region, reads, new))
                        queued += new
                    while pending:
                        yield from _tensors(*pending.popleft()[:4])
                finally:  # a loader that stopped early (a refused refit): reads not started dropped, running ones end
                    for _, _, _, reads, _ in pending:
                        for future in reads:
                            if not future.cancel():
                                future.exception()
                    os.close(fd)
    finally:
        buffers.done()


class Buffers:
    """Where runs are read: one after another in a shared :data:`RUN_BYTES` buffer (each at a 64-byte boundary, so any
    dtype can be viewed there), a run larger than that in a buffer of its own; page-locked where ``pinned``, from
    torch's cached blocks where one is free, else newly page-locked while the reads of this process have grown the
    pool by less than ``pinned_cap``, else pageable: whatever keeps buffers alive, refits must not page-lock the
    host's memory away."""

    ALIGN = 64

    def __init__(self, pinned: bool, pinned_cap: int = PINNED_GROWTH_CAP, settle_after: int = PINNED_SETTLE_AFTER,
                 settle=None):
        self.pinned, self.pinned_cap, self.settle_after = pinned, pinned_cap, settle_after
        # torch hands a pinned block out again only once the copies queued from it are done: waiting for them lets
        # the cache serve the next buffer rather than page-locking a new one
        self._settle = settle or (lambda: torch.cuda.current_stream().synchronize())
        self.settled = 0  # how many times this read waited
        self.shared, self.used = None, RUN_BYTES
        self.allocated = 0  # bytes of every buffer allocated so far
        self.pageable = 0  # bytes of those read into pageable memory (no free cached block, the cap reached)
        self.grown = 0  # bytes by which this read grew the page-locked pool (known once it is done)
        self._pool_start = pinned_pool()[0] if pinned else 0

    def new_bytes(self, nbytes: int) -> int:
        """How many bytes a region of ``nbytes`` allocates anew."""
        if nbytes > RUN_BYTES:
            return nbytes
        return RUN_BYTES if nbytes and self.used + nbytes > RUN_BYTES else 0

    def region(self, nbytes: int) -> torch.Tensor:
        new = self.new_bytes(nbytes)
        self.allocated += new
        if nbytes > RUN_BYTES:
            return self._allocate(nbytes)
        if new:
            self.shared, self.used = self._allocate(RUN_BYTES), 0
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        at = self.used
        self.used += -(-nbytes // self.ALIGN) * self.ALIGN
        return self.shared[at:at + nbytes]

    def pin(self, nbytes: int) -> bool:
        """Whether a new buffer of ``nbytes`` is page-locked."""
        if not self.pinned:
            return False
        owned, active = pinned_pool()
        return owned - active >= nbytes or _GROWN[0] + max(0, owned - self._pool_start) + nbytes <= self.pinned_cap

    def done(self) -> None:
        """The read is over: what it grew the pool by (``grown``) counts against the cap of the reads after it."""
        if self.pinned:
            self.grown = max(0, pinned_pool()[0] - self._pool_start)
            _GROWN[0] += self.grown

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.pinned and pinned_pool()[0] - self._pool_start >= self.settle_after:
            self._settle()
            self.settled += 1
        pin = self.pin(nbytes)
        self.pageable += 0 if pin or not self.pinned else nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def pinned_pool() -> Tuple[int, int]:
    """(bytes of page-locked blocks torch's host allocator owns, bytes of those in use); (0, 0) where torch does not
    say."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if not (stats and torch.cuda.is_available()):
        return 0, 0
    s = stats()
    return s.get("allocated_bytes.current", 0), s.get("active_bytes.current", 0)


def _tensors(run: List[tuple], start: int, region: torch.Tensor, reads: list) -> Iterator[Tuple[str, torch.Tensor]]:
    for future in reads:
        future.result()
    for name, dtype, shape, s, e in run:
        yield name, region[s - start:e - start].view(dtype).reshape(shape)
