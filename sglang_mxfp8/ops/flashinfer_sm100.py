"""Host side of the Blackwell-native MXFP8 kernels on FlashInfer's real API (SM100/103/107; cutlass dense also SM110/12x).

Written against FlashInfer 0.6.7.post3 (``mm_mxfp8``, ``mxfp8_quantize``, ``cutlass_fused_moe`` with
``use_mxfp8_act_scaling``). No SM100 GPU was available to us: layouts and refit behaviour are verified
on CPU (tests/test_blackwell.py; the kernels: kernels/linear/flashinfer_sm100.py, kernels/moe/flashinfer_cutlass.py), including an emulated forward that undoes every prepared layout.

Refit rules as on Hopper: the loader's parameters keep checkpoint shapes; swizzled scales live in
buffers allocated once and rewritten in place; the trtllm GEMM's row shuffle is applied to the FP8
weight in place (its storage is allocated padded to a multiple of 128 rows at creation, the
parameter being a view of the first N rows), tracked per row so it is never applied twice.
"""

from __future__ import annotations

import torch

from ..format import layouts
from ..format.numerics import MX_BLOCK
from ..format.refit import PartialReloadError, _row_fingerprints

SM100_ONLY_QUANTIZE = (100, 103, 107, 110, 120, 121)


def require_mxfp8_quantize_kernel(capability, gpu_name: str) -> None:
    """FlashInfer's CUDA ``mxfp8_quantize`` compiles to an empty body below SM100 and returns garbage."""
    major, minor = capability
    if major * 10 + minor not in SM100_ONLY_QUANTIZE:
        raise RuntimeError(
            f"FlashInfer mxfp8_quantize has no kernel body for SM{major}{minor} ({gpu_name}) and would return "
            "uninitialised memory; use the Hopper paths (--fp8-gemm-backend triton or flashinfer_trtllm)"
        )


def mxfp8_quantize_activation(x: torch.Tensor, layout: str):
    """x [M, K] bf16 -> (e4m3 [M, K], 1-D swizzled uint8 scales) with FlashInfer's SM100 kernel."""
    from flashinfer import SfLayout, mxfp8_quantize

    require_mxfp8_quantize_kernel(torch.cuda.get_device_capability(x.device), torch.cuda.get_device_name(x.device))
    sf_layout = {"8x4": SfLayout.layout_8x4, "128x4": SfLayout.layout_128x4}[layout]
    return mxfp8_quantize(x, is_sf_swizzled_layout=True, alignment=MX_BLOCK, sf_swizzle_layout=sf_layout)


