"""SGLang's piecewise CUDA graphs (on by default in 0.5.10.post1) trace the model with torch.compile(fullgraph=True)
before capturing prefill graphs. Our MXFP8 linear layers must reach that trace as one opaque op each, computing
what the eager layer computes; traced into, their kernels' host code breaks the graph.

Run on the CPU: SGLang's real Mxfp8 linear method on an H200's kernel choice (our Triton W8A8 and weight-only
kernels, in Triton's interpreter), traced by torch.compile with SGLang's piecewise flag set.
"""

from conftest import run_python, importable_tests_env
import pytest

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang

CODE = r"""
import torch
import sglang.srt.layers.quantization.fp8 as fp8
import sys
from sglang_mxfp8.cli.doctor import KNOWN_GPUS
from sglang_mxfp8.format.numerics import quantize_mxfp8
from sglang_mxfp8.platform import GpuSpec
from sglang_mxfp8 import compat
from sglang_mxfp8.sglang import quant_methods
import conftest

flags = sys.modules[compat.sglang_object("piecewise_graph_flag").__module__]  # where this SGLang keeps it
enable_piecewise_cuda_graph = (getattr(flags, "enable_piecewise_cuda_graph", None)
                               or flags.enable_tc_piecewise_cuda_graph)

conftest.init_fp8_gemm_config(conftest.set_server_args(fp8_gemm_runner_backend="triton"))
quant_methods.current_gpu = lambda: GpuSpec(*KNOWN_GPUS["h200"])  # the kernel choice an H200 gets
fp8.get_tensor_model_parallel_world_size = lambda: 1  # no process group on this machine: one GPU's sizes
torch.manual_seed(0)
n, k = 320, 256
layers = [conftest.mxfp8_linear(prefix, *quantize_mxfp8(torch.randn(n, k) * torch.logspace(-2, 1, k)))
          for prefix in ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj")]
print("backend", layers[0].quant_method.plan.base.name)
bias = torch.randn(n).to(torch.bfloat16)

def two_layers(x):
    h = layers[0].quant_method.apply(layers[0], x, bias)
    return layers[1].quant_method.apply(layers[1], h[:, :k].contiguous())

graphs = []
def keep_graph(gm, example_inputs):
    graphs.append(gm)
    return gm.forward

compiled = torch.compile(two_layers, fullgraph=True, backend=keep_graph, dynamic=False)
for m in (7, 200):  # the weight-only kernel's batch and the W8A8 kernel's
    x = torch.randn(m, k).to(torch.bfloat16)
    x[m // 2, 3] = float("nan")  # wherever the NaN goes, the traced layers put it in the same places
    eager = two_layers(x)
    with enable_piecewise_cuda_graph():
        traced = compiled(x)
    ops = [str(node.target) for node in graphs[-1].graph.nodes if node.op == "call_function"]
    print(m, ops.count("sglang_mxfp8.linear"), len(ops) - ops.count("sglang_mxfp8.linear"),
          torch.equal(traced.isnan(), eager.isnan()), torch.equal(torch.nan_to_num(traced), torch.nan_to_num(eager)))
"""


def test_linear_layers_trace_as_one_op_each_and_compute_the_eager_result():
    p = run_python(CODE, {"TRITON_INTERPRET": "1", **importable_tests_env()}, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert lines[0] == "backend triton_w8a8"
    # per batch: our two ops, the slice between them (getitem), the same output bit for bit and NaN for NaN
    assert [line.split() for line in lines[1:]] == [["7", "2", "1", "True", "True"], ["200", "2", "1", "True", "True"]]
