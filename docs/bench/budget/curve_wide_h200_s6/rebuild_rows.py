"""Rebuild curve_rows.json for the wide config on one H200 from the three device calls of
2026-11-25 (the device returns a limited number of files; see curve.md): the second call's rows
file, the baseline reports that came back, and the first call's printed table for the rows whose
files did not come back (peaks to the printed 2 decimals of GiB)."""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3] / "benchmarks"))
from budget_sweep import _common, write_curve  # noqa: E402

CONFIG = "wide layers=8 batch=2 seq=2048 world=1"
GIB = 2**30
rows = json.loads((HERE / "curve_wide" / "curve_rows.json").read_text())
for path in sorted(HERE.glob("baseline_*.json")):
    mode = path.stem.removeprefix("baseline_")
    report = json.loads(path.read_text())
    result = dict(report["models"]["wide"]["results"][mode])
    result["config"] = CONFIG
    rows.append({"kind": "baseline", "label": mode, **_common(result)})
printed = [  # the first call's table: (kind, label, budget bytes, peak GiB, tokens/s, error)
    ("baseline", "fsdp2-compile", None, 35.10, 31125, ""),
    ("shardc", "shardc 38925025303", 38925025303, 35.10, 34547, ""),
    ("shardc", "shardc 39473265096", 39473265096, 35.10, 35018, ""),
    ("shardc", "shardc 40021504889", 40021504889, 35.10, 34914, ""),
    ("shardc", "shardc auto", None, 35.10, 34832, ""),
    ("shardc", "shardc 38376785510", 38376785510, None, None,
     "MemoryBudgetError: below the smallest budget accepted (refused at compile time)"),
]
for kind, label, budget, peak, tps, error in printed:
    row = {"kind": kind, "label": label, "status": "error" if error else "ok", "error": error,
           "config": CONFIG, "measured_peak_bytes": peak and int(peak * GIB),
           "tokens_per_s_per_gpu": tps, "from_printed_table": True}
    if kind == "shardc":
        row["budget"] = label.split()[1]
        row["budget_bytes"] = budget
    rows.append(row)
write_curve(rows, HERE, "Tokens/s against measured peak: wide, 8 layers, batch 2 x 2048, one H200")
