"""The kernel registry: each (architecture, flag, shape) gets the plan its priority list says, batch band by batch
band; each kernel refuses on its own the shapes it cannot run; errors are one line naming the flag, GPU and choices."""

import sys
import types
from pathlib import Path

import pytest
import torch

from sglang_mxfp8 import platform
from sglang_mxfp8.ops import cublas_sm90
from sglang_mxfp8.kernels import registry as r
from sglang_mxfp8.kernels.base import LinearSpec, MoESpec, Mxfp8ConfigError
from sglang_mxfp8.platform import GpuSpec
from sglang_mxfp8.settings import Settings

H200 = GpuSpec("NVIDIA H200", 90)
A100 = GpuSpec("NVIDIA A100", 80)
L40 = GpuSpec("NVIDIA L40S", 89)
B200 = GpuSpec("NVIDIA B200", 100)
RTX = GpuSpec("NVIDIA RTX PRO 6000", 120)
THOR = GpuSpec("NVIDIA Thor", 110)
DEFAULT = Settings()
PACKAGE = Path(__file__).resolve().parents[1] / "sglang_mxfp8"


@pytest.fixture
def libraries(monkeypatch):
    """FlashInfer present, cuBLAS's block-scaled GEMM usable, DeepGEMM absent unless a test says otherwise."""
    monkeypatch.setattr(platform, "flashinfer_missing", lambda: None)
    monkeypatch.setattr(cublas_sm90, "unsupported", lambda: None)
    monkeypatch.setattr(platform, "deep_gemm_missing", lambda api, needs="": "deep_gemm does not import (test)")

    def set_deep_gemm(present: bool):
        monkeypatch.setattr(platform, "deep_gemm_missing", lambda api, needs="": None if present else "not installed")
        stand_in = types.ModuleType("deep_gemm")  # only what the registry asks of it; no kernel runs here
        stand_in.get_mk_alignment_for_contiguous_layout = lambda: 128
        monkeypatch.setitem(sys.modules, "deep_gemm", stand_in)
    return set_deep_gemm


def dense(gpu, flag, n, k, dtype=torch.bfloat16, settings=DEFAULT):
    return r.select_linear(LinearSpec("model.layers.0.mlp.down_proj", n, k, dtype), gpu, flag, settings)


G, D, C, F, T, W = "gemv", "deepgemm", "cublas", "flashinfer_sm90", "triton_w8a8", "weight_only"


@pytest.mark.parametrize("flag,n,k,deep_gemm,bands,fallback", [
    ("auto", 5120, 2048, True, {"1 token": G, "1024+ tokens": D, "other batches": F}, False),
    ("auto", 5120, 2048, False, {"1 token": G, "1024+ tokens": C, "other batches": F}, False),
    ("flashinfer_trtllm", 2048, 4096, True, {"1 token": G, "1024+ tokens": D, "other batches": F}, False),
    ("auto", 14336, 4096, False, {"1024+ tokens": C, "other batches": F}, False),  # up projection: no GEMV beside FI
    ("auto", 1088, 2048, False, {"other batches": F}, False),  # N % 128: no cuBLAS
    ("auto", 1088, 2048, True, {"1024+ tokens": D, "other batches": F}, False),
    ("auto", 5120, 2080, True, {"1-16 tokens": W, "other batches": T}, True),  # K % 128: FlashInfer cannot
    ("flashinfer_trtllm", 5000, 2048, False, {"1-16 tokens": W, "other batches": T}, True),  # N % 64
    ("triton", 5120, 2048, True, {"1 token": G, "1-16 tokens": W, "other batches": T}, False),
    ("triton", 14336, 4096, True, {"1 token": G, "other batches": T}, False),  # N > 5120: no weight-only
    ("triton", 1000, 2080, False, {"1-16 tokens": W, "other batches": T}, False),
])
def test_hopper_dense_plans(libraries, flag, n, k, deep_gemm, bands, fallback):
    libraries(deep_gemm)
    plan = dense(H200, flag, n, k)
    assert plan.bands() == bands and plan.fallback == fallback


