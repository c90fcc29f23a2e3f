"""Refit reliability against a real server: soak, refit under load, corrupt refits.

Needs a GPU (bash benchmarks/run_h200.sh reliability). Checkpoints A and B are tiny random Qwen3-MoE
models converted to MXFP8; references come from fresh servers started on each.

1. soak: N refits alternating A/B; after each, greedy tokens identical to the fresh server's and
   logprobs within 1e-4; GPU memory after the last refit within 1 MiB of after the first.
   Every MXFP8 tensor keeps its storage (the plugin's per-load storage line) and decode batches keep
   running as CUDA graphs (SGLang's decode log line, --decode-log-interval 1).
2. under load: 64 requests around a refit A -> B (32 sent before, 32 during it): none fails, each
   equals A's or B's reference exactly (the soak server batches like the references; see
   refit_under_load). Mismatches are reported with where they diverge and the reference's top-two
   margin there.
3. corrupt refits (NaN weights, missing scale tensor, wrong scale shape, wrong weight dtype): the refit
   call fails naming the tensor, the server keeps serving A (checked by a request), a good refit works.
4. malformed checkpoints at start-up (the same four, K % 32 != 0 on a quantized layer, a config that
   says mxfp8 over BF16 weights): the server exits non-zero, promptly, with a line naming the tensor.
5. update_weights_from_tensor (RL weight sync, no disk): B's tensors sent from this process as CUDA
   IPC handles, weights and scales in separate calls; the next request equals B's fresh server.
"""

import argparse
import json
import os
import re
import signal
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch
from safetensors.torch import load_file, save_file

from sglang_mxfp8.format.convert import convert
from sglang_mxfp8.format.numerics import quantize_mxfp8
from sglang_mxfp8.cli.serving import Server
from sglang_mxfp8.cli.serving import divergence as first_divergence
from sglang_mxfp8.cli.tiny_model import write_qwen3_moe

FLAGS = "--fp8-gemm-backend triton --moe-runner-backend triton"
# one request (8 sequences) per batch and no prefix reuse: every batch as the references' (see refit_under_load)
SOAK_FLAGS = FLAGS + " --decode-log-interval 1 --max-running-requests 8 --disable-radix-cache"
BAD_TENSOR = "model.layers.0.mlp.experts.3.down_proj"


def gpu_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def same(a, b, tol=1e-4) -> bool:
    """Greedy tokens identical and logprobs within ``tol``, sequence by sequence."""
    return all(x["ids"] == y["ids"] and max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"])) <= tol
               for x, y in zip(a, b))


def corrupt_variants(a: Path, work: Path):
    tensors = load_file(str(a / "model.safetensors"))
    w, s = BAD_TENSOR + ".weight", BAD_TENSOR + ".weight_scale_inv"

    def variant(name, edit):
        d = work / name
        shutil.copytree(a, d, dirs_exist_ok=True)
        t = dict(tensors)
        edit(t)
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
        return name, d

    def nan(t):
        v = t[w].clone()
        v.view(torch.uint8)[5, 7] = 0x7F
        t[w] = v

    def wrong_shape(t):
        t[s] = t[s][:, :-1].contiguous()

    def wrong_dtype(t):
        t[w] = t[w].to(torch.bfloat16)

    return [variant("nan_weight", nan), variant("missing_scale", lambda t: t.pop(s)),
            variant("wrong_scale_shape", wrong_shape), variant("wrong_weight_dtype", wrong_dtype)]


