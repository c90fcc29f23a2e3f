"""The backend decision table: GPU x flags x shapes, including the one-line errors."""

import pytest

from sglang_mxfp8 import resolver as r

H200 = r.GpuSpec("NVIDIA H200", 90)
A100 = r.GpuSpec("NVIDIA A100", 80)
L40 = r.GpuSpec("NVIDIA L40S", 89)
B200 = r.GpuSpec("NVIDIA B200", 100)
RTX = r.GpuSpec("NVIDIA RTX PRO 6000", 120)
THOR = r.GpuSpec("NVIDIA Thor", 110)


@pytest.mark.parametrize(
    "gpu,flag,n,k,kernel,fallback",
    [
        (H200, "auto", 5120, 2048, r.HOPPER_FLASHINFER, None),
        (H200, "auto", 5120, 2080, r.HOPPER_TRITON, "auto"),
        (H200, "triton", 5120, 2048, r.HOPPER_TRITON, None),
        (H200, "flashinfer_trtllm", 5120, 2048, r.HOPPER_FLASHINFER, None),
        (H200, "flashinfer_trtllm", 5120, 2080, r.HOPPER_TRITON, "flashinfer_trtllm"),  # K % 128
        (H200, "flashinfer_trtllm", 5000, 2048, r.HOPPER_TRITON, "flashinfer_trtllm"),  # N % 64
        (B200, "auto", 5120, 2048, r.SM100_FLASHINFER_CUTLASS, None),
        (B200, "flashinfer_trtllm", 5120, 2048, r.SM100_FLASHINFER_TRTLLM, None),
        (B200, "flashinfer_trtllm", 5120, 2080, r.SM100_FLASHINFER_CUTLASS, "flashinfer_trtllm"),  # K % 256
        (B200, "flashinfer_cutlass", 5120, 2048, r.SM100_FLASHINFER_CUTLASS, None),
        (B200, "flashinfer_cutlass", 64, 2048, r.SGLANG_TRITON_MXFP8, "flashinfer_cutlass"),
        (B200, "triton", 5120, 2048, r.SGLANG_TRITON_MXFP8, None),
        (RTX, "auto", 5120, 2048, r.SM100_FLASHINFER_CUTLASS, None),
        (RTX, "triton", 5120, 2048, r.SGLANG_TRITON_MXFP8, None),
        (THOR, "auto", 5120, 2048, r.SM100_FLASHINFER_CUTLASS, None),
    ],
)
def test_dense_table(gpu, flag, n, k, kernel, fallback):
    choice = r.resolve_dense(gpu, flag, flashinfer=True, n=n, k=k)
    assert choice.kernel == kernel
    assert choice.fallback_from == fallback
    assert choice.reason


def test_trtllm_needs_bf16_output_and_falls_back_with_a_reason():
    c = r.resolve_dense(B200, "flashinfer_trtllm", flashinfer=True, n=5120, k=2048, bf16=False)
    assert c.kernel == r.SM100_FLASHINFER_CUTLASS and c.fallback_from == "flashinfer_trtllm" and "bf16" in c.reason


def test_auto_never_picks_trtllm_gen_on_blackwell():
    # mm_mxfp8's trtllm backend needs the weight shuffled in place; like vLLM, auto leaves it opt-in
    for gpu in (B200, RTX, THOR):
        for n, k in ((5120, 2048), (2048, 4096), (14336, 4096), (256, 256)):
            assert r.resolve_dense(gpu, "auto", flashinfer=True, n=n, k=k).kernel != r.SM100_FLASHINFER_TRTLLM


def test_without_flashinfer_auto_falls_to_triton_and_explicit_flashinfer_fails():
    assert r.resolve_dense(H200, "auto", flashinfer=False, n=512, k=512).kernel == r.HOPPER_TRITON
    assert r.resolve_dense(B200, "auto", flashinfer=False, n=512, k=512).kernel == r.SGLANG_TRITON_MXFP8
    with pytest.raises(r.Mxfp8ConfigError, match="FlashInfer is not installed"):
        r.resolve_dense(H200, "flashinfer_trtllm", flashinfer=False, n=512, k=512)


