"""sglang_mxfp8: serve MXFP8 checkpoints with stock SGLang on Hopper and Blackwell.

Importing this package is cheap (no torch, no sglang, no logging): the startup hook imports it in every
Python process. The SGLang integration lives in :mod:`sglang_mxfp8.sglang`.
"""

__version__ = "0.1.0"
# the releases CI tests, patches probe in between: written here only (setup.py, ci/test.sh and the tests read it)
OLDEST_SGLANG, NEWEST_SGLANG = "0.5.10.post1", "0.5.23"
SUPPORTED_SGLANG = f"{OLDEST_SGLANG} to {NEWEST_SGLANG}"
DISABLE_ENV = "SGLANG_MXFP8_DISABLE"

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def error_line(e: BaseException, limit: int = 120) -> str:
    """An exception as one line: its type and the first line of its message (cut at ``limit``; empty messages too)."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:limit]}"


def parse_switch(value):
    """1/true/yes/on -> True, 0/false/no/off -> False (any case, spaces ignored); unset or other -> None."""
    value = (value or "").strip().lower()
    return True if value in _ON else False if value in _OFF else None
