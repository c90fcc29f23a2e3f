"""Tensor-parallel shards of MXFP8 layers, converted per rank as each TP rank does after loading.

SGLang narrows the e4m3 weight and its uint8 [N, K/32] scales along the same dimension; each rank
then converts its shard to Hopper block scales. Splits that fall inside a 128-wide (or 128-row)
block must still reproduce the unsharded MXFP8 values.
"""

import pytest
import torch

from sglang_mxfp8.format.numerics import convert_to_block_scales, dequantize_block_fp8, dequantize_mxfp8, quantize_mxfp8
from sglang_mxfp8.layouts.hopper import BlockScaleConverter


def _shard(q, s, dim, tp, rank):
    if dim == 0:
        n = q.shape[0] // tp
        return q[rank * n : (rank + 1) * n], s[rank * n : (rank + 1) * n]
    k = q.shape[1] // tp
    assert k % 32 == 0, "SGLang refuses K shards that split a 1x32 block (validate_block_quant_shapes)"
    return q[:, rank * k : (rank + 1) * k], s[:, rank * k // 32 : (rank + 1) * k // 32]


@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize(
    "n,k,dim",
    [(5120, 2048, 0), (2048, 4096, 1), (1088, 1024, 0), (384, 1536, 1), (256, 1280, 1)],
    # (1088/2 = 544 rows: shard boundary inside a 128-row block; 1536/4 = 384 and 1280/4 = 320
    #  columns: K shards that end inside a 128-column group)
)
def test_per_rank_conversion_reproduces_unsharded_values(n, k, dim, tp, block_rows):
    g = torch.Generator().manual_seed(n + k + tp)
    q, s = quantize_mxfp8(torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g) * 0.5))
    full = dequantize_mxfp8(q, s)
    parts = []
    for rank in range(tp):
        qs, ss = _shard(q, s, dim, tp, rank)
        qs = qs.clone()
        scales, _ = convert_to_block_scales(qs, ss.contiguous(), block_rows)
        parts.append(dequantize_block_fp8(qs, scales, block_rows))
    got = torch.cat(parts, dim=dim)
    rel = ((got - full).norm() / full.norm()).item()
    assert rel < (1e-6 if block_rows == 1 else 5e-5), rel


def test_expert_parallel_shard_is_a_group_slice():
    e, rows, k = 8, 256, 512
    q, s = quantize_mxfp8(torch.randn(e, rows, k))
    local = slice(4, 8)  # ep_size 2, rank 1 owns experts 4..7
    conv = BlockScaleConverter(4, rows, k, 128, "cpu", "experts.w13")
    w = q[local].clone()
    conv.refresh(w, s[local].contiguous())
    for i in range(4):
        ref = dequantize_mxfp8(q[4 + i], s[4 + i])
        got = dequantize_block_fp8(w[i], conv.block_scale[i], 128)
        assert ((got - ref).norm() / ref.norm()).item() < 5e-5
