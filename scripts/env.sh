#!/usr/bin/env bash
# Makes sure .venv exists with torch (CPU build 2.13.0 unless a torch is already there) and shardc
# installed in editable mode with its test and plot extras. Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import torch, shardc, pytest, hypothesis, matplotlib, transformers" >/dev/null 2>&1; then
  echo "setting up .venv (first run only) ..." >&2
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,plot]"
fi
# pytest-xdist runs the suite's test files on two workers (scripts/test.sh): one file's spawned
# ranks or single-process tests then fill the core another file's leaves idle. Best effort: the
# suite runs on one worker without it.
if ! .venv/bin/python -c "import xdist" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "pytest-xdist>=3.5" \
    || echo "env.sh: pytest-xdist could not be installed; scripts/test.sh runs on one worker" >&2
fi
