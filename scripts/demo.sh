#!/usr/bin/env bash
# The main job: train the example Llama on 2 CPU ranks through the shardc backend, dump the plan,
# save a DCP checkpoint and reload it. Extra arguments go to examples/train_llama.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
exec .venv/bin/python examples/train_llama.py "$@"
