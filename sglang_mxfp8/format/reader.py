"""A safetensors checkpoint read for a refit: each tensor read by a few threads, ahead of the loader, straight from the
file into page-locked host memory (one copy out of the page cache; the loader's copy to the GPU is then a DMA at the
link's speed), instead of into pageable memory that the copy to the GPU stages again. Tensors come out per file in
name order, as SGLang's own iterators give them. Each tensor has its own buffer (torch's pinned-memory cache reuses
them once the loader lets go), so a loader that keeps a tensor keeps it whole."""

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
AHEAD_BYTES = 1 << 30  # read ahead of the loader at most this much (page-locked)


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


def _read(fd: int, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple, pinned: bool) -> torch.Tensor:
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    view, done = memoryview(buf.numpy()), 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"file ended {nbytes - done} bytes early reading a tensor at offset {offset}")
        done += n
    return buf.view(dtype).reshape(shape)


def read_tensors(files: Iterable[str], pinned: bool, threads: int = READ_THREADS,
                 ahead_bytes: int = AHEAD_BYTES) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of ``files``, per file in name order; ``pinned``: in page-locked memory (needs a
    GPU)."""
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mxfp8-read") as pool:
        for path in files:
            entries, data = tensor_entries(path)
            fd = os.open(path, os.O_RDONLY)
            try:
                pending: Deque[tuple] = collections.deque()
                queued = 0
                for name, dtype, shape, start, end in entries:
                    while pending and queued + (end - start) > ahead_bytes:
                        done_name, future, nbytes = pending.popleft()
                        queued -= nbytes
                        yield done_name, future.result()
                    pending.append((name, pool.submit(_read, fd, data + start, end - start, dtype, shape, pinned),
                                    end - start))
                    queued += end - start
                while pending:
                    done_name, future, _ = pending.popleft()
                    yield done_name, future.result()
            finally:  # a loader that stopped early (a refused refit): reads not started dropped, running ones end
                for _, future, _ in pending:
                    if not future.cancel():
                        future.exception()
                os.close(fd)
