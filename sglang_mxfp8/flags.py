"""SGLang's two backend flags as this package reads them, importable without torch (the CLI's help and argument
errors must not wait for torch)."""

DENSE_FLAG = "--fp8-gemm-backend"
MOE_FLAG = "--moe-runner-backend"
DENSE_FLAGS = ("auto", "triton", "flashinfer_trtllm", "flashinfer_cutlass")
MOE_FLAGS = ("auto", "triton", "flashinfer_cutlass", "flashinfer_trtllm", "flashinfer_trtllm_routed", "cutlass")
# the command our users copy: FlashInfer's dense GEMM and fused MoE on Blackwell, our Hopper kernels under them
RECOMMENDED_FLAGS = f"{DENSE_FLAG} flashinfer_trtllm {MOE_FLAG} flashinfer_cutlass"

DENSE_HELP = ("dense MXFP8 GEMM backend, as SGLang's flag: auto, flashinfer_trtllm (FlashInfer's GEMM, ours on "
              "Hopper), flashinfer_cutlass (Blackwell), triton")
MOE_HELP = ("MoE runner backend, as SGLang's flag: auto, flashinfer_cutlass (FlashInfer's fused MoE), triton, "
            "flashinfer_trtllm / flashinfer_trtllm_routed / cutlass (Blackwell, SGLang's own)")
