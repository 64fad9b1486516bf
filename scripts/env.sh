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
