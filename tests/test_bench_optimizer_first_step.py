"""The optimizer benchmark (``benchmarks/optimizer_first_step.py``): each mode runs in its own
process and its record says how many parameter tensors the optimizer stepped, which code and
which torch measured it (no timing is asserted here: benchmarks, not tests, show speed)."""

from __future__ import annotations

import json

import pytest

from benchmarks.optimizer_first_step import main


# The benchmark's smoke run (two compiled modes): slow (suite time, s64).
@pytest.mark.slow
def test_each_mode_records_its_step_over_every_parameter_tensor(tmp_path):
    main(["--tiny", "--depths", "2", "--steps", "1", "--out", str(tmp_path), "--name", "t"])
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert [(r["depth"], r["mode"]) for r in rows] == [(2, "dtensor"), (2, "default")]
    # 9 tensors per llama block, the embedding, the final norm and the output projection.
    assert {r["params"] for r in rows} == {2 * 9 + 3}
    assert all(r["first_step_s"] > 0 and r["steady_step_s"] > 0 and r["shardc_sha256"]
               for r in rows)
    table = (tmp_path / "t.md").read_text()
    assert "| 2 | 21 | dtensor |" in table and "| 2 | 21 | default |" in table
