"""Per-row fingerprints of a weight in memory: how an in-place layout tells the rows a load rewrote from the rows it
already converted, so post-load processing is idempotent and a partial reload is converted where it landed."""

from __future__ import annotations

import torch

_SIG_CHUNK_BYTES = 1 << 24


class PartialReloadError(RuntimeError):
    """A reload that an in-place layout cannot make right from what is in memory (part of a block, a scale without
    its weight)."""


def row_fingerprints(t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Weighted sums per row (int64) of a 2-D tensor's bytes, written into ``out``; chunked. Rows of a multiple of 4
    bytes are read as int32 words, each widened to int64 and times its own odd coefficient below 2**31: the product
    keeps every bit of the word (an int32 product would keep a changed top byte's low 8 bits only, and rows changed
    there collided about once in 2,000), so two rows that differ in one or two bytes never share a fingerprint; words
    rather than bytes keep a refit's post-processing near the weights' bytes."""
    b = t.contiguous().view(torch.uint8)
    r, width = b.shape
    if b.is_cuda and width % 32 == 0:  # one read, no temporaries; the same sums bit for bit
        from .scan_triton import fingerprint_rows

        return fingerprint_rows(b, out)
    if width % 4 == 0:
        words = b.view(torch.int32)
        coeff = (torch.arange(1, width // 4 + 1, device=b.device, dtype=torch.int64) * 2654435761 % (1 << 31)) | 1
        step = max(1, _SIG_CHUNK_BYTES // width)  # 16 MB of the weight a step: int64 temporaries of 32 MB
        for r0 in range(0, r, step):
            out[r0 : r0 + step] = (words[r0 : r0 + step].to(torch.int64) * coeff).sum(dim=1)
        return out
    coeff = torch.arange(1, width + 1, device=b.device, dtype=torch.int64) * 2654435761 % 1000003 + 1
    step = max(1, _SIG_CHUNK_BYTES // (8 * width))
    for r0 in range(0, r, step):
        out[r0 : r0 + step] = (b[r0 : r0 + step].to(torch.int64) * coeff).sum(dim=1)
    return out

