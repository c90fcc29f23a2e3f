"""The value checks of a weight update whose tensors are views of one flat tensor (a trainer's flattened bucket) in one
Triton launch: one program per tensor reads its bytes and flags a NaN e4m3 byte, a NaN scale byte (255), or a NaN or
Inf in a BF16 / FP16 / FP32 tensor. Checked one by one, each tensor cost a few kernel launches, and an MXFP8 update
carries a scale tensor beside every weight. Bytes are read one by one, so a tensor may start at any byte of the
bucket (a scale of odd length before it); a float's exponent is read from its two upper bytes (little-endian)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

E4M3, SCALE, BF16, FP16, FP32 = range(5)  # what a tensor's bytes hold (the kernel compares these numbers)
KINDS = {torch.float8_e4m3fn: E4M3, torch.uint8: SCALE, torch.bfloat16: BF16, torch.float16: FP16,
         torch.float32: FP32}
CHUNK = 1024  # elements a program reads at a time


@triton.jit
def _bad_kernel(flat_ptr, starts_ptr, counts_ptr, kinds_ptr, bad_ptr, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    start = tl.load(starts_ptr + i)  # int64 byte offset
    count = tl.load(counts_ptr + i)  # elements
    kind = tl.load(kinds_ptr + i)
    width = tl.where(kind >= 4, 4, tl.where(kind >= 2, 2, 1))  # bytes per element: FP32; BF16, FP16; E4M3, SCALE
    found = tl.zeros((CHUNK,), dtype=tl.int32)
    for first in range(0, count, CHUNK):
        j = first + tl.arange(0, CHUNK).to(tl.int64)
        ok = j < count
        top = start + j * width + width - 1  # the byte holding the sign and the exponent's upper bits
        hi = tl.load(flat_ptr + top, mask=ok, other=0).to(tl.int32)
        lo = tl.load(flat_ptr + top - 1, mask=ok & (width > 1), other=0).to(tl.int32)
        e4m3 = (hi & 0x7F) == 0x7F
        scale = hi == 0xFF
        wide = ((hi & 0x7F) == 0x7F) & ((lo & 0x80) == 0x80)  # BF16 and FP32: eight exponent bits all set
        half = (hi & 0x7C) == 0x7C  # FP16: five exponent bits all set
        bad = tl.where(kind == 0, e4m3, tl.where(kind == 1, scale, tl.where(kind == 3, half, wide)))
        found = found | (bad & ok).to(tl.int32)
    tl.store(bad_ptr + i, tl.max(found, axis=0))


def regions(tensors: List[torch.Tensor], flat: torch.Tensor) -> Tuple[List[int], List[int], List[int]]:
    """Byte offsets in ``flat`` (uint8, contiguous), element counts and kinds of ``tensors``, each a contiguous view
    of ``flat``'s storage of a dtype in :data:`KINDS`."""
    base = flat.storage_offset()
    starts, counts, kinds = [], [], []
    for t in tensors:
        starts.append(t.storage_offset() * t.element_size() - base)
        counts.append(t.numel())
        kinds.append(KINDS[t.dtype])
    return starts, counts, kinds


def bad_tensors(flat: torch.Tensor, tensors: List[torch.Tensor]) -> torch.Tensor:
    """Per tensor of ``tensors`` (views of ``flat``'s storage), whether a value is refused, as int32 on the device:
    one launch, no host sync."""
    starts, counts, kinds = regions(tensors, flat)
    device = flat.device
    bad = torch.empty(len(tensors), dtype=torch.int32, device=device)
    if tensors:
        _bad_kernel[(len(tensors),)](
            flat, torch.tensor(starts, dtype=torch.int64, device=device),
            torch.tensor(counts, dtype=torch.int64, device=device), torch.tensor(kinds, dtype=torch.int32,
                                                                                 device=device),
            bad, CHUNK=CHUNK)
    return bad


def fits(flat: torch.Tensor, checked: list) -> bool:
    """Whether :func:`first_refused` can check ``checked`` (``format.checkpoint.checked_values``): contiguous views of
    ``flat``'s storage (uint8, contiguous) of the dtypes it reads."""
    ptr = flat.untyped_storage().data_ptr()
    return flat.dtype == torch.uint8 and flat.is_contiguous() and all(
        t.dtype in KINDS and t.is_contiguous() and t.untyped_storage().data_ptr() == ptr for _, _, t in checked)


def first_refused(flat: torch.Tensor, checked: list) -> Optional[str]:
    """"name: what" of the first tensor of ``checked`` whose values are refused, or None: one launch, one host sync."""
    if not checked:
        return None
    bad = bad_tensors(flat, [t for _, _, t in checked]).nonzero()
    if bad.numel() == 0:
        return None
    name, what, _ = checked[int(bad[0, 0])]
    return f"{name}: {what}"
