"""Measured peak against the whole-step peak budget (issue 22), over a sweep of budgets.

Runs ``train_bench.py --modes shardc-budget`` once per budget (``SHARDC_PEAK_BUDGET``), each in
its own ``torchrun``, and prints per budget: the planner's minimum, its predicted peak, the
buckets it kept gathered, the blocks it recomputed, the measured peak (``max_memory_allocated``)
and tokens/s. Without ``--budgets`` it first runs ``auto`` (the device's capacity less a
margin), reads the predicted peak from it, then runs a 1-byte budget, which is refused naming
the feasible minimum (every bucket resharded, every block that can be recomputed recomputed)
and the smallest budget accepted (the minimum plus the margin for the prediction's error,
``peak_memory_margin``), and sweeps ``--count`` budgets evenly between the two, plus one just below the minimum (which
must be refused at compile time). Budgets below the fully resharded plan's peak recompute
blocks.

    python benchmarks/budget_sweep.py --nproc 1 --model 1b --count 8
    python benchmarks/budget_sweep.py --nproc 2 --model 1b --budgets 30e9 32e9   # a chunk
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(budget: str, args, out: Path) -> dict:
    name = f"budget_{budget}"
    cmd = ["torchrun", f"--nproc-per-node={args.nproc}", str(HERE / "train_bench.py"),
           "--model", args.model, "--modes", "shardc-budget", "--steps", str(args.steps),
           "--warmup", "2", "--profile-steps", "0", "--no-dump-plan", "--out", str(out),
           "--name", name, *args.extra]
    env = {**os.environ, "SHARDC_PEAK_BUDGET": budget}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    path = out / f"{name}.json"
    if not path.exists():
        return {"budget": budget, "status": f"no report (rc {proc.returncode})",
                "tail": (proc.stdout + proc.stderr)[-1500:]}
    result = json.loads(path.read_text())["models"][args.model]["results"]["shardc-budget"]
    region = max(result.get("regions", [{}]), key=lambda r: r.get("budget", {}).get(
        "peak_bytes", 0), default={})
    error = str(result.get("error", ""))
    named = re.search(r"feasible minimum (\d+) B", error)  # a refusal names the minimum
    # ... and the smallest budget accepted (the minimum plus the prediction's margin).
    smallest = re.search(r"smallest budget accepted is (\d+) B", error)
    return {"budget": budget, "status": result.get("status"), "error": error[-600:],
            "named_minimum_bytes": int(named.group(1)) if named else None,
            "smallest_budget_bytes": int(smallest.group(1)) if smallest else None,
            **region.get("budget", {}),
            "measured_peak_bytes": result.get("peak_alloc_bytes"),
            "tokens_per_s_per_gpu": result.get("tokens_per_s_per_gpu")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--model", default="1b")
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--budgets", nargs="*", default=None, help="bytes (floats allowed) or auto")
    p.add_argument("--out", default="docs/bench/budget")
    p.add_argument("extra", nargs="*", help="more train_bench.py arguments (after --)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.budgets:
        budgets = [b if b == "auto" else str(int(float(b))) for b in args.budgets]
    else:
        auto = run("auto", args, out)
        rows.append(auto)
        low, high = auto.get("minimum_bytes"), auto.get("peak_bytes")
        if not low:
            print(json.dumps(auto, indent=1))
            sys.exit("the auto run gave no budget record")
        # The refusal of a 1-byte budget names the smallest budget accepted: the feasible
        # minimum with recompute, plus the margin for the prediction's error.
        probe = run("1", args, out)
        low = probe.get("smallest_budget_bytes") or probe.get("named_minimum_bytes") or low
        # Keeping everything can predict a lower peak than resharding everything (the
        # backward's re-gather buffers go); then sweep from the lower one up 10 %.
        low, high = min(low, high), max(high, low)
        high = max(high, int(low * 1.1))
        step = (high - low) / max(args.count - 1, 1)
        budgets = [str(int(low + i * step)) for i in range(args.count)] + [str(low - 1)]
    for b in budgets:
        rows.append(run(b, args, out))
        print(json.dumps(rows[-1]), flush=True)
    print("\nbudget B | status | minimum B | predicted peak B | measured peak B | "
          "measured <= budget | kept | recomputed | tokens/s/GPU")
    for r in rows:
        measured, budget = r.get("measured_peak_bytes"), r.get("budget_bytes")
        ok = "-" if not (measured and budget) else str(measured <= budget)
        print(f"{r['budget']} | {r.get('status')} | {r.get('minimum_bytes')} | "
              f"{r.get('peak_bytes')} | {measured} | {ok} | {r.get('kept')} | "
              f"{r.get('recomputed')} | "
              f"{r.get('tokens_per_s_per_gpu')}")
    (out / "sweep.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
