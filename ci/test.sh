#!/usr/bin/env bash
# The tests, on a fresh machine too (README's test command; .ci/run calls it). A pinned CPU virtual environment
# (ci/requirements.txt + ci/constraints.txt; SGLang installed with --no-deps so its CUDA torch pin never lands on a
# CPU machine) is built once per requirements hash under ~/.cache/sglang_mxfp8 (PyPI has no CPU-only torch for x86-64
# Linux: torch 2.14.1 with its CUDA libraries, 7.0 GB; about 4 minutes), this package is installed editable (its .pth
# startup hook live in subprocesses), then pytest runs with the oldest supported SGLang (OLDEST_SGLANG of
# sglang_mxfp8/__init__.py) and the tests marked `sglang` again with the newest (ci/newest.txt, a folder on PYTHONPATH):
# about 14 minutes per pass on two cores. Each step says what it does and how long it took. Extra arguments go to both
# pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OLDEST=$(sed -n 's/^OLDEST_SGLANG, NEWEST_SGLANG = "\([^"]*\)".*/\1/p' sglang_mxfp8/__init__.py)  # the range's one home
NEWEST_RELEASE=$(sed -n 's/^OLDEST_SGLANG, NEWEST_SGLANG = "[^"]*", "\([^"]*\)".*/\1/p' sglang_mxfp8/__init__.py)
KEY=$( (cat ci/requirements.txt ci/constraints.txt; echo "$OLDEST") | sha256sum | cut -c1-12)
VENV=${SGLANG_MXFP8_VENV:-$HOME/.cache/sglang_mxfp8/venv-$KEY}
NEWEST=$VENV/sglang-newest-$( (cat ci/newest.txt; echo "$NEWEST_RELEASE") | sha256sum | cut -c1-12)
PIP=(--disable-pip-version-check --progress-bar off)
START=$SECONDS

say() {  # a step, with the time the run has taken so far
  echo "ci/test.sh [$(( (SECONDS - START) / 60 ))m$(( (SECONDS - START) % 60 ))s] $*"
}

if [ ! -f "$VENV/.complete" ]; then
  say "building the test environment $VENV (once per ci/requirements.txt and ci/constraints.txt; about 3 minutes)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install "${PIP[@]}" -r ci/requirements.txt -c ci/constraints.txt |
    { grep -v "^Requirement already" || true; }
  "$VENV/bin/python" -m pip install "${PIP[@]}" --no-deps "sglang==$OLDEST"
  touch "$VENV/.complete"
  say "test environment ready ($(du -sh "$VENV" | cut -f1))"
fi
if [ ! -f "$NEWEST/.complete" ]; then
  say "adding the newest supported SGLang ($NEWEST_RELEASE) beside it in $NEWEST (once)"
  rm -rf "$NEWEST"
  "$VENV/bin/python" -m pip install "${PIP[@]}" -q --no-deps --target "$NEWEST" --only-binary=:all: \
    --python-version 3.12 --platform manylinux_2_34_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 "sglang==$NEWEST_RELEASE" -r ci/newest.txt
  touch "$NEWEST/.complete"
  say "newest SGLang ready ($(du -sh "$NEWEST" | cut -f1))"
fi
say "installing this package (editable)"
"$VENV/bin/python" -m pip install "${PIP[@]}" -q --no-deps --no-build-isolation -e .

run_pytest() {  # pytest's exit status, with "collected nothing" (5) as a failure
  set +e
  "$@"
  local rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then echo "ci/test.sh: pytest collected no tests"; return 1; fi
  return "$rc"
}
say "ruff: pyflakes and line length on the package and the tests"
"$VENV/bin/ruff" check --quiet sglang_mxfp8 tests benchmarks || rc=$?
say "all tests, sglang $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang"))') (one line per file)"
run_pytest "$VENV/bin/python" -m pytest tests "$@" || rc=$?
say "tests that touch SGLang, sglang $(PYTHONPATH=$NEWEST "$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang"))')"
PYTHONPATH=$NEWEST run_pytest "$VENV/bin/python" -m pytest tests -m sglang "$@" || rc=$?
say "done"
exit "${rc:-0}"
