"""Tokens/s against measured peak memory: shardc's budgets and FSDP2's configurations (issue 22).

Contract: the functions here are pure (no torch, no process group): they take the rows that
``benchmarks/budget_sweep.py`` collects, one per run, as dicts with ``kind`` (``"shardc"`` or
``"baseline"``), ``label``, ``status``, ``measured_peak_bytes``, ``tokens_per_s_per_gpu`` and,
for shardc, ``budget_bytes``; and they return text: a markdown table with the comparison at
equal memory (:func:`curve_markdown`) and an SVG plot drawn by hand (:func:`curve_svg`), so no
plotting package is needed on the GPU machine.

The comparison is the issue's goal read two ways:

* per shardc budget: the best FSDP2 configuration whose measured peak fits that budget, and
  shardc's tokens/s over its tokens/s;
* per FSDP2 point: whether some shardc point with a measured peak no higher has tokens/s at
  least as high (shardc's curve above that point).
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

GIB = float(1 << 30)

Row = dict[str, Any]


def ok_points(rows: list[Row], kind: str) -> list[Row]:
    """The rows of ``kind`` that ran and measured a peak and a throughput."""
    return [r for r in rows if r.get("kind") == kind and r.get("status") == "ok"
            and r.get("measured_peak_bytes") and r.get("tokens_per_s_per_gpu")]


def best_baseline_within(rows: list[Row], memory_bytes: float) -> Row | None:
    """The FSDP2 point with the highest tokens/s whose measured peak is within
    ``memory_bytes`` (None: none fits)."""
    fits = [r for r in ok_points(rows, "baseline") if r["measured_peak_bytes"] <= memory_bytes]
    return max(fits, key=lambda r: r["tokens_per_s_per_gpu"], default=None)


def shardc_dominating(rows: list[Row], point: Row) -> Row | None:
    """The shardc point with the highest tokens/s among those whose measured peak is at most
    ``point``'s; returned only if its tokens/s are at least ``point``'s."""
    fits = [r for r in ok_points(rows, "shardc")
            if r["measured_peak_bytes"] <= point["measured_peak_bytes"]]
    best = max(fits, key=lambda r: r["tokens_per_s_per_gpu"], default=None)
    if best is not None and best["tokens_per_s_per_gpu"] >= point["tokens_per_s_per_gpu"]:
        return best
    return None


def _gib(n: float | None) -> str:
    return "–" if not n else f"{n / GIB:.2f}"


def _tps(n: float | None) -> str:
    return "–" if not n else f"{n:,.0f}"


def _why(row: Row) -> str:
    text = str(row.get("error") or row.get("status") or "")
    return text.replace("|", "\\|").replace("\n", " ")[:140]


def curve_markdown(rows: list[Row], title: str = "") -> str:
    """The rows as a markdown table (shardc by budget, then the baselines) with the comparison
    at equal memory, and a line per goal."""
    lines = [f"# {title}" if title else "# Tokens/s against measured peak", ""]
    lines += ["| point | budget GiB | planned for GiB | measured peak GiB | peak <= budget | "
              "tokens/s/GPU | best FSDP2 within the budget | shardc / it |",
              "| --- | ---: | ---: | ---: | --- | ---: | --- | ---: |"]
    shardc = sorted((r for r in rows if r.get("kind") == "shardc"),
                    key=lambda r: r.get("budget_bytes") or 0)
    for r in shardc:
        budget, peak = r.get("budget_bytes"), r.get("measured_peak_bytes")
        planned = budget - r["margin_bytes"] if budget and r.get("margin_bytes") else budget
        if r.get("status") != "ok":
            lines.append(f"| {r['label']} | {_gib(budget)} | {_gib(planned)} | – | – | "
                         f"{r.get('status')}: {_why(r)} | | |")
            continue
        fits = "–" if not (budget and peak) else ("yes" if peak <= budget else
                                                  f"**no** (+{(peak / budget - 1):.1%})")
        best = best_baseline_within(rows, budget) if budget else None
        ratio = (f"{r['tokens_per_s_per_gpu'] / best['tokens_per_s_per_gpu']:.3f}"
                 if best else "–")
        lines.append(f"| {r['label']} | {_gib(budget)} | {_gib(planned)} | {_gib(peak)} | "
                     f"{fits} | {_tps(r.get('tokens_per_s_per_gpu'))} | "
                     f"{best['label'] + ' ' + _tps(best['tokens_per_s_per_gpu']) if best else '–'}"
                     f" | {ratio} |")
    for r in (r for r in rows if r.get("kind") == "baseline"):
        if r.get("status") != "ok":
            lines.append(f"| {r['label']} | | | – | | {r.get('status')}: {_why(r)} | | |")
            continue
        lines.append(f"| {r['label']} | | | {_gib(r.get('measured_peak_bytes'))} | | "
                     f"{_tps(r.get('tokens_per_s_per_gpu'))} | | |")
    lines += ["", *goal_lines(rows)]
    return "\n".join(lines) + "\n"


def goal_lines(rows: list[Row]) -> list[str]:
    """The goals, each answered from the rows (or said to be unanswerable)."""
    out = []
    measured = [r for r in ok_points(rows, "shardc") if r.get("budget_bytes")]
    over = [r["label"] for r in measured if r["measured_peak_bytes"] > r["budget_bytes"]]
    out.append(f"- measured peak <= budget: {len(measured) - len(over)} of {len(measured)} "
               "shardc budgets" + (f" (over: {', '.join(over)})" if over else ""))
    base = ok_points(rows, "baseline")
    if not base or not measured:
        out.append("- shardc's curve above every FSDP2 point: not answerable (no "
                   + ("FSDP2" if not base else "shardc") + " point measured)")
        return out
    below = [b for b in base if shardc_dominating(rows, b) is None]
    out.append(f"- shardc's curve above every FSDP2 point: {len(base) - len(below)} of "
               f"{len(base)} FSDP2 points have a shardc point with no more measured memory and "
               "at least their tokens/s" + (
                   " (not: " + ", ".join(f"{b['label']} at {_gib(b['measured_peak_bytes'])} GiB"
                                         for b in below) + ")" if below else ""))
    worse = [r["label"] for r in measured
             if (b := best_baseline_within(rows, r["budget_bytes"])) is not None
             and r["tokens_per_s_per_gpu"] < b["tokens_per_s_per_gpu"]]
    compared = [r for r in measured if best_baseline_within(rows, r["budget_bytes"])]
    out.append(f"- at each budget, shardc >= the best FSDP2 configuration within it: "
               f"{len(compared) - len(worse)} of {len(compared)} budgets with an FSDP2 point "
               "within them" + (f" (below: {', '.join(worse)})" if worse else ""))
    return out


_PALETTE = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf", "#ff7f0e")
_MARKERS = ("square", "triangle", "diamond", "cross", "circle")


def _ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """About ``n`` round tick values (1, 2, 2.5 or 5 times a power of ten apart) in [lo, hi]."""
    raw = max(hi - lo, 1e-12) / n
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9)
    return [round(k * step, 10) for k in range(first, math.floor(hi / step + 1e-9) + 1)]


def _marker(shape: str, x: float, y: float, color: str) -> str:
    if shape == "square":
        return f'<rect x="{x - 5:.1f}" y="{y - 5:.1f}" width="10" height="10" fill="{color}"/>'
    if shape == "triangle":
        return (f'<polygon points="{x:.1f},{y - 6:.1f} {x - 6:.1f},{y + 5:.1f} '
                f'{x + 6:.1f},{y + 5:.1f}" fill="{color}"/>')
    if shape == "diamond":
        return (f'<polygon points="{x:.1f},{y - 7:.1f} {x + 6:.1f},{y:.1f} {x:.1f},{y + 7:.1f} '
                f'{x - 6:.1f},{y:.1f}" fill="{color}"/>')
    if shape == "cross":
        return (f'<path d="M{x - 5:.1f},{y - 5:.1f} L{x + 5:.1f},{y + 5:.1f} M{x - 5:.1f},'
                f'{y + 5:.1f} L{x + 5:.1f},{y - 5:.1f}" stroke="{color}" stroke-width="2.5"/>')
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" fill="none" stroke="{color}" ' \
           'stroke-width="2"/>'


def curve_svg(rows: list[Row], title: str = "", width: int = 900, height: int = 560) -> str:
    """tokens/s per GPU (y) against measured peak GiB (x): shardc's budgets as a red line of
    dots (each budget a dotted tick on the x axis), every FSDP2 point as its own marker, with a
    legend. An SVG document as text."""
    shardc = sorted(ok_points(rows, "shardc"), key=lambda r: r["measured_peak_bytes"])
    base = ok_points(rows, "baseline")
    points = shardc + base
    left, right, top, bottom = 80, 250, 40, 60
    pw, ph = width - left - right, height - top - bottom
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="15">{escape(title or "tokens/s vs peak")}</text>']
    if not points:
        out.append(f'<text x="{left}" y="{top + 40}">no measured points</text></svg>')
        return "\n".join(out) + "\n"
    xs = [r["measured_peak_bytes"] / GIB for r in points]
    xs += [r["budget_bytes"] / GIB for r in shardc if r.get("budget_bytes")]
    ys = [r["tokens_per_s_per_gpu"] for r in points]
    x_lo, x_hi = min(xs), max(xs)
    pad = max((x_hi - x_lo) * 0.05, 0.05)
    x_lo, x_hi = max(0.0, x_lo - pad), x_hi + pad
    y_lo, y_hi = 0.0, max(ys) * 1.08

    def px(v: float) -> float:
        return left + (v - x_lo) / (x_hi - x_lo) * pw

    def py(v: float) -> float:
        return top + ph - (v - y_lo) / (y_hi - y_lo) * ph

    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" '
               'stroke="#444"/>')
    for t in _ticks(x_lo, x_hi):
        out.append(f'<line x1="{px(t):.1f}" y1="{top}" x2="{px(t):.1f}" y2="{top + ph}" '
                   'stroke="#eee"/>')
        out.append(f'<text x="{px(t):.1f}" y="{top + ph + 18}" text-anchor="middle">'
                   f'{t:g}</text>')
    for t in _ticks(y_lo, y_hi):
        out.append(f'<line x1="{left}" y1="{py(t):.1f}" x2="{left + pw}" y2="{py(t):.1f}" '
                   'stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{t:,.0f}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 16}" text-anchor="middle">measured peak '
               '(max_memory_allocated), GiB</text>')
    out.append(f'<text x="18" y="{top + ph / 2}" text-anchor="middle" '
               f'transform="rotate(-90 18 {top + ph / 2})">tokens/s per GPU</text>')
    legend: list[tuple[str, str]] = []
    if shardc:
        for r in shardc:
            if r.get("budget_bytes"):
                x = px(r["budget_bytes"] / GIB)
                out.append(f'<line x1="{x:.1f}" y1="{top + ph - 8}" x2="{x:.1f}" '
                           f'y2="{top + ph}" stroke="{_PALETTE[0]}" stroke-dasharray="2,2"/>')
        path = " ".join(f"{'M' if i == 0 else 'L'}{px(r['measured_peak_bytes'] / GIB):.1f},"
                        f"{py(r['tokens_per_s_per_gpu']):.1f}" for i, r in enumerate(shardc))
        out.append(f'<path d="{path}" fill="none" stroke="{_PALETTE[0]}" stroke-width="2"/>')
        for r in shardc:
            out.append(f'<circle cx="{px(r["measured_peak_bytes"] / GIB):.1f}" '
                       f'cy="{py(r["tokens_per_s_per_gpu"]):.1f}" r="4" fill="{_PALETTE[0]}">'
                       f'<title>{escape(str(r["label"]))}</title></circle>')
        legend.append((f'<circle cx="{{x}}" cy="{{y}}" r="4" fill="{_PALETTE[0]}"/>',
                       "shardc (budgets; ticks: budget)"))
    for i, r in enumerate(base):
        color = _PALETTE[1 + i % (len(_PALETTE) - 1)]
        shape = _MARKERS[i % len(_MARKERS)]
        x, y = px(r["measured_peak_bytes"] / GIB), py(r["tokens_per_s_per_gpu"])
        out.append(_marker(shape, x, y, color))
        legend.append((shape + "|" + color, str(r["label"])))
    lx, ly = left + pw + 20, top + 10
    for j, (mark, text) in enumerate(legend):
        y = ly + j * 22
        if "|" in mark and not mark.startswith("<"):
            shape, color = mark.split("|")
            out.append(_marker(shape, lx + 6, y, color))
        else:
            out.append(mark.format(x=f"{lx + 6:.1f}", y=f"{y:.1f}"))
        out.append(f'<text x="{lx + 18}" y="{y + 4}">{escape(text)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def curve_png(rows: list[Row], path: str, title: str = "") -> bool:
    """The same plot as :func:`curve_svg` with matplotlib, if it is installed (False if not)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(10, 6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    shardc = sorted(ok_points(rows, "shardc"), key=lambda r: r["measured_peak_bytes"])
    if shardc:
        ax.plot([r["measured_peak_bytes"] / GIB for r in shardc],
                [r["tokens_per_s_per_gpu"] for r in shardc], "o-", color=_PALETTE[0],
                label="shardc (budgets; ticks: budget)")
        for r in shardc:
            if r.get("budget_bytes"):
                ax.axvline(r["budget_bytes"] / GIB, ymax=0.03, color=_PALETTE[0], lw=1)
    for i, r in enumerate(ok_points(rows, "baseline")):
        ax.plot([r["measured_peak_bytes"] / GIB], [r["tokens_per_s_per_gpu"]],
                "s^Dxo"[i % 5], color=_PALETTE[1 + i % (len(_PALETTE) - 1)], ms=9,
                label=str(r["label"]))
    ax.set_xlabel("measured peak (max_memory_allocated), GiB")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.set_title(title or "tokens/s vs peak")
    ax.legend(loc="lower right", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return True
