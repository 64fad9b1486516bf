"""What the peak-budget search costs on the CPU test models: its trials (which configurations,
how many repeats) and the seconds of each pipeline stage, in the trials and in the real build.

Runs the budget scenarios of ``tests/real_models.py`` (``peak_budget``, ``peak_budget_offload``,
``peak_budget_optimizer``) on spawned gloo ranks, with the pipeline's stages wrapped by timers
(``shardc.compile.pipeline``'s module functions), and prints per scenario and rank: the trials
(``search_inputs``'s trial calls) and the distinct configurations among them, the wall
seconds and calls per stage (trials / real build), the CPU seconds of the scenario and of the
search (this process's: steadier than wall seconds on a loaded machine), and the hash and a
digest of every plan built for real; ``--json`` also keeps every trial's plan hash, peak and
step time (so two commits can be compared: same trials, same decisions, same plans, same
graphs). The key of a trial: (compile, kept, recomputed, offloaded, depth, optimizer on the
host, parameters whose state is on the host).

    PYTHONPATH=$PWD:$PWD/tests .venv/bin/python benchmarks/budget_trials.py --world 1 2
    ... --json /tmp/after.json   # the rows, for a comparison with another commit's
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _path in (HERE.parent, HERE.parent / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

SCENARIOS = ("peak_budget", "peak_budget_offload", "peak_budget_optimizer")
STAGES = ("copy_graph_module", "keep_gathered", "joint_passes", "region_blocks",
          "recompute_blocks", "partition", "offload_activations", "lower_and_predict", "lower",
          "predict",
          "plan_within_budget", "apply_plan", "predict_peak")


def _instrument(stats: dict) -> None:
    """Wrap the pipeline's stages with timers and ``search_inputs``'s trial with a counter."""
    from shardc.compile import pipeline

    state = {"in_trial": False}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                where = "trial" if state["in_trial"] else "real"
                stats["seconds"][f"{where}/{name}"] += time.perf_counter() - start
                stats["seconds"][f"{where}/{name}/calls"] += 1
        return wrapper

    for name in STAGES:
        if hasattr(pipeline, name):
            setattr(pipeline, name, timed(name, getattr(pipeline, name)))

    search_inputs = pipeline.search_inputs

    def counted_search_inputs(gm, joint_inputs, options, region, kwargs):
        start = time.perf_counter()
        inputs = search_inputs(gm, joint_inputs, options, region, kwargs)
        stats["seconds"]["search_inputs"] += time.perf_counter() - start
        trial = inputs.trial
        compile_index = stats["compiles"] = stats.get("compiles", 0) + 1

        def counted(kept, recomputed, offloaded, depth):
            key = (compile_index, tuple(sorted(kept)), tuple(sorted(recomputed)),
                   tuple(sorted(offloaded)), depth, region.optimizer_on_host,
                   tuple(sorted(region.optimizer_host_params)))
            stats["trials"].append(repr(key))
            state["in_trial"] = True
            start = time.perf_counter()
            try:
                plan = trial(kept, recomputed, offloaded, depth)
                stats["trial_plans"].append((repr(key), plan.hash(), plan.predicted.peak_bytes,
                                             plan.predicted.step_time_s))
                return plan
            finally:
                state["in_trial"] = False
                stats["seconds"]["trial_total"] += time.perf_counter() - start

        return dataclasses.replace(inputs, trial=counted)

    pipeline.search_inputs = counted_search_inputs

    choose = pipeline.budget_search.choose_under_budget

    def timed_choose(*args, **kwargs):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return choose(*args, **kwargs)
        finally:
            stats["seconds"]["search_total"] += time.perf_counter() - start
            stats["seconds"]["search_cpu"] += time.process_time() - cpu

    pipeline.budget_search.choose_under_budget = timed_choose

    plan_and_lower = pipeline.plan_and_lower

    def recorded(fw, bw, options, region, **kwargs):
        plan = plan_and_lower(fw, bw, options, region, **kwargs)
        if plan.budget is not None:
            data = plan.to_dict()
            digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
            code = hashlib.sha256((fw.code + (bw.code if bw is not None else "")).encode())
            stats["plans"].append({"hash": plan.hash(), "plan_digest": digest,
                                   "code_digest": code.hexdigest()[:16],
                                   "trials": plan.budget.trials})
        return plan

    pipeline.plan_and_lower = recorded


def run(rank: int, world: int, names: list[str]) -> dict:
    """One rank: every scenario, instrumented (module level: spawned by ``run_ranks``)."""
    import real_models

    out = {}
    for name in names:
        stats = {"seconds": collections.defaultdict(float), "trials": [], "plans": [],
                 "trial_plans": []}
        from shardc.compile import pipeline

        saved = {n: getattr(pipeline, n) for n in (*STAGES, "search_inputs", "plan_and_lower")
                 if hasattr(pipeline, n)}
        saved_choose = pipeline.budget_search.choose_under_budget
        _instrument(stats)
        try:
            result = real_models.run_scenarios(rank, world, [name])[name]
        finally:
            for n, fn in saved.items():
                setattr(pipeline, n, fn)
            pipeline.budget_search.choose_under_budget = saved_choose
        out[name] = {"seconds": dict(stats["seconds"]), "trials": stats["trials"],
                     "plans": stats["plans"], "trial_plans": stats["trial_plans"],
                     "scenario_s": result.get("seconds"),
                     "scenario_cpu_s": result.get("cpu_seconds"),
                     "exception": result.get("exception")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS))
    parser.add_argument("--keys", action="store_true", help="print every trial's key")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    from dist_utils import run_ranks

    rows = {}
    for world in args.world:
        results = run_ranks(run, world, args.scenarios)
        for name in args.scenarios:
            for rank, per in enumerate(results):
                r = per[name]
                counts = collections.Counter(r["trials"])
                s = r["seconds"]
                print(f"world {world} rank {rank} {name}: scenario {r['scenario_s']:.1f} s "
                      f"(CPU {r['scenario_cpu_s']:.1f} s), search {s.get('search_total', 0):.1f} s "
                      f"(CPU {s.get('search_cpu', 0):.1f} s), trials {len(r['trials'])} "
                      f"({len(counts)} distinct, {len(r['trials']) - len(counts)} repeats) "
                      f"{s.get('trial_total', 0):.1f} s")
                if r["exception"]:
                    print("  EXCEPTION", r["exception"][:2000])
                if rank == 0 and args.keys:
                    for key in r["trials"]:
                        print(f"  trial {key}")
                if rank == 0:
                    for where in ("trial", "real"):
                        parts = [f"{n} {s[f'{where}/{n}']:.2f} s/{s[f'{where}/{n}/calls']:.0f}"
                                 for n in STAGES if f"{where}/{n}" in s]
                        print(f"  {where}: " + ", ".join(parts))
                    for p in r["plans"]:
                        print(f"  plan {p}")
                rows[f"{world}/{rank}/{name}"] = r
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
