"""Refit reliability against a real server: soak, refit under load, corrupt refits.

Needs a GPU (bash benchmarks/run_h200.sh reliability). Checkpoints A and B are tiny random Qwen3-MoE
models converted to MXFP8; references come from fresh servers started on each.

1. soak: N refits alternating A/B; after each, greedy tokens identical to the fresh server's and
   logprobs within 1e-4; GPU memory after the last refit within 1 MiB of after the first.
2. under load: 64 requests in flight while refitting A -> B: none fails, each equals A's or B's reference.
3. corrupt refits (NaN weights, missing scale tensor, wrong scale shape, wrong weight dtype): the refit
   call fails naming the tensor, the server keeps serving A (checked by a request), a good refit works.
"""

import argparse
import json
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch
from safetensors.torch import load_file, save_file

from sglang_mxfp8.convert import convert
from sglang_mxfp8.serving import Server
from sglang_mxfp8.tiny_model import write_qwen3_moe

FLAGS = "--fp8-gemm-backend triton --moe-runner-backend triton"
BAD_TENSOR = "model.layers.0.mlp.experts.3.down_proj"


def gpu_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def same(a, b, tol=1e-4) -> bool:
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--refits", type=int, default=100)
    args = ap.parse_args()
    out, work = Path(args.out), Path("/tmp/reliability")
    out.mkdir(parents=True, exist_ok=True)
    ckpt = {}
    for name, seed in (("A", 0), ("B", 1)):
        write_qwen3_moe(work / f"{name}_bf16", seed=seed)
        convert(work / f"{name}_bf16", work / name, force=True, progress=False)
        ckpt[name] = work / name
    report = {}

    refs = {}
    for name in ("A", "B"):
        s = Server(f"fresh_{name}", str(ckpt[name]), FLAGS, 30300, out)
        try:
            s.wait()
            refs[name] = s.generate()
        finally:
            s.stop()

    s = Server("soak", str(ckpt["A"]), FLAGS, 30301, out)
    try:
        s.wait()
        ok, mem = 0, []
        for i in range(args.refits):
            target = "B" if i % 2 == 0 else "A"
            code, body = s.refit(str(ckpt[target]))
            ok += code == 200 and body.get("success") and same(s.generate(), refs[target])
            if i in (0, args.refits - 1):
                mem.append(gpu_mib())
        report["soak"] = {"refits": args.refits, "matching_fresh_server": ok, "gpu_mib_after_first_and_last": mem}
        print(report["soak"], flush=True)

        s.refit(str(ckpt["A"]))
        with ThreadPoolExecutor(64) as pool:
            futures = [pool.submit(s.generate) for _ in range(64)]
            time.sleep(0.2)
            code, body = s.refit(str(ckpt["B"]))
            results, failed = [], 0
            for f in futures:
                try:
                    results.append(f.result())
                except requests.RequestException:
                    failed += 1
        matches = sum(same(r, refs["A"]) or same(r, refs["B"]) for r in results)
        report["under_load"] = {"requests": 64, "failed": failed, "equal_to_A_or_B": matches, "refit": [code, body]}
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
    finally:
        s.stop()
    (out / "reliability.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
