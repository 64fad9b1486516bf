#!/usr/bin/env bash
# The test suite (CPU, gloo). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
exec .venv/bin/python -m pytest -q -m "not gpu" "$@"
