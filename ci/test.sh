#!/usr/bin/env bash
# The tests, on a fresh machine too (README's test command; .ci/run calls it): a pinned CPU virtual environment
# (ci/requirements.txt + ci/constraints.txt; SGLang installed with --no-deps so its CUDA torch pin never lands on a
# CPU machine), built once per requirements hash under ~/.cache/sglang_mxfp8 (about 7 minutes and 7 GB the first time),
# this package installed editable (so its .pth startup hook is live in subprocesses), then pytest. Extra arguments go
# to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
KEY=$(cat ci/requirements.txt ci/constraints.txt | sha256sum | cut -c1-12)
VENV=${SGLANG_MXFP8_VENV:-$HOME/.cache/sglang_mxfp8/venv-$KEY}
if [ ! -f "$VENV/.complete" ]; then
  echo "ci/test.sh: creating $VENV"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r ci/requirements.txt -c ci/constraints.txt
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps sglang==0.5.10.post1
  touch "$VENV/.complete"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .

set +e
"$VENV/bin/python" -m pytest -q tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "ci/test.sh: pytest collected no tests"; exit 1; fi
exit "$rc"