@pytest.mark.parametrize(
    "gpu,flag,match",
    [
        (H200, "flashinfer_cutlass", r"--fp8-gemm-backend flashinfer_cutlass cannot run MXFP8 on NVIDIA H200 \(SM90\).*valid choices on this GPU: auto, triton, flashinfer_trtllm"),
        (H200, "deep_gemm", r"--fp8-gemm-backend deep_gemm .*not an MXFP8 dense backend"),
        (RTX, "flashinfer_trtllm", r"RTX PRO 6000 \(SM120\).*auto, triton, flashinfer_cutlass"),
        (A100, "auto", r"NVIDIA A100 \(SM80\) has none"),
        (L40, "auto", r"NVIDIA L40S \(SM89\) has none"),
    ],
)
def test_dense_errors_are_one_line_and_name_flag_gpu_choices(gpu, flag, match):
    with pytest.raises(r.Mxfp8ConfigError, match=match) as e:
        r.resolve_dense(gpu, flag, flashinfer=True, n=512, k=512)
    assert "\n" not in str(e.value)


def test_dense_k_not_multiple_of_32_names_layer():
    with pytest.raises(r.Mxfp8ConfigError, match="model.layers.0.mlp.down_proj: K=100"):
        r.resolve_dense(H200, "auto", flashinfer=True, n=256, k=100, layer="model.layers.0.mlp.down_proj")


@pytest.mark.parametrize(
    "gpu,flag,kernel",
    [
        (H200, "auto", r.HOPPER_TRITON_MOE),
        (H200, "triton", r.HOPPER_TRITON_MOE),
        (H200, "flashinfer_cutlass", r.HOPPER_FLASHINFER_CUTLASS_MOE),
        (B200, "flashinfer_cutlass", r.SM100_FLASHINFER_CUTLASS_MOE),
        (B200, "auto", r.SGLANG_NATIVE_MOE),
        (B200, "flashinfer_trtllm_routed", r.SGLANG_NATIVE_MOE),
        (B200, "cutlass", r.SGLANG_NATIVE_MOE),
    ],
)
def test_moe_table(gpu, flag, kernel):
    assert r.resolve_moe(gpu, flag, flashinfer=True, hidden=2048, intermediate=768).kernel == kernel


@pytest.mark.parametrize(
    "gpu,flag,match",
    [
        (H200, "flashinfer_trtllm", r"--moe-runner-backend flashinfer_trtllm cannot run MXFP8 on NVIDIA H200 \(SM90\).*auto, triton, flashinfer_cutlass"),
        (B200, "triton", r"B200 \(SM100\).*auto, cutlass, flashinfer_cutlass, flashinfer_trtllm, flashinfer_trtllm_routed"),
        (RTX, "auto", r"no MXFP8 MoE kernel exists for NVIDIA RTX PRO 6000 \(SM120\)"),
    ],
)
def test_moe_errors(gpu, flag, match):
    with pytest.raises(r.Mxfp8ConfigError, match=match):
        r.resolve_moe(gpu, flag, flashinfer=True, hidden=2048, intermediate=768)


@pytest.mark.parametrize("gpu,hidden,intermediate,tp,match", [
    (H200, 2048, 96, 1, r"experts: intermediate size 96 is not a multiple of 128, .*; keep this MoE layer BF16 "
                        r"\(modules_to_not_convert\)$"),
    # a tensor-parallel share: the splits that would work
    (H200, 2048, 192, 4, r"intermediate size 768 split 4 ways .* leaves 192 per rank, not a multiple of 128, "
                         r".*--tp / --ep-size = 1, 2, 3 or 6 "),
    # no split helps a size that is not a multiple of 128 whole
    (H200, 2048, 48, 2, r"intermediate size 96, 48 per rank, is not a multiple of 128, .*keep this MoE layer BF16"),
    (B200, 2048, 48, 16, r"intermediate size 768 split 16 ways .* leaves 48 per rank, not a multiple of 32, the MXFP8 "
                         r"scale block; .* = 1, 2, 3, 4, 6, 8 or 12 "),
    (B200, 2050, 768, 2, r"hidden size 2050 is not a multiple of 32, the MXFP8 scale block; MXFP8 MoE cannot hold it "
                         r"on NVIDIA B200"),
])
def test_moe_sizes_the_kernels_cannot_hold(gpu, hidden, intermediate, tp, match):
    with pytest.raises(r.Mxfp8ConfigError, match=match):
        r.resolve_moe(gpu, "auto", flashinfer=True, hidden=hidden, intermediate=intermediate, tp=tp)


def test_a_hopper_moe_share_of_128_rows_runs():
    assert r.resolve_moe(H200, "auto", flashinfer=True, hidden=2048, intermediate=128, tp=6).kernel == r.HOPPER_TRITON_MOE
