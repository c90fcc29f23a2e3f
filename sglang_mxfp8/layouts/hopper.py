"""Hopper block scales: MXFP8 weights converted in place, idempotently and refit-safe, to power-of-two 1x128 or
128x128 block scales.

SGLang's loader writes checkpoint tensors (e4m3 weight, uint8 [rows, K/32] scales) into the same
parameters on every load and then runs post-load processing again. We convert the weight *in place*
(no second FP8 copy) and write the float32 block scales into a buffer allocated once, so storage
never moves and captured CUDA graphs stay valid.

To know what it already did, the converter keeps per-row fingerprints of the weight as converted
(and as loaded), and of the scale row. On each call a row is

- *stale-converted* if it still holds the bytes we wrote and they differ from what was loaded:
  nothing was reloaded there, so it is left alone (running twice never converts twice);
- *fresh* otherwise (reloaded, or a row the conversion did not change): converted from scratch.

A 128x128 block mixing the two kinds (a reload of part of a block), or a scale row reloaded
without its weight, cannot be made right from what is in memory and raises
:class:`PartialReloadError`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..format.checkpoint import refuse_flagged_rows, validate_loaded
from ..format.numerics import MX_BLOCK, block_exponents, count_shifted, exponents_to_scales, shift_to_block_exponents
from .fingerprints import PartialReloadError, row_fingerprints

_CONVERT_CHUNK_ELEMENTS = 1 << 24  # a whole-weight conversion's step: ~0.4 GB of float32 temporaries at most


@dataclass
class ConversionStats:
    converted_rows: int
    changed_elements: int
    check_s: float = 0.0  # validation and reload fingerprints, GPU work finished
    layout_s: float = 0.0  # the conversion into the kernel layout, GPU work finished


class BlockScaleConverter:
    """Owns the derived buffers of one weight ``[G, R, K]`` (G = experts, or 1 for a linear layer)."""

    def __init__(self, groups: int, rows: int, k: int, block_rows: int, device, name: str):
        if k % MX_BLOCK:
            raise ValueError(f"{name}: K={k} is not a multiple of {MX_BLOCK}")
        self.name = name
        self.groups, self.rows, self.k, self.block_rows = groups, rows, k, block_rows
        nb = -(-rows // block_rows)
        kb = -(-k // 128)
        self.block_scale = torch.ones((groups, nb, kb), dtype=torch.float32, device=device)
        self._exps = torch.zeros((groups, nb, kb), dtype=torch.int32, device=device)
        n = groups * rows
        self._sig_converted = torch.zeros(n, dtype=torch.int64, device=device)
        self._sig_loaded = torch.zeros(n, dtype=torch.int64, device=device)
        self._sig_scale = torch.zeros(n, dtype=torch.int64, device=device)
        self._ever = False

    def refresh(self, weight: torch.Tensor, scale: torch.Tensor) -> ConversionStats:
        """Bring ``weight`` (in place) and ``self.block_scale`` up to date with what was loaded."""
        start = time.perf_counter()
        w = weight.view(self.groups * self.rows, self.k)
        s = scale.view(self.groups * self.rows, self.k // MX_BLOCK)
        nonzero, cur, cur_scale = self._checked(w, s)
        if self._ever:
            untouched = cur == self._sig_converted
            noop = self._sig_converted == self._sig_loaded  # conversion left these bytes as loaded
            scale_moved = cur_scale != self._sig_scale
            stale = untouched & ~noop
            if bool((stale & scale_moved).any()):
                row = int((stale & scale_moved).nonzero()[0])
                raise PartialReloadError(
                    f"{self.name}: scale row {row} was reloaded but its weight row was not; "
                    "reload the weight and its scale together"
                )
            fresh = ~untouched | (noop & scale_moved)
        else:
            stale = torch.zeros_like(cur, dtype=torch.bool)
            fresh = ~stale
        if not bool(fresh.any()):  # (a host sync: the checks' GPU work is done)
            return ConversionStats(0, 0, time.perf_counter() - start)
        checked = time.perf_counter()

        br = self.block_rows
        nb = self._exps.shape[1]
        pad = nb * br - self.rows

        def blocks(mask):
            return (
                torch.nn.functional.pad(mask.view(self.groups, self.rows), (0, pad)).view(self.groups, nb, br).any(-1)
            )

        todo_blocks = blocks(fresh)
        mixed = todo_blocks & blocks(stale)
        if bool(mixed.any()):
            g, b = (int(v) for v in mixed.nonzero()[0])
            raise PartialReloadError(
                f"{self.name}: rows {b * br}..{(b + 1) * br - 1} (group {g}) were partly reloaded inside one "
                f"{br}x128 scale block; reload the whole layer (or every row of that block)"
            )

        if (pad == 0 or self.groups == 1) and bool(todo_blocks.all()):
            changed = self._convert_whole(w, s, nonzero)
        else:
            changed = self._convert_blocks(weight, scale, todo_blocks)
        converted = todo_blocks.repeat_interleave(br, dim=1)[:, : self.rows].reshape(-1)
        # torch.where, not masked assignment: a boolean index costs a host sync per tensor
        self._sig_loaded.copy_(torch.where(converted, cur, self._sig_loaded))
        self._sig_scale.copy_(torch.where(converted, cur_scale, self._sig_scale))
        self.block_scale.copy_(exponents_to_scales(self._exps))
        row_fingerprints(w, cur)
        self._sig_converted.copy_(torch.where(converted, cur, self._sig_converted))
        self._ever = True
        rows = int(converted.sum())  # (a host sync)
        return ConversionStats(rows, changed, checked - start, time.perf_counter() - checked)

    def _checked(self, w: torch.Tensor, s: torch.Tensor):
        """(nonzero blocks, weight row fingerprints, scale row fingerprints) of what was loaded, refusing NaN and
        missing scales; on a GPU one read of the weight (layouts.scan_triton), on the CPU the torch steps."""
        cur, cur_scale = torch.empty_like(self._sig_loaded), torch.empty_like(self._sig_scale)
        if w.is_cuda:
            from .scan_triton import scan_loaded

            nonzero, flags, scale_done = scan_loaded(w, s, cur, cur_scale)
            refuse_flagged_rows(flags, self.name)
            if not scale_done:
                row_fingerprints(s, cur_scale)
            return nonzero, cur, cur_scale
        return validate_loaded(w, s, self.name), row_fingerprints(w, cur), row_fingerprints(s, cur_scale)

    def _convert_whole(self, w: torch.Tensor, s: torch.Tensor, nonzero: torch.Tensor) -> int:
        """Every block reloaded (a whole refit), row blocks aligned with the groups: ``w [G * R, K]`` converted as one
        matrix (on a GPU in one kernel; on the CPU in steps of whole row blocks, each step's rows a view written in
        place); one host sync at the end."""
        br = self.block_rows
        exps = self._exps.view(-1, self._exps.shape[-1])
        if w.is_cuda:  # one Triton pass over the weight, bit for bit the steps below (tests/gpu checks every byte)
            from .hopper_triton import to_block_scales_

            return int(to_block_scales_(w, s, nonzero, br, exps))
        step = max(1, _CONVERT_CHUNK_ELEMENTS // (br * self.k)) * br
        changed = torch.zeros((), dtype=torch.int64, device=w.device)
        for r0 in range(0, w.shape[0], step):
            q, sc = w[r0:r0 + step], s[r0:r0 + step]
            e = block_exponents(q, sc, br, nonzero[r0:r0 + step])
            changed += count_shifted(q, sc, e, br)
            exps[r0 // br:r0 // br + e.shape[0]] = e
        return int(changed)

    def _convert_blocks(self, weight: torch.Tensor, scale: torch.Tensor, todo_blocks: torch.Tensor) -> int:
        """The blocks ``todo_blocks [G, ceil(R / block_rows)]`` marks, group by group (a partial reload, or rows that
        do not fill their last block)."""
        br = self.block_rows
        changed = 0
        # rows are gathered and written back as bytes: torch before 2.10 has no boolean-mask indexing of e4m3 on CPU
        wg = weight.view(self.groups, self.rows, self.k).view(torch.uint8)
        sg = scale.view(self.groups, self.rows, self.k // MX_BLOCK)
        chunk = max(br, (4096 // br) * br)
        for g in range(self.groups):
            for r0 in range(0, self.rows, chunk):
                r1 = min(self.rows, r0 + chunk)
                b0, b1 = r0 // br, -(-r1 // br)
                todo = todo_blocks[g, b0:b1]
                if not bool(todo.any()):
                    continue
                rows_mask = todo.repeat_interleave(br)[: r1 - r0]
                q = wg[g, r0:r1][rows_mask].view(weight.dtype)
                sc = sg[g, r0:r1][rows_mask]
                exps = block_exponents(q, sc, br)
                changed += shift_to_block_exponents(q, sc, exps, br)
                wg[g, r0:r1][rows_mask] = q.view(torch.uint8)
                self._exps[g, b0:b1][todo] = exps
        return changed

