"""Refused refits never take a server down (a real SGLang server per case, a small random Qwen3-MoE): every kind of
refit the plugin refuses, from disk and from a trainer's tensors, in a random order and repeated, with accepted refits
between; after each the server answers, a refused one keeps the outputs, an accepted one gives a fresh server's, and
torch.compile never recompiles. Under piecewise CUDA graphs (SGLang's default) and without, for each Hopper MoE flag.

``REFUSALS_CASES`` picks cases by id (comma-separated, e.g. ``flashinfer_cutlass-pcg``); ``REFUSALS_FRESH_B=0`` starts
no fresh server on the second checkpoint (its outputs are then those of its first accepted refit)."""

import json
import os
import socket

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper (SM90) GPU; run python -m pytest tests/gpu on an H100/H200")

# (MoE flag, piecewise CUDA graphs, also a fresh server on the second checkpoint)
CASES = [("flashinfer_cutlass", True, True), ("flashinfer_cutlass", False, False), ("triton", True, False),
         ("auto", False, False)]
IDS = [f"{flag}-{'pcg' if pcg else 'no-pcg'}" for flag, pcg, _ in CASES]
WANTED = {c for c in os.environ.get("REFUSALS_CASES", "").split(",") if c}
BASE = ("--attention-backend triton --sampling-backend pytorch --grammar-backend none --skip-tokenizer-init "
        "--mem-fraction-static 0.3 --cuda-graph-max-bs 16 --fp8-gemm-backend flashinfer_trtllm")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from sglang_mxfp8.bench.models import negated
    from sglang_mxfp8.bench.tiny_model import write_qwen3_moe
    from sglang_mxfp8.format.convert import convert

    root = tmp_path_factory.mktemp("refusals")
    bf16 = write_qwen3_moe(root / "bf16", seed=3, device="cuda", vocab=2048, std=0.1)  # ACCURACY_PROMPTS' ids < 2048
    a = root / "A"
    convert(bf16, a, device="cuda")
    return {"A": a, "B": negated(a, root / "B-negated")}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("flag,pcg,fresh_b", CASES, ids=IDS)
def test_refused_refits_in_random_order_keep_the_server_serving(checkpoints, tmp_path, flag, pcg, fresh_b):
    from sglang_mxfp8.bench.refusals import SERVER_ENV, RefitSequence, dump, shuffled_steps, summary
    from sglang_mxfp8.bench.served import prompt_outputs
    from sglang_mxfp8.bench.serving import Server

    case = f"{flag}-{'pcg' if pcg else 'no-pcg'}"
    if WANTED and case not in WANTED:
        pytest.skip(f"not in REFUSALS_CASES={','.join(sorted(WANTED))}")
    flags = f"{BASE} --moe-runner-backend {flag}" + ("" if pcg else " --disable-piecewise-cuda-graph")
    logs = tmp_path / "logs"
    fresh = {}
    if fresh_b and os.environ.get("REFUSALS_FRESH_B") != "0":
        server = Server(f"{case}-fresh-B", str(checkpoints["B"]), flags, _port(), logs, env=SERVER_ENV, base="")
        try:
            server.wait(timeout=600)
            fresh["B"] = prompt_outputs(server.port)
        finally:
            server.stop()
    server = Server(case, str(checkpoints["A"]), flags, _port(), logs, env=SERVER_ENV, base="")
    try:
        server.wait(timeout=600)
        result = RefitSequence(server.port, checkpoints, server.log, tmp_path, prompt_outputs, seed=1).run(
            shuffled_steps(seed=len(case), repeats=1), fresh)
    finally:
        server.stop()
    out = os.environ.get("REFUSALS_OUT")
    if out:
        dump({"case": case, "flags": flags, **result}, __import__("pathlib").Path(out) / f"refusals-{case}.json")
    print(case, summary(result))
    bad = [s for s in result["steps"] if not (s["answered"] and s["outputs_as_expected"]
                                              and s["success"] == s["expected_success"])]
    assert not bad, json.dumps(bad, indent=1)
    assert result["recompiles"] == 0 and not result["scheduler_died"], summary(result)
    assert result["refused"] >= 13 and result["accepted"] >= 4