def test_a_trial_kernel_is_timed_by_the_bench_but_in_no_plan_and_no_table(libraries):
    """The split-K W8A8 GEMM has no rows yet: ``bench layers --all-kernels`` times it beside FlashInfer's GEMM (whose
    128x128 scales it reads) at 2-128 tokens, while no flag's plan, priority list or README row holds it."""
    spec = LinearSpec("layer", 5120, 2048)
    timed = {e.kernel.name: (e, base.name) for e, base in r.candidates("linear", H200, spec)}
    entry, base = timed["splitk_w8a8"]
    assert entry.trial and base == F and entry.takes(2) and entry.takes(128) and not entry.takes(1) | entry.takes(129)
    for flag in ("auto", "flashinfer_trtllm", "triton"):
        assert "splitk_w8a8" not in dense(H200, flag, 5120, 2048).bands().values()
        assert "splitk_w8a8" not in [k.name for k in r.flag_kernels("linear", H200, flag)]
    assert "splitk_w8a8" not in r.markdown() and entry.measured == ()


def test_bench_all_kernels_gives_each_timed_kernel_the_buffers_a_plan_gives_it(libraries):
    """``bench layers --all-kernels`` builds each band kernel's layers with the plan it would have beside its base:
    the split-K GEMM finds its workspace for the layer's width (built on the base alone, its first call raised)."""
    from sglang_mxfp8.bench.layers import _plan_of
    from sglang_mxfp8.kernels.linear.splitk import SplitKW8A8

    spec = LinearSpec("layer", 4864, 2048)  # a width no other test builds
    entry, base = next((e, b) for e, b in r.candidates("linear", H200, spec) if e.kernel.name == "splitk_w8a8")
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(4864, 2048, dtype=torch.float8_e4m3fn), requires_grad=False)
    SplitKW8A8._workspaces.clear()
    _plan_of(entry, base, spec, H200).create_buffers(layer)
    [(key, space)] = SplitKW8A8._workspaces.items()
    assert key == (4864, "cpu") and space.sums.shape == (128, 4864) and not space.sums.any()
    assert [e.kernel.name for e in _plan_of(entry, base, spec, H200).entries] == ["splitk_w8a8", base.name]
    base_entry = next(e for e, b in r.candidates("linear", H200, spec) if e.kernel is b)
    assert [e.kernel.name for e in _plan_of(base_entry, base_entry.kernel, spec, H200).entries] == [
        base_entry.kernel.name]


def test_plan_apply_bands_pick_by_batch_size(libraries):
    libraries(True)
    plan = dense(H200, "auto", 5120, 2048)
    assert [plan.kernel_for(m).name for m in (1, 2, 16, 1023, 1024, 8192)] == [G, F, F, F, D, D]
    plan = dense(H200, "triton", 5120, 2048)
    assert [plan.kernel_for(m).name for m in (1, 2, 16, 17, 4096)] == [G, W, W, T, T]


def test_a_float16_model_keeps_bf16_only_kernels_out(libraries):
    libraries(True)
    plan = dense(H200, "auto", 5120, 2048, torch.float16)
    assert plan.bands() == {"1024+ tokens": C, "other batches": F}
    skipped = dict((e.kernel.name, why) for e, why in plan.skipped)
    assert skipped[D] == "a float16 model (DeepGEMM writes bf16)" and "float16" in skipped[G]


def test_deepgemm_shadows_cublas_and_both_name_why(libraries):
    libraries(True)
    plan = dense(H200, "auto", 5120, 2048)
    assert dict((e.kernel.name, why) for e, why in plan.skipped) == {C: "its batches go to deepgemm"}
    assert plan.explain().endswith("[not cublas: its batches go to deepgemm]")


def test_a_band_kernel_must_read_the_base_kernels_scale_layout(libraries):
    """cuBLAS reads 128x128 weight scale blocks: beside a base kernel that writes per-row scales it cannot run."""
    from sglang_mxfp8.kernels.plan import Entry, select

    plan = select(LinearSpec("l", 5120, 2048), H200, "test", (Entry(r.CUBLAS, 1024), Entry(r.TRITON_W8A8)), DEFAULT)
    assert plan.bands() == {"other batches": "triton_w8a8"}
    assert [(e.kernel.name, why) for e, why in plan.skipped] == [
        ("cublas", "reads 128-row weight scale blocks; triton_w8a8 writes 1")]
    plan = select(LinearSpec("l", 5120, 2048), H200, "test", (Entry(r.CUBLAS, 1024), Entry(r.FLASHINFER_SM90)), DEFAULT)
    assert plan.bands() == {"1024+ tokens": "cublas", "other batches": "flashinfer_sm90"}


def test_precompile_ranges_leave_out_what_other_kernels_take(libraries):
    libraries(True)
    plan = dense(H200, "auto", 5120, 2048)
    assert [(e.kernel.name, lo, hi) for e, lo, hi in plan.ranges(8192)] == [(G, 1, 1), (D, 1024, 8192), (F, 2, 1023)]
    assert [(e.kernel.name, lo, hi) for e, lo, hi in plan.ranges(512)] == [(G, 1, 1), (F, 2, 512)]


