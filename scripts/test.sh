#!/usr/bin/env bash
# The test suite (CPU, gloo). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
# Tests marked slow (more checkpointing variants in their own process groups, the parity
# scenarios of tests/test_parity.py's SLOW, covered elsewhere in the default suite) are left out;
# run them with: .venv/bin/python -m pytest -q -m slow tests/test_real_models.py tests/test_mesh.py tests/test_parity.py tests/test_planner.py tests/test_sink_residual.py tests/test_body_donations.py
exec .venv/bin/python -m pytest -q -m "not gpu and not slow" "$@"
