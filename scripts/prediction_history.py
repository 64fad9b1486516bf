"""Every predicted-against-measured step stored under ``docs/bench/predict`` in one table.

``benchmarks/predict_step.py`` measures a step two ways: *steady* (back-to-back steps, from one
step's start event to the next one's, the host free to run ahead: how training runs) and
*synced* (each step timed from an idle device). The step model predicts both
(``StepPrediction.steady_s`` and ``step_s``); reports made before the twenty-seventh session
predicted only the synced step, which this table then sets against both. It shows the errors row
by row, and the mean absolute errors, so that a change to the model (or a new profile) can be read
against every row measured so far::

    python scripts/prediction_history.py [--root docs/bench/predict] [--precision fp8]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def rows(root: Path) -> list[dict]:
    """One dict per successful row of every ``predict_step.py`` JSON under ``root``."""
    out = []
    for path in sorted(root.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or not isinstance(data.get("results"), list):
            continue
        for r in data["results"]:
            if not isinstance(r, dict) or r.get("status") != "ok":
                continue
            if not r.get("measured_synced_step_s") or not r.get("predicted_step_s"):
                continue
            out.append({"file": str(path.relative_to(root)), "config": r.get("config") or {},
                        "mesh": r.get("mesh"), "predicted": r["predicted_step_s"],
                        "predicted_synced": r.get("predicted_synced_step_s",
                                                  r["predicted_step_s"]),
                        "steady": r["measured_step_s"], "synced": r["measured_synced_step_s"]})
    return out


def _label(cfg: dict) -> str:
    keys = ("model", "layers", "batch", "precision")
    return " ".join(str(cfg.get(k, "?")) for k in keys)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="docs/bench/predict")
    p.add_argument("--precision", default=None, help="only rows of this precision")
    args = p.parse_args()
    found = [r for r in rows(Path(args.root))
             if args.precision in (None, r["config"].get("precision"))]
    if not found:
        raise SystemExit(f"no predicted-against-measured rows under {args.root}")
    print("| file | mesh | row | predicted ms | steady ms | error | predicted synced ms | "
          "synced ms | error |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in found:
        pred, steady, synced = r["predicted"] * 1e3, r["steady"] * 1e3, r["synced"] * 1e3
        pred_synced = r["predicted_synced"] * 1e3
        print(f"| {r['file']} | {r['mesh']} | {_label(r['config'])} | {pred:.1f} | "
              f"{steady:.1f} | {pred / steady - 1:+.1%} | {pred_synced:.1f} | {synced:.1f} | "
              f"{pred_synced / synced - 1:+.1%} |")
    for key, predicted in (("steady", "predicted"), ("synced", "predicted_synced")):
        errs = [abs(r[predicted] / r[key] - 1) for r in found]
        within = sum(e <= 0.10 for e in errs)
        print(f"\nagainst the {key} step: mean |error| {statistics.mean(errs):.1%}, "
              f"{within} of {len(errs)} rows within 10%")


if __name__ == "__main__":
    main()
