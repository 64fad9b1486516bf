"""``python -m shardc plan``: plan for any world size without GPUs (fake process group)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardc.planning.profile import resolve_profile
from shardc.tools.cli import parse_model_spec


def test_model_spec_parsing():
    cfg = parse_model_spec("llama-70b:n_layers=2,tie_embeddings=true")
    assert cfg.n_layers == 2 and cfg.dim == 8192 and cfg.tie_embeddings
    with pytest.raises(SystemExit, match="unknown model"):
        parse_model_spec("gpt-nope")
    with pytest.raises(SystemExit, match="unknown LlamaConfig field"):
        parse_model_spec("llama-1b:depth=3")


def test_plan_for_a_large_world_without_gpus(tmp_path):
    cmd = [sys.executable, "-m", "shardc", "plan", "llama-tiny:n_layers=3,vocab_size=1000",
           "--world-size", "1024", "--seq", "64", "--dump", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world size 1024" in result.stdout
    plan = json.loads((tmp_path / "region0.rank0.plan.json").read_text())
    assert plan["world_size"] == 1024
    kinds = [c["kind"] for c in plan["collectives"]]
    # 5 buckets (embedding, 3 blocks, norm+head): gathered in forward and backward, reduced once.
    assert kinds.count("reduce_scatter") == 5
    assert kinds.count("all_gather") >= 5 + 4
    assert plan["predicted"]["step_time_s"] > 0
    # A GPU's plan: the caching allocator's blocks and the runtime's workspaces (the default
    # profile's, measured by its calibration) counted in every peak.
    runtime = resolve_profile(None).runtime_bytes()
    assert runtime > 0 and plan["predicted"]["runtime_bytes"] == runtime
    assert plan["memory_by_category"]["peak"]["bytes"]["runtime workspaces"] == runtime
    for suffix in ("plan.txt", "trace.json"):
        assert (tmp_path / f"region0.rank0.{suffix}").exists()


def test_plan_under_a_memory_budget_prints_the_decisions(capsys):
    """``--memory-budget`` a little above the fully resharded peak (1.60 MiB here with the
    default packed blocks, 1.71 MiB with every bucket kept; blocks compiled once as under a
    budget the planner traces them): the planner keeps some buckets
    gathered and reshards others, and says why. Counted as requested bytes (``memory_target``
    ``"exact"``): the CUDA count's 64 MiB of workspaces would dwarf this tiny model's peak.
    In this process (``cli.main``, what ``python -m shardc`` runs: the test above runs it as a
    command)."""
    from shardc.tools import cli

    assert cli.main(["plan", "llama-tiny:n_layers=3,vocab_size=1000", "--world-size", "8",
                     "--seq", "64", "--summary-only", "--memory-budget", "1.70MiB",
                     "--options", json.dumps({"memory_target": "exact"})]) == 0
    out = capsys.readouterr().out
    assert "peak budget 1.70 MiB (1782579 B)" in out, out
    decisions = [line for line in out.splitlines() if line.startswith("  bucket ")]
    assert len(decisions) == 4, out
    assert any(": kept," in d for d in decisions) and any(": resharded," in d for d in decisions)


def test_auto_memory_budget_without_a_gpu_is_the_planned_devices_capacity_less_the_margin(
        capsys):
    """``--memory-budget auto`` on a machine without the GPU: the budget a compile on the
    planned device takes (its capacity less the allocator margin), printed; without a device
    memory to take it from, a clear error instead of a plan for some other device."""
    from shardc.planning.budget import AUTO_MARGIN_FRACTION, AUTO_MARGIN_MIN_BYTES, auto_budget
    from shardc.tools.cli import _auto_budget
    from shardc.tools.model_spec import ModelSpecError

    h200 = 150_109_880_320  # the h200 profile's device memory
    assert auto_budget(h200) == int(h200 - AUTO_MARGIN_FRACTION * h200)
    small = 3 << 30  # where the fraction is below the floor, the floor applies
    assert _auto_budget(float(small), "h200") == small - AUTO_MARGIN_MIN_BYTES
    assert f"auto = {small - AUTO_MARGIN_MIN_BYTES:,} B" in capsys.readouterr().out
    with pytest.raises(ModelSpecError, match="--device"):
        _auto_budget(None, "cpu-calibrated")
