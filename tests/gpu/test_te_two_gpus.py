"""TransformerEngine with shardc across two or more GPUs: runs ``te_dist_worker.py`` under
``torchrun`` (one process per GPU) and checks each scenario's result (see the worker's
docstring for what each proves). Skipped with the reason on fewer than two GPUs or without TE.
``SHARDC_TE_DIST_REPORT=<file>`` keeps the worker's JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from gpu_marks import needs_fp8_gpu

try:
    import transformer_engine.pytorch  # noqa: F401
    _TE_ERROR = None
except Exception as exc:  # noqa: BLE001 - any import failure means "no usable TE"
    _TE_ERROR = f"{type(exc).__name__}: {exc}"

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SCENARIOS = [f"fp8_params_same_batch[{k}-{r}]" for k in ("Linear", "LayerNormMLP",
                                                          "TransformerLayer")
             for r in ("current", "delayed")]
SCENARIOS += ["fp8_params_own_batches[current]", "fp8_params_own_batches[delayed]",
              "float8_policy_same_batch", "dcp_fp8_params_2_to_2_and_1"]

pytestmark = [pytest.mark.gpu, needs_fp8_gpu,
              pytest.mark.skipif(_TE_ERROR is not None,
                                 reason=f"TransformerEngine not importable ({_TE_ERROR})"),
              pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, found {GPUS}")]


@pytest.fixture(scope="module")
def report() -> dict[str, dict]:
    path = os.environ.get("SHARDC_TE_DIST_REPORT") or os.path.join(tempfile.mkdtemp(),
                                                                   "report.jsonl")
    worker = os.path.join(os.path.dirname(__file__), "te_dist_worker.py")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(min(GPUS, 2)),
         worker, path], capture_output=True, text=True, timeout=480)
    print(proc.stdout[-6000:], proc.stderr[-6000:])
    results = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                results[row["name"]] = row
    assert results, f"the worker reported nothing (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return results


@pytest.mark.parametrize("name", SCENARIOS)
def test_two_gpu_scenario(report, name):
    row = report.get(name)
    assert row is not None, f"{name} did not run (the worker stopped early?)"
    assert row["ok"] and row["ok_on_every_rank"], row.get("traceback") or row
