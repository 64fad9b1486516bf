"""The largest-batch search (``benchmarks/largest_batch.py``): doubling then bisection finds the
largest batch that fits within its bounded number of tries, classifies failures, and stops on an
error that is not a memory answer. The runs are stand-ins (no torchrun)."""

from __future__ import annotations

import argparse
import time

import pytest

import benchmarks.largest_batch as lb


def _args(**kw) -> argparse.Namespace:
    base = dict(budget="auto", start=4, max_batch=1024, max_tries=10, deadline_s=0.0,
                try_estimate_s=1.0, t0=time.monotonic())
    return argparse.Namespace(**{**base, **kw})


def _fake_runs(monkeypatch, fits_up_to: int, error_at: int | None = None):
    tried = []

    def run(mode, name, args, out, env, extra):
        batch = int(extra[extra.index("--batch") + 1])
        tried.append(batch)
        if batch == error_at:
            return {"status": "error", "error": "RuntimeError: something else"}, ""
        if batch <= fits_up_to:
            return {"status": "ok", "tokens_per_s_per_gpu": 1000.0 + batch,
                    "peak_alloc_bytes": batch << 30, "config": f"1b batch={batch}"}, ""
        return {"status": "error", "error": "OutOfMemoryError: CUDA out of memory"}, ""
    monkeypatch.setattr(lb, "torchrun", run)
    return tried


@pytest.mark.parametrize("fits_up_to", [0, 1, 3, 4, 7, 12, 33, 60])
def test_finds_the_largest_batch_that_fits(monkeypatch, tmp_path, fits_up_to):
    tried = _fake_runs(monkeypatch, fits_up_to)
    state = lb.search("fsdp2-compile-ac", _args(), tmp_path, {}, lambda: None)
    assert state["complete"] and state["lo"] == fits_up_to, state
    assert state["hi"] == fits_up_to + 1 and len(tried) <= 10
    assert len(set(tried)) == len(tried)  # no batch tried twice
    best = lb.best_try(state)
    assert (best is None) == (fits_up_to == 0)
    if best:
        assert best["tokens_per_s_per_gpu"] == 1000.0 + fits_up_to
        assert state["config"] == "1b"


def test_bounded_tries_leave_a_bracket_to_resume(monkeypatch, tmp_path):
    tried = _fake_runs(monkeypatch, 45)
    state = lb.search("shardc-budget", _args(max_tries=4), tmp_path, {}, lambda: None)
    assert tried == [4, 8, 16, 32] and state["lo"] == 32 and state["hi"] is None
    assert "4 tries used" in state["stopped"] and not state.get("complete")
    state.pop("stopped")
    state = lb.search("shardc-budget", _args(), tmp_path, state, lambda: None)
    assert state["complete"] and state["lo"] == 45 and tried[4] == 64


def test_an_error_that_is_not_memory_stops_the_search(monkeypatch, tmp_path):
    _fake_runs(monkeypatch, 100, error_at=16)
    state = lb.search("fsdp2-compile-ac", _args(), tmp_path, {}, lambda: None)
    assert state["lo"] == 8 and "error at batch 16" in state["stopped"]
    assert state["tries"][-1]["verdict"] == "error"


def test_classify():
    assert lb.classify({"status": "ok"}, "") == "fits"
    assert lb.classify({"status": "error", "error": "torch.OutOfMemoryError: CUDA out of "
                        "memory. Tried to allocate 2.00 GiB"}, "") == "oom"
    assert lb.classify({"status": "error", "error": "BackendCompilerFailed: MemoryBudgetError: "
                        "... feasible minimum 123 B"}, "") == "refused"
    assert lb.classify({}, "no report\n[killed after 420 s]") == "killed"
    assert lb.classify({"status": "error", "error": "KeyError: x"}, "") == "error"
    assert lb.classify({"status": "error", "error": "MemoryBudgetError: shardc: peak_memory_"
                        "budget_bytes='auto' needs a CUDA device"}, "") == "error"


def test_report_states_the_goal():
    results = {
        "shardc-budget": {"lo": 48, "hi": 49, "complete": True, "config": "1b", "tries": [
            {"batch": 48, "verdict": "fits", "tokens_per_s_per_gpu": 30000.0,
             "measured_peak_bytes": 70 << 30}]},
        "fsdp2-compile-ac": {"lo": 32, "hi": 64, "stopped": "8 tries used", "config": "1b",
                             "tries": [{"batch": 32, "verdict": "fits",
                                        "tokens_per_s_per_gpu": 28000.0,
                                        "measured_peak_bytes": 60 << 30},
                                       {"batch": 64, "verdict": "oom"}]}}
    text = lb.markdown(results, "python benchmarks/largest_batch.py --resume")
    assert "| shardc-budget | 1b | 48 | 30,000 | 70.00 | 49 | 1 | complete |" in text
    assert "| 64 (oom) |" in text
    assert ("48 / 32 = 1.50x (met; a search is open or hit --max-batch, so the ratio is a "
            "bound)") in text
    assert "shardc 30,000, FSDP2-AC 28,000 (met)" in text
    assert "--resume" in text
