"""End-to-end check of served MXFP8 vs BF16 with the stock SGLang launcher, plus disk refits.

For each server spec (name=CKPT[:extra flags]) it starts ``python -m sglang.launch_server``, sends
fixed prompts as input_ids (greedy, with logprobs), optionally refits with /update_weights_from_disk
(same path, then another checkpoint) and records tokens and logprobs. Comparisons are printed and
written as JSON; server logs are kept for the plugin's own log lines.

    python benchmarks/e2e/serve_check.py --out OUT --server bf16=CKPT_BF16 \
        --server mx=CKPT_MX:"--fp8-gemm-backend triton" --refit mx=CKPT_MX,CKPT_MX2 --fresh mx2=CKPT_MX2
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

BASE_FLAGS = (
    "--attention-backend triton --sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.3 "
    "--disable-piecewise-cuda-graph --skip-tokenizer-init --cuda-graph-max-bs 16"
)
PROMPTS = [[1, 17 + i, 300 + 7 * i, 42, 999 - i, 5, 77 + 3 * i, 512] for i in range(8)]


class Server:
    def __init__(self, name, ckpt, flags, port, log_dir):
        self.name, self.ckpt, self.port = name, ckpt, port
        self.log = Path(log_dir) / f"server_{name}.log"
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", ckpt, "--port", str(port)]
        cmd += shlex.split(BASE_FLAGS) + shlex.split(flags)
        self.cmd = " ".join(cmd)
        print(f"[{name}] {self.cmd}", flush=True)
        self.t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout=400):
        url = f"http://127.0.0.1:{self.port}/health_generate"
        while time.time() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"[{self.name}] exited {self.proc.returncode}; tail:\n{self.log.read_text()[-3000:]}")
            try:
                if requests.get(url, timeout=5).status_code == 200:
                    print(f"[{self.name}] up after {time.time() - self.t0:.0f} s", flush=True)
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise TimeoutError(f"[{self.name}] not up after {timeout} s")

    def generate(self, max_new_tokens=16):
        r = requests.post(
            f"http://127.0.0.1:{self.port}/generate",
            json={"input_ids": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                              "ignore_eos": True}, "return_logprob": True},
            timeout=120,
        )
        r.raise_for_status()
        out = []
        for item in r.json():
            lp = item["meta_info"]["output_token_logprobs"]
            out.append({"ids": [t[1] for t in lp], "logprobs": [t[0] for t in lp]})
        return out

    def refit(self, path):
        r = requests.post(f"http://127.0.0.1:{self.port}/update_weights_from_disk", json={"model_path": path}, timeout=300)
        return r.status_code, r.json()

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001
            os.killpg(self.proc.pid, signal.SIGKILL)


def compare(a, b):
    same = sum(x["ids"] == y["ids"] for x, y in zip(a, b))
    first = [next((i for i, (p, q) in enumerate(zip(x["ids"], y["ids"])) if p != q), len(x["ids"])) for x, y in zip(a, b)]
    diffs = [abs(p - q) for x, y, f in zip(a, b, first) for p, q in zip(x["logprobs"][:f], y["logprobs"][:f])]
    return {"identical_sequences": f"{same}/{len(a)}", "max_logprob_diff_before_divergence": max(diffs) if diffs else None,
            "mean_first_divergence": sum(first) / len(first)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--server", action="append", default=[], help="name=CKPT[:flags]")
    ap.add_argument("--refit", action="append", default=[], help="name=SAME_PATH,OTHER_PATH for a started server")
    ap.add_argument("--compare", action="append", default=[], help="a,b: compare two results")
    ap.add_argument("--port", type=int, default=30100)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    refits = dict(r.split("=", 1) for r in args.refit)
    results, report = {}, {"servers": {}, "comparisons": {}}
    for i, spec in enumerate(args.server):
        name, rest = spec.split("=", 1)
        ckpt, _, flags = rest.partition(":")
        s = Server(name, ckpt, flags, args.port + i, out)
        try:
            s.wait()
            info = {"cmd": s.cmd, "startup_s": round(time.time() - s.t0, 1)}
            results[name] = s.generate()
            if name in refits:
                same, other = refits[name].split(",")
                info["refit_same"] = s.refit(same)
                results[f"{name}+refit_same"] = s.generate()
                info["refit_other"] = s.refit(other)
                results[f"{name}+refit_other"] = s.generate()
            report["servers"][name] = info
        finally:
            s.stop()
        log = s.log.read_text()
        report["servers"].setdefault(name, {})["plugin_lines"] = [l for l in log.splitlines() if "sglang_mxfp8" in l][:12]
        print(json.dumps(report["servers"][name], indent=1), flush=True)
    for pair in args.compare:
        a, b = pair.split(",")
        report["comparisons"][pair] = compare(results[a], results[b])
        print(pair, report["comparisons"][pair], flush=True)
    (out / "serve_check.json").write_text(json.dumps({"report": report, "results": results}, indent=1))


if __name__ == "__main__":
    main()
