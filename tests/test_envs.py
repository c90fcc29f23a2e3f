"""The one reader of the package's on/off environment switches."""

import pytest

from sglang_mxfp8.envs import env_switch


@pytest.mark.parametrize("value,default,expected", [
    (None, True, True), (None, False, False), ("", True, True),
    ("1", False, True), (" ON ", False, True), ("Yes", False, True), ("true", False, True),
    ("0", True, False), ("Off", True, False), ("no", True, False), (" FALSE", True, False),
    ("maybe", True, True), ("maybe", False, False),  # not a switch value: the default holds
])
def test_env_switch(monkeypatch, value, default, expected):
    if value is None:
        monkeypatch.delenv("SGLANG_MXFP8_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("SGLANG_MXFP8_TEST_SWITCH", value)
    assert env_switch("SGLANG_MXFP8_TEST_SWITCH", default) is expected