@pytest.mark.parametrize("kernel,n,k,why", [
    (r.FLASHINFER_SM90, 5120, 2080, "needs K % 128 == 0 and N % 64 == 0 (N=5120, K=2080)"),
    (r.FLASHINFER_SM90, 5000, 2048, "needs K % 128 == 0 and N % 64 == 0 (N=5000, K=2048)"),
    (r.DEEPGEMM, 5120, 2080, "[5120 x 2080] is not a multiple of 128 in K and 64 in N"),
    (r.DEEPGEMM, 1000, 2048, "[1000 x 2048] is not a multiple of 128 in K and 64 in N"),
    (r.CUBLAS, 5120, 2176, "needs whole 128x128 blocks with K / 128 a multiple of 4 (N=5120, K=2176)"),
    (r.CUBLAS, 1088, 2048, "needs whole 128x128 blocks with K / 128 a multiple of 4 (N=1088, K=2048)"),
    (r.FLASHINFER_TRTLLM_MXFP8, 5120, 2176, "needs K % 256 == 0 and N >= 128 (N=5120, K=2176)"),
    (r.FLASHINFER_TRTLLM_MXFP8, 64, 2048, "needs K % 256 == 0 and N >= 128 (N=64, K=2048)"),
    (r.FLASHINFER_CUTLASS_MXFP8, 64, 2048, "needs N, K >= 128 (N=64, K=2048)"),
    (r.WEIGHT_ONLY, 14336, 4096, "N = 14336 > 5120, where it measured slower than the W8A8 GEMM"),
    (r.WEIGHT_ONLY, 6144, 4096, "N = 6144 > 5120, where it measured slower than the W8A8 GEMM"),
    (r.GEMV_BESIDE_FLASHINFER, 14336, 4096, "[14336 x 4096] is not among the shapes it measured faster on"),
])
def test_each_kernel_refuses_what_it_cannot_run(kernel, n, k, why):
    assert kernel.can_implement(LinearSpec("l", n, k)) == (False, why)
    assert kernel.can_implement(LinearSpec("l", 5120, 2048 if kernel is not r.WEIGHT_ONLY else 4096))[0] or \
        kernel is r.GEMV_BESIDE_FLASHINFER


@pytest.mark.parametrize("gpu,flag,n,k,bands,fallback", [
    (B200, "auto", 5120, 2048, {"other batches": "flashinfer_cutlass_mxfp8"}, False),
    (B200, "flashinfer_trtllm", 5120, 2048, {"other batches": "flashinfer_trtllm_mxfp8"}, False),
    (B200, "flashinfer_trtllm", 5120, 2080, {"other batches": "flashinfer_cutlass_mxfp8"}, True),  # K % 256
    (B200, "flashinfer_cutlass", 5120, 2048, {"other batches": "flashinfer_cutlass_mxfp8"}, False),
    (B200, "triton", 5120, 2048, {"other batches": "sglang_triton_mxfp8"}, False),
    (RTX, "auto", 5120, 2048, {"other batches": "flashinfer_cutlass_mxfp8"}, False),
    (RTX, "triton", 5120, 2048, {"other batches": "sglang_triton_mxfp8"}, False),
    (THOR, "auto", 5120, 2048, {"other batches": "flashinfer_cutlass_mxfp8"}, False),
])
def test_blackwell_dense_plans(libraries, gpu, flag, n, k, bands, fallback):
    plan = dense(gpu, flag, n, k)
    assert plan.bands() == bands and plan.fallback == fallback
    assert r.native("linear", gpu, flag) == (flag == "triton")


def test_trtllm_needs_bf16_output_and_falls_back_with_a_reason(libraries):
    plan = dense(B200, "flashinfer_trtllm", 5120, 2048, torch.float16)
    assert plan.base.name == "flashinfer_cutlass_mxfp8" and plan.fallback
    assert "writes bf16" in plan.explain()


def test_a_layer_no_kernel_can_run_is_one_line_naming_each_refusal(libraries):
    with pytest.raises(Mxfp8ConfigError) as e:
        dense(B200, "flashinfer_cutlass", 64, 2048)
    assert str(e.value) == (
        "model.layers.0.mlp.down_proj [64 x 2048]: no MXFP8 kernel for this layer on NVIDIA B200 (SM100) with flag "
        "flashinfer_cutlass (flashinfer_cutlass_mxfp8: needs N, K >= 128 (N=64, K=2048)); keep this layer BF16 "
        "(modules_to_not_convert)")


