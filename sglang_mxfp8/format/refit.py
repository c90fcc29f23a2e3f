"""Idempotent, refit-safe in-place conversion of MXFP8 weights to Hopper block scales.

SGLang's loader writes checkpoint tensors (e4m3 weight, uint8 [rows, K/32] scales) into the same
parameters on every load and then runs post-load processing again. We convert the weight *in place*
(no second FP8 copy) and write the float32 block scales into a buffer allocated once, so storage
never moves and captured CUDA graphs stay valid.

To know what it already did, the converter keeps per-row fingerprints of the weight as converted
(and as loaded), and of the scale row. On each call a row is

- *stale-converted* if it still holds the bytes we wrote and they differ from what was loaded:
  nothing was reloaded there, so it is left alone (running twice never converts twice);
- *fresh* otherwise (reloaded, or a row the conversion did not change): converted from scratch.

A 128x128 block mixing the two kinds (a reload of part of a block), or a scale row reloaded
without its weight, cannot be made right from what is in memory and raises
:class:`PartialReloadError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .numerics import (E8M0_NAN, MX_BLOCK, ScaleRounding, block_exponents, count_shifted, exponents_to_scales,
                       quantize_mxfp8, shift_to_block_exponents)

_SIG_CHUNK_BYTES = 1 << 24
_CONVERT_CHUNK_ELEMENTS = 1 << 24  # a whole-weight conversion's step: ~0.4 GB of float32 temporaries at most


class PartialReloadError(RuntimeError):
    pass


def _row_fingerprints(t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Weighted byte sums per row (int64) of a 2-D tensor, written into ``out``; chunked."""
    b = t.contiguous().view(torch.uint8)
    r, width = b.shape
    coeff = torch.arange(1, width + 1, device=b.device, dtype=torch.int64) * 2654435761 % 1000003 + 1
    step = max(1, _SIG_CHUNK_BYTES // (8 * width))
    for r0 in range(0, r, step):
        out[r0 : r0 + step] = (b[r0 : r0 + step].to(torch.int64) * coeff).sum(dim=1)
    return out


def validate_loaded(weight: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    """Refuse checkpoint data that would compute garbage silently: NaN weights or scales, missing scales.

    A missing scale tensor leaves SGLang's zero-initialised bytes (2**-127) under real weights.
    """
    rows, k = weight.shape[-2:]
    w = weight.reshape(-1, k).view(torch.uint8)
    s = scale.reshape(-1, k // MX_BLOCK)
    if bool(torch.any(s == 255)):
        row = int((s == 255).any(dim=1).nonzero()[0])
        raise ValueError(f"{name}: scale row {row} holds NaN (0xFF): the checkpoint has non-finite values there")
    if bool(torch.any((w & 0x7F) == 0x7F)):
        row = int(((w & 0x7F) == 0x7F).any(dim=1).nonzero()[0])
        raise ValueError(f"{name}: weight row {row} holds NaN e4m3 values; fix the checkpoint")
    nonzero_blocks = (w & 0x7F).reshape(w.shape[0], -1, MX_BLOCK).amax(-1) > 0
    if bool(torch.any((s == 0) & nonzero_blocks)):
        row = int(((s == 0) & nonzero_blocks).any(dim=1).nonzero()[0])
        raise ValueError(
            f"{name}: scale row {row} is zero under nonzero weights, as if its scale tensor was never loaded; "
            "check that the checkpoint has a weight_scale_inv (uint8 [N, K/32]) for this weight"
        )


FLOAT_WEIGHTS = (torch.bfloat16, torch.float16, torch.float32)  # a trainer's weights, quantized on arrival


def refused_update(named: List[Tuple[str, torch.Tensor]], scale_name: str = "weight_scale_inv") -> Optional[str]:
    """Why a weight update sent as named tensors (SGLang's ``update_weights_from_tensor``) must be refused before any
    of it is written, or None. A load writes tensor after tensor into the served weights, so a refusal half-way
    through would serve a mix; everything a post-load check would refuse is checked here first: an e4m3 weight and
    its UE8M0 scale ``[..., K/32]`` arrive together, float8 weights are e4m3, scale bytes are not NaN (255), e4m3
    bytes are not NaN, float tensors are finite. The values are read on their device with one host sync."""
    names = dict(named)
    problems, flags = [], []
    for name, t in named:
        if name.endswith("." + scale_name):
            weight = names.get(name[: -len(scale_name)] + "weight")
            if t.dtype != torch.uint8:
                problems.append(f"{name}: the scale is {t.dtype}, expected torch.uint8 (UE8M0, one byte per "
                                f"{MX_BLOCK} weights along K)")
            elif weight is None:
                problems.append(f"{name}: a scale without its weight {name[: -len(scale_name)]}weight in this "
                                "update; send each MXFP8 weight with its scale in the same call")
            else:
                flags.append((name, "holds NaN scale bytes (255)", (t == E8M0_NAN).any()))
        elif t.dtype == torch.float8_e4m3fn:
            scale = names.get(name[: -len("weight")] + scale_name) if name.endswith(".weight") else None
            if scale is None:
                problems.append(f"{name}: an e4m3 weight without its scale {name[: -len('weight')]}{scale_name} in "
                                "this update; send each MXFP8 weight with its scale in the same call")
            elif scale.dtype == torch.uint8 and (t.shape[-1] % MX_BLOCK
                                                 or tuple(scale.shape) != (*t.shape[:-1], t.shape[-1] // MX_BLOCK)):
                problems.append(f"{name}: weight {list(t.shape)} needs a scale of shape {_scale_shape(t.shape)} "
                                f"(one per {MX_BLOCK} along K), the update has {list(scale.shape)}")
            else:
                flags.append((name, "holds NaN e4m3 values", ((t.view(torch.uint8) & 0x7F) == 0x7F).any()))
        elif t.is_floating_point() and t.element_size() == 1:
            problems.append(f"{name}: {t.dtype} is not an MXFP8 element type; MXFP8 weights are "
                            "torch.float8_e4m3fn with a uint8 scale")
        elif t.dtype in FLOAT_WEIGHTS:
            flags.append((name, "holds NaN or Inf", ~torch.isfinite(t).all()))
        if problems:
            return problems[0]
    by_device: Dict[torch.device, list] = {}
    for flag in flags:
        by_device.setdefault(flag[2].device, []).append(flag)
    for group in by_device.values():
        for (name, what, _), bad in zip(group, torch.stack([f for _, _, f in group]).tolist()):
            if bad:
                return f"{name}: {what}"
    return None


class LoadTracker:
    """Which shards SGLang's loader wrote into a weight and into its scale since the last post-load step.

    A refit checkpoint that lacks a scale tensor (or has a scale without its weight) leaves the previous
    tensor in memory, and nothing in memory tells that apart from a good load; only the loader's calls
    do. The tracker wraps each parameter's ``weight_loader`` and records a key per call (shard and
    expert ids) with the tensor's shape; a scale whose shape does not fit its weight ([N, K] ->
    [N, K/32]) or a tensor of the wrong dtype is refused before it is copied; :meth:`check` compares
    the two key sets and then forgets them.

    A BF16, FP16 or FP32 tensor for an MXFP8 weight (a trainer's weights, through SGLang's
    ``update_weights_from_tensor``) is quantized where the parameter lives, with the converter's numbers and the
    checkpoint's scale rounding, and loaded as the weight and its scale a checkpoint would have held: what
    ``sglang-mxfp8 convert`` writes for that tensor, nothing of the float tensor kept.
    """

    def __init__(self, name: str, pairs: Dict[str, tuple], scale_name: str = "weight_scale_inv",
                 rounding: ScaleRounding = "ceil"):
        """``pairs``: label -> (weight parameter, scale parameter), e.g. {"": (w, s)} or {"w13": ...};
        ``scale_name``: the scale's name in the checkpoint; ``rounding``: the scale rounding its converter used."""
        self.name, self.pairs, self.scale_name, self.rounding = name, pairs, scale_name, rounding
        self.seen: Dict[tuple, Dict[tuple, torch.Size]] = {}
        for label, (weight, scale) in pairs.items():
            for kind, param in (("weight", weight), ("scale", scale)):
                self._wrap(param, (label, kind))

    def _wrap(self, param: torch.nn.Parameter, slot: tuple) -> None:
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        attr = "_weight_loader" if hasattr(param, "_weight_loader") else "weight_loader"
        original: Callable = getattr(param, attr, None) or default_weight_loader
        seen = self.seen.setdefault(slot, {})
        expected = param.dtype
        label, kind = slot
        partner = (label, "scale" if kind == "weight" else "weight")
        tensor = self._weight_name(label)

        def weight_loader(p, loaded_weight, *args, **kwargs):
            if kind == "weight" and loaded_weight.dtype in FLOAT_WEIGHTS and expected == torch.float8_e4m3fn:
                return self._load_quantized(label, p, loaded_weight, args, kwargs)
            if loaded_weight.dtype != expected:  # copy_ would cast it silently into garbage
                raise ValueError(
                    f"{tensor}{'' if kind == 'weight' else ' scale'}: checkpoint tensor is {loaded_weight.dtype}, "
                    f"expected {expected} for an MXFP8 checkpoint; convert the BF16 checkpoint with "
                    "`sglang-mxfp8 convert`"
                )
            # the tensor's own name (args holding a '.') differs between weight and scale; ids do not
            key = tuple(a for a in args if not (isinstance(a, str) and "." in a))
            key += tuple(kwargs.get(k) for k in ("shard_id", "loaded_shard_id", "expert_id"))
            seen[key] = loaded_weight.shape
            other = self.seen[partner].get(key)
            if other is not None:
                w, sc = (loaded_weight.shape, other) if kind == "weight" else (other, loaded_weight.shape)
                if w[-1] % MX_BLOCK or tuple(sc) != (*w[:-1], w[-1] // MX_BLOCK):
                    raise ValueError(
                        f"{tensor}{_ids([key])}: weight {list(w)} needs a scale of shape {_scale_shape(w)} (one per "
                        f"{MX_BLOCK} along K), the checkpoint has {list(sc)}"
                    )
            return original(p, loaded_weight, *args, **kwargs)

        setattr(param, attr, weight_loader)

    def _load_quantized(self, label: str, param, loaded_weight: torch.Tensor, args: tuple, kwargs: dict):
        """A float tensor for an MXFP8 weight: quantized on the parameter's device, then the weight and its scale
        loaded through their own (wrapped) loaders with the same shard and expert ids, the scale under its name."""
        if loaded_weight.shape[-1] % MX_BLOCK:
            raise ValueError(f"{self._weight_name(label)}: a {loaded_weight.dtype} tensor of shape "
                             f"{list(loaded_weight.shape)} cannot be MXFP8 (K not a multiple of {MX_BLOCK}); keep this "
                             "layer BF16 (modules_to_not_convert)")
        q, scale = quantize_mxfp8(loaded_weight.to(param.device), self.rounding)
        scale_param = self.pairs[label][1]
        # the tensor's name, where the loader takes one (a MoE's "...experts.w13_weight"): its scale's
        scale_args = tuple(a[: -len("weight")] + self.scale_name if isinstance(a, str) and a.endswith("weight") else a
                           for a in args)
        scale_param.weight_loader(scale_param, scale, *scale_args, **kwargs)
        return param.weight_loader(param, q, *args, **kwargs)

    def _weight_name(self, label: str) -> str:
        return f"{self.name}.{label}_weight" if label else f"{self.name}.weight"

    def check(self) -> None:
        """Raise if a weight shard was loaded without its scale, or the other way round; then reset."""
        try:
            for (label, kind), loaded in self.seen.items():
                if kind != "weight":
                    continue
                keys, scales = set(loaded), set(self.seen[(label, "scale")])
                tensor = self._weight_name(label)
                if keys - scales:
                    raise ValueError(
                        f"{tensor}: the checkpoint loaded this weight{_ids(keys - scales)} without its scale "
                        "tensor; an MXFP8 weight needs its uint8 [N, K/32] scale in the same load"
                    )
                if scales - keys:
                    raise ValueError(
                        f"{tensor}: the checkpoint loaded the scale{_ids(scales - keys)} without the weight; "
                        "load both together"
                    )
        finally:
            self.reset()

    def reset(self) -> None:
        """Forget recorded loads (also those of a load that raised before its post-processing ran)."""
        for keys in self.seen.values():
            keys.clear()


def _scale_shape(weight_shape) -> str:
    """The scale shape a weight of ``weight_shape`` needs, as '[256, 16]' ('[256, 15.5]' where K is no multiple)."""
    return "[" + ", ".join(f"{d:g}" for d in (*weight_shape[:-1], weight_shape[-1] / MX_BLOCK)) + "]"


def _ids(keys) -> str:
    """' (shards ...)' naming up to three shard/expert keys; empty for an unsharded tensor."""
    named = sorted((tuple(x for x in k if x is not None) for k in keys), key=str)
    named = [k for k in named if k]
    if not named:
        return ""
    more = f" and {len(named) - 3} more" if len(named) > 3 else ""
    return " (shards " + ", ".join(str(k) for k in named[:3]) + more + ")"


@dataclass
class ConversionStats:
    converted_rows: int
    changed_elements: int


class BlockScaleConverter:
    """Owns the derived buffers of one weight ``[G, R, K]`` (G = experts, or 1 for a linear layer)."""

    def __init__(self, groups: int, rows: int, k: int, block_rows: int, device, name: str):
        if k % MX_BLOCK:
            raise ValueError(f"{name}: K={k} is not a multiple of {MX_BLOCK}")
        self.name = name
        self.groups, self.rows, self.k, self.block_rows = groups, rows, k, block_rows
        nb = -(-rows // block_rows)
        kb = -(-k // 128)
        self.block_scale = torch.ones((groups, nb, kb), dtype=torch.float32, device=device)
        self._exps = torch.zeros((groups, nb, kb), dtype=torch.int32, device=device)
        n = groups * rows
        self._sig_converted = torch.zeros(n, dtype=torch.int64, device=device)
        self._sig_loaded = torch.zeros(n, dtype=torch.int64, device=device)
        self._sig_scale = torch.zeros(n, dtype=torch.int64, device=device)
        self._ever = False

    def refresh(self, weight: torch.Tensor, scale: torch.Tensor) -> ConversionStats:
        """Bring ``weight`` (in place) and ``self.block_scale`` up to date with what was loaded."""
        w = weight.view(self.groups * self.rows, self.k)
        s = scale.view(self.groups * self.rows, self.k // MX_BLOCK)
        validate_loaded(w, s, self.name)
        cur = _row_fingerprints(w, torch.empty_like(self._sig_loaded))
        cur_scale = _row_fingerprints(s, torch.empty_like(self._sig_scale))
        if self._ever:
            untouched = cur == self._sig_converted
            noop = self._sig_converted == self._sig_loaded  # conversion left these bytes as loaded
            scale_moved = cur_scale != self._sig_scale
            stale = untouched & ~noop
            if bool((stale & scale_moved).any()):
                row = int((stale & scale_moved).nonzero()[0])
                raise PartialReloadError(
                    f"{self.name}: scale row {row} was reloaded but its weight row was not; "
                    "reload the weight and its scale together"
                )
            fresh = ~untouched | (noop & scale_moved)
        else:
            stale = torch.zeros_like(cur, dtype=torch.bool)
            fresh = ~stale
        if not bool(fresh.any()):
            return ConversionStats(0, 0)

        br = self.block_rows
        nb = self._exps.shape[1]
        pad = nb * br - self.rows

        def blocks(mask):
            return torch.nn.functional.pad(mask.view(self.groups, self.rows), (0, pad)).view(self.groups, nb, br).any(-1)

        todo_blocks = blocks(fresh)
        mixed = todo_blocks & blocks(stale)
        if bool(mixed.any()):
            g, b = (int(v) for v in mixed.nonzero()[0])
            raise PartialReloadError(
                f"{self.name}: rows {b * br}..{(b + 1) * br - 1} (group {g}) were partly reloaded inside one "
                f"{br}x128 scale block; reload the whole layer (or every row of that block)"
            )

        if (pad == 0 or self.groups == 1) and bool(todo_blocks.all()):
            changed = self._convert_whole(w, s)
        else:
            changed = self._convert_blocks(weight, scale, todo_blocks)
        converted = todo_blocks.repeat_interleave(br, dim=1)[:, : self.rows].reshape(-1)
        self._sig_loaded[converted] = cur[converted]
        self._sig_scale[converted] = cur_scale[converted]
        self.block_scale.copy_(exponents_to_scales(self._exps))
        _row_fingerprints(w, cur)
        self._sig_converted[converted] = cur[converted]
        self._ever = True
        return ConversionStats(int(converted.sum()), changed)

    def _convert_whole(self, w: torch.Tensor, s: torch.Tensor) -> int:
        """Every block reloaded (a whole refit), row blocks aligned with the groups: ``w [G * R, K]`` converted as one
        matrix, in steps of whole row blocks, each step's rows a view written in place; one host sync at the end."""
        br = self.block_rows
        exps = self._exps.view(-1, self._exps.shape[-1])
        step = max(1, _CONVERT_CHUNK_ELEMENTS // (br * self.k)) * br
        changed = torch.zeros((), dtype=torch.int64, device=w.device)
        for r0 in range(0, w.shape[0], step):
            q, sc = w[r0:r0 + step], s[r0:r0 + step]
            e = block_exponents(q, sc, br)
            changed += count_shifted(q, sc, e, br)
            exps[r0 // br:r0 // br + e.shape[0]] = e
        return int(changed)

    def _convert_blocks(self, weight: torch.Tensor, scale: torch.Tensor, todo_blocks: torch.Tensor) -> int:
        """The blocks ``todo_blocks [G, ceil(R / block_rows)]`` marks, group by group (a partial reload, or rows that
        do not fill their last block)."""
        br = self.block_rows
        changed = 0
        # rows are gathered and written back as bytes: torch before 2.10 has no boolean-mask indexing of e4m3 on CPU
        wg = weight.view(self.groups, self.rows, self.k).view(torch.uint8)
        sg = scale.view(self.groups, self.rows, self.k // MX_BLOCK)
        chunk = max(br, (4096 // br) * br)
        for g in range(self.groups):
            for r0 in range(0, self.rows, chunk):
                r1 = min(self.rows, r0 + chunk)
                b0, b1 = r0 // br, -(-r1 // br)
                todo = todo_blocks[g, b0:b1]
                if not bool(todo.any()):
                    continue
                rows_mask = todo.repeat_interleave(br)[: r1 - r0]
                q = wg[g, r0:r1][rows_mask].view(weight.dtype)
                sc = sg[g, r0:r1][rows_mask]
                exps = block_exponents(q, sc, br)
                changed += shift_to_block_exponents(q, sc, exps, br)
                wg[g, r0:r1][rows_mask] = q.view(torch.uint8)
                self._exps[g, b0:b1][todo] = exps
        return changed
