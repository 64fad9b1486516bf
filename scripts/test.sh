#!/usr/bin/env bash
# The test suite (CPU, gloo). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
# Tests marked slow (more checkpointing variants in their own process groups, the parity
# scenarios of tests/test_parity.py's SLOW, covered elsewhere in the default suite) are left out;
# run them all with: .venv/bin/python -m pytest -q -m "slow and not gpu" tests
exec .venv/bin/python -m pytest -q -m "not gpu and not slow" "$@"
