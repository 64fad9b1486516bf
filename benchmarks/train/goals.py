"""The issue's goals and the diagnosis sentences, computed from a model's results.

Contract: pure functions of the ``results`` dict of one model (as :func:`runner.aggregate` makes
it, or as read back from an earlier run's JSON), so an old report can be re-evaluated.
"""

from __future__ import annotations

from typing import Any

from train.modes import SHARDED_BASELINES
from train.units import GIB
from train.units import gib as _gib


def evaluate_goals(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's three goals, each with met / not met and the numbers."""
    goals = []
    sc, bound = results.get("shardc", {}), results.get("bound", {})
    ok = lambda r: r.get("status") == "ok"  # noqa: E731

    g: dict[str, Any] = {"goal": "shardc tokens/s >= 0.95 x bound"}
    if ok(sc) and ok(bound):
        ratio = sc["tokens_per_s_per_gpu"] / bound["tokens_per_s_per_gpu"]
        g.update(met=ratio >= 0.95, value=ratio,
                 detail=f"{sc['tokens_per_s_per_gpu']:,.0f} / {bound['tokens_per_s_per_gpu']:,.0f}"
                        f" = {ratio:.3f}x bound")
        if ratio < 0.95:
            need = 0.95 * bound["tokens_per_s_per_gpu"]
            gap_ms = sc["step_ms_median"] - bound["step_ms_median"]
            g["detail"] += (f"; missed by {0.95 - ratio:.3f} (needs {need:,.0f} tokens/s, i.e. "
                            f"{sc['step_ms_median'] - bound['step_ms_median'] / 0.95:.1f} ms/step "
                            f"less; shardc is {gap_ms:.1f} ms/step slower than bound)")
    else:
        g.update(met=None, detail="not evaluated (shardc or bound did not run)")
    goals.append(g)

    g = {"goal": "shardc peak alloc <= lowest of fsdp2 / fsdp2-compile / simplefsdp"}
    base = {m: results[m]["peak_alloc_bytes"] for m in SHARDED_BASELINES
            if ok(results.get(m, {})) and "peak_alloc_bytes" in results[m]}
    if ok(sc) and "peak_alloc_bytes" in sc and base:
        best = min(base, key=base.get)
        diff = sc["peak_alloc_bytes"] - base[best]
        amount = f"{diff / GIB:+.2f} GiB" if abs(diff) >= 0.1 * GIB else \
            f"{diff / (1 << 20):+.1f} MiB"
        g.update(met=diff <= 0, value=sc["peak_alloc_bytes"] / base[best],
                 detail=f"shardc {_gib(sc['peak_alloc_bytes'])} GiB vs {best} "
                        f"{_gib(base[best])} GiB ({amount}, {100 * diff / base[best]:+.3f}%)")
    else:
        g.update(met=None, detail="not evaluated (no peak memory for shardc or the baselines)")
    goals.append(g)

    g = {"goal": "shardc predicted peak within 5% of measured"}
    pred, kind = sc.get("predicted_peak_bytes"), sc.get("predicted_peak_kind", "")
    if ok(sc) and pred is not None and "peak_alloc_bytes" in sc:
        meas = sc["peak_alloc_bytes"]
        err = (pred - meas) / meas
        if kind.startswith("peak_bytes"):
            g.update(met=abs(err) <= 0.05, value=err,
                     detail=f"predicted {_gib(pred)} GiB vs measured {_gib(meas)} GiB "
                            f"({100 * err:+.1f}%)")
        else:
            g.update(met=False, value=err,
                     detail=f"the plan has no whole-step peak (no `peak_bytes`); its "
                            f"`peak_comm_buffer_bytes` = {_gib(pred)} GiB covers only the "
                            f"communication buffers, against {_gib(meas)} GiB measured "
                            f"({100 * err:+.1f}%)")
    else:
        g.update(met=None, detail="not evaluated (no prediction or no measured peak)")
    goals.append(g)
    return goals


def diagnose(results: dict[str, dict[str, Any]]) -> list[str]:
    """Sentences on where shardc's time and memory go, from the plan and the profile."""
    sc, bound = results.get("shardc", {}), results.get("bound", {})
    lines: list[str] = []
    prof, bprof = sc.get("profile") or {}, bound.get("profile") or {}
    if sc.get("status") == "ok" and bound.get("status") == "ok":
        gap = sc["step_ms_median"] - bound["step_ms_median"]
        lines.append(f"shardc step {sc['step_ms_median']:.1f} ms vs bound "
                     f"{bound['step_ms_median']:.1f} ms: {gap:+.1f} ms/step.")
    if sc.get("status") == "ok" and prof:
        lines.append(
            f"Profiler (mean over ranks, per step): NCCL kernels {prof['comm_ms']:.1f} ms, of "
            f"which {prof['exposed_comm_ms']:.1f} ms exposed (no other kernel running) and "
            f"{prof['overlapped_comm_ms']:.1f} ms overlapped; non-NCCL kernels "
            f"{prof['compute_ms']:.1f} ms; GPU idle {prof['idle_ms']:.1f} ms.")
        if bprof:
            lines.append(
                f"Bound for comparison: kernels {bprof['compute_ms']:.1f} ms, idle "
                f"{bprof['idle_ms']:.1f} ms per step; shardc's non-NCCL kernels take "
                f"{prof['compute_ms'] - bprof['compute_ms']:+.1f} ms more (copies into and out "
                f"of communication buffers, compute slowed by concurrent NCCL kernels) and its "
                f"idle time {prof['idle_ms'] - bprof['idle_ms']:+.1f} ms more.")
    if "predicted_exposed_comm_s" in sc:
        # predicted_step_time_s is the plans' forward+backward graphs, not the whole step (no
        # optimizer step: with CPU offload the host step is most of it); the whole step's
        # prediction is benchmarks/predict_step.py's (shardc.planning.step.predict_step).
        lines.append(
            f"Plan prediction: forward+backward graphs "
            f"{1e3 * sc.get('predicted_step_time_s', 0):.1f} ms (not the whole step: without "
            "the optimizer step, gradient hand-off and zero_grad; benchmarks/predict_step.py "
            "predicts the whole step), "
            f"communication {1e3 * sc.get('predicted_comm_time_s', 0):.1f} ms of which "
            f"{1e3 * sc['predicted_exposed_comm_s']:.1f} ms exposed "
            f"({sc.get('n_regions', '?')} compiled region(s)).")
    keep = results.get("shardc-keeporder", {})
    if keep.get("status") == "ok":
        kprof = keep.get("profile") or {}
        text = (f"shardc-keeporder (Inductor's reorder_for_peak_memory off, so the plan's issue "
                f"positions survive): step {keep['step_ms_median']:.1f} ms, "
                f"{keep['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU")
        if bound.get("status") == "ok":
            text += (f" = {keep['tokens_per_s_per_gpu'] / bound['tokens_per_s_per_gpu']:.3f}x "
                     "bound")
        if kprof:
            text += (f"; NCCL {kprof['comm_ms']:.1f} ms/step, {kprof['exposed_comm_ms']:.1f} ms "
                     "exposed")
        if "peak_alloc_bytes" in keep:
            text += f"; peak {_gib(keep['peak_alloc_bytes'])} GiB allocated"
        lines.append(text + ".")
    pool = results.get("shardc-pool", {})
    if pool.get("status") == "ok" and sc.get("status") == "ok":
        text = (f"shardc-pool (static communication pool under Inductor, comm_pool=True): "
                f"{pool['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU "
                f"({pool['tokens_per_s_per_gpu'] / sc['tokens_per_s_per_gpu']:.3f}x shardc)")
        if "peak_alloc_bytes" in pool and "peak_alloc_bytes" in sc:
            text += (f", peak {_gib(pool['peak_alloc_bytes'])} GiB allocated vs shardc's "
                     f"{_gib(sc['peak_alloc_bytes'])} GiB")
        lines.append(text + ".")
    if sc.get("status") == "ok" and "peak_alloc_bytes" in sc:
        text = f"Memory: shardc peak {_gib(sc['peak_alloc_bytes'])} GiB allocated"
        if bound.get("peak_alloc_bytes"):
            text += f" vs bound (replicated) {_gib(bound['peak_alloc_bytes'])} GiB"
        regions = sc.get("regions") or []
        parts = {k: v for k, v in (regions[0]["predicted"] if regions else {}).items()
                 if k.endswith("_bytes")}
        if parts:
            text += "; the plan's memory terms (region 0, GiB): " + ", ".join(
                f"{k} {v / GIB:.2f}" for k, v in parts.items())
        lines.append(text + ".")
    snap = sc.get("memory_at_peak")
    if snap:
        lines.append(
            f"Memory history of one shardc step (rank 0): peak {_gib(snap['peak_live_bytes'])} "
            "GiB allocated during the step on top of "
            f"{_gib(snap['allocated_before_recording_bytes_lower_bound'])} GiB allocated before "
            f"it, reached at {snap['peak_at']} ({snap['peak_phase']}); live at the peak by "
            "phase: " + ", ".join(f"{k} {_gib(v)} GiB" for k, v in snap["by_phase_bytes"].items())
            + "; largest sites: " + "; ".join(
                f"{t['site']} {_gib(t['bytes'])} GiB x{t['count']} `{t['source'][:70]}`"
                for t in snap["top"][:8]) + ".")
    return lines