class InPlaceRowShuffle:
    """Applies trtllm-gen's 32-row-block shuffle to a padded FP8 weight in place, once per load."""

    def __init__(self, storage: torch.Tensor, logical_rows: int, name: str):
        self.storage, self.n, self.name = storage, logical_rows, name
        rows = storage.shape[0]
        self.src = layouts.shuffle_source_indices(rows, storage.device)
        self._sig_done = torch.zeros(rows, dtype=torch.int64, device=storage.device)
        self._sig_before = torch.zeros_like(self._sig_done)
        self._ever = False

    def refresh(self) -> int:
        """Shuffle the blocks the loader rewrote; returns how many rows were shuffled."""
        w = self.storage.view(torch.uint8)
        rows = w.shape[0]
        cur = _row_fingerprints(w, torch.empty_like(self._sig_done))
        if self._ever:
            touched = cur != self._sig_done
            stale = ~touched & (self._sig_done != self._sig_before)
            touched[self.n :] = False  # padding rows are never loaded
            stale[self.n :] = False
            blk = touched.view(-1, layouts.SHUFFLE_BLOCK).any(-1)
            mixed = blk & stale.view(-1, layouts.SHUFFLE_BLOCK).any(-1)
            if bool(mixed.any()):
                b = int(mixed.nonzero()[0])
                raise PartialReloadError(
                    f"{self.name}: rows {b * 32}..{b * 32 + 31} were partly reloaded inside one 32-row shuffle block; "
                    "reload the whole layer"
                )
        else:
            blk = torch.ones(rows // layouts.SHUFFLE_BLOCK, dtype=torch.bool, device=w.device)
        if not bool(blk.any()):
            return 0
        rows_todo = blk.repeat_interleave(layouts.SHUFFLE_BLOCK)
        w[self.n :][rows_todo[self.n :]] = 0  # padding back to canonical zeros before re-shuffling
        _row_fingerprints(w, cur)
        self._sig_before[rows_todo] = cur[rows_todo]
        for b in blk.nonzero().flatten().tolist():  # 32-row blocks: temporaries stay tiny
            r0 = b * layouts.SHUFFLE_BLOCK
            w[r0 : r0 + 32] = w[self.src[r0 : r0 + 32]]
        _row_fingerprints(w, cur)
        self._sig_done[rows_todo] = cur[rows_todo]
        self._ever = True
        return int(rows_todo.sum())


def pad_weight_storage(layer: torch.nn.Module, n: int, k: int) -> torch.Tensor:
    """Re-home ``layer.weight`` ([n, k]) as a view of zeroed [ceil(n/128)*128, k] storage (done once, at creation)."""
    n_pad = -(-n // 128) * 128
    storage = torch.zeros((n_pad, k), dtype=layer.weight.dtype, device=layer.weight.device)
    layer.weight.data = storage[:n]
    return storage


class CutlassMoeScales:
    """Per-expert 128x4-swizzled scales packed as int32, the ``quant_scales`` of MXFP8 ``cutlass_fused_moe``.

    fc1: [E, align128(2I), align128(H)/32/4] int32, fc2: [E, align128(H), align128(I)/32/4] int32,
    global scales 1.0 (E8M0 block scales carry everything). Rewritten in place after every load.
    """

    def __init__(self, experts: int, hidden: int, inter: int, device):
        def buf(rows, k):
            n = layouts.swizzled_len(rows, k // MX_BLOCK, 128)
            return torch.zeros((experts, n), dtype=torch.uint8, device=device)

        self.shapes = ((2 * inter, hidden), (hidden, inter))
        self.fc1, self.fc2 = buf(2 * inter, hidden), buf(hidden, inter)
        self.ones = torch.ones(experts, dtype=torch.float32, device=device)

    def refresh(self, w13_scale: torch.Tensor, w2_scale: torch.Tensor) -> None:
        for out, s in ((self.fc1, w13_scale), (self.fc2, w2_scale)):
            for e in range(s.shape[0]):
                out[e].copy_(layouts.swizzle_128x4(s[e]))

    def quant_scales(self):
        (r1, k1), (r2, k2) = self.shapes
        fc1 = self.fc1.view(torch.int32).view(self.fc1.shape[0], -(-r1 // 128) * 128, -1)
        fc2 = self.fc2.view(torch.int32).view(self.fc2.shape[0], -(-r2 // 128) * 128, -1)
        return [fc1, self.ones, fc2, self.ones]


def cutlass_mxfp8_moe(x, topk_weights, topk_ids, w13, w2, scales: CutlassMoeScales, *, tp_size=1, tp_rank=0,
                      ep_size=1, ep_rank=0):
    """FlashInfer CUTLASS fused MoE, MXFP8 weights x MXFP8 activations; w13 is [up; gate].

    Autotuning is capped at the batch in hand (next power of two, at most 8192), as SGLang does for
    its ModelOpt CUTLASS MoE, so CUDA-graph batch sizes never trigger tuning for larger shapes.
    """
    from flashinfer.fused_moe import cutlass_fused_moe

    a, a_sf = mxfp8_quantize_activation(x.contiguous(), "128x4")
    out = torch.empty_like(x)
    cutlass_fused_moe(
        input=a, token_selected_experts=topk_ids.to(torch.int32), token_final_scales=topk_weights.float(),
        fc1_expert_weights=w13, fc2_expert_weights=w2, output_dtype=x.dtype, quant_scales=scales.quant_scales(),
        input_sf=a_sf, use_mxfp8_act_scaling=True, tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size,
        ep_rank=ep_rank, output=out, tune_max_num_tokens=min(8192, 1 << max(0, x.shape[0] - 1).bit_length()),
    )
    return out
