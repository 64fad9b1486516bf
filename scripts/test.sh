#!/usr/bin/env bash
# The test suite (CPU, gloo). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
# Tests marked slow (more checkpointing variants in their own process groups) are left out;
# run them with: .venv/bin/python -m pytest -q -m slow tests/test_real_models.py tests/test_mesh.py
exec .venv/bin/python -m pytest -q -m "not gpu and not slow" "$@"