def startup_variants(ckpt_a: Path, work: Path):
    """Corrupt copies of A for start-up, plus K % 32 != 0 on a quantized layer and mxfp8 over BF16 weights."""
    variants = corrupt_variants(ckpt_a, work / "startup")
    # experts' down_proj with K = 144 = 4.5 x 32, quantized anyway (our converter refuses such a model):
    # weight [N, 144] e4m3, scale [N, 5]
    k144 = write_qwen3_moe(work / "k144_bf16", moe_intermediate=144)
    tensors = {}
    for name, t in load_file(str(k144 / "model.safetensors")).items():
        if ".experts." in name:
            k = t.shape[-1]
            q, s = quantize_mxfp8(torch.nn.functional.pad(t.float(), (0, -k % 32)))
            t, tensors[name.replace(".weight", ".weight_scale_inv")] = q[:, :k].contiguous(), s
        tensors[name] = t
    bad_k = work / "k_not_multiple_of_32"
    bad_k.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(bad_k / "model.safetensors"), metadata={"format": "pt"})
    bf16 = work / "mxfp8_config_over_bf16"
    shutil.copytree(work / "A_bf16", bf16, dirs_exist_ok=True)
    quant = json.loads((ckpt_a / "config.json").read_text())["quantization_config"]
    for dst, src in ((bad_k, k144), (bf16, bf16)):  # both say mxfp8, as A does
        cfg = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    return variants + [("k_not_multiple_of_32", work / "k_not_multiple_of_32"), ("mxfp8_config_over_bf16", bf16)]


