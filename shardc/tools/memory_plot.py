"""Plots of a plan's memory (PNG, matplotlib): the whole step stacked by category, and a world-size
sweep of the capacity planner.

:func:`step_memory_plot` draws the step's memory over the schedule (forward, backward, then the
optimizer step) stacked by category (``Plan.memory_by_category``: parameter shards, optimizer
state, gradients, gathered parameters, saved activations, temporaries, communication buffers),
the device's capacity as a line and the peak marked with what is live there; below it, the
communication buffers alone on their own scale (``Plan.memory_timeline``), which would lie flat
at the bottom of the whole step's axis. matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardc.planning.plan import Plan

GIB = 2**30
_COLORS = {"parameter shards": "tab:blue", "optimizer state": "tab:purple",
           "gradients": "tab:olive", "gathered parameters": "tab:orange",
           "saved activations": "tab:green", "temporaries": "tab:gray",
           "communication buffers": "tab:red", "runtime workspaces": "tab:brown"}
_GRAPH_ORDER = ("forward", "backward", "optimizer step")


def _figure(rows: int, height: float):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("shardc's plots need matplotlib: pip install matplotlib "
                          "(or pip install 'shardc[plot]')") from exc
    fig = Figure(figsize=(12, height * rows + 0.8), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _step_columns(data: dict[str, Any]) -> tuple[list[float], dict[str, list[float]], dict]:
    """x coordinates (the graphs one after another, each over its own positions) and the stacked
    series; also where each graph starts, for labels and the peak marker."""
    xs: list[float] = []
    series: dict[str, list[float]] = {c: [] for c in data["categories"]}
    starts: dict[str, tuple[float, float]] = {}
    offset = 0.0
    graphs = [g for g in _GRAPH_ORDER if g in data["graphs"]]
    total_positions = sum(max(data["graphs"][g]["positions"], default=0) + 1
                          for g in graphs if g != "optimizer step")
    for g in graphs:
        cols = data["graphs"][g]
        width = max(total_positions * 0.03, 1.0) if g == "optimizer step" else None
        length = width if width else max(cols["positions"], default=0) + 1
        starts[g] = (offset, length)
        positions = [0.0, width] if width else cols["positions"]
        for i, pos in enumerate(positions):
            xs.append(offset + pos)
            j = 0 if width else i
            for c in series:
                series[c].append(cols["bytes"][c][j] / GIB)
        offset += length
    return xs, series, starts


def _draw_step(ax, plan: Plan, capacity_bytes: float | None) -> None:
    data = plan.memory_by_category
    xs, series, starts = _step_columns(data)
    ax.stackplot(xs, *series.values(), labels=list(series), step="post",
                 colors=[_COLORS.get(c) for c in series], alpha=0.85)
    top = max((sum(v) for v in zip(*series.values(), strict=True)), default=0.0)
    if capacity_bytes is not None:
        ax.axhline(capacity_bytes / GIB, color="black", linestyle="--",
                   label=f"device capacity ({capacity_bytes / GIB:.1f} GiB)")
        top = max(top, capacity_bytes / GIB)
    if plan.budget is not None:  # the whole-step peak budget the plan was made under
        ax.axhline(plan.budget.budget_bytes / GIB, color="tab:red", linestyle=":",
                   label=f"peak budget ({plan.budget.budget_bytes / GIB:.2f} GiB)")
        top = max(top, plan.budget.budget_bytes / GIB)
    peak = data.get("peak") or {}
    if peak.get("graph") in starts:
        start, length = starts[peak["graph"]]
        x = start + (peak["position"] if peak["graph"] != "optimizer step" else length / 2)
        total = sum(peak["bytes"].values()) / GIB
        live = sorted(peak["bytes"].items(), key=lambda kv: -kv[1])
        text = f"peak {total:.2f} GiB ({peak['graph']}):\n" + "\n".join(
            f"{c}: {b / GIB:.2f} GiB" for c, b in live if b > 0)
        ax.plot([x], [total], marker="v", color="black")
        ax.annotate(text, (x, total), xytext=(10, -10), textcoords="offset points",
                    fontsize="x-small", va="top",
                    bbox={"boxstyle": "round", "fc": "white", "alpha": 0.85})
    on_host = plan.budget is not None and plan.budget.optimizer_on_host
    state = "part of the state" if on_host and plan.budget.optimizer.partial else "state"
    for g, (start, _) in starts.items():
        ax.axvline(start, color="black", linewidth=0.5, alpha=0.5)
        # The peak budget's last lever: the state is in host memory, not in these columns.
        label = (f" {g} ({state} on the host)" if g == "optimizer step" and on_host
                 else f" {g}")
        ax.text(start, top * 1.12, label, fontsize="small", va="top")
    ax.set_xlim(0, max(xs, default=1))
    ax.set_ylim(0, max(top * 1.15, 1e-6))
    ax.set_ylabel("GiB per rank")
    ax.set_xlabel("schedule position (forward, backward, optimizer step)")
    ax.legend(loc="upper left", fontsize="x-small", ncol=2)
    ax.grid(True, alpha=0.3)


def _draw_comm(ax, plan: Plan) -> None:
    graphs = [g for g in _GRAPH_ORDER if plan.memory_timeline.get(g)]
    offset = 0
    top = 0.0
    for g in graphs:
        timeline = plan.memory_timeline[g]
        xs = [offset + i for i in range(len(timeline) + 1)]
        ys = [v / GIB for v in [*timeline, timeline[-1]]]
        ax.step(xs, ys, where="post", label=f"{g}")
        ax.fill_between(xs, ys, step="post", alpha=0.25)
        top = max(top, *ys)
        offset += len(timeline) + 1
    peak = plan.predicted.get("peak_comm_buffer_bytes")
    if peak is not None:
        ax.axhline(peak / GIB, color="tab:red", linestyle="--",
                   label=f"predicted peak of communication buffers ({peak / GIB:.3f} GiB)")
        top = max(top, peak / GIB)
    if not graphs:
        ax.text(0.5, 0.5, "no communication buffers in this plan", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_ylim(0, max(top * 1.15, 1e-6))
    ax.set_ylabel("communication buffers (GiB)")
    ax.set_xlabel("schedule position (forward, then backward)")
    ax.legend(loc="upper right", fontsize="x-small")
    ax.grid(True, alpha=0.3)


def step_memory_plot(plan: Plan, path: str | Path, *,
                     capacity_bytes: float | None = None) -> Path:
    """Write a PNG of the step's memory by category and of its communication buffers."""
    whole = bool(plan.memory_by_category.get("graphs"))
    fig = _figure(2 if whole else 1, 3.6)
    fig.suptitle(f"shardc region {plan.region}, world size {plan.world_size}: memory per rank "
                 f"(plan {plan.hash()})")
    if whole:
        _draw_step(fig.add_subplot(2, 1, 1), plan, capacity_bytes)
    _draw_comm(fig.add_subplot(2 if whole else 1, 1, 2 if whole else 1), plan)
    return _save(fig, path)


