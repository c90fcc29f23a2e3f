"""Deliberate small bugs in the core logic, each applied alone to the source, and the CPU tests that must catch it.

Not run by CI (a few minutes): run it after changing the tests or the code they guard, in the environment .ci/run
builds. Each mutation replaces one exact snippet (it must occur once), the listed tests run with -x, and a mutation
the tests pass under is a gap: exit 1. The source file is restored after each run, also on error or ^C.

    python tests/mutations/mutate.py [--only NAME ...]
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = "sglang_mxfp8/"
NUMERICS = ["tests/test_numerics.py", "tests/test_numerics_spec.py"]
REFIT = ["tests/test_refit.py"]
DISPATCH = ["tests/test_registry.py", "tests/test_moe_plans.py"]
CONVERT = ["tests/test_convert.py"]

# (name, area, file, snippet, its replacement, the tests that must fail)
MUTATIONS = [
    ("ceil-boundary", "numerics", "format/numerics.py", "torch.ldexp(amax, -e) > E4M3_MAX",
     "torch.ldexp(amax, -e) >= E4M3_MAX", NUMERICS),
    ("floor-exponent", "numerics", "format/numerics.py", "return (exp - 1 - E4M3_EMAX)", "return (exp - E4M3_EMAX)",
     NUMERICS),
    ("zero-block-scale", "numerics", "format/numerics.py", "e = torch.where(nonzero, e, torch.zeros_like(e))", "e = e",
     NUMERICS),
    ("nan-block-scale", "numerics", "format/numerics.py",
     "scale = torch.where(finite, scale, torch.full_like(scale, E8M0_NAN))", "scale = scale", NUMERICS),
    ("e8m0-clamp", "numerics", "format/numerics.py", ".clamp(-E8M0_BIAS, E8M0_BIAS)",
     ".clamp(-E8M0_BIAS + 1, E8M0_BIAS)", NUMERICS),
    ("e8m0-decode", "numerics", "format/numerics.py", "(s - E8M0_BIAS).float()", "(s - E8M0_BIAS + 1).float()",
     NUMERICS),
    ("refit-scale-only", "refit", "layouts/hopper.py", "fresh = ~untouched | (noop & scale_moved)",
     "fresh = ~untouched", REFIT),
    ("refit-stale-rows", "refit", "layouts/hopper.py", "stale = untouched & ~noop", "stale = untouched & noop", REFIT),
    ("refit-mixed-block", "refit", "layouts/hopper.py", "        if bool(mixed.any()):\n            g, b",
     "        if False:\n            g, b", REFIT),
    ("refit-nan-scale", "refit", "format/checkpoint.py", "nan_scale, nan_weight, missing = (s == 255),",
     "nan_scale, nan_weight, missing = (s == 254),", REFIT),
    ("refit-nan-weight", "refit", "format/checkpoint.py", "(block_max == 0x7F), (s == 0) & nonzero",
     "(block_max == 0x7E), (s == 0) & nonzero", REFIT),
    ("refit-missing-scale", "refit", "format/checkpoint.py", "(block_max == 0x7F), (s == 0) & nonzero",
     "(block_max == 0x7F), (s == 0) & ~nonzero", REFIT),
    ("refit-checks-skipped", "refit", "format/checkpoint.py",
     "if not any(torch.stack([nan_scale.any(), nan_weight.any(), missing.any()]).tolist()):", "if True:", REFIT),
    ("convert-whole-step-offset", "refit", "layouts/hopper.py", "            exps[r0 // br:r0 // br + e.shape[0]] = e",
     "            exps[:e.shape[0]] = e", REFIT),
    ("convert-whole-unaligned-groups", "refit", "layouts/hopper.py",
     "if (pad == 0 or self.groups == 1) and bool(todo_blocks.all()):", "if bool(todo_blocks.all()):", REFIT),
    ("refit-converted-count", "refit", "layouts/hopper.py", "rows = int(converted.sum())  # (a host sync)",
     "rows = 0", REFIT),
    ("tracker-weight-without-scale", "tracker", "sglang/loads.py", "                if keys - scales:",
     "                if False:", REFIT),
    ("tracker-scale-without-weight", "tracker", "sglang/loads.py", "                if scales - keys:",
     "                if False:", REFIT),
    ("tracker-dtype", "tracker", "sglang/loads.py", "if loaded_weight.dtype != expected:", "if False:", REFIT),
    ("e8m0-nan-decodes-inf", "numerics", "format/numerics.py",
     '    return torch.where(s == E8M0_NAN, torch.full_like(val, float("nan")), val)', "    return val", NUMERICS),
    ("e8m0-nan-decodes-254", "numerics", "format/numerics.py", "torch.where(s == E8M0_NAN,",
     "torch.where(s == E8M0_NAN - 1,", NUMERICS),
    ("signed-zero-counts", "numerics", "format/numerics.py", "nz = (q.view(torch.uint8) & 0x7F)",
     "nz = (q.view(torch.uint8) & 0xFF)", NUMERICS),
    ("signed-zero-loses-sign", "numerics", "format/numerics.py", "new = torch.ldexp(old, shift).to(FP8)",
     "new = (torch.ldexp(old, shift) + 0.0).to(FP8)", NUMERICS),
    ("fingerprint-plain-word-sum", "refit", "layouts/fingerprints.py",
     "(words[r0 : r0 + step] * coeff).sum(dim=1, dtype=torch.int64)",
     "words[r0 : r0 + step].sum(dim=1, dtype=torch.int64)", REFIT),
    ("fingerprint-word-weights-one", "refit", "layouts/fingerprints.py", "* 2654435761 % (1 << 31)) | 1",
     "* 0 % (1 << 31)) | 1", REFIT),
    ("fingerprint-plain-sum", "refit", "layouts/fingerprints.py",
     "(b[r0 : r0 + step].to(torch.int64) * coeff).sum(dim=1)", "b[r0 : r0 + step].to(torch.int64).sum(dim=1)", REFIT),
    ("fingerprint-repeating-weights", "refit", "layouts/fingerprints.py",
     "dtype=torch.int64) * 2654435761 % 1000003 + 1", "dtype=torch.int64) % 2 + 1", REFIT),
    ("storage-compared-with-last-load", "refit", "sglang/weights.py",
     "    moved = [name for name, ptr in now.items() if first.get(name) != ptr]\n",
     "    moved = [name for name, ptr in now.items() if first.get(name) != ptr]\n    model._sglang_mxfp8_storage = "
     "now\n", REFIT),
    ("storage-parameters-only", "refit", "sglang/weights.py",
     "for name, t in (state.tensors() if state is not None else ()):", "for name, t in ():", REFIT),
    ("storage-count-only", "refit", "sglang/weights.py",
     "    moved = [name for name, ptr in now.items() if first.get(name) != ptr]",
     "    moved = [] if len(first) == len(now) else list(now)", REFIT),
    ("modelopt-algo-substring", "config", "format/checkpoint.py",
     'str(section.get("quant_algo") or "").upper() == "MXFP8"',
     '"MXFP8" in str(section.get("quant_algo") or "").upper()', ["tests/test_checkpoint_config.py"]),
    ("modelopt-algo-any-fp8", "config", "format/checkpoint.py",
     'str(section.get("quant_algo") or "").upper() == "MXFP8"', '"FP8" in str(section.get("quant_algo") or "").upper()',
     ["tests/test_checkpoint_config.py"]),
    ("tracker-expert-id", "tracker", "sglang/loads.py", '("shard_id", "loaded_shard_id", "expert_id")',
     '("shard_id", "loaded_shard_id")', REFIT),
    ("dispatch-flashinfer-k128", "dispatch", "kernels/linear/flashinfer_sm90.py", "if spec.k % 128 or spec.n % 64:",
     "if spec.k % 32 or spec.n % 64:", DISPATCH),
    ("dispatch-cublas-k512", "dispatch", "kernels/linear/cublas.py", "if spec.k % 512 or spec.n % 128:",
     "if spec.k % 128 or spec.n % 128:", DISPATCH),
    ("dispatch-trtllm-k256", "dispatch", "kernels/linear/flashinfer_sm100.py", "if spec.k % 256 or spec.n < 128:",
     "if spec.k % 128 or spec.n < 128:", DISPATCH),
    ("dispatch-deepgemm-band", "dispatch", "kernels/registry.py", "Entry(DEEPGEMM, 1024,", "Entry(DEEPGEMM, 512,",
     DISPATCH),
    ("dispatch-scale-layout", "dispatch", "kernels/base.py", "if self.scale_rows not in (None, base.scale_rows):",
     "if False:", DISPATCH),
    ("dispatch-w13-order", "dispatch", "kernels/base.py",
     "if base.up_first and not (self.up_first or self.either_w13_order):", "if False:", DISPATCH),
    ("gemv-moe-up-first", "kernels", "ops/triton_sm90/gemv.py", "rows = offs_i + ((r + UP_FIRST) % 2) * I",
     "rows = offs_i + (r % 2) * I", ["tests/test_triton_cpu.py"]),
    ("w8a8-moe-swap-halves", "kernels", "ops/triton_sm90/moe_sorted.py", "    if SWAP_HALVES:\n        half = N // 2",
     "    if False:\n        half = N // 2", ["tests/test_triton_cpu.py"]),
    ("dispatch-band-edge", "dispatch", "kernels/plan.py", "(self.max_m is None or m <= self.max_m)",
     "(self.max_m is None or m < self.max_m)", DISPATCH),
    ("dispatch-weight-only-n", "dispatch", "kernels/linear/weight_only.py", "if spec.n > self.max_n:",
     "if spec.n > 2 * self.max_n:", DISPATCH),
    ("dispatch-moe-128", "dispatch", "kernels/moe/triton_fused.py", "size_refusal(spec, 128,", "size_refusal(spec, 32,",
     DISPATCH),
    ("convert-overlap", "converter I/O", "format/convert.py", "if s == d or s in d.parents or d in s.parents:",
     "if s == d:", CONVERT),
    ("convert-force-marker", "converter I/O", "format/convert.py", "        if written is None:",
     "        if False:", CONVERT),
    ("convert-force-foreign-files", "converter I/O", "format/convert.py", "        if foreign:", "        if False:",
     CONVERT),
    ("convert-force-marker-exists", "converter I/O", "format/convert.py",
     "    if marker.is_symlink() or not marker.is_file():", "    if not marker.exists():", CONVERT),
    ("convert-force-marker-anywhere", "converter I/O", "format/convert.py", "    marker = folder / MARKER",
     "    marker = next(folder.rglob(MARKER), folder / MARKER)", CONVERT),
    ("convert-force-marker-content", "converter I/O", "format/convert.py",
     'if not (isinstance(written, dict) and str(written.get("converted_by", "")).startswith("sglang_mxfp8 ")):',
     "if False:", CONVERT),
    ("convert-partial-in-tmp", "converter I/O", "format/convert.py", 'partial-", dir=dst.parent))', 'partial-"))',
     CONVERT),
    ("convert-partial-beside-input", "converter I/O", "format/convert.py", 'partial-", dir=dst.parent))',
     'partial-", dir=src.parent))', CONVERT),
    ("convert-partial-in-cwd", "converter I/O", "format/convert.py", 'partial-", dir=dst.parent))',
     'partial-", dir=Path.cwd()))', CONVERT),
    ("convert-shard-name", "converter I/O", "format/convert.py", "Path(name).name != name", "False", CONVERT),
    ("convert-kept-finite", "conversion", "format/convert.py",
     "if t.is_floating_point() and not bool(torch.isfinite(t).all()):", "if False:", CONVERT),
    ("convert-weight-files", "converter I/O", "format/convert.py", "if p.name.endswith(WEIGHT_SUFFIXES):",
     'if p.name.endswith(".safetensors"):', CONVERT),
    ("convert-nan-weight", "conversion", "format/convert.py", "if bool((s == E8M0_NAN).any()):", "if False:", CONVERT),
    ("refit-rollback-path", "refit", "sglang/weights.py", "            self.model_config.model_path = served_path",
     "            pass", ["tests/test_patches.py::test_failed_refit_rolls_back_to_the_served_checkpoint"]),
    ("refit-failed-rollback-raising", "refit", "sglang/weights.py", "            ok, message = False, str(again)",
     "            ok, message = True, str(again)",
     ["tests/test_patches.py::test_failed_refit_rolls_back_to_the_served_checkpoint"]),
    ("refit-failed-rollback-false", "refit", "sglang/weights.py",
     "        if not ok:\n            raise RuntimeError(f\"refit from",
     "        if False:\n            raise RuntimeError(f\"refit from",
     ["tests/test_patches.py::test_failed_refit_rolls_back_to_the_served_checkpoint"]),
    ("update-entry-point-left-out", "refit", "sglang/patches/model_runner.py",
     '                 "update_weights_from_ipc")', "                 )",
     ["tests/test_patches.py::test_every_weight_update_entry_point_of_this_sglang_is_post_processed"]),
    ("native-empty-plan", "dispatch", "kernels/registry.py",
     "    return bool(entries) and all(e.kernel.native for e in entries)",
     "    return all(e.kernel.native for e in entries)",
     ["tests/test_registry.py::test_a_flag_with_no_kernel_on_a_gpu_is_never_reported_as_sglangs_own"]),
    ("report-rows-as-read", "bench", "bench/report.py", "    rows = sorted(rows, key=_row_order)",
     "    rows = list(rows)",
     ["tests/test_bench.py::test_reports_cite_the_newest_row_of_each_figure_whatever_order_the_rows_come_in"]),
    ("range-as-text", "compat", "compat.py",
     "        return (*(int(x) for x in head.split(\".\")[:3]), int(post or 0))",
     "        return (*head.split(\".\")[:3], post or \"0\")",
     ["tests/test_patches.py::test_a_release_outside_the_tested_range_gets_one_warning"]),
    ("refit-keeps-default-dtype", "refit", "sglang/patches/loader_utils.py",
     "            finally:\n                torch.set_default_dtype(old)", "            finally:\n                pass",
     ["tests/test_patches.py::test_sglangs_set_default_torch_dtype_restores_the_dtype_when_its_block_raises"]),
    ("tensor-update-checked", "refit", "sglang/patches/model_runner.py", "                if problem is not None:",
     "                if False:",
     ["tests/test_patches.py::test_a_spoiled_tensor_update_is_refused_before_anything_is_written"]),
    ("config-module-list", "config", "format/checkpoint.py", "if not isinstance(value, list) or",
     "if not isinstance(value, (list, str)) or", ["tests/test_checkpoint_config.py"]),
    ("tested-range-edge", "versions", "compat.py",
     "_release(OLDEST_SGLANG) <= release <= _release(NEWEST_SGLANG)",
     "_release(OLDEST_SGLANG) < release < _release(NEWEST_SGLANG)",
     ["tests/test_patches.py::test_a_release_outside_the_tested_range_gets_one_warning"]),
    ("probe-first-location", "versions", "compat.py", "if obj is not None and (not has or hasattr(obj, has)):",
     "if obj is not None:",
     ["tests/test_patches.py::test_a_probe_takes_the_first_location_that_has_what_the_patch_needs"]),
    ("pinned-reads-for-every-load", "refit", "sglang/patches/loader.py", "            if REFIT_READS.active:",
     "            if True:", ["tests/test_reader.py"]),
    ("pinned-reads-for-bf16-refits", "refit", "sglang/weights.py",
     "        with refit_reads(scale_name is not None):\n            ok, message = original(self, model_path",
     "        with refit_reads():\n            ok, message = original(self, model_path",
     ["tests/test_patches.py::test_only_an_mxfp8_models_refit_reads_page_locked"]),
    ("reader-window-drops-tensors", "refit", "format/reader.py",
     "                        yield done_name, future.result()", "                        future.result()",
     ["tests/test_reader.py"]),
    ("bucket-splits-weight-and-scale", "bench", "bench/trainer.py",
     "if group and size + nbytes > bucket_bytes and not scale_of_last:", "if group and size + nbytes > bucket_bytes:",
     ["tests/test_bench.py::test_a_trainers_buckets_hold_the_checkpoints_tensors_in_order_each_within_its_size"]),
    ("flag-successor", "versions", "bench/serving.py", "if name in RENAMED_FLAGS and name not in known:",
     "if name in RENAMED_FLAGS and name in known:", ["tests/test_serving.py"]),
    ("off-grid-deepgemm-band", "dispatch", "kernels/moe/deepgemm.py", "return standard_sized_experts(spec, 128,",
     "return standard_sized_experts(spec, 32,", DISPATCH),
    ("builds-after-sglang-imports", "dispatch", "sglang/autoload.py", "        patches.before_import(self._name)\n", "",
     ["tests/test_patches.py::test_launch_builds_run_before_sglangs_server_args_executes"]),
    ("build-process-sees-the-gpu", "dispatch", "sglang/launch.py", 'CUDA_VISIBLE_DEVICES="", ', "",
     ["tests/test_patches.py::test_launch_builds_each_planned_kernels_jit_module_once_in_a_process_of_its_own"]),
    ("build-process-leaves-compilers", "dispatch", "kernels/jit_builds.py", "        os.killpg(0, signal.SIGTERM)\n",
     "", ["tests/test_patches.py::test_build_process_stops_with_its_launcher"]),
    ("build-process-outlives-launcher", "dispatch", "kernels/jit_builds.py",
     "launcher = int(os.environ.get(LAUNCHER_ENV) or os.getppid())", "launcher = os.getppid()",
     ["tests/test_patches.py::test_build_process_stops_with_its_launcher"]),
    ("launch-builds-in-children", "dispatch", "sglang/launch.py",
     "    if LAUNCHER_ENV in os.environ:  # SGLang's", "    if False:  # SGLang's",
     ["tests/test_patches.py::test_launch_builds_start_before_sglang_parses_only_for_an_mxfp8_launch"]),
    ("launch-builds-ignore-config", "dispatch", "sglang/launch.py",
     'if any(arg == "--config" or arg.startswith("--config=") for arg in argv):', "if False:",
     ["tests/test_patches.py::test_launch_args_are_read_before_sglang_as_sglangs_parser_reads_them"]),
    ("w8a8-act-scale", "kernels", "ops/triton_sm90/dense_w8a8.py", "sa = tl.load(sa_ptr + sa_offs + kb,",
     "sa = tl.load(sa_ptr + sa_offs + 0 * kb,",
     ["tests/test_triton_cpu.py::test_interpreted_masked_w8a8_moe_matches_float64_reference"]),
    ("trimmed-moe-sources", "build", "ops/flashinfer_jit/fused_moe.py",
     "return not source.name.startswith(_MOE_GEMM_KERNELS) or source.name.endswith(_RUNNER_DTYPES)", "return True",
     ["tests/test_jit_fused_moe.py"]),
    ("trimmed-binding-guard", "build", "ops/flashinfer_jit/fused_moe.py",
     "    if (use_deepseek_fp8_block_scale && mActivationDtype", "    if (mActivationDtype",
     ["tests/test_jit_fused_moe.py"]),
    ("expert-maps-not-declared", "build", "ops/flashinfer_jit/fused_moe.py",
     "    declarations = \"\".join(instantiation(w, extern=True) for w in widths)", "    declarations = \"\"",
     ["tests/test_jit_fused_moe.py"]),
    ("expert-maps-width-dropped", "build", "ops/flashinfer_jit/fused_moe.py", "    groups = [widths[:-_ALONE]] +",
     "    groups = [widths[:-_ALONE - 1]] +", ["tests/test_jit_fused_moe.py"]),
    ("moe-module-waited-at-create", "build", "kernels/moe/flashinfer_cutlass.py",
     "    def prebuild(self):\n        fused_moe.build()\n",
     "    def prebuild(self):\n        fused_moe.build()\n\n    def create_buffers(self, layer, spec, state):\n"
     "        fused_moe.build()\n        super().create_buffers(layer, spec, state)\n",
     ["tests/test_registry.py"]),
    ("trimmed-gemm-include-dir", "build", "ops/flashinfer_jit/blockscale_gemm.py",
     "extra_include_dirs=list(spec.extra_include_dirs or []) + [csrc / GEMM_DIR])",
     "extra_include_dirs=list(spec.extra_include_dirs or []))", ["tests/test_jit_blockscale_gemm.py"]),
    ("trimmed-gemm-switched-off", "build", "ops/flashinfer_jit/blockscale_gemm.py",
     '    if os.environ.get(DEEPGEMM_SWITCH) == "0":', "    if False:", ["tests/test_jit_blockscale_gemm.py"]),
    ("trimmed-gemm-keeps-sm89", "build", "ops/flashinfer_jit/blockscale_gemm.py",
     '    trimmed = source.replace(_SM89_INCLUDE, "")', "    trimmed = source", ["tests/test_jit_blockscale_gemm.py"]),
    ("trimmed-gemm-factory-check", "build", "ops/flashinfer_jit/blockscale_gemm.py",
     "    if not _runner_factory_takes_a_module():", "    if False:", ["tests/test_jit_blockscale_gemm.py"]),
    ("kernel-source-stages", "compile", "ops/flashinfer_jit/tile_configs.py", "{cfg.stages}, {threads}",
     "{cfg.stages - 1}, {threads}", ["tests/test_jit_tile_configs.py"]),
    ("tile-waves-groups", "compile", "ops/flashinfer_jit/tile_configs.py", "_cdiv(n, bn) * groups", "_cdiv(n, bn)",
     ["tests/test_jit_tile_configs.py"]),
    ("tile-grouped-multicast", "compile", "ops/flashinfer_jit/tile_configs.py", "multicast = 2 if groups == 1 and wide",
     "multicast = 2 if wide", ["tests/test_jit_tile_configs.py"]),
    ("moe-swap-threshold", "compile", "ops/flashinfer_jit/tile_configs.py",
     "swap_below = 64 if shape.gemm_type == GROUPED and num_sms == 78 else SWAP_AB_BELOW_M",
     "swap_below = SWAP_AB_BELOW_M", ["tests/test_jit_tile_configs.py"]),
    ("dense-swap-threshold", "compile", "ops/flashinfer_jit/tile_configs.py",
     "64 if shape.gemm_type == GROUPED and num_sms == 78", "64 if num_sms == 78", ["tests/test_jit_tile_configs.py"]),
    ("restated-sources-gate", "compile", "ops/flashinfer_jit/tile_configs.py", "        if digest not in known:",
     "        if False:", ["tests/test_jit_tile_configs.py"]),
    ("band-configs", "compile", "ops/flashinfer_jit/tile_configs.py", "for m in range(min_m, max_m + 1):",
     "for m in range(1, max_m + 1):", ["tests/test_jit_tile_configs.py"]),
]


def run(mutation) -> tuple:
    name, area, rel, old, new, tests = mutation
    path = ROOT / PKG / rel
    source = path.read_text()
    if source.count(old) != 1:
        return "stale", f"snippet found {source.count(old)} times in {rel}"
    try:
        path.write_text(source.replace(old, new))
        start = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-rf", "-p", "no:cacheprovider", *tests],
                           cwd=ROOT, capture_output=True, text=True, timeout=900)
        took = time.perf_counter() - start
    finally:
        path.write_text(source)
    failed = next((line.split(" ")[1] for line in p.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))), "")
    return ("caught" if p.returncode != 0 else "MISSED"), f"{took:.0f} s {failed}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="+", help="mutation names")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m[0] in args.only]
    print("| mutation | area | file | verdict | detail |\n|---|---|---|---|---|", flush=True)
    verdicts = []
    for m in chosen:
        verdict, detail = run(m)
        verdicts.append(verdict)
        print(f"| {m[0]} | {m[1]} | {m[2]} | {verdict} | {detail} |", flush=True)
    print(f"{verdicts.count('caught')} of {len(chosen)} caught")
    return 0 if all(v == "caught" for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
