"""Planning time of ``python -m shardc plan`` against model depth and world size.

    python benchmarks/planning.py [--depths 8 16 32 80] [--worlds 2 64 1024 4096]
                                  [--full-depths 8 16 32 80]

Each point runs in a fresh process (a fake process group per world size): the Llama-70B shape
(d_model 8192, 64 heads, 8 KV heads, FFN 28672) with the given number of layers, batch 1 x 4096
tokens per rank. Points are planned the CLI's default way (from a per-block template when the
model has more blocks than a template traces, ``shardc.template``); the ``--full-depths`` points
are planned again tracing every block, for reference. Reports the time from building the model to
the finished plan (``plan_model``'s seconds), the whole process's wall time, the 1-minute load
average before the point, the plan's predictions and a digest of the plan without node names
(``shardc.template.plan_digest``: equal digests are equal plans).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Everything from this line on in the output file is prose, kept when the table is rewritten.
NOTES_MARKER = "<!-- notes below: kept by benchmarks/planning.py -->"

POINT = """
import json, time
from shardc.tools.cli import parse_model_spec, plan_model
from shardc.tools.template import plan_digest
cfg = parse_model_spec("llama-70b:n_layers={depth}")
plan, seconds = plan_model(cfg, {world}, 1, 4096, {{}}, template={template})
print(json.dumps({{"seconds": seconds, "params": cfg.num_params(),
                  "collectives": len(plan.collectives), "buckets": len(plan.buckets),
                  "step_time_s": plan.predicted["step_time_s"],
                  "exposed_comm_s": plan.predicted["exposed_comm_s"],
                  "peak_bytes": plan.predicted.get("peak_bytes", 0),
                  "mode": "template" if any("from a template" in n for n in plan.notes)
                  else "full", "digest": plan_digest(plan)}}))
"""


def run_point(depth: int, world: int, template: bool = True) -> dict:
    load = os.getloadavg()[0]
    start = time.perf_counter()
    code = POINT.format(depth=depth, world=world, template=template)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=1800)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        return {"depth": depth, "world": world, "error": result.stderr[-500:]}
    data = json.loads(result.stdout.strip().splitlines()[-1])
    data.update(depth=depth, world=world, process_s=wall, load=load)
    return data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32, 80])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 64, 1024, 4096])
    parser.add_argument("--depth-for-worlds", type=int, default=80)
    parser.add_argument("--world-for-depths", type=int, default=1024)
    parser.add_argument("--full-depths", type=int, nargs="*", default=[8, 16, 32, 80],
                        help="depths also planned by tracing every block (world-for-depths)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "planning.md"))
    args = parser.parse_args()
    points = [(d, args.world_for_depths, True) for d in args.depths]
    points += [(args.depth_for_worlds, w, True) for w in args.worlds
               if (args.depth_for_worlds, w, True) not in points]
    points += [(d, args.world_for_depths, False) for d in args.full_depths]
    import torch

    rows = []
    for depth, world, template in points:
        row = run_point(depth, world, template)
        print(json.dumps(row), flush=True)
        rows.append(row)
    loads = [r["load"] for r in rows if "load" in r] or [0.0]
    lines = [
        "# Planning time",
        "",
        f"Command: `python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}`".rstrip(),
        f"Date: {date.today()}, machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, torch {torch.__version__}. The 1-minute load "
        f"average before the points ranged from {min(loads):.1f} to {max(loads):.1f} "
        "(column `load`): other jobs shared the cores, and wall times grow with the load.",
        "",
        "Llama-70B layer shape, batch 1 x 4096 per rank, planned on the meta device over a fake "
        "process group. `trace+plan s`: from building the model to the finished plan (template: "
        "block check, trace of 5 blocks, repetition, shardc's passes; full: Dynamo + AOTAutograd "
        "+ partition + shardc's passes over every block); `process s`: the whole process, "
        "interpreter start and imports included; `load`: 1-minute load average before the point "
        "(2 cores); `digest`: `shardc.template.plan_digest`, equal for equal plans.",
        "",
        "| layers | params | world | mode | trace+plan s | process s | load | buckets | "
        "collectives | predicted step ms | exposed comm ms | predicted peak GiB | digest |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['depth']} | | {r['world']} | error: {r['error'][:80]} |")
            continue
        lines.append(
            f"| {r['depth']} | {r['params'] / 1e9:.1f}B | {r['world']} | {r['mode']} | "
            f"{r['seconds']:.1f} | {r['process_s']:.1f} | {r['load']:.1f} | {r['buckets']} | "
            f"{r['collectives']} | {r['step_time_s'] * 1e3:.1f} | "
            f"{r['exposed_comm_s'] * 1e3:.2f} | {r['peak_bytes'] / 2**30:.2f} | "
            f"`{r['digest']}` |")
    out = Path(args.out)
    old = out.read_text() if out.exists() else ""
    notes = old[old.index(NOTES_MARKER):] if NOTES_MARKER in old else ""
    out.write_text("\n".join(lines) + "\n" + ("\n" + notes if notes else ""))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