def sweep_plot(rows: Sequence[Any], path: str | Path, title: str) -> Path:
    """Write a PNG of a world-size sweep (``shardc.tools.planner.Capacity`` rows): step time and
    exposed communication, tokens/s per GPU and MFU, and the peak memory against capacity."""
    fig = _figure(3, 2.6)
    fig.suptitle(f"{title}: predicted by world size")
    worlds = [r.world for r in rows]
    ax = fig.add_subplot(3, 1, 1)
    ax.plot(worlds, [r.step_s * 1e3 for r in rows], marker="o", label="step")
    ax.plot(worlds, [r.exposed_comm_s * 1e3 for r in rows], marker="o",
            label="exposed communication")
    ax.set_ylabel("ms")
    ax2 = fig.add_subplot(3, 1, 2)
    ax2.plot(worlds, [r.tokens_per_s for r in rows], marker="o", label="tokens/s per GPU")
    ax2.set_ylabel("tokens/s per GPU")
    twin = ax2.twinx()
    twin.plot(worlds, [r.mfu * 100 for r in rows], marker="s", color="tab:green", label="MFU")
    twin.set_ylabel("MFU %")
    ax3 = fig.add_subplot(3, 1, 3)
    ax3.plot(worlds, [r.peak_bytes / GIB for r in rows], marker="o", label="predicted peak")
    caps = {r.capacity_bytes for r in rows if r.capacity_bytes is not None}
    for cap in caps:
        ax3.axhline(cap / GIB, color="black", linestyle="--",
                    label=f"device capacity ({cap / GIB:.1f} GiB)")
    ax3.set_ylabel("GiB per rank")
    ax3.set_xlabel("world size")
    for a in (ax, ax2, ax3):
        a.set_xscale("log", base=2)
        a.grid(True, alpha=0.3)
        a.legend(loc="upper left", fontsize="x-small")
    return _save(fig, path)