def check_startup(variants, out: Path, timeout=300):
    """Start every malformed checkpoint at once; each must exit non-zero with a line naming a tensor."""
    procs = {}
    for i, (name, path) in enumerate(variants):
        log = out / f"startup_{name}.log"
        cmd = ["python3", "-m", "sglang.launch_server", "--model-path", str(path), "--port", str(30500 + i),
               "--skip-tokenizer-init", "--attention-backend", "triton", "--mem-fraction-static", "0.05",
               "--disable-cuda-graph", *FLAGS.split()]
        procs[name] = (subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True),
                       log, time.time())
    report = {}
    for name, (proc, log, t0) in procs.items():
        try:
            code = proc.wait(timeout=max(1, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = "hung"
        text = log.read_text()
        errors = [line for line in text.splitlines()
                  if re.search(r"(Error|error|Exception):", line) and "Traceback" not in line]
        report[name] = {"exit": code, "seconds": round(time.time() - t0), "error": errors[-1][-300:] if errors else None,
                        "names_tensor": bool(errors and re.search(r"model\.layers\.\d+\.", errors[-1]))}
        print(name, report[name], flush=True)
    return report


def update_from_tensor(s: Server, ckpt: Path):
    """RL weight sync: the checkpoint's tensors as CUDA IPC handles, weights and scales in two calls."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    tensors = {k: v.cuda() for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    results = []
    for part in ([k for k in tensors if not k.endswith("_scale_inv")], [k for k in tensors if k.endswith("_scale_inv")]):
        payload = MultiprocessingSerializer.serialize([(k, tensors[k]) for k in part], output_str=True)
        r = requests.post(f"http://127.0.0.1:{s.port}/update_weights_from_tensor",
                          json={"serialized_named_tensors": [payload], "flush_cache": True}, timeout=300)
        results.append([r.status_code, r.json().get("success")])
    torch.cuda.synchronize()
    return results, tensors


def divergence(seq, ref) -> tuple:
    """(first differing position or None, the reference's top-two margin there, max logprob diff before)."""
    n, diff = first_divergence(seq, ref)
    return n, None if n is None else round(ref["margins"][n], 4), round(diff, 4)


def refit_under_load(s: Server, ckpt: dict, refs: dict) -> dict:
    """32 requests (8 sequences each) queued or in flight, refit A -> B, 32 more sent while it runs.

    The soak server runs one request at a time (--max-running-requests 8, no radix cache), so every
    batch has the references' composition and a completion must equal A's or B's reference exactly
    (tokens, logprobs within 1e-4): SGLang lets the request in flight finish before it loads and holds
    new ones until the load is done, so anything else is a torn model."""
    with ThreadPoolExecutor(65) as pool:
        futures = [pool.submit(s.generate) for _ in range(32)]
        time.sleep(0.2)
        refit = pool.submit(s.refit, str(ckpt["B"]))
        time.sleep(0.05)
        futures += [pool.submit(s.generate) for _ in range(32)]
        code, body = refit.result()
    report = {"requests": len(futures), "failed": 0, "equal_to_A": 0, "equal_to_B": 0, "equal_to_neither": 0,
              "refit": [code, body], "neither_details": []}
    for f in futures:
        try:
            result = f.result()
        except requests.RequestException:
            report["failed"] += 1
            continue
        name = next((n for n in "AB" if same(result, refs[n])), None)
        report[f"equal_to_{name or 'neither'}"] += 1
        if not name and len(report["neither_details"]) < 8:
            report["neither_details"].append({n: [divergence(x, y) for x, y in zip(result, refs[n])] for n in "AB"})
    return report


def log_counts(log: Path, since: int = 0) -> dict:
    text = log.read_text()[since:]
    return {
        "storage_unchanged_lines": len(re.findall(r"storage of all \d+ MXFP8 tensors unchanged", text)),
        "storage_moved_lines": len(re.findall(r"MXFP8 tensors moved since the first load", text)),
        "decode_batches_with_cuda_graph": len(re.findall(r"Decode batch.*cuda graph: True", text)),
        "decode_batches_without_cuda_graph": len(re.findall(r"Decode batch.*cuda graph: False", text)),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--refits", type=int, default=100)
    ap.add_argument("--skip-startup", action="store_true")
    args = ap.parse_args()
    out, work = Path(args.out), Path("/tmp/reliability")
    out.mkdir(parents=True, exist_ok=True)
    ckpt = {}
    for name, seed in (("A", 0), ("B", 1)):
        write_qwen3_moe(work / f"{name}_bf16", seed=seed)
        convert(work / f"{name}_bf16", work / name, force=True, progress=False)
        ckpt[name] = work / name
    report = {}

    # one server at a time: SGLang sizes its KV pool from the memory a load took, which servers
    # loading side by side inflate ("Not enough memory")
    refs = {}
    for i, name in enumerate("AB"):
        f = Server(f"fresh_{name}", str(ckpt[name]), FLAGS, 30300 + i, out)
        try:
            f.wait()
            refs[name] = f.generate(margins=True)
        finally:
            f.stop()
    s = Server("soak", str(ckpt["A"]), SOAK_FLAGS, 30302, out)
    try:
        s.wait()
        log_start = len(s.log.read_text())
        ok, mem = 0, []
        for i in range(args.refits):
            target = "B" if i % 2 == 0 else "A"
            code, body = s.refit(str(ckpt[target]))
            ok += code == 200 and body.get("success") and same(s.generate(), refs[target])
            if i in (0, args.refits - 1):
                mem.append(gpu_mib())
        report["soak"] = {"refits": args.refits, "matching_fresh_server": ok, "gpu_mib_after_first_and_last": mem,
                          **log_counts(s.log, log_start)}
        print(report["soak"], flush=True)

        s.refit(str(ckpt["A"]))
        report["under_load"] = refit_under_load(s, ckpt, refs)
        print(report["under_load"], flush=True)

        report["corrupt"] = {}
        s.refit(str(ckpt["A"]))
        for name, path in corrupt_variants(ckpt["A"], work):
            code, body = s.refit(str(path))
            still_a = same(s.generate(), refs["A"])
            report["corrupt"][name] = {"success": body.get("success"), "message": body.get("message", "")[:300],
                                       "still_serving_A": still_a}
            print(name, report["corrupt"][name], flush=True)
        code, body = s.refit(str(ckpt["B"]))
        report["good_refit_after_corrupt"] = body.get("success") and same(s.generate(), refs["B"])

        s.refit(str(ckpt["A"]))
        report["from_tensor"] = {}
        for target in ("B", "A"):
            calls, _ = update_from_tensor(s, ckpt[target])
            report["from_tensor"][target] = {"calls": calls, "equals_fresh_server": same(s.generate(), refs[target])}
            print("update_weights_from_tensor", target, report["from_tensor"][target], flush=True)
        report["server_log_totals"] = log_counts(s.log)
    finally:
        s.stop()
    (out / "reliability.json").write_text(json.dumps(report, indent=1))
    if not args.skip_startup:
        report["startup"] = check_startup(startup_variants(ckpt["A"], work), out)
    (out / "reliability.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
