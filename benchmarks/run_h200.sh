#!/usr/bin/env bash
# Everything that needs the H200, in phases that each fit one 10-minute device command:
#   bash benchmarks/run_h200.sh kernels   # GPU tests + dense layer benchmark
#   bash benchmarks/run_h200.sh serve     # tiny Qwen3-MoE: BF16 vs MXFP8 served by stock SGLang, refits
#   bash benchmarks/run_h200.sh recv|accuracy-prep|accuracy   # real-model gsm8k (see tools/ship_gguf.py)
#   bash benchmarks/run_h200.sh recv|fa3-install              # FlashAttention 3 for the served runs (tools/ship_fa3.py)
#   bash benchmarks/run_h200.sh gsm8k     # bench_sglang.py against the real server on a converted tiny model
#   bash benchmarks/run_h200.sh reliability  # refit soak, refit under load, corrupt refits
#   bash benchmarks/run_h200.sh fi-moe    # FlashInfer's SM90 fused MoE (trimmed build): build time, GPU tests, MoE table
#   bash benchmarks/run_h200.sh masked    # the masked W8A8 MoE for sizes off the 128 grid: GPU tests, table vs BF16
#   bash benchmarks/run_h200.sh fi-serve  # the stock flashinfer_cutlass command served: tiny Qwen3-MoE vs BF16, refits
#   bash benchmarks/run_h200.sh off-grid  # a tiny Qwen3-MoE off the 128 grid (hidden 576, intermediate 96) served vs its BF16 twin, refits
#   bash benchmarks/run_h200.sh jit-build # FlashInfer's SM90 GEMM modules built on empty caches (full vs DeepGEMM-only source), then their GPU tests
#   bash benchmarks/run_h200.sh precompile  # the per-tile-config kernels (dense, fused MoE) named as FlashInfer compiles them, ours bit-equal
#   bash benchmarks/run_h200.sh startup   # server start, empty caches vs restart, BF16 vs MXFP8 (tiny; STARTUP_MODEL=e2e: /tmp/e2e after e2e-prep)
#   bash benchmarks/run_h200.sh moe       # MoE layer: MXFP8 vs BF16 time, error, weight memory; MoE tile sweep
#   bash benchmarks/run_h200.sh tune      # Triton tile sweep + the README's demo on the GPU
#   bash benchmarks/run_h200.sh w8a16     # weight-only FP8 kernels for small M: GPU tests, dense and MoE tile sweeps
#   bash benchmarks/run_h200.sh tables    # dense (CUDA-graph timer) and MoE tables with every candidate kernel
#   bash benchmarks/run_h200.sh cublas    # cuBLAS's block-scaled FP8 GEMM: GPU tests, dense table (graph timer) beside FlashInfer
#   bash benchmarks/run_h200.sh rowwise   # per-row-scale probe: dense and MoE candidates vs block scales and BF16
#   bash benchmarks/run_h200.sh gemv      # one-token GEMVs (dense, MoE): GPU tests and tile sweeps vs BF16 and our MXFP8 paths
#   bash benchmarks/run_h200.sh prefill   # MoE GPU tests (weight-only, CUTLASS prefill path) + the MoE candidates table
#   bash benchmarks/run_h200.sh e2e       # served tok/s and decode latency, Qwen3-30B-A3B-shaped, BF16 vs MXFP8
#   bash benchmarks/run_h200.sh e2e-prep  # MoE GPU tests + the e2e checkpoints at E2E_LAYERS (deep models: a command of its own); DEEPGEMM=1: DeepGEMM's GPU tests, its kernels compiled and timed
#   bash benchmarks/run_h200.sh tp-shards # one TP2 rank's dense and MoE layer shards, timed on one GPU
#   bash benchmarks/run_h200.sh deepgemm  # DeepGEMM prefill MoE (carry .deepgemm): GPU tests, table vs CUTLASS grouped, Triton, BF16; DENSE=1: dense too
#   bash benchmarks/run_h200.sh deepgemm-dense  # DeepGEMM dense prefill (carry .deepgemm): GPU tests, its compile cost at load, dense table at 256 and 512 tokens
#   bash benchmarks/run_h200.sh prefill-host  # eager prefill layers (dense, MoE): GPU time against the host's time to issue each call
#   bash benchmarks/run_h200.sh piecewise # tiny MXFP8 model served with SGLang's default piecewise CUDA graphs vs without, refits
#   bash benchmarks/run_h200.sh tp2       # two GPUs (nvidia-h200-x2): --tp 2 vs --tp 1 served, refits at TP2
#   WHEELS="dirs" SGLANG_SITE=/tmp/sglang_0517 bash benchmarks/run_h200.sh site  # another SGLang release's wheels
#   SGLANG_SITE=/tmp/sglang_0517 bash benchmarks/run_h200.sh PHASE                # any phase on that release
# Needs .gpu/ from ../shared/gpu/make-wheelhouse.sh (carried with the command). Results go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sglang_mxfp8_out}
mkdir -p "$OUT"
if [ "${1:-}" = recv ]; then
  # one chunk of a large file per command (tools/ship_chunks.py; carry ROOT/cK): the GGUF's (.model/cK, to
  # /tmp/gguf_chunks) or FlashAttention 3's (.fa3/cK, to /tmp/fa3_chunks); kept under /tmp, which outlives the
  # repo folder while the machine stays warm; no .gpu needed
  DEST=${3:-/tmp/gguf_chunks}
  mkdir -p "$DEST" && mv "${2:?recv ROOT/cK [DEST]}"/chunk*.bin "$DEST"/ && ls "$DEST" | tr '\n' ' '
  exit