def test_auto_never_picks_trtllm_gen_on_blackwell(libraries):
    # mm_mxfp8's trtllm backend needs the weight shuffled in place; like vLLM, auto leaves it opt-in
    for gpu in (B200, RTX, THOR):
        for n, k in ((5120, 2048), (2048, 4096), (14336, 4096), (256, 256)):
            assert "flashinfer_trtllm_mxfp8" not in dense(gpu, "auto", n, k).bands().values()


def test_without_flashinfer_auto_takes_triton_and_a_named_flashinfer_flag_fails(libraries, monkeypatch):
    monkeypatch.setattr(
        platform, "flashinfer_missing", lambda: "FlashInfer is not installed (pip install flashinfer-python)"
    )
    assert dense(H200, "auto", 512, 512).base.name == T
    with pytest.raises(Mxfp8ConfigError, match="FlashInfer is not installed"):
        dense(H200, "flashinfer_trtllm", 512, 512)
    assert r.flag_choices("linear", H200) == ("auto", "triton")


@pytest.mark.parametrize(
    "gpu,flag,match",
    [
        (
            H200,
            "flashinfer_cutlass",
            r"^--fp8-gemm-backend flashinfer_cutlass cannot run MXFP8 on NVIDIA H200 \(SM90\): no "
            r"such kernel for this architecture; valid choices on this GPU: auto, triton, flashinfer_trtllm$",
        ),
        (H200, "deep_gemm", r"--fp8-gemm-backend deep_gemm .*not an MXFP8 dense backend"),
        (RTX, "flashinfer_trtllm", r"RTX PRO 6000 \(SM120\).*auto, triton, flashinfer_cutlass$"),
        (A100, "auto", r"NVIDIA A100 \(SM80\) has none"),
        (L40, "auto", r"NVIDIA L40S \(SM89\) has none"),
    ],
)
def test_dense_errors_are_one_line_and_name_flag_gpu_choices(libraries, gpu, flag, match):
    with pytest.raises(Mxfp8ConfigError, match=match) as e:
        dense(gpu, flag, 512, 512)
    assert "\n" not in str(e.value)


def test_dense_k_not_multiple_of_32_names_layer(libraries):
    with pytest.raises(Mxfp8ConfigError, match="model.layers.0.mlp.down_proj: K=100"):
        dense(H200, "auto", 256, 100)


def moe(gpu, flag, hidden=2048, intermediate=768, tp=1, settings=DEFAULT, **kw):
    return r.select_moe(MoESpec("experts", 128, hidden, intermediate, tp=tp, **kw), gpu, flag, settings)


@pytest.mark.parametrize("flag,deep_gemm,hidden,intermediate,bands", [
    ("auto", True, 2048, 768, {"1 token": "moe_gemv", "1024+ tokens": "deepgemm_moe", "other batches": "triton_moe"}),
    ("triton", False, 2048, 768, {"1 token": "moe_gemv", "2048+ tokens": "cutlass_moe", "other batches": "triton_moe"}),
    ("auto", True, 4096, 1536, {"1024+ tokens": "deepgemm_moe", "other batches": "triton_moe"}),  # no GEMV measured
])
def test_hopper_moe_plans(libraries, flag, deep_gemm, hidden, intermediate, bands):
    libraries(deep_gemm)
    plan = moe(H200, flag, hidden, intermediate)
    assert plan.bands() == bands and plan.base.layout.up_first is False


@pytest.mark.parametrize("spec_change,why", [
    (dict(non_standard="activation gelu (gated True); it runs SiLU-gated experts only"), "activation gelu"),
    (dict(ep=2), "expert parallel size 2"),
    (dict(dtype=torch.float16), "a float16 model"),
])
def test_moe_layers_our_kernels_cannot_compute_stay_on_triton(libraries, spec_change, why):
    libraries(True)
    plan = moe(H200, "auto", **spec_change)
    if "dtype" in spec_change:  # the CUTLASS grouped MoE takes fp16 too
        assert plan.bands() == {"2048+ tokens": "cutlass_moe", "other batches": "triton_moe"}
    else:
        assert plan.bands() == {"other batches": "triton_moe"}
    assert all(
        why in reason for e, reason in plan.skipped if e.kernel.name != "cutlass_moe" or "dtype" not in spec_change
    )


