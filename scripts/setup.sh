#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv.
# torch is installed first at the pinned CPU build, then everything else under constraints.txt,
# so no step can pull a newer (CUDA) torch. Idempotent: a stamp skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=".venv"
STAMP="$VENV/.batchgen-setup-stamp"
want="$(cat pyproject.toml setup.py constraints.txt | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
export DS_BUILD_OPS=0 PIP_DISABLE_PIP_VERSION_CHECK=1
"$VENV/bin/python" -m pip install -q -c constraints.txt torch==2.13.0
"$VENV/bin/python" -m pip install -q -c constraints.txt -e '.[test]'
echo "$want" > "$STAMP"