fi
if [ "${1:-}" = site ]; then
  # another SGLang release beside the image's Python, in a folder of its own ($SGLANG_SITE): adds the wheels and
  # trimmed sglang-kernel (*.tgz) carried this time in the folders $WHEELS (parts of a wheelhouse too large for one
  # command: make-wheelhouse.sh's output split across commands while the machine stays warm)
  D=${SGLANG_SITE:?}
  mkdir -p "$D"
  for w in ${WHEELS:?}; do
    for t in "$w"/*.tgz; do [ -f "$t" ] && tar xzf "$t" -C "$D"; done
    find "$w" -name '*.whl' | xargs -r python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$D"
  done
  echo "$D: $(ls "$D" | wc -l) entries"
  exit
fi
if [ -n "${SGLANG_SITE:-}" ]; then  # the release set up by the site phase, instead of .gpu's 0.5.10.post1
  export PYTHONPATH=$SGLANG_SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
  python3 -c 'import torch, sglang, flashinfer; print("gpu env:", torch.cuda.get_device_name(), "torch", torch.__version__, "sglang", sglang.__version__, "flashinfer", flashinfer.__version__)'
else
  source .gpu/bootstrap.sh || exit 1
fi
export FLASHINFER_WORKSPACE_BASE=/tmp/fi_cache
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"

deepgemm_env() {
  # DeepGEMM for prefill batches (kernels/moe/deepgemm.py, ops/deepgemm_sm90.py): the sgl-deep-gemm wheel where it is
  # installed (pip install sglang_mxfp8[deepgemm]; SGLang 0.5.11+ depends on it), else built from source: .deepgemm (git-ignored,
  # carried): DeepGEMM's sources (git clone https://github.com/deepseek-ai/DeepGEMM .deepgemm; checkout 54e2261,
  # without its submodules) with fmt's headers in .deepgemm/third-party/fmt/include (CUTLASS's come from FlashInfer's
  # wheel), and prebuilt/_C.so where an earlier machine of this image built it (the deepgemm phase writes
  # $OUT/deepgemm_C.so); set up in /tmp/deepgemm once per machine.
  local DG=/tmp/deepgemm
  if python3 -c "import deep_gemm" 2>/dev/null; then
    python3 -c "import deep_gemm, importlib.metadata as m; print('deep_gemm', deep_gemm.__file__, m.version('sgl-deep-gemm'))"
    return
  fi
  if [ ! -f $DG/.built ]; then
    rm -rf $DG && cp -r .deepgemm $DG || return 1
    local FI
    FI=$(python3 -c "import flashinfer, os; print(os.path.dirname(flashinfer.__file__))")/data/cutlass/include
    ln -sfn "$FI/cutlass" $DG/deep_gemm/include/cutlass && ln -sfn "$FI/cute" $DG/deep_gemm/include/cute
    mkdir -p $DG/third-party/cutlass && ln -sfn "$FI" $DG/third-party/cutlass/include
    if [ -f $DG/prebuilt/_C.so ]; then
      cp $DG/prebuilt/_C.so $DG/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so && touch $DG/.built
    else
      python3 -c "import wheel.bdist_wheel" 2>/dev/null ||  # setup.py imports it; setuptools carries the same command
        sed -i 's/^from wheel.bdist_wheel import/from setuptools.command.bdist_wheel import/' $DG/setup.py
      export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
      local start
      start=$(date +%s)
      (cd $DG && MAX_JOBS=16 python3 setup.py build_ext --inplace) > "$OUT/deepgemm_build.log" 2>&1 &&
        touch $DG/.built; echo "DeepGEMM build exit $? after $(( $(date +%s) - start )) s"
    fi
  fi
  export PYTHONPATH=$DG${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__version__)"
}

deepgemm_compile_twice() {
  # DeepGEMM's kernels for the prefill range compiled at load as a server does (bench_deepgemm_precompile.py), into
  # its cache folder ($DG_JIT_CACHE_DIR, else ~/.deep_gemm; empty on a fresh machine), then again read back from it
  for run in "empty cache" "cache on disk"; do
    timeout 200 python3 benchmarks/kernels/bench_deepgemm_precompile.py --out "$OUT/deepgemm_precompile_${run// /_}.md" \
      --label "$run" 2>&1 | grep "^|"
  done
}

tiny_checkpoints() {
  # two tiny Qwen3-MoE checkpoints with different weights, BF16 and MXFP8: /tmp/tm_{bf16,mx}, /tmp/tm2_{bf16,mx}
  python3 - <<'PY'
from sglang_mxfp8.cli.tiny_model import write_qwen3_moe
from sglang_mxfp8.format.convert import convert
write_qwen3_moe("/tmp/tm_bf16", seed=0); write_qwen3_moe("/tmp/tm2_bf16", seed=1)
convert("/tmp/tm_bf16", "/tmp/tm_mx", force=True, progress=False); convert("/tmp/tm2_bf16", "/tmp/tm2_mx", force=True, progress=False)
PY
}

case "${1:-kernels}" in
fa3-install)
  python3 tools/ship_fa3.py install /tmp/fa3_chunks
  ;;
accuracy-prep)
  # needs accelerate in .gpu/wheels (transformers' GGUF loader asks for it)
  cat /tmp/gguf_chunks/chunk*.bin > /tmp/model.gguf
  echo "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046  /tmp/model.gguf" | sha256sum -c - || exit 1
  python3 - <<'PY'
import json, os, torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
out = "/tmp/coder-bf16"
tok = AutoTokenizer.from_pretrained("/tmp", gguf_file="model.gguf")
model = AutoModelForCausalLM.from_pretrained("/tmp", gguf_file="model.gguf", dtype=torch.bfloat16)
try:
    model.save_pretrained(out)
except ValueError:  # transformers 5.17 counts a GGUF-loaded model as quantized and will not save it
    os.makedirs(out, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, f"{out}/model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "bfloat16"
    cfg["architectures"] = [type(model).__name__]  # a GGUF-loaded config has none
    json.dump(cfg, open(f"{out}/config.json", "w"), indent=1)
tok.save_pretrained(out)
print(sorted(os.listdir(out)), sum(v.numel() for v in model.state_dict().values()) / 1e9, "B params")
PY
  sglang-mxfp8 convert /tmp/coder-bf16 /tmp/coder-mxfp8 --force
  python3 benchmarks/accuracy/upcycle_moe.py /tmp/coder-bf16 /tmp/coder-moe-bf16
  sglang-mxfp8 convert /tmp/coder-moe-bf16 /tmp/coder-moe-mxfp8 --force
  ;;
accuracy)
  # every served model in one command, one server at a time (about 1.5 min each for the 1.5B model)
  python3 benchmarks/accuracy/run_accuracy.py --out "$OUT" \
    --serve bf16=/tmp/coder-bf16 \
    --serve mx_flashinfer=/tmp/coder-mxfp8:"--fp8-gemm-backend flashinfer_trtllm" \
    --serve mx_triton=/tmp/coder-mxfp8:"--fp8-gemm-backend triton" \
    --serve moe_mx_triton=/tmp/coder-moe-mxfp8:"--fp8-gemm-backend flashinfer_trtllm --moe-runner-backend triton" \
    --serve moe_bf16=/tmp/coder-moe-bf16:"--moe-runner-backend triton" \
    --serve moe_mx_cutlass=/tmp/coder-moe-mxfp8:"--fp8-gemm-backend flashinfer_trtllm --moe-runner-backend flashinfer_cutlass" \
    --compare bf16,mx_flashinfer --compare bf16,mx_triton --compare moe_bf16,moe_mx_triton --compare bf16,moe_bf16 -- \
    --num-questions "${ACC_QUESTIONS:-1319}" --num-shots 8 --parallel 256 --max-new-tokens 512
  ;;
kernels)
  python3 -m pytest -q tests/gpu 2>&1 | tee "$OUT/pytest_gpu.txt"
  python3 benchmarks/kernels/bench_dense.py --out "$OUT/dense.md" --flashinfer 2>&1 | tail -30
  python3 benchmarks/kernels/bench_dense.py --out "$OUT/dense_graph.md" --flashinfer --timer graph 2>&1 | tail -30
  ;;
gsm8k)
  # the offline gsm8k benchmark against the real server (random tiny model: the pipeline, not accuracy)
  python3 -c 'from sglang_mxfp8.cli.tiny_model import write_qwen3_moe; from sglang_mxfp8.format.convert import convert; write_qwen3_moe("/tmp/gt_bf16", tokenizer=True); convert("/tmp/gt_bf16", "/tmp/gt_mx", force=True, progress=False)'
  python3 benchmarks/gsm8k/serve_and_bench.py /tmp/gt_mx --log-dir "$OUT" \
    --flags "--fp8-gemm-backend triton --moe-runner-backend triton" -- \
    --num-questions 200 --num-shots 5 --parallel 64 --max-new-tokens 64 --result-file "$OUT/gsm8k.jsonl"
  ;;
reliability)
  python3 benchmarks/reliability/refit_checks.py --out "$OUT" --refits "${REFITS:-100}"
  ;;
fi-moe)
  # FlashInfer's CUTLASS fused MoE on SM90 from the trimmed build (sglang_mxfp8/ops/flashinfer_moe_sm90.py): built on
  # an empty cache, then loaded by a second process as a restart does; ninja's per-object times kept
  for run in "empty cache" "restart"; do
    start=$(date +%s%N)
    timeout 480 python3 -c 'import logging; logging.basicConfig(level=logging.INFO, format="%(message)s")
from sglang_mxfp8.ops import flashinfer_moe_sm90 as f; f.fused_moe_api()' 2>&1 | tail -4
    echo "trimmed FlashInfer fused MoE, $run: $(( ($(date +%s%N) - start) / 1000000 )) ms ($(nproc) CPUs)"
  done
  find /tmp/fi_cache -name .ninja_log -path "*fp8_block_scale*" -exec cp {} "$OUT/fi_moe_ninja_log.txt" \;
  python3 -m pytest -q -rf tests/gpu/test_flashinfer_moe_sm90.py -k "not precompile" 2>&1 | tail -6
  # FI_BENCH=0: no MoE table (then the fi-serve phase, SERVE_TIMEOUT=seconds left, fits the same command)
  if [ "${FI_BENCH:-1}" = 1 ]; then
    timeout 180 python3 benchmarks/kernels/bench_flashinfer_moe_sm90.py --out "$OUT/fi_moe.md" 2>&1 | grep "^|\|trimmed\|Error"
  fi
  ;;
masked)
  # the masked W8A8 MoE for sizes off the 128 grid: its GPU tests (every Hopper MoE flag, a NaN token, graph replay,
  # refit, the gpt-oss-20b layer's memory), then its table against BF16 and SGLang's Triton block-FP8 MoE (on the grid, and
  # on the experts zero-padded to it off the grid: padding, the alternative to masking)
  python3 -m pytest -q -rf -s tests/gpu/test_hopper_kernels.py -k "off_grid or masked or gpt_oss" 2>&1 | grep "passed\|failed\|FAILED\|Error\|BF16 ("
  # MASKED_BENCH=0: the tests alone (then the off-grid phase fits the same command)
  if [ "${MASKED_BENCH:-1}" = 1 ]; then
    timeout 240 python3 benchmarks/kernels/bench_off_grid_moe.py --out "$OUT/off_grid_moe.md" 2>&1 | grep "^|\|BF16\|Error"
  fi
  ;;
fi-serve)
  # the README's stock command (flashinfer_trtllm dense, flashinfer_cutlass MoE) on the tiny MXFP8 Qwen3-MoE against
  # its BF16 twin; refit to the same checkpoint and to another, against a fresh server of the other
  tiny_checkpoints
  start=$(date +%s)
  python3 -c 'from sglang_mxfp8.ops import flashinfer_moe_sm90 as f; f.build()'
  echo "trimmed module ready (built or found) in $(( $(date +%s) - start )) s"
  FI="--fp8-gemm-backend flashinfer_trtllm --moe-runner-backend flashinfer_cutlass"
  timeout "${SERVE_TIMEOUT:-560}" python3 benchmarks/e2e/serve_check.py --out "$OUT" \
    --server bf16=/tmp/tm_bf16 \
    --server mx_fi=/tmp/tm_mx:"$FI" --refit mx_fi=/tmp/tm_mx,/tmp/tm2_mx \
    --server mx2_fi=/tmp/tm2_mx:"$FI" \
    --compare bf16,mx_fi --compare mx_fi,mx_fi+refit_same --compare mx2_fi,mx_fi+refit_other
  grep -h "sglang_mxfp8" "$OUT"/server_mx_fi.log | head -12
  ;;
off-grid)
  # hidden 576 and expert intermediate 96 (multiples of 32, not of 128): dense layers on the Triton W8A8 kernel's
  # masked tails, MoE on the masked W8A8 MoE, with each MoE flag that serves on Hopper
  python3 - <<'PY'
from sglang_mxfp8.cli.tiny_model import write_qwen3_moe
from sglang_mxfp8.format.convert import convert
for name, seed in (("og", 0), ("og2", 1)):
    write_qwen3_moe(f"/tmp/{name}_bf16", seed=seed, hidden=576, moe_intermediate=96)
    convert(f"/tmp/{name}_bf16", f"/tmp/{name}_mx", force=True, progress=False)
PY
  TR="--fp8-gemm-backend triton --moe-runner-backend triton"
  FI="--fp8-gemm-backend flashinfer_trtllm --moe-runner-backend flashinfer_cutlass"
  timeout 560 python3 benchmarks/e2e/serve_check.py --out "$OUT" \
    --server og_bf16=/tmp/og_bf16 \
    --server og_triton=/tmp/og_mx:"$TR" --refit og_triton=/tmp/og_mx,/tmp/og2_mx \
    --server og2_triton=/tmp/og2_mx:"$TR" \
    --server og_fi=/tmp/og_mx:"$FI" \
    --compare og_bf16,og_triton --compare og_triton,og_triton+refit_same --compare og2_triton,og_triton+refit_other \
    --compare og_bf16,og_fi --compare og_triton,og_fi
  grep -h "sglang_mxfp8.*MoE\|sglang_mxfp8.*experts" "$OUT"/server_og_fi.log | head -6
  ;;
jit-build)
  # each module on an empty cache, one after another with every CPU: FlashInfer's own dense fp8_blockscale_gemm_90, ours
  # from the DeepGEMM-only GEMM source (ops/flashinfer_blockscale_build.py), the trimmed fused MoE; ninja's per-object
  # times kept; then, on those builds, the GPU tests of both ops (ours against FlashInfer's full module bit for bit);
  # JIT_MODULES="trimmed fused MoE" (comma-separated names): those modules alone, then the fused MoE's GPU tests only
  export FLASHINFER_WORKSPACE_BASE=/tmp/fi_jit_build
  rm -rf $FLASHINFER_WORKSPACE_BASE
  IFS=, read -ra MODULES <<< "${JIT_MODULES:-flashinfer full dense,deepgemm-only dense,trimmed fused MoE}"
  for module in "${MODULES[@]}"; do
    start=$(date +%s%N)
    timeout 300 python3 - "$module" <<'PY' 2>&1 | grep -v "^\s*$" | tail -2
import sys
from flashinfer.jit.gemm import gen_fp8_blockscale_gemm_sm90_module
from sglang_mxfp8.ops import flashinfer_blockscale_build as fb, flashinfer_moe_sm90 as moe
build = {"flashinfer full dense": lambda: fb.build_spec(gen_fp8_blockscale_gemm_sm90_module()),
         "deepgemm-only dense": fb.build_dense, "trimmed fused MoE": moe.build}[sys.argv[1]]
build()
PY
    echo "| $module | $(( ($(date +%s%N) - start) / 1000000 )) ms | $(nproc) CPUs |"
  done
  for log in $(find $FLASHINFER_WORKSPACE_BASE -name .ninja_log); do
    cp "$log" "$OUT/ninja_log_$(basename "$(dirname "$log")").txt"
  done
  if [ -z "${JIT_MODULES:-}" ]; then
    python3 -m pytest -q -rf tests/gpu/test_hopper_kernels.py -k "(flashinfer or trimmed or backend_matches_reference) and not precompile" 2>&1 | tail -4
  fi
  python3 -m pytest -q -rf tests/gpu/test_flashinfer_moe_sm90.py -k "not precompile" 2>&1 | tail -4
  ;;
precompile)
  # the kernels FlashInfer's SM90 JIT compiles per tile config (dense GEMM; the fused MoE's grouped GEMMs, after the
  # fi-moe phase built its module): FlashInfer compiling alone must name exactly our enumeration, ours compiled first
  # by concurrent nvcc must give the same outputs bit for bit (minutes: FlashInfer compiles one kernel after another)
  python3 -m pytest -q -rf -s tests/gpu -k "precompile_compiles_exactly" 2>&1 | grep "passed\|failed\|FAILED\|Error\|RAN\|PRECOMPILE"
  ;;
startup)
  # start to /health_generate with empty compile caches and again on what that start left, BF16 then MXFP8
  # (FlashInfer dense GEMM, Triton MoE) (benchmarks/startup/bench_server_start.py); the extra runs in a second command
  # on the same machine (all in one would pass 10 minutes): STARTUP_ARGS="--compile-jobs-zero --build-first
  # --extras-only", MXFP8 with FlashInfer compiling its GEMM kernels alone and MXFP8 on caches filled by sglang-mxfp8
  # build; STARTUP_MODEL=e2e: the Qwen3-30B-A3B-shaped model e2e-prep wrote; STARTUP_MX_FLAGS: the MXFP8 server's
  # backend flags instead, e.g. "--fp8-gemm-backend flashinfer_trtllm --moe-runner-backend flashinfer_cutlass";
  # STARTUP_ARGS=--mx-restart-only: the MXFP8 restart a command whose time ran out left to do
  if [ "${STARTUP_MODEL:-tiny}" = e2e ]; then B=/tmp/e2e/bf16 M=/tmp/e2e/mxfp8; else tiny_checkpoints; B=/tmp/tm_bf16 M=/tmp/tm_mx; fi
  CACHES=/tmp/start_caches/${STARTUP_MODEL:-tiny}
  timeout "${STARTUP_TIMEOUT:-585}" python3 benchmarks/startup/bench_server_start.py --out "$OUT" --bf16 $B --mx $M \
    --label "${STARTUP_MODEL:-tiny}" --cache-root "$(dirname "$CACHES")" ${STARTUP_MX_FLAGS:+--mx-flags "$STARTUP_MX_FLAGS"} \
    ${STARTUP_ARGS:-} 2>&1 |
    grep "^|\|Error\|error"
  # MOE_TESTS=1: then the FlashInfer fused MoE's GPU tests on the module the MXFP8 start built (its cache folder)
  if [ "${MOE_TESTS:-0}" = 1 ]; then
    FLASHINFER_WORKSPACE_BASE=$CACHES/mx/flashinfer \
      python3 -m pytest -q -rf tests/gpu/test_flashinfer_moe_sm90.py -k "not precompile" 2>&1 | tail -4
  fi
  ;;
e2e-prep)
  # /tmp outlives the repo folder while the machine stays warm: the next e2e command reuses these checkpoints
  TESTS="moe or weight_only"
  if [ "${DEEPGEMM:-0}" = 1 ]; then
    # DeepGEMM's kernels into its disk cache (~/.deep_gemm), timed cold then warm (before the tests fill it); its GPU tests
    deepgemm_env || exit 1
    deepgemm_compile_twice
    TESTS="$TESTS or deepgemm"
  fi
  # PREP_TESTS=0: no GPU tests (they took 244 s of a 592 s DEEPGEMM=1 prep at 16 layers)
  [ "${PREP_TESTS:-1}" = 1 ] && python3 -m pytest -q -rf tests/gpu -k "$TESTS" 2>&1 | tail -8
  python3 benchmarks/e2e/bench_throughput.py --out "$OUT" --layers "${E2E_LAYERS:-8}" --prepare-only
  df -h /tmp | tail -1
  ;;
e2e)
  # FlashInfer SM90 GEMM kernels for every tile config compiled at load unless PRECOMPILE=0 (sglang_mxfp8/kernels/linear/flashinfer_sm90.py)
  export SGLANG_MXFP8_PRECOMPILE=${PRECOMPILE:-1}
  [ "${DEEPGEMM:-0}" = 1 ] && { deepgemm_env || exit 1; }  # DEEPGEMM=1: prefill batches (dense and MoE) on DeepGEMM
  # MoE batches of 2048+ tokens run SGLang's CUTLASS grouped MoE, of 1024+ DeepGEMM's with DEEPGEMM=1
  # (sglang_mxfp8/kernels/registry.py). Two servers
  # at 8 layers fit the 10-minute command with fixed-size rounds (each FlashInfer server precompiles for
  # 1.5-3 min); the 6 s rounds and the batch-128 profile should add about a minute per server (not yet
  # timed), so run e2e-prep first;
  # E2E_MX="NAME=[ENV=VALUE ...] FLAGS" adds an MXFP8 variant, e.g.
  # PRECOMPILE=0 E2E_LAYERS=4 E2E_MX="no CUTLASS prefill=SGLANG_MXFP8_DISABLED_KERNELS=cutlass_moe --fp8-gemm-backend flashinfer_trtllm --moe-runner-backend triton"
  # E2E_ARGS passes more options to bench_throughput.py, e.g. E2E_ARGS="--concurrency 16 128"; each timed round
  # runs ROUND_SECONDS (default 6) of back-to-back requests per client (ROUND_SECONDS=0: fixed 2 x c requests);
  # WINDOW_SECONDS=W instead: each concurrency in one run of clients with staggered starts, rated over --repeats
  # windows of W s in its steady state (bench_throughput.steady_windows)
  # the one-token GEMVs served: E2E_MX="no dense GEMV=SGLANG_MXFP8_DISABLED_KERNELS=gemv --fp8-gemm-backend flashinfer_trtllm --moe-runner-backend triton"
  # (or "no GEMV MoE=SGLANG_MXFP8_DISABLED_KERNELS=moe_gemv ..."), with E2E_ARGS="--concurrency 1 --profile-batch 1"
  # E2E_ARGS="--profile-prefill 4": also where a 1024-token prefill batch spends its GPU time, per server
  # On a fresh machine an MXFP8 server's first start captures its decode graphs in ~2 min (our Triton kernels
  # compile; BF16 ~45 s) and, unless e2e-prep ran with DEEPGEMM=1 here, compiles DeepGEMM's kernels while loading
  # (~95 s): e2e-prep and e2e do not fit one 10-minute command together
  # E2E_FLAGS: more launch flags for every server, after the base ones (the last of a repeated flag wins), e.g.
  # E2E_FLAGS="--attention-backend fa3" once fa3-install has run on this machine
  # SGLang's piecewise CUDA graphs for prefill batches, its default (sglang_mxfp8.cli.serving's base flags turn them off
  # for quick starts), unless PIECEWISE=0 (every e2e run before the sixteenth session ran without them)
  PCG=""; [ "${PIECEWISE:-1}" = 1 ] && PCG=" --enforce-piecewise-cuda-graph"
  MEASURE="--round-seconds ${ROUND_SECONDS:-6}"
  [ -n "${WINDOW_SECONDS:-}" ] && MEASURE="--window-seconds $WINDOW_SECONDS"
  timeout 580 python3 benchmarks/e2e/bench_throughput.py --out "$OUT" --layers "${E2E_LAYERS:-8}" \
    --flags "--cuda-graph-max-bs 128${PCG}${E2E_FLAGS:+ $E2E_FLAGS}" \
    --mx "flashinfer dense=--fp8-gemm-backend flashinfer_trtllm --moe-runner-backend triton" \
    ${E2E_MX:+--mx "$E2E_MX"} \
    --profile-steps 16 --profile-batch 1 128 $MEASURE ${E2E_ARGS:-}
  ;;
tp-shards)
  python3 benchmarks/kernels/bench_dense.py --out "$OUT/dense_tp2.md" --flashinfer --timer graph --tp 2 2>&1 | tail -30
  python3 benchmarks/kernels/bench_moe.py --out "$OUT/moe_tp2.md" --tp 2 2>&1 | grep "^|"
  ;;
tp2)
  # small Qwen3-MoE whose shards stay whole 128-blocks at TP2 (intermediate 256 -> 128 per rank);
  # MoE on Triton: flashinfer_cutlass is refused on SM90 (see the stock phase)
  python3 - <<'PY'
from sglang_mxfp8.cli.tiny_model import write_qwen3_moe
from sglang_mxfp8.format.convert import convert
for name, seed in (("tp_a", 0), ("tp_b", 1)):
    write_qwen3_moe(f"/tmp/{name}_bf16", seed=seed, moe_intermediate=256)
    convert(f"/tmp/{name}_bf16", f"/tmp/{name}_mx", force=True, progress=False)
PY
  FL="--fp8-gemm-backend flashinfer_trtllm --moe-runner-backend triton"
  python3 benchmarks/e2e/serve_check.py --out "$OUT" \
    --server tp1=/tmp/tp_a_mx:"$FL" \
    --server tp2=/tmp/tp_a_mx:"$FL --tp 2" --refit tp2=/tmp/tp_a_mx,/tmp/tp_b_mx \
    --server tp2_b=/tmp/tp_b_mx:"$FL --tp 2" \
    --compare tp1,tp2 --compare tp2,tp2+refit_same --compare tp2_b,tp2+refit_other
  ;;
moe)
  python3 benchmarks/kernels/bench_moe.py --out "$OUT/moe.md"
  python3 benchmarks/kernels/tune_moe.py --out "$OUT/tune_moe.md" 2>&1 | grep -v "Config file\|MoE kernel config"
  ;;
w8a16)
  python3 -m pytest -q tests/gpu -k weight_only 2>&1 | tail -3
  (cd benchmarks/kernels && timeout 300 python3 sweep_triton.py --kernel w8a16 --out "$OUT/sweep_w8a16.md"
   timeout 180 python3 sweep_triton.py --kernel moe_w8a16 --out "$OUT/sweep_moe_w8a16.md" 2>&1 | grep "^|")
  ;;
tables)
  python3 benchmarks/kernels/bench_dense.py --out "$OUT/dense_graph.md" --flashinfer --timer graph 2>&1 | tail -25
  python3 benchmarks/kernels/bench_moe.py --out "$OUT/moe.md" 2>&1 | grep "^|"
  ;;
cublas)
  python3 -m pytest -q tests/gpu -k "cublas or backend_matches" 2>&1 | tee "$OUT/pytest_cublas.txt" | tail -4
  python3 benchmarks/kernels/bench_dense.py --out "$OUT/dense_cublas.md" --flashinfer --timer graph --ms ${DENSE_MS:-16 64 128 256 512 1024 4096 8192} 2>&1 | grep "^|\|:"
  ;;
rowwise)
  python3 -m pytest -q tests/gpu -k "cublas or backend_matches" 2>&1 | tail -3  # the quantizer's NaN scale, served paths
  timeout 480 python3 benchmarks/kernels/bench_rowwise.py --out-dir "$OUT" 2>&1 | grep "^|\|plot\|Error"
  ;;
gemv)
  python3 -m pytest -q tests/gpu -k gemv 2>&1 | tee "$OUT/pytest_gemv.txt" | tail -30
  for k in ${GEMV_SWEEPS:-gemv moe_gemv}; do  # GEMV_SWEEPS=moe_gemv: the MoE's sweep alone
    (cd benchmarks/kernels && timeout 400 python3 sweep_triton.py --kernel "$k" --out "$OUT/sweep_$k.md" 2>&1 | grep "^|")
  done
  ;;
prefill)
  python3 -m pytest -q tests/gpu -k "moe or weight_only" 2>&1 | tail -4
  python3 benchmarks/kernels/bench_moe.py --out "$OUT/moe.md" 2>&1 | grep "^|"
  ;;
deepgemm)
  deepgemm_env || exit 1
  python3 -m pytest -q tests/gpu -k "deepgemm or prefill_moe or cutlass_grouped or moe_segments" 2>&1 | tail -4
  timeout 420 python3 benchmarks/kernels/bench_deepgemm_moe.py --out "$OUT/deepgemm_moe.md" 2>&1 | grep "^|\|Error\|error\|failed" | head -40
  [ -n "${DENSE:-}" ] && timeout 300 python3 benchmarks/kernels/bench_dense.py --out "$OUT/dense_deepgemm.md" --flashinfer \
    --deepgemm --timer graph --ms 16 128 1024 4096 8192 2>&1 | grep "^|\|:"  # DENSE=1: DeepGEMM's dense GEMM too
  [ -f .deepgemm/prebuilt/_C.so ] || strip --strip-debug -o "$OUT/deepgemm_C.so" /tmp/deepgemm/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so
  ;;
deepgemm-dense)
  deepgemm_env || exit 1
  python3 -m pytest -q -rf tests/gpu -k "deepgemm or prefill or cublas" 2>&1 | tail -12
  export DG_JIT_CACHE_DIR=/tmp/dg_probe  # an empty cache folder, then the same one again
  deepgemm_compile_twice
  unset DG_JIT_CACHE_DIR
  timeout 200 python3 benchmarks/kernels/bench_dense.py --out "$OUT/dense_deepgemm_prefill.md" --flashinfer --deepgemm \
    --timer graph --ms ${DENSE_MS:-256 512} 2>&1 | grep "^|\|:"
  ;;
prefill-host)
  # eager prefill layers: GPU time vs the host's time to issue them (carry .deepgemm for DeepGEMM's rows)
  deepgemm_env
  timeout 400 python3 benchmarks/kernels/bench_prefill_host.py --out "$OUT/prefill_host.md" 2>&1 | grep "^|\|Error"
  ;;
piecewise)
  # SGLang's piecewise CUDA graphs (its default: prefill batches up to the chunked prefill size replayed from graphs;
  # every other served run here turns them off): the same tiny MXFP8 model served without and with them, then refit
  tiny_checkpoints
  FL="--fp8-gemm-backend ${PIECEWISE_DENSE:-triton} --moe-runner-backend triton"
  EAGER=(--server mx_eager=/tmp/tm_mx:"$FL" --compare mx_eager,mx_piecewise)  # PIECEWISE_ONLY=1: the piecewise server alone
  [ -n "${PIECEWISE_ONLY:-}" ] && EAGER=()
  timeout ${PIECEWISE_TIMEOUT:-560} python3 benchmarks/e2e/serve_check.py --out "$OUT" \
    --server mx_piecewise=/tmp/tm_mx:"$FL --enforce-piecewise-cuda-graph" --refit mx_piecewise=/tmp/tm_mx,/tmp/tm2_mx \
    "${EAGER[@]}" --compare mx_piecewise,mx_piecewise+refit_same --compare mx_piecewise,mx_piecewise+refit_other
  grep -h "Capture piecewise\|Piecewise\|Error\|error" "$OUT"/server_mx_piecewise.log | head -8
  ;;
tune)
  python3 benchmarks/kernels/sweep_triton.py --out "$OUT/sweep.md"
  sglang-mxfp8 demo --workdir /tmp/demo 2>&1 | tee "$OUT/demo.txt"
  ;;
serve)
  tiny_checkpoints
  python3 benchmarks/e2e/serve_check.py --out "$OUT" \
    --server bf16=/tmp/tm_bf16 \
    --server mx_triton=/tmp/tm_mx:"--fp8-gemm-backend triton --moe-runner-backend triton" \
    --refit mx_triton=/tmp/tm_mx,/tmp/tm2_mx \
    --server mx2_fresh=/tmp/tm2_mx:"--fp8-gemm-backend triton --moe-runner-backend triton" \
    ${SERVE_EXTRA:-} \
    --compare bf16,mx_triton --compare mx_triton,mx_triton+refit_same --compare mx2_fresh,mx_triton+refit_other
  ;;
esac
