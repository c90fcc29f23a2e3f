"""Peak host memory of ``sglang-mxfp8 convert`` on a sharded checkpoint, vs the largest shard.

Writes a random Llama-like checkpoint of SHARDS shards (SHARD_MB each) and converts it in a child
process whose peak RSS (ru_maxrss) is reported.

    python benchmarks/convert/peak_memory.py --shards 4 --shard-mb 256
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--shard-mb", type=int, default=256)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "bf16", Path(tmp) / "mx"
        src.mkdir()
        k = 4096
        rows = args.shard_mb * 2**20 // (2 * k)
        weight_map = {}
        for i in range(args.shards):
            name = f"model.layers.{i}.mlp.down_proj.weight"
            shard = f"model-{i + 1:05d}-of-{args.shards:05d}.safetensors"
            save_file({name: torch.randn(rows, k, dtype=torch.bfloat16)}, str(src / shard))
            weight_map[name] = shard
        (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        code = (
            "import resource, sys; from sglang_mxfp8.format.convert import convert\n"
            f"convert({str(src)!r}, {str(dst)!r}, progress=False)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
        )
        base = subprocess.run([sys.executable, "-c", "import resource, torch, safetensors, tqdm; import sglang_mxfp8.convert;"
                               "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"], capture_output=True, text=True, check=True)
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        base_mb, peak_mb = int(base.stdout.split()[-1]) / 1024, int(run.stdout.split()[-1]) / 1024
        total = args.shards * args.shard_mb
        print(f"checkpoint {total} MiB in {args.shards} shards of {args.shard_mb} MiB: converter peak RSS {peak_mb:.0f} MiB, "
              f"of which {base_mb:.0f} MiB is the interpreter with torch imported; "
              f"working set {peak_mb - base_mb:.0f} MiB = {(peak_mb - base_mb) / args.shard_mb:.2f} x one shard")


if __name__ == "__main__":
    main()
