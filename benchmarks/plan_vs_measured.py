"""Plans made without GPUs against GPU runs: ``python -m shardc plan`` on a CPU-only machine
predicts the peak and the step that ``benchmarks/predict_step.py`` measured.

    # on the GPU machine (writes predict_step.json with what it measured and the plan it made):
    torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile h100.json --out docs/bench
    # here, without a GPU:
    python benchmarks/plan_vs_measured.py --measured docs/bench/predict_step.json \\
        --profile h100.json --out docs/bench/plan_vs_measured.md
    python benchmarks/plan_vs_measured.py            # peaks only, against the runs in ROWS

With ``--measured``, each configuration that ran is planned here exactly as the capacity planner
plans for a user (``shardc.tools.planner.plan_model``: Inductor's graphs, the per-block template,
attention as the GPU's fused kernel, the loss in the compiled region, bf16 compute with fp32
reduction, the same cluster profile), and the CPU plan's peak and step (the plan's forward and
backward, then the gradient hand-off, optimizer and zero_grad: ``shardc.planning.step.
predict_step``, as predict_step.py predicts it) are set beside the GPU's
measured ones and the plan the GPU run made at compile time. FP8 rows are planned as the GPU
runs them (``Float8Policy(modules=(Linear, Embedding))``, the Linears traced on
``torch._scaled_mm``: ``shardc.sharding.fp8.scaled_mm_as_on_gpu``).
Without ``--measured`` it compares peaks with the recorded runs in ``ROWS``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shardc.planning.profile import PRESETS, preset_for_device, resolve_profile  # noqa: E402
from shardc.tools.model_spec import llama_model, parse_model  # noqa: E402
from shardc.tools.planner import (  # noqa: E402
    DEVICES_GIB,
    GIB,
    PlanSetup,
    device_capacity,
    plan_model,
    plan_model_step,
    whole_step,
)

# name: (model spec, overrides, world, batch, seq, measured peak GiB, where it was measured)
ROWS = {
    "1b-w1": ("llama-1b", [], 1, 4, 2048, 19.96,
              "1 x H100, docs/bench/refactor17 (train_bench.py --model 1b, world 1)"),
    "1b-w2": ("llama-1b", [], 2, 4, 2048, 14.59,
              "2 x H200, docs/bench/README.md (train_bench_f09ceaf)"),
    "wide-w2": ("llama-wide", [], 2, 2, 2048, 17.59,
                "2 x H200, docs/bench/README.md (train_bench_f09ceaf; peak in opt.step)"),
}


def _err(pred: float, meas: float | None) -> str:
    return "–" if not pred or not meas else f"{(pred / meas - 1) * 100:+.1f}%"


def _peaks_only(only: list[str] | None) -> list[str]:
    lines = ["| config | world | batch x seq | predicted GiB | measured GiB | error | plan s | "
             "measured on |", "|---|---:|---|---:|---:|---:|---:|---|"]
    print("\n".join(lines), flush=True)
    for name in only or ROWS:
        spec, overrides, world, batch, seq, measured, source = ROWS[name]
        start = time.perf_counter()
        # the GPU's count: the caching allocator's blocks and the runtime's workspaces
        plan, _ = plan_model(parse_model(spec, overrides), world, batch, seq,
                             {"memory_target": "cuda"},
                             setup=PlanSetup(precision="bf16", inductor=True))
        predicted = plan.predicted.peak_bytes / GIB
        lines.append(f"| {name} | {world} | {batch} x {seq} | {predicted:.2f} | "
                     f"{measured:.2f} | {_err(predicted, measured)} | "
                     f"{time.perf_counter() - start:.0f} | {source} |")
        print(lines[-1], flush=True)
    return lines


def _profile_option(meta: dict, profile: str | None) -> dict:
    """The cluster profile the GPU run used: ``--profile``, else the one it names if it is a
    preset or a file here, else the preset for its GPU."""
    name = profile or meta.get("profile_arg")
    if name and (name in PRESETS or Path(name).is_file()):
        return {"profile": name}
    if name:
        raise SystemExit(f"plan_vs_measured: the GPU run used the profile {name!r}, which is "
                         "not here; pass its file as --profile")
    return {"profile": preset_for_device(meta.get("gpu", ""))}


def mesh_setup(meta: dict) -> PlanSetup:
    """How the GPU run trained (bf16, Inductor) on the mesh it ran on: predict_step.py's
    ``--mesh RxS`` (``mesh_shape``: HSDP, shard groups of S ranks) or ``--tp N`` (``tp``);
    reports without them ran FSDP over every rank. Its CPU offload (``--offload``,
    ``--step-in-backward``; reports without them ran none) with torch's default AdamW, as it
    ran (the CLI's ``--optimizer adamw``)."""
    shape = meta.get("mesh_shape")
    return PlanSetup(precision="bf16", inductor=True, tp=int(meta.get("tp") or 1),
                     shard_size=int(shape[1]) if shape else None,
                     offload=meta.get("offload") or "none",
                     step_in_backward=bool(meta.get("step_in_backward")), optimizer="adamw")


@dataclass(frozen=True)
class PlannedRow:
    """A GPU run's configuration planned here: the whole step, the peak, the planning
    seconds, and the predicted exposed communication (seconds per step: what communication
    adds to the step, ``StepPrediction.exposed_comm_s``)."""

    step_s: float
    peak_bytes: float
    seconds: float
    exposed_comm_s: float = 0.0


# ``--backend-option`` fields a CPU plan does not take from the GPU run's record: its profile
# is this script's ``--profile`` or the run's, its budget the run's ``--memory-budget`` (a
# budget set as a backend option is not re-planned), and the CPU planner sets Inductor itself.
_OWN_OPTIONS = ("cluster", "peak_memory_budget_bytes", "inductor")


def _run_options(meta: dict, cluster: dict) -> dict:
    """The backend options the GPU run compiled with that the plan depends on: its cluster
    profile, its peak memory budget (``"auto"``: the budget a compile on that GPU takes,
    :func:`shardc.planning.budget.auto_budget` of its memory) and the ``ShardcOptions`` fields
    it set with ``--backend-option`` (``meta["backend_options"]``; the others of
    :data:`_OWN_OPTIONS`)."""
    from shardc.planning.budget import auto_budget

    recorded = meta.get("backend_options") or {}
    options: dict = {k: v for k, v in recorded.items() if k not in _OWN_OPTIONS}
    options["cluster"] = cluster
    budget = meta.get("memory_budget")
    if budget == "auto":
        gpu = str(meta.get("gpu", "")).lower()
        device = next((d for d in DEVICES_GIB if d in gpu), None)
        if device is None:
            raise SystemExit(f"plan_vs_measured: the run's memory budget was 'auto' on "
                             f"{meta.get('gpu')!r}, whose memory is not known here")
        options["peak_memory_budget_bytes"] = auto_budget(device_capacity(device))
    elif budget is not None:
        options["peak_memory_budget_bytes"] = int(float(budget))
    return options


def plan_measured_row(meta: dict, r: dict, profile: str | None) -> PlannedRow:
    """One configuration of a ``predict_step.py`` report (``meta``, result ``r``) planned
    here, as the capacity planner plans it for a user, with what the run used: its mesh,
    precision, cluster profile, memory budget and CUDA graphs (``--cudagraphs``: the step
    replayed)."""
    from train.workload import model_config

    cluster = _profile_option(meta, profile)
    prof = resolve_profile(cluster)
    options = _run_options(meta, cluster)
    c = r["config"]
    seq = c.get("seq") or meta["seq"]
    cfg = model_config(c["model"], seq, bool(meta.get("tiny")), c["layers"])
    setup = replace(mesh_setup(meta), fp8=c["precision"] == "fp8", fp8_embedding=True)
    start = time.perf_counter()
    # The budget planner runs on whole traces only (the CLI's --memory-budget does the same).
    planned = plan_model_step(llama_model(cfg), int(meta["world_size"]), c["batch"], seq,
                              options, template="peak_memory_budget_bytes" not in options,
                              setup=setup)
    seconds = time.perf_counter() - start
    step = whole_step(planned, prof, cudagraphs=bool(meta.get("cudagraphs")))
    # Back to back, as the measured step and the GPU plan's predicted_step_s are.
    return PlannedRow(step.steady_s, planned.plan.predicted.peak_bytes, seconds,
                      step.exposed_comm_s)


def _from_measured(path: str, profile: str | None) -> list[str]:
    report = json.loads(Path(path).read_text())
    meta = report["meta"]
    prof = resolve_profile(_profile_option(meta, profile))
    world = int(meta["world_size"])
    mesh = f", mesh {meta['mesh']}" if meta.get("mesh") else ""
    lines = [
        f"# CPU plans against GPU runs ({meta['gpu']} x {world}{mesh})", "",
        f"- GPU run: `{meta['command']}` ({meta['git']}, {meta['date']} UTC)",
        f"- CPU plans: `python benchmarks/plan_vs_measured.py --measured {path}` with the cluster "
        f"profile {prof.name} ({prof.date})", "",
        "| model | layers | batch x seq | CPU plan peak GiB | measured GiB | error | "
        "GPU plan peak GiB | CPU plan step ms | measured step ms | error | GPU plan step ms | "
        "plan s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    for r in report["results"]:
        c = r["config"]
        seq = c.get("seq") or meta["seq"]
        head = (f"| {c['model']}{' FP8' if c['precision'] == 'fp8' else ''} | {c['layers']} | "
                f"{c['batch']} x {seq} |")
        if r.get("status") != "ok":
            lines.append(f"{head} {r.get('status')} |" + " |" * 8)
            print(lines[-1], flush=True)
            continue
        planned = plan_measured_row(meta, r, profile)
        meas_peak, meas_step = r.get("measured_peak_bytes"), r.get("measured_step_s")
        lines.append(
            f"{head} {planned.peak_bytes / GIB:.2f} | "
            f"{'–' if not meas_peak else f'{meas_peak / GIB:.2f}'} | "
            f"{_err(planned.peak_bytes, meas_peak)} | {r['predicted_peak_bytes'] / GIB:.2f} | "
            f"{planned.step_s * 1e3:.1f} | {meas_step * 1e3:.1f} | "
            f"{_err(planned.step_s, meas_step)} | {r['predicted_step_s'] * 1e3:.1f} | "
            f"{planned.seconds:.0f} |")
        print(lines[-1], flush=True)
    lines += ["", "Goal: the CPU plan within 5% of the measured peak and 10% of the measured "
              "step, as the plan made at compile time on the GPU is."]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", action="append", default=None,
                        help="predict_step.py's JSON report (GPU run) to plan and compare; "
                             "repeat for several runs (one table each)")
    parser.add_argument("--profile", default=None,
                        help="cluster profile file or preset (default: the GPU run's)")
    parser.add_argument("--out", default=None, help="write the table (markdown) here too")
    parser.add_argument("--only", action="append", choices=list(ROWS),
                        help="without --measured: these recorded runs only")
    args = parser.parse_args(argv)
    if args.measured:
        lines = []
        for path in args.measured:
            lines += [*_from_measured(path, args.profile), ""]
    else:
        lines = _peaks_only(args.only)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
