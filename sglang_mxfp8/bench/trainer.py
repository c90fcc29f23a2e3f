"""A trainer's weight sync, as RL stacks send it to a server on the same GPU: named CUDA tensors (or one flattened
bucket of them) serialized as handles for SGLang's ``update_weights_from_tensor``, a checkpoint's tensors in file
order in buckets of a bounded size."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, List, Tuple

import requests

if TYPE_CHECKING:
    import torch

BUCKET_BYTES = 512 << 20  # a bucket of a trainer's update (RL stacks send a few hundred MB at a time)


def update_weights_from_tensor(port: int, named: List[Tuple[str, "torch.Tensor"]], bucket: bool = False,
                               flush_cache: bool = True) -> Tuple[bool, str]:
    """SGLang's tensor refit endpoint, as a trainer on the same GPU calls it: the named CUDA tensors serialized
    (handles, not data) for rank 0; ``bucket``: flattened into one tensor first (SGLang's ``flattened_bucket``)."""
    import torch
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    on_gpu = [(n, t.to("cuda")) for n, t in named]
    sent, load_format = on_gpu, None
    if bucket:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        flat = FlattenedTensorBucket(named_tensors=on_gpu)
        sent = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
        load_format = "flattened_bucket"
    payload = MultiprocessingSerializer.serialize(sent, output_str=True)
    r = requests.post(f"http://127.0.0.1:{port}/update_weights_from_tensor", timeout=900,
                      json={"serialized_named_tensors": [payload], "load_format": load_format,
                            "flush_cache": flush_cache})
    torch.cuda.synchronize()
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    return r.status_code == 200 and bool(body.get("success")), f"{r.status_code}: {body.get('message', r.text[:200])}"


def buckets(ckpt: Path, bucket_bytes: int = BUCKET_BYTES) -> Iterator[List[Tuple[str, "torch.Tensor"]]]:
    """``ckpt``'s tensors in file and key order, grouped into buckets of at most ``bucket_bytes`` (a larger tensor
    alone), read on the host. An MXFP8 weight's scale stays in its weight's bucket (one update carries both, as the
    server checks it), whatever that bucket's size."""
    from safetensors import safe_open

    group, size = [], 0
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                nbytes = t.numel() * t.element_size()
                scale_of_last = bool(group) and name.startswith(group[-1][0] + "_scale")
                if group and size + nbytes > bucket_bytes and not scale_of_last:
                    yield group
                    group, size = [], 0
                group.append((name, t))
                size += nbytes
    if group:
        yield group


def tensor_refit(port: int, ckpt: Path, bucket_bytes: int = BUCKET_BYTES) -> dict:
    """One whole-model update from a trainer's tensors: ``ckpt``'s tensors in flattened buckets, each put on the GPU
    and flattened before the clock runs (a trainer holds its weights there), then sent; the last flushes the cache;
    then one token generated, since an MXFP8 server finishes an update (its post-load processing) before its next
    forward. The seconds from the first send to that token, and the parts."""
    import torch

    send_s, sent_bytes, count = 0.0, 0, 0
    groups = list(buckets(ckpt, bucket_bytes))
    for i, group in enumerate(groups):
        on_gpu = [(n, t.to("cuda")) for n, t in group]
        torch.cuda.synchronize()
        start = time.perf_counter()
        ok, answer = update_weights_from_tensor(port, on_gpu, bucket=True, flush_cache=i == len(groups) - 1)
        send_s += time.perf_counter() - start
        if not ok:
            raise RuntimeError(f"update_weights_from_tensor (bucket {i + 1} of {len(groups)} from {ckpt}) answered "
                               f"{answer}")
        sent_bytes += sum(t.numel() * t.element_size() for _, t in on_gpu)
        count += len(on_gpu)
        del on_gpu
    start = time.perf_counter()
    r = requests.post(f"http://127.0.0.1:{port}/generate", timeout=600,
                      json={"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    r.raise_for_status()
    first_forward_s = time.perf_counter() - start
    return {"seconds": send_s + first_forward_s, "send_s": send_s, "first_forward_s": first_forward_s,
            "buckets": len(groups), "tensors": count, "bytes": sent_bytes, "bucket_bytes": bucket_bytes}