@pytest.mark.parametrize("gpu,flag,base", [
    (B200, "flashinfer_cutlass", "flashinfer_cutlass_mxfp8_moe"),
    (B200, "auto", "sglang_flashinfer_trtllm_moe"),
    (B200, "flashinfer_trtllm_routed", "sglang_flashinfer_trtllm_routed_moe"),
    (B200, "cutlass", "sglang_cutlass_moe"),
])
def test_blackwell_moe_plans(libraries, gpu, flag, base):
    plan = moe(gpu, flag)
    assert plan.bands() == {"other batches": base}
    assert r.native("moe", gpu, flag) == (flag != "flashinfer_cutlass")
    assert plan.base.layout.up_first == (flag == "flashinfer_cutlass")


@pytest.mark.parametrize(
    "gpu,flag,match",
    [
        (
            H200,
            "flashinfer_trtllm",
            r"--moe-runner-backend flashinfer_trtllm cannot run MXFP8 on NVIDIA H200 \(SM90\): no "
            r"such kernel for this architecture; valid choices on this GPU: auto, triton, "
            r"flashinfer_cutlass$",
        ),
        (
            B200,
            "triton",
            r"B200 \(SM100\).*auto, flashinfer_cutlass, flashinfer_trtllm, flashinfer_trtllm_routed, cutlass$",
        ),
        (RTX, "auto", r"no MXFP8 MoE kernel exists for NVIDIA RTX PRO 6000 \(SM120\)"),
    ],
)
def test_moe_errors(libraries, gpu, flag, match):
    with pytest.raises(Mxfp8ConfigError, match=match) as e:
        moe(gpu, flag)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("gpu,hidden,intermediate,tp,match", [
    # no split helps a size that is not a multiple of 128 whole
    (H200, 2048, 48, 2, r"triton_w8a8_moe: intermediate size 96 split 2 ways .* leaves 48 per rank, not a multiple "
                        r"of 32, MXFP8's scale block; serve with --tp / --ep-size = 1 or 3 "),
    (B200, 2048, 48, 16, r"intermediate size 768 split 16 ways .* leaves 48 per rank, not a multiple of 32, the MXFP8 "
                         r"scale block; .* = 1, 2, 3, 4, 6, 8 or 12 "),
    (B200, 2050, 768, 2, r"hidden size 2050 is not a multiple of 32, the MXFP8 scale block; MXFP8 MoE cannot hold it"),
])
def test_moe_sizes_the_kernels_cannot_hold(libraries, gpu, hidden, intermediate, tp, match):
    with pytest.raises(Mxfp8ConfigError, match=match):
        moe(gpu, "auto", hidden, intermediate, tp)


def test_a_hopper_moe_share_of_128_rows_runs(libraries):
    assert moe(H200, "auto", 2048, 128, tp=6).base.name == "triton_moe"


def test_disabled_kernels_are_skipped_with_the_setting_named(libraries):
    libraries(True)
    settings = Settings.from_env({"SGLANG_MXFP8_DISABLED_KERNELS": "gemv, deepgemm,moe_gemv"})
    plan = dense(H200, "auto", 5120, 2048, settings=settings)
    assert plan.bands() == {"1024+ tokens": C, "other batches": F}
    assert ("gemv", "SGLANG_MXFP8_DISABLED_KERNELS lists it") in [(e.kernel.name, why) for e, why in plan.skipped]
    assert moe(H200, "auto", settings=settings).bands() == {
        "1024+ tokens": "deepgemm_moe",
        "other batches": "triton_moe",
    }
    with pytest.raises(Mxfp8ConfigError, match=r"--fp8-gemm-backend triton cannot run MXFP8 on NVIDIA H200 \(SM90\): "
                                               "SGLANG_MXFP8_DISABLED_KERNELS lists it"):
        dense(H200, "triton", 5120, 2048, settings=Settings(disabled_kernels=frozenset({"triton_w8a8"})))


@pytest.mark.parametrize("env,disabled,precompile", [
    ({}, set(), True),
    ({"SGLANG_MXFP8_PRECOMPILE": "FALSE "}, set(), False),
    ({"SGLANG_MXFP8_PRECOMPILE": "1"}, set(), True),
    ({"SGLANG_MXFP8_DISABLED_KERNELS": "cublas, weight_only,,"}, {"cublas", "weight_only"}, True),
    ({"SGLANG_MXFP8_GEMV": "0"}, set(), True),  # a switch this release does not read changes nothing
])
def test_settings_read_the_switches(env, disabled, precompile):
    s = Settings.from_env(env)
    assert (set(s.disabled_kernels), s.precompile, s.warnings) == (disabled, precompile, ())


