"""The budget curve's table and plot (``benchmarks/train/curve.py``): the comparison at equal
memory and the goals read from synthetic rows; the hand-drawn SVG is well-formed and draws
every measured point."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from benchmarks.train.curve import (
    _ticks,
    best_baseline_within,
    curve_markdown,
    curve_svg,
    shardc_dominating,
)

G = 1 << 30


def _shardc(budget_gib, peak_gib, tps, status="ok"):
    return {"kind": "shardc", "label": f"shardc {budget_gib}", "budget_bytes": budget_gib * G,
            "margin_bytes": int(budget_gib * G * 0.02 / 1.02), "status": status,
            "measured_peak_bytes": peak_gib * G, "tokens_per_s_per_gpu": tps}


def _base(label, peak_gib, tps, status="ok"):
    return {"kind": "baseline", "label": label, "status": status,
            "measured_peak_bytes": peak_gib * G, "tokens_per_s_per_gpu": tps}


ROWS = [_shardc(20, 19, 1000), _shardc(30, 29.5, 1500), _shardc(40, 40.4, 1800),
        _shardc(10, 0, 0, status="error"),
        _base("fsdp2-compile-ac", 18, 900), _base("fsdp2-compile", 35, 1600),
        _base("fsdp2-compile-sac", 25, 1200), _base("fsdp2-compile-offload", 0, 0, "error")]


def test_comparison_at_equal_memory():
    assert best_baseline_within(ROWS, 20 * G)["label"] == "fsdp2-compile-ac"
    assert best_baseline_within(ROWS, 30 * G)["label"] == "fsdp2-compile-sac"
    assert best_baseline_within(ROWS, 17 * G) is None
    # sac (25 GiB, 1200) is dominated by shardc 20 (19 GiB, 1000)? No: fewer tokens/s.
    assert shardc_dominating(ROWS, ROWS[6]) is None
    assert shardc_dominating(ROWS, ROWS[5]) is None  # 35 GiB: shardc 30 has 1500 < 1600
    assert shardc_dominating(ROWS, ROWS[4]) is None  # 18 GiB: no shardc point that low
    assert shardc_dominating(ROWS, _base("x", 45, 1700))["label"] == "shardc 40"


def test_table_answers_the_goals():
    text = curve_markdown(ROWS, "1b, 8 layers")
    assert text.startswith("# 1b, 8 layers")
    assert "| shardc 40 | 40.00 | 39.22 | 40.40 | **no** (+1.0%) | 1,800 |" in text
    assert "| shardc 20 | 20.00 | 19.61 | 19.00 | yes | 1,000 | fsdp2-compile-ac 900 | 1.111 |" \
        in text
    assert "measured peak <= budget: 2 of 3 shardc budgets (over: shardc 40)" in text
    assert "0 of 3 FSDP2 points have a shardc point" in text
    assert "3 of 3 budgets with an FSDP2 point within them" in text
    assert "fsdp2-compile-offload | | | – | | error" in text


def test_svg_draws_every_point():
    root = ET.fromstring(curve_svg(ROWS, "1b"))
    ns = "{http://www.w3.org/2000/svg}"
    dots = [c for c in root.iter(f"{ns}circle") if c.find(f"{ns}title") is not None]
    assert len(dots) == 3  # the shardc points that ran
    texts = [t.text for t in root.iter(f"{ns}text")]
    for label in ("fsdp2-compile-ac", "fsdp2-compile", "fsdp2-compile-sac"):
        assert label in texts
    assert "fsdp2-compile-offload" not in texts  # it did not run
    assert ET.fromstring(curve_svg([], "empty")) is not None


def test_ticks_are_round_and_cover_the_range():
    assert _ticks(0, 1800) == [0, 500, 1000, 1500]
    assert _ticks(17.5, 41.3) == [20, 25, 30, 35, 40]
    assert _ticks(0.1, 0.13)[0] >= 0.1


def test_offload_budgets_run_shardc_offloaded_as_shardc_points(tmp_path, monkeypatch):
    """``budget_sweep.py --offload-budgets``: each budget runs ``shardc-offload-budget`` with
    that budget, and its row is a shardc point of the curve under its own label, beside the
    plain budget's row of the same bytes."""
    import argparse

    from benchmarks import budget_sweep

    ran = []

    def fake_torchrun(mode, name, args, out, env=None, extra=None, steps=None):
        ran.append((mode, name, env["SHARDC_PEAK_BUDGET"]))
        return {"status": "ok", "config": "1b", "peak_alloc_bytes": 5 * G,
                "tokens_per_s_per_gpu": 100.0, "regions": []}, ""

    monkeypatch.setattr(budget_sweep, "torchrun", fake_torchrun)
    args = argparse.Namespace(margin=None)
    budget = budget_sweep._budget_arg("6e9")
    rows = [budget_sweep.run(budget, args, tmp_path, offload=True),
            budget_sweep.run(budget, args, tmp_path)]
    assert ran == [("shardc-offload-budget", "offload_budget_6000000000", "6000000000"),
                   ("shardc-budget", "budget_6000000000", "6000000000")]
    assert [r["label"] for r in rows] == ["shardc offload 6000000000", "shardc 6000000000"]
    assert all(r["kind"] == "shardc" and r["budget_bytes"] == 6_000_000_000 for r in rows)
    merged = budget_sweep.merge(budget_sweep.merge([], rows[0]), rows[1])
    assert len(merged) == 2  # one row each: the labels differ
    assert "shardc offload 6000000000" in curve_markdown(merged)
