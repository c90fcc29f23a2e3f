"""``quantization.*``: SGLang's ``mxfp8`` quantization method is our :class:`Mxfp8Config`, and its dense MXFP8
dispatch answers with our registry's plan."""

from __future__ import annotations

import functools

from ..patching import APPLIED, after_import_of, replace, target

QUANT_METHODS = "sglang_mxfp8.sglang.quant_methods"  # what both patches hand SGLang; it imports SGLang itself


def register_config() -> None:
    if not after_import_of(QUANT_METHODS, register_config):
        return
    from sglang.srt.layers import quantization

    from ..quant_methods import Mxfp8Config

    methods = target(quantization, "QUANTIZATION_METHODS", "quantization.mxfp8_config")
    if methods is not None and methods.get("mxfp8") is not Mxfp8Config:
        methods["mxfp8"] = Mxfp8Config
        APPLIED["quantization.mxfp8_config"] = "sglang.srt.layers.quantization.QUANTIZATION_METHODS['mxfp8']"


def route_dense_dispatch() -> None:
    if not after_import_of(QUANT_METHODS, route_dense_dispatch):
        return
    from sglang.srt.layers.quantization import fp8, fp8_utils

    from .. import quant_methods

    def make(original):
        @functools.wraps(quant_methods.dispatch_w8a8_mxfp8_linear)
        def dispatch_w8a8_mxfp8_linear(*args, **kwargs):
            # SGLang's own zero-argument call comes only from its online-quantization path
            # (BF16 checkpoint + --quantization mxfp8, Blackwell), which keeps SGLang's kernels.
            if not args and not kwargs:
                return original()
            return quant_methods.dispatch_w8a8_mxfp8_linear(*args, **kwargs)

        return dispatch_w8a8_mxfp8_linear

    replace(fp8_utils, "dispatch_w8a8_mxfp8_linear", "quantization.dense_dispatch", make)
    fp8.dispatch_w8a8_mxfp8_linear = fp8_utils.dispatch_w8a8_mxfp8_linear
