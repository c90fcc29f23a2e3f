"""Reading the package's on/off environment switches (SGLANG_MXFP8_*), one way for all of them."""

import os

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def env_switch(name: str, default: bool) -> bool:
    """1/true/yes/on -> True, 0/false/no/off -> False (any case, spaces ignored); unset or other -> default."""
    value = os.environ.get(name, "").strip().lower()
    return True if value in _ON else False if value in _OFF else default


GEMV_ENV = "SGLANG_MXFP8_GEMV"
MOE_GEMV_ENV = "SGLANG_MXFP8_MOE_GEMV"


def dense_gemv_enabled() -> bool:
    """One-token batches (batch-1 decode) of the Hopper dense layers on the weight-streaming GEMV of
    sglang_mxfp8.triton_hopper, for the layer shapes each backend lists as measured faster on the H200
    (``DenseBackend.gemv_shapes``). On unless SGLANG_MXFP8_GEMV=0."""
    return env_switch(GEMV_ENV, default=True)


def moe_gemv_enabled() -> bool:
    """One-token batches of the Hopper MoE on the two-launch GEMV MoE, for the layer shapes measured faster
    on the H200 (``moe_hopper.GEMV_MOE_SHAPES``). On unless SGLANG_MXFP8_MOE_GEMV=0."""
    return env_switch(MOE_GEMV_ENV, default=True)
