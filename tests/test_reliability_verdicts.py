"""The refit-under-load verdict of benchmarks/reliability/refit_checks.py: which completions count as
following a reference (equal, or diverging only at a near tie) and which reveal a torn model."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("refit_checks", ROOT / "benchmarks/reliability/refit_checks.py")
refit_checks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(refit_checks)

REF = {"ids": [5, 6, 7, 8], "logprobs": [-0.5, -1.0, -0.7, -0.2], "margins": [2.0, 0.03, 1.5, 0.9]}


@pytest.mark.parametrize("seq, verdict, diff", [
    ({"ids": [5, 6, 7, 8], "logprobs": [-0.52, -1.0, -0.7, -0.2]}, "equal", 0.02),
    # differs where the reference's top two were 0.03 apart: another batch's rounding may pick either
    ({"ids": [5, 9, 3, 3], "logprobs": [-0.49, -1.1, -4.0, -3.0]}, "near_tie", 0.01),
    # differs where the reference was sure (margin 1.5): not rounding
    ({"ids": [5, 6, 9, 8], "logprobs": [-0.5, -1.0, -0.7, -0.2]}, "no", 0.0),
    # same tokens, logprobs far off: another model that happens to agree
    ({"ids": [5, 6, 7, 8], "logprobs": [-0.5, -1.6, -0.7, -0.2]}, "no", 0.6),
])
def test_follows(seq, verdict, diff):
    got, got_diff = refit_checks.follows(seq, REF)
    assert got == verdict
    assert got_diff == pytest.approx(diff, abs=1e-9)