@pytest.mark.parametrize("value,jobs,warned", [(None, None, False), ("0", 0, False), (" 12", 12, False),
                                               ("many", None, True), ("-1", None, True)])
def test_compile_jobs_setting(value, jobs, warned):
    s = Settings.from_env({} if value is None else {"SGLANG_MXFP8_COMPILE_JOBS": value})
    assert s.compile_jobs == jobs
    assert [w for w in s.warnings if "SGLANG_MXFP8_COMPILE_JOBS" in w and "one per CPU" in w] == (
        [s.warnings[0]] if warned else [])


@pytest.mark.parametrize("flag", ["auto", "triton", "flashinfer_cutlass"])
@pytest.mark.parametrize("hidden,intermediate,tp", [(2880, 2880, 1), (2048, 96, 1), (576, 768, 1), (2048, 192, 4)])
def test_moe_off_the_128_grid_takes_the_masked_moe(libraries, flag, hidden, intermediate, tp):
    """Sizes that are multiples of 32, not of 128 (a TP share of 192 too): the masked W8A8 MoE is the base kernel of
    every Hopper MoE flag, a fallback announced as such under flashinfer_cutlass;
    no band kernel that needs whole 128-blocks joins it (DeepGEMM present)."""
    libraries(True)
    plan = moe(H200, flag, hidden, intermediate, tp)
    assert plan.bands() == {"other batches": "triton_w8a8_moe"}
    assert plan.entries[-1].fallback == (flag == "flashinfer_cutlass")
    refusals = {e.kernel.name: why for e, why in plan.skipped}
    if flag != "flashinfer_cutlass":
        for band in ("deepgemm_moe", "cutlass_moe"):
            assert "not a multiple of 128, which its grouped GEMM needs" in refusals[band], refusals


