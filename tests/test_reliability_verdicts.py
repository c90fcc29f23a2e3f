"""How benchmarks/reliability/refit_checks.py compares completions with references: exact equality
(tokens, logprobs within 1e-4) and, for a mismatch, where it diverges and how close the reference's
choice was there."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("refit_checks", ROOT / "benchmarks/reliability/refit_checks.py")
refit_checks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(refit_checks)

REF = {"ids": [5, 6, 7, 8], "logprobs": [-0.5, -1.0, -0.7, -0.2], "margins": [2.0, 0.03, 1.5, 0.9]}


def test_same_needs_every_token_and_logprobs_within_tolerance():
    close = {"ids": [5, 6, 7, 8], "logprobs": [-0.50005, -1.0, -0.7, -0.2]}
    assert refit_checks.same([close, REF], [REF, REF])
    assert not refit_checks.same([{**close, "logprobs": [-0.5002, -1.0, -0.7, -0.2]}], [REF])
    assert not refit_checks.same([REF, {**close, "ids": [5, 6, 7, 9]}], [REF, REF])


def test_divergence_reports_position_margin_and_logprob_gap():
    assert refit_checks.divergence(REF, REF) == (None, None, 0.0)
    seq = {"ids": [5, 9, 3, 3], "logprobs": [-0.49, -1.1, -4.0, -3.0]}
    assert refit_checks.divergence(seq, REF) == (1, 0.03, 0.01)
