"""Does DeepGEMM's first kernel compile depend on what the process imported before ``deep_gemm``? Each case runs
in a process of its own: import what it names, then one dense FP8 GEMM through deepgemm_sm90.dense_gemm (which
compiles a kernel on first use). Prints one line per case: exit code (-11: segmentation fault) and the order.

    python benchmarks/kernels/probe_deepgemm_import_order.py
"""

import os
import subprocess
import sys
import tempfile

GEMM = """
import torch
from sglang_mxfp8.ops.deepgemm_sm90 import dense_gemm
from sglang_mxfp8.format.numerics import quantize_mxfp8
from sglang_mxfp8.format.refit import BlockScaleConverter
q, s = quantize_mxfp8(torch.randn(2048, 4096, device="cuda") * 0.02)
c = BlockScaleConverter(1, 2048, 4096, 128, q.device, "probe"); c.refresh(q, s)
out = dense_gemm(torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16), q, c.block_scale[0])
torch.cuda.synchronize(); print("ok", float(out.float().abs().mean()))
"""
FLASHINFER_GEMM = """
from flashinfer.gemm import fp8_blockscale_gemm_sm90
w = torch.zeros(2048, 4096, dtype=torch.float8_e4m3fn, device="cuda")
fp8_blockscale_gemm_sm90(torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16), w, None,
                         torch.ones(16, 32, device="cuda"), out_dtype=torch.bfloat16)
"""
CASES = {
    "deep_gemm imported first": "import torch, deep_gemm\n" + GEMM,
    "flashinfer.gemm imported, then deep_gemm": "import torch, flashinfer.gemm, deep_gemm\n" + GEMM,
    "FlashInfer's SM90 GEMM run, then deep_gemm imported": "import torch\n" + FLASHINFER_GEMM + "import deep_gemm\n" + GEMM,
    "sglang.srt.layers.quantization.fp8 imported, then deep_gemm": "import torch, sglang.srt.layers.quantization.fp8, deep_gemm\n" + GEMM,
    "deep_gemm imported first, then FlashInfer's SM90 GEMM run": "import torch, deep_gemm\n" + FLASHINFER_GEMM + GEMM,
}

for name, code in CASES.items():
    env = dict(os.environ, DG_JIT_CACHE_DIR=tempfile.mkdtemp())  # each case compiles from an empty cache
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    last = (p.stdout.strip().splitlines() or [""])[-1]
    print(f"| {name} | exit {p.returncode} | {last or p.stderr.strip().splitlines()[-1][:100] if p.stderr.strip() else ''} |", flush=True)
