#!/usr/bin/env bash
# The test suite (CPU, gloo). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
# Tests marked slow (more checkpointing variants in their own process groups, the parity
# scenarios of tests/test_parity.py's SLOW, covered elsewhere in the default suite) are left out;
# run them with: .venv/bin/python -m pytest -q -m slow tests/test_real_models.py tests/test_mesh.py tests/test_parity.py tests/test_planner.py
# Two workers (SHARDC_TEST_WORKERS; 0 runs in one process), a test file per worker at a time
# (--dist loadfile: a file's module-scoped process groups stay shared by its tests).
workers=()
if .venv/bin/python -c "import xdist" >/dev/null 2>&1 && [ "${SHARDC_TEST_WORKERS:-2}" != 0 ]; then
  workers=(-n "${SHARDC_TEST_WORKERS:-2}" --dist loadfile)
fi
exec .venv/bin/python -m pytest -q -m "not gpu and not slow" ${workers[@]+"${workers[@]}"} "$@"
