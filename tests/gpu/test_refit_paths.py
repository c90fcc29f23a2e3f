"""Every refit path on one server under the recommended flags, with the first and last decoder layers kept BF16
(``convert --keep-bf16 first:1 --keep-bf16 last:1``): refits from disk and as a trainer's tensors (MXFP8 tensors, and
the BF16 checkpoint's tensors, quantized by the server), alternating two checkpoints; after each, the greedy outputs
equal those of a fresh server on the checkpoint refitted to. From the second load on, the MXFP8 tensors are copied
straight where the first load put them (sglang/direct.py), which the server log says."""

import os
import socket

import pytest
import requests
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper (SM90) GPU; run python -m pytest tests/gpu on an H100/H200")

FLAGS = ("--attention-backend triton --sampling-backend pytorch --grammar-backend none --skip-tokenizer-init "
         "--mem-fraction-static 0.3 --cuda-graph-max-bs 16 --fp8-gemm-backend flashinfer_trtllm "
         "--moe-runner-backend flashinfer_cutlass")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from sglang_mxfp8.bench.models import negated
    from sglang_mxfp8.bench.tiny_model import write_qwen3_moe
    from sglang_mxfp8.format.convert import convert

    root = tmp_path_factory.mktemp("refit-paths")
    bf16 = write_qwen3_moe(root / "bf16", seed=5, device="cuda", vocab=2048, std=0.1, layers=4)
    a = root / "A"
    convert(bf16, a, device="cuda", keep_bf16=["first:1", "last:1"], progress=False)
    return {"bf16": bf16, "A": a, "B": negated(a, root / "B")}


def test_every_refit_path_gives_a_fresh_servers_outputs_with_layers_kept_bf16(checkpoints, tmp_path):
    from sglang_mxfp8.bench.refusals import update_weights_from_disk
    from sglang_mxfp8.bench.served import prompt_outputs
    from sglang_mxfp8.bench.serving import Server
    from sglang_mxfp8.bench.trainer import tensor_refit

    logs = tmp_path / "logs"
    fresh = {}
    for name in ("B", "A"):  # the server on A stays up for the refits
        server = Server(f"refit-paths-{name}", str(checkpoints[name]), FLAGS, _port(), logs, base="")
        try:
            server.wait(timeout=600)
            fresh[name] = prompt_outputs(server.port)
        finally:
            if name == "B" or name not in fresh:
                server.stop()
    assert fresh["A"] != fresh["B"]

    def outputs():
        requests.post(f"http://127.0.0.1:{server.port}/flush_cache", timeout=60).raise_for_status()
        return prompt_outputs(server.port)

    steps = [("disk", "B"), ("disk", "A"), ("tensors", "B"), ("bf16 tensors", "A"), ("disk", "B"), ("tensors", "A")]
    try:
        for source, name in steps:
            if source == "disk":
                ok, answer = update_weights_from_disk(server.port, checkpoints[name])
                assert ok, (source, name, answer)
            else:
                tensor_refit(server.port, checkpoints["bf16" if source == "bf16 tensors" else name])
            assert outputs() == fresh[name], (source, name)
    finally:
        server.stop()
    log = server.log.read_text(errors="replace")
    direct = [line for line in log.splitlines() if "copied straight where they land" in line]
    assert len(direct) >= len(steps), log[-3000:]
    assert "moved since" not in log and "tensors moved" not in log
    if os.environ.get("REFIT_PATHS_LOG"):
        print("\n".join(direct))