@pytest.mark.parametrize("flag", ["auto", "triton", "flashinfer_cutlass"])
def test_gpt_oss_20b_moe_layer_weights_stay_under_055x_bf16(libraries, flag):
    """The memory goal off the 128 grid: a gpt-oss-20b-shaped MoE layer (32 experts, hidden and intermediate 2880) as
    each Hopper MoE flag plans it, FP8 weights + the checkpoint's UE8M0 scales + every buffer the plan derives (on the
    meta device: their sizes, as the GPU test measures them allocated), against its BF16 weights."""
    e, h, i = 32, 2880, 2880
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.empty(e, 2 * i, h, dtype=torch.float8_e4m3fn, device="meta"), False)
    layer.w2_weight = torch.nn.Parameter(torch.empty(e, h, i, dtype=torch.float8_e4m3fn, device="meta"), False)
    plan = r.select_moe(MoESpec("gpt_oss.experts", e, h, i), H200, flag)
    derived = sum(t.numel() * t.element_size() for _, t in plan.create_buffers(layer).tensors())
    weights = 3 * e * h * i
    ratio = (weights + weights // 32 + derived) / (2 * weights)
    assert plan.base.name == "triton_w8a8_moe" and 0.515 < ratio <= 0.55, ratio  # FP8 + scales alone: 0.5156x


@pytest.mark.parametrize(
    "deep_gemm,disabled,bands",
    [
        (
            False,
            "",
            {"1 token": "moe_gemv", "2+ tokens": "triton_w8a8_moe", "other batches": "flashinfer_cutlass_moe_sm90"},
        ),
        (
            True,
            "",
            {
                "1 token": "moe_gemv",
                "1024+ tokens": "deepgemm_moe",
                "2+ tokens": "triton_w8a8_moe",
                "other batches": "flashinfer_cutlass_moe_sm90",
            },
        ),
        # pure FlashInfer
        (True, "moe_gemv,triton_w8a8_moe,deepgemm_moe", {"other batches": "flashinfer_cutlass_moe_sm90"}),
    ],
)
def test_flashinfer_cutlass_on_hopper_takes_the_measured_bands_beside_flashinfers_moe(libraries, deep_gemm, disabled,
                                                                                      bands):
    """FlashInfer's fused MoE stays the base (its [up; gate] w13 order is the layer's); the band kernels that read
    that order take the batches where they measured faster; SGLang's CUTLASS grouped MoE, which reads [gate; up] only,
    is passed over with that reason; SGLANG_MXFP8_DISABLED_KERNELS gives the pure FlashInfer path."""
    libraries(deep_gemm)
    plan = moe(H200, "flashinfer_cutlass", settings=Settings.from_env({"SGLANG_MXFP8_DISABLED_KERNELS": disabled}))
    assert plan.bands() == bands and plan.base.layout.up_first
    assert [m for m in (1, 2, 1023, 1024, 8192) if plan.kernel_for(m) is r.FLASHINFER_CUTLASS_SM90_MOE] == (
        [] if not disabled else [1, 2, 1023, 1024, 8192])
    if not disabled:
        assert dict((e.kernel.name, why) for e, why in plan.skipped)["cutlass_moe"] == (
            "its batches go to deepgemm_moe" if deep_gemm else
            "reads w13 as [gate; up]; flashinfer_cutlass_moe_sm90 loads it as [up; gate]")
        assert [e.kernel.name for e, lo, hi in plan.ranges(8192)][-1] != "flashinfer_cutlass_moe_sm90"  # never runs
    # under auto the masked MoE is no band: its entry sits beside FlashInfer's MoE only
    assert "triton_w8a8_moe" not in moe(H200, "auto").bands().values()


@pytest.mark.sglang  # the clone of SGLang's function, with the newest SGLang too
def test_the_up_first_cutlass_moe_is_timed_beside_flashinfers_moe_and_planned_nowhere(libraries):
    """SGLang's CUTLASS grouped MoE on FlashInfer's [up; gate] w13 has no rows yet: ``bench layers --all-kernels``
    times it beside FlashInfer's fused MoE (the only base writing that order) from 2048 tokens, while no flag's plan,
    priority list or README row holds it. Its clone of SGLang's function differs from it in the activation alone."""
    from sglang.srt.layers.moe import cutlass_moe

    from sglang_mxfp8.kernels.moe.cutlass_grouped import up_first_fused_experts
    from sglang_mxfp8.ops.triton_sm90.silu_and_mul import silu_and_mul_up_first

    spec = MoESpec("experts", 128, 2048, 768)
    timed = {e.kernel.name: (e, base.name) for e, base in r.candidates("moe", H200, spec)}
    entry, base = timed["cutlass_moe_up_first"]
    assert entry.trial and base == "flashinfer_cutlass_moe_sm90" and entry.takes(2048) and not entry.takes(2047)
    assert timed["cutlass_moe"][1] != "flashinfer_cutlass_moe_sm90"
    assert r.CUTLASS_MOE_UP_FIRST.layout_mismatch(r.TRITON_MOE) == (
        "reads w13 as [up; gate]; triton_moe loads it as [gate; up]")
    for flag in ("auto", "triton", "flashinfer_cutlass"):
        assert "cutlass_moe_up_first" not in moe(H200, flag).bands().values()
        assert "cutlass_moe_up_first" not in [k.name for k in r.flag_kernels("moe", H200, flag)]
    assert "cutlass_moe_up_first" not in r.markdown() and entry.measured == ()
    clone, original = up_first_fused_experts(), cutlass_moe.cutlass_fused_experts_fp8
    assert clone is not original and clone.__code__ is original.__code__
    assert clone.__globals__["silu_and_mul"] is silu_and_mul_up_first
    assert {n: v for n, v in clone.__globals__.items() if n != "silu_and_mul"} == {
        n: v for n, v in vars(cutlass_moe).items() if n != "silu_and_mul"}


def test_flashinfer_cutlass_on_hopper_plans_the_trimmed_flashinfer_moe(libraries, monkeypatch):
    from sglang_mxfp8.ops.flashinfer_jit import fused_moe

    plan = moe(
        H200, "flashinfer_cutlass", settings=Settings(disabled_kernels=frozenset({"moe_gemv", "triton_w8a8_moe"}))
    )
    assert plan.bands() == {"other batches": "flashinfer_cutlass_moe_sm90"} and plan.base.layout.up_first
    assert not r.native("moe", H200, "flashinfer_cutlass")
    assert moe(H200, "auto").base.name == "triton_moe"  # auto: the measured Hopper list (FlashInfer's MoE slower)
    # the model is built without waiting for the module's build (started at launch): its first call waits, after the
    # weights are read and the dense kernels compiled
    built = []
    monkeypatch.setattr(fused_moe, "build", lambda verbose=False: built.append(verbose))
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.empty(128, 2 * 768, 2048, dtype=torch.float8_e4m3fn, device="meta"),
                                          False)
    layer.w2_weight = torch.nn.Parameter(torch.empty(128, 2048, 768, dtype=torch.float8_e4m3fn, device="meta"), False)
    assert {name for name, _ in plan.create_buffers(layer).tensors()} and built == []


