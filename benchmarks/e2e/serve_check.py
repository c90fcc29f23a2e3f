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
import time
from pathlib import Path

from sglang_mxfp8.cli.serving import Server, divergence

def compare(a, b):
    same = sum(x["ids"] == y["ids"] for x, y in zip(a, b))
    div = [divergence(x, y) for x, y in zip(a, b)]
    first = [len(x["ids"]) if n is None else n for x, (n, _) in zip(a, div)]
    diffs = [d for f, (_, d) in zip(first, div) if f]
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
