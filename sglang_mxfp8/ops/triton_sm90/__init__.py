"""Triton kernels for MXFP8 weights on Hopper, one module per kernel family (fp32 accumulate throughout):

- ``act_quant``: activations to e4m3 with one float32 scale per 128-element group (the W8A8 kernels' input);
- ``dense_w8a8``: the W8A8 GEMM on FP8 tensor cores; ``dense_w8a16``: the weight-only GEMM for small batches;
- ``moe_sorted``: the W8A8 fused MoE in SGLang's sorted-token layout, K and N tails masked;
- ``splitk_w8a8``: the W8A8 GEMM for up to 128 tokens, K split across programs;
- ``gemv``: one-token GEMV and MoE on CUDA cores (batch-1 decode);
- ``moe_segments``: the scatter, quantize and gather glue around DeepGEMM's grouped GEMM;
- ``silu_and_mul``: the MoE activation over either w13 order (SGLang's CUTLASS grouped MoE on [up; gate] weights).
"""
