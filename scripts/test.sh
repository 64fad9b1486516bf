#!/usr/bin/env bash
# The test suite (CPU, gloo). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
# Tests marked slow (more checkpointing variants in their own process groups, the parity
# scenarios of tests/test_parity.py's SLOW (with, since s35, its core at world 4 and the
# BlockStack and compiled offload at 3), tests/test_real_models.py's world-3 group
# (SLOW_WORLDS), the 2-D mesh variants of tests/test_mesh.py's *_MORE lists, and other variants
# each marked with where its feature stays covered in the default suite) are left out; run them
# all with: .venv/bin/python -m pytest -q -m "slow and not gpu" tests
exec .venv/bin/python -m pytest -q -m "not gpu and not slow" "$@"
