"""Float tensors for checking an MXFP8 quantizer byte for byte against format.numerics.quantize_mxfp8 (the Triton
quantizer: interpreted in tests/test_triton_cpu.py, on the GPU in tests/gpu/test_rl_weight_sync.py)."""

import torch


def quantize_cases(seed: int) -> list:
    """Float tensors an MXFP8 quantizer must get right: every BF16 and every FP16 bit pattern (NaN, +-Inf, +-0,
    subnormals) among random neighbours, every BF16 value as its block's first element beside normal draws of a third
    its magnitude, FP32 over 83 binary orders (scale exponents clamped at both ends) and FP32 subnormals, and blocks
    of BF16 or FP16 subnormals alone."""
    g = torch.Generator().manual_seed(seed)
    every_bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every_fp16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    first = torch.randn(65536, 32, generator=g) * every_bf16.float().abs().clamp(max=1e30)[:, None] / 3
    first[:, 0] = every_bf16.float()
    bf16_sub, fp16_sub = (torch.zeros(n, 32, dtype=dt) for n, dt in ((2048, torch.bfloat16), (1023, torch.float16)))
    bf16_sub[:, 0] = torch.arange(1, 2049, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    bf16_sub[:, 5] = -bf16_sub[:, 0] / 3
    fp16_sub[:, 0] = torch.arange(1, 1024, dtype=torch.int32).to(torch.int16).view(torch.float16)
    fp16_sub[:, 7] = -fp16_sub[:, 0] / 3
    return [every_bf16[torch.randperm(65536, generator=g)].reshape(-1, 64), first.bfloat16(),
            every_fp16[torch.randperm(65536, generator=g)].reshape(-1, 128),
            torch.randn(300, 256, generator=g) * torch.logspace(-45, 38, 300)[:, None],
            torch.randn(64, 64, generator=g) * 1e-40, bf16_sub, fp16_sub,
            (torch.randn(3, 5, 96, generator=g) * 0.02).bfloat16()]
