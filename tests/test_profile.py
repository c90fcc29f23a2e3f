"""The profile routine's reading of torch.profiler traces: kernels sorted by name, GPU time per category."""

import gzip
import json
import threading
import time

import pytest

from sglang_mxfp8.bench import profile

# names as SGLang's kernels, ours and the libraries' appear in traces of a Qwen3-MoE server
NAMES = {
    "_fwd_grouped_kernel_stage1": "attention",  # Triton decode attention (its name says grouped)
    "_fwd_kernel_stage2": "attention",
    "void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>": "attention",
    "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>": "attention",
    "nvjet_tst_128x64_64x8_1x1_v_bz_TNT": "dense",  # cuBLAS BF16
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "dense",
    "_w8a8_gemm_kernel": "dense",
    "_w8a16_gemv_kernel": "dense",
    "_quant_act_kernel": "dense",
    "fused_moe_kernel": "moe",  # SGLang's Triton MoE
    "void moe::topkGatingSoftmax<float, 8, 128>": "moe",
    "_moe_gemv_up_kernel": "moe",
    "_silu_mul_quant_kernel": "moe",
    "void cutlass::device_kernel<GemmUniversal<cutlass::gemm::GroupProblemShape<...>>>": "moe",
    "void tensorrt_llm::kernels::cutlass_kernels::expandInputRowsKernel<...>": "moe",
    "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>": "other",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "other",
}


@pytest.mark.parametrize("name", NAMES)
def test_each_kernel_falls_in_its_category(name):
    assert profile.category(name) == NAMES[name]


def _trace(path, events):
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_the_split_sums_kernel_time_per_category_and_step_and_lists_others(tmp_path):
    events = [{"ph": "X", "cat": "kernel", "name": name, "ts": i, "dur": 10.0 * (1 + i % 3)}
              for i, name in enumerate(NAMES)]
    events += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1e6},  # CPU time is not GPU time
               {"ph": "i", "cat": "kernel", "name": "fused_moe_kernel", "ts": 0}]  # an instant has no duration
    _trace(tmp_path / "t.trace.json.gz", events)
    times = profile.kernel_times(tmp_path / "t.trace.json.gz")
    assert sum(times.values()) == sum(e["dur"] for e in events[:len(NAMES)])
    out = profile.split(times, steps=4)
    expected = {cat: sum(10.0 * (1 + i % 3) for i, n in enumerate(NAMES) if NAMES[n] == cat) / 1000 / 4
                for cat in profile.CATEGORIES}
    assert {c: out[f"{c}_ms"] for c in profile.CATEGORIES} == pytest.approx(expected)
    assert list(out["other_kernels_ms"]) == sorted((n for n in NAMES if NAMES[n] == "other"),
                                                   key=lambda n: -times[n])


def test_traces_are_taken_once_both_stages_are_written_and_refused_when_one_is_missing(tmp_path):
    def write_later():
        time.sleep(1)
        _trace(tmp_path / "1.5-TP-0-EXTEND.trace.json.gz", [])
        time.sleep(1)
        _trace(tmp_path / "1.5-TP-0-DECODE.trace.json.gz", [])

    t = threading.Thread(target=write_later)
    t.start()
    found = profile.wait_for_traces(tmp_path, deadline=time.monotonic() + 30)
    t.join()
    assert sorted(p.name for p in found.values()) == ["1.5-TP-0-DECODE.trace.json.gz", "1.5-TP-0-EXTEND.trace.json.gz"]
    (tmp_path / "1.5-TP-0-DECODE.trace.json.gz").unlink()
    with pytest.raises(RuntimeError, match="1.5-TP-0-EXTEND.trace.json.gz.*both a prefill and a decode trace"):
        profile.wait_for_traces(tmp_path, deadline=time.monotonic() + 3)
