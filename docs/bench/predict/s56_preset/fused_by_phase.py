"""One row of a ``predict_step.py`` report planned on this machine as
``benchmarks/plan_vs_measured.py`` plans it; prints the graphs' predicted milliseconds by phase
and category where they differ from the plan the GPU run made at compile time, then both steps.

    PYTHONPATH=.:benchmarks python docs/bench/predict/s56_preset/fused_by_phase.py \\
        docs/bench/compile_time/s55/gpu/predict_s55.json 4 [--profile h200]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from plan_vs_measured import _profile_option, _run_options, mesh_setup
from train.workload import model_config

from shardc.planning.profile import resolve_profile
from shardc.tools.model_spec import llama_model
from shardc.tools.planner import plan_model_step, whole_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("row", type=int, help="index into the report's results")
    parser.add_argument("--profile", default="h200")
    args = parser.parse_args()
    report = json.loads(open(args.report).read())
    meta, r = report["meta"], report["results"][args.row]
    cluster = _profile_option(meta, args.profile)
    c = r["config"]
    seq = c.get("seq") or meta["seq"]
    cfg = model_config(c["model"], seq, bool(meta.get("tiny")), c["layers"])
    setup = replace(mesh_setup(meta), fp8=c["precision"] == "fp8", fp8_embedding=True)
    options = _run_options(meta, cluster)
    planned = plan_model_step(llama_model(cfg), int(meta["world_size"]), c["batch"], seq,
                              options, template="peak_memory_budget_bytes" not in options,
                              setup=setup)
    here = {k: v * 1e3 for k, v in (planned.plan.predicted.time_by_category_s or {}).items()}
    gpu = r["predicted_ms_by_category"]
    # Only the phase-prefixed keys: this plan's graphs hold no step-level totals.
    for key in sorted(k for k in set(here) | set(gpu) if "/" in k and not k.startswith("step/")):
        if abs(here.get(key, 0.0) - gpu.get(key, 0.0)) > 0.01:
            print(f"{key:24s} here {here.get(key, 0.0):9.3f} ms  GPU plan {gpu.get(key, 0.0):9.3f}"
                  f" ms  {here.get(key, 0.0) - gpu.get(key, 0.0):+.3f}")
    step = whole_step(planned, resolve_profile(cluster), cudagraphs=bool(meta.get("cudagraphs")))
    print(f"step here {step.steady_s * 1e3:.1f} ms, GPU plan {r['predicted_step_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
