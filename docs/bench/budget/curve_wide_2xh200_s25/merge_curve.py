import json, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from budget_sweep import write_curve
s24 = json.load(open("docs/bench/budget/curve_wide_2xh200_s24/curve_rows.json"))
c1 = json.load(open("docs/bench/budget/curve_wide_2xh200_s25/call1/curve_rows.json"))
c5 = json.load(open("docs/bench/budget/curve_wide_2xh200_s25/call5/curve_rows.json"))
new_labels = {r["label"] for r in c1 + c5}
rows = []
for r in s24:
    if r["label"] in new_labels:
        continue
    r = dict(r); r["label"] = r["label"] + " (s24)"
    rows.append(r)
rows += c1 + c5
out = Path("docs/bench/budget/curve_wide_2xh200_s25")
write_curve(rows, out, "wide 8 layers, batch 2, 2 H200s (s24 and s25 rows)")
print(len(rows))