def test_every_kernel_is_named_once_and_disabling_knows_them():
    names = r.kernel_names()
    assert len(names) == len(set(names))
    assert {"gemv", "weight_only", "triton_w8a8", "flashinfer_sm90", "deepgemm", "cublas", "moe_gemv",
            "deepgemm_moe", "cutlass_moe", "triton_moe"} <= set(names)


def test_kernels_are_chosen_in_the_registry_only():
    """No kernel-name comparison outside kernels/registry.py: a choice lives in the registry as one entry."""
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for pattern in (".kernel ==", ".kernel !=", ".name ==", "kernel in ("):
            assert pattern not in text, f"{path.relative_to(PACKAGE)} compares kernel names ({pattern})"


def test_deep_gemm_not_installed_is_named():
    if "deep_gemm" in sys.modules or __import__("importlib").util.find_spec("deep_gemm"):
        pytest.skip("deep_gemm is installed here")
    assert platform.deep_gemm_missing("fp8_gemm_nt") == (
        "deep_gemm does not import (ModuleNotFoundError: No module named 'deep_gemm')")


def test_a_deep_gemm_build_without_the_apis_is_refused(monkeypatch):
    old = types.ModuleType("deep_gemm")  # a build without the dense GEMM or the psum layout
    old.__version__ = "0.0.1"
    old.m_grouped_fp8_gemm_nt_contiguous = lambda *a, **kw: None
    old.m_grouped_fp8_gemm_nt_contiguous.__doc__ = "no such layout"
    old.get_mk_alignment_for_contiguous_layout = lambda: 128
    monkeypatch.setitem(sys.modules, "deep_gemm", old)
    assert platform.deep_gemm_missing("fp8_gemm_nt") == "deep_gemm 0.0.1 has no fp8_gemm_nt"
    deepgemm_moe = r.DEEPGEMM_MOE
    assert deepgemm_moe.missing(H200) == (
        "deep_gemm 0.0.1 has no m_grouped_fp8_gemm_nt_contiguous with use_psum_layout")
    old.m_grouped_fp8_gemm_nt_contiguous.__doc__ = "use_psum_layout: ..."  # a source build's binding
    assert deepgemm_moe.missing(H200) is None

    def wheel_wrapper(a, b, d, grouped_layout, use_psum_layout=False, expected_m_for_psum_layout=None):
        pass  # the sgl-deep-gemm wheel's Python wrapper: no docstring, the keyword in its signature

    old.m_grouped_fp8_gemm_nt_contiguous = wheel_wrapper
    assert deepgemm_moe.missing(H200) is None
    old.get_mk_alignment_for_contiguous_layout = lambda: 64
    assert deepgemm_moe.missing(H200) == "deep_gemm's M alignment is 64, not 128"

    def unloadable():  # a wheel built for another torch: its ops library fails when first called
        raise OSError("Could not load this library: /tmp/dg/deep_gemm/_C.so")

    old.get_mk_alignment_for_contiguous_layout = unloadable
    assert deepgemm_moe.missing(H200) == ("deep_gemm does not run here (OSError: Could not load this library: "
                                          "/tmp/dg/deep_gemm/_C.so)")


def test_a_flag_with_no_kernel_on_a_gpu_is_never_reported_as_sglangs_own():
    """native() answers "SGLang's own MXFP8 method" only where every kernel of the flag's plan is SGLang's: a flag
    with no kernel on a GPU (an empty plan) is not handed to SGLang, whose MXFP8 methods would then run where they
    cannot; every GPU, layer kind and flag."""
    from sglang_mxfp8.cli.doctor import KNOWN_GPUS
    from sglang_mxfp8.flags import DENSE_FLAGS, MOE_FLAGS

    seen = {"empty": 0, "native": 0, "ours": 0}
    for name, args in KNOWN_GPUS.items():
        gpu = GpuSpec(*args)
        for kind, flags in (("linear", DENSE_FLAGS), ("moe", MOE_FLAGS)):
            for flag in flags:
                entries = r.table(kind, gpu).entries(flag)
                answer = r.native(kind, gpu, flag)
                if not entries:
                    assert answer is False, (name, kind, flag)
                    seen["empty"] += 1
                else:
                    assert answer == all(e.kernel.native for e in entries), (name, kind, flag)
                    seen["native" if answer else "ours"] += 1
    assert all(seen.values()), seen  # each kind of answer occurs
