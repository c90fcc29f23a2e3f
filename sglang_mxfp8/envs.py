"""Reading the package's on/off environment switches (SGLANG_MXFP8_*), one way for all of them."""

import os

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def env_switch(name: str, default: bool) -> bool:
    """1/true/yes/on -> True, 0/false/no/off -> False (any case, spaces ignored); unset or other -> default."""
    value = os.environ.get(name, "").strip().lower()
    return True if value in _ON else False if value in _OFF else default
