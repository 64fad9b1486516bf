"""Planning time of ``python -m shardc plan`` against model depth and world size.

    python benchmarks/planning.py [--depths 8 16 32 80] [--worlds 2 64 1024 4096]

Each point runs in a fresh process (a fake process group per world size): the Llama-70B shape
(d_model 8192, 64 heads, 8 KV heads, FFN 28672) with the given number of layers, batch 1 x 4096
tokens per rank. Reports the wall time of tracing + planning (Dynamo, AOTAutograd, partition,
shardc's passes) and the plan's predictions.
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

POINT = """
import json, time
from shardc.cli import parse_model_spec, plan_model
cfg = parse_model_spec("llama-70b:n_layers={depth}")
plan, seconds = plan_model(cfg, {world}, 1, 4096, {{}})
print(json.dumps({{"seconds": seconds, "params": cfg.num_params(),
                  "collectives": len(plan.collectives), "buckets": len(plan.buckets),
                  "step_time_s": plan.predicted["step_time_s"],
                  "exposed_comm_s": plan.predicted["exposed_comm_s"],
                  "peak_bytes": plan.predicted.get("peak_bytes", 0)}}))
"""


def run_point(depth: int, world: int) -> dict:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", POINT.format(depth=depth, world=world)],
                            capture_output=True, text=True, cwd=ROOT, timeout=1800)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        return {"depth": depth, "world": world, "error": result.stderr[-500:]}
    data = json.loads(result.stdout.strip().splitlines()[-1])
    data.update(depth=depth, world=world, process_s=wall)
    return data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32, 80])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 64, 1024, 4096])
    parser.add_argument("--depth-for-worlds", type=int, default=8)
    parser.add_argument("--world-for-depths", type=int, default=1024)
    parser.add_argument("--out", default=str(ROOT / "docs" / "planning.md"))
    args = parser.parse_args()
    points = [(d, args.world_for_depths) for d in args.depths]
    points += [(args.depth_for_worlds, w) for w in args.worlds
               if (args.depth_for_worlds, w) not in points]
    rows = []
    for depth, world in points:
        row = run_point(depth, world)
        print(json.dumps(row), flush=True)
        rows.append(row)
    lines = [
        "# Planning time",
        "",
        f"Command: `python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}`".rstrip(),
        f"Date: {date.today()}, machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}.",
        "",
        "Llama-70B layer shape, batch 1 x 4096 per rank, traced on the meta device over a fake "
        "process group. `trace+plan s` is Dynamo + AOTAutograd + partition + shardc's passes; "
        "`process s` adds interpreter start and imports.",
        "",
        "| layers | params | world | trace+plan s | process s | buckets | collectives | "
        "predicted step ms | exposed comm ms | predicted peak GiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['depth']} | | {r['world']} | error: {r['error'][:80]} |")
            continue
        lines.append(
            f"| {r['depth']} | {r['params'] / 1e9:.1f}B | {r['world']} | {r['seconds']:.1f} | "
            f"{r['process_s']:.1f} | {r['buckets']} | {r['collectives']} | "
            f"{r['step_time_s'] * 1e3:.1f} | {r['exposed_comm_s'] * 1e3:.2f} | "
            f"{r['peak_bytes'] / 2**30:.2f} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
