"""The tile-config enumeration behind precompiling FlashInfer's SM90 block-scale GEMM.

The facts checked against: the kernels an H200 profile of the served Qwen3-30B-A3B-shaped model ran
at batch 1 (benchmarks/RESULTS.md, e2e): ``deep_gemm::fp8_gemm_kernel_swapAB<2048, 4096, 128, 16, 128,
1, 8, ...>`` and ``<5120, 2048, 128, 16, 128, 1, 8, ...>`` (N, K, block M, block N, block K, groups,
stages). tests/gpu checks the whole enumeration against the kernels FlashInfer compiles.
"""

import pytest

from conftest import set_server_args
from sglang_mxfp8.ops import flashinfer_sm90 as fs

H200_SMS = 132


@pytest.mark.parametrize("n,k", [(2048, 4096), (5120, 2048)])
def test_batch_one_config_matches_the_h200_profile(n, k):
    cfg = fs.tile_config(1, n, k, H200_SMS)
    assert cfg == fs.TileConfig(swap_ab=True, block_m=128, block_n=16, stages=8, multicast=1)
    assert fs.jit_kernel_name(n, k, cfg) == f"gemm_swapAB_{n}_{k}_128_16_128_1_81_8_1_Normal"


def test_swap_ab_below_32_tokens_and_multicast_from_1024():
    assert fs.tile_config(31, 5120, 2048, H200_SMS).swap_ab and not fs.tile_config(32, 5120, 2048, H200_SMS).swap_ab
    assert fs.tile_config(1023, 5120, 2048, H200_SMS).multicast == 1
    big = fs.tile_config(8192, 5120, 2048, H200_SMS)
    assert big.block_m == 128 and big.multicast == (2 if 5120 % (big.block_n * 2) == 0 else 1)
    assert fs.tile_config(64, 5120, 2048, H200_SMS).block_m == 64 and fs.tile_config(65, 5120, 2048, H200_SMS).block_m == 128


@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (14336, 4096), (4096, 14336)])
def test_every_config_up_to_max_m_has_its_smallest_m(n, k):
    configs = fs.configs_up_to(n, k, 8192, H200_SMS)
    assert 4 <= len(configs) <= 32  # a handful of kernels to compile per shape, not one per M
    for cfg, m in configs.items():
        assert fs.tile_config(m, n, k, H200_SMS) == cfg
        assert all(fs.tile_config(j, n, k, H200_SMS) != cfg for j in range(max(1, m - 64), m))
        assert fs._smem_bytes(cfg.stages, k, cfg.block_m, cfg.block_n, cfg.swap_ab) <= fs.SM90_SMEM_BYTES
    assert {fs.tile_config(m, n, k, H200_SMS) for m in range(1, 8193, 37)} <= set(configs)


def test_serving_max_tokens_from_sglang_server_args():
    import sglang.srt.layers.quantization.fp8  # noqa: F401 - SGLang's module first: its patch imports quant_methods

    from sglang_mxfp8.sglang.quant_methods import serving_max_tokens

    set_server_args(chunked_prefill_size=8192, max_prefill_tokens=16384, cuda_graph_max_bs=128)
    assert serving_max_tokens() == 8192
    set_server_args(chunked_prefill_size=-1, max_prefill_tokens=16384, cuda_graph_max_bs=128)
    assert serving_max_tokens() == 16384
    set_server_args(chunked_prefill_size=64, max_prefill_tokens=16384, cuda_graph_max_bs=256)
    assert serving_max_tokens() == 256
