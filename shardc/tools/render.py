"""Render a :class:`shardc.planning.plan.Plan` for people: a text table, a Chrome/Perfetto trace,
a memory plot, and :func:`dump_plan`, which writes all of them (plus the plan's JSON) for one rank.

Positions are indices into ``Plan.graphs[graph]`` (``p`` means "before compute op ``p``"; ``p ==
len(ops)`` is the end of the graph). Predicted times are seconds from the start of their graph;
the trace places the backward graph after the forward graph on one time axis.

Nothing here imports torch; matplotlib is imported only by :func:`memory_plot`
(``shardc.tools.memory_plot``).
"""

from __future__ import annotations

import json
import logging
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardc.tools.render_copies import copy_events, copy_lines

if TYPE_CHECKING:  # (the plan renders itself through this module: Plan.table)
    from shardc.planning.plan import Collective, ComputeOp, Plan


log = logging.getLogger("shardc")

# Options recorded in the plan that do not change the plan (hidden from the table's header).
_NON_PLANNING_OPTIONS = frozenset({"dump_dir", "check_plan_consistency", "debug_pool"})
_GRAPH_ORDER = ("forward", "backward")


# ------------------------------------------------------------------------------------ helpers


def _stall_note(c: Collective) -> str:
    """``", stall X"`` where the stream's stall for ``c`` exceeds what it adds (later host
    waits absorbed the rest), else nothing."""
    return f", stall {_ms(c.stall_s)}" if c.stall_s > c.exposed_s else ""


def _stall_s(c: Collective) -> float:
    """The compute stream's stall for ``c`` on the predicted timeline (what the trace draws):
    ``stall_s``, or in plans made before it ``exposed_s``, which then held the stall (a newer
    plan's exposure never exceeds its stall)."""
    return max(c.stall_s, c.exposed_s)


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _truncate(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _graph_names(plan: Plan) -> list[str]:
    """Graphs of the plan in display order: forward, backward, then any other in plan order."""
    seen: list[str] = []
    for name in [*plan.graphs, *(c.graph for c in plan.collectives), *plan.memory_timeline]:
        if name not in seen:
            seen.append(name)
    known = [g for g in _GRAPH_ORDER if g in seen]
    return known + [g for g in seen if g not in _GRAPH_ORDER]


def _issue_order(plan: Plan) -> list[Collective]:
    order = {g: i for i, g in enumerate(_graph_names(plan))}
    indexed = list(enumerate(plan.collectives))
    indexed.sort(key=lambda item: (order[item[1].graph], item[1].issue_pos,
                                   item[1].predicted_start_s, item[0]))
    return [c for _, c in indexed]


def _bucket_names(plan: Plan) -> dict[int, str]:
    return {b.index: b.name for b in plan.buckets}


def _abbrev_params(params: Sequence[str], width: int = 72) -> str:
    """``layers.0.{attn.wq.weight, attn.wk.weight, … (+5)}``: common dotted prefix factored out."""
    if not params:
        return "-"
    if len(params) == 1:
        return _truncate(params[0], width)
    split = [p.split(".") for p in params]
    prefix: list[str] = []
    for parts in zip(*(s[:-1] for s in split), strict=False):
        if all(part == parts[0] for part in parts):
            prefix.append(parts[0])
        else:
            break
    head = ".".join(prefix) + "." if prefix else ""
    rests = [".".join(s[len(prefix):]) for s in split]
    opening, closing = (head + "{", "}") if head else ("", "")
    shown: list[str] = []
    for i, rest in enumerate(rests):
        left = len(rests) - i - 1  # names after this one
        more = f", … (+{left})" if left else ""
        if len(opening + ", ".join([*shown, rest]) + more + closing) > width and shown:
            return opening + ", ".join(shown) + f", … (+{left + 1})" + closing
        shown.append(rest)
    return _truncate(opening + ", ".join(shown) + closing, width)


def _format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *,
                  right: Sequence[bool], widths: Sequence[int | None],
                  wrap: int | None = None) -> list[str]:
    """Fixed-width table. Cells longer than their column's width are truncated, except in column
    ``wrap``, whose cells are wrapped onto continuation lines."""
    cells: list[list[list[str]]] = []
    for row in rows:
        out_row = []
        for i, value in enumerate(row):
            text = str(value)
            limit = widths[i]
            if i == wrap and limit:
                out_row.append(textwrap.wrap(text, limit) or [""])
            else:
                out_row.append([_truncate(text, limit) if limit else text])
        cells.append(out_row)
    col_w = [len(h) for h in headers]
    for row in cells:
        for i, lines in enumerate(row):
            col_w[i] = max(col_w[i], *(len(s) for s in lines))

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(col_w[i]) if right[i] else v.ljust(col_w[i]) for i, v in enumerate(values)]
        return "  ".join(parts).rstrip()

    out = [line(headers), line(["-" * w for w in col_w])]
    for row in cells:
        height = max(len(lines) for lines in row)
        for k in range(height):
            out.append(line([lines[k] if k < len(lines) else "" for lines in row]))
    return out


def _pos_label(ops: list[ComputeOp], pos: int, width: int = 20) -> str:
    if 0 <= pos < len(ops):
        return _truncate(f"{pos} {ops[pos].name}", width)
    if ops and pos == len(ops):
        return f"{pos} <end>"
    return str(pos)


# --------------------------------------------------------------------------------- text table


def _bytes_by_dtype(plan: Plan) -> list[str]:
    """One line per kind of shardc's collectives: full-buffer bytes per step by communication
    dtype (FP8 gathers show up here as half the bytes of bf16); then one line per group of the
    collectives found in the traced graph (tensor parallelism): count and bytes by kind."""
    lines = []
    for kind in ("all_gather", "reduce_scatter"):  # CollectiveKind values
        totals: dict[str, int] = {}
        for c in plan.collectives:
            if c.kind == kind and c.origin == "shardc" and not c.elided:
                totals[c.dtype] = totals.get(c.dtype, 0) + c.buffer_bytes
        if totals:
            parts = ", ".join(f"{d} {_fmt_bytes(n)} ({n} B)" for d, n in sorted(totals.items()))
            lines.append(f"{kind.replace('_', '-')} bytes by dtype: {parts}")
    elided: dict[str, int] = {}
    for c in plan.collectives:
        if c.elided:
            elided[str(c.kind)] = elided.get(str(c.kind), 0) + 1
    if elided:
        parts = ", ".join(f"{n} {kind}" for kind, n in sorted(elided.items()))
        lines.append(f"elided (one-rank groups, no communication): {parts}")
    found: dict[str, dict[str, list[int]]] = {}
    for c in plan.collectives:
        if c.origin != "shardc":
            count_bytes = found.setdefault(c.group, {}).setdefault(c.kind, [0, 0])
            count_bytes[0] += 1
            count_bytes[1] += c.buffer_bytes
    for group, kinds in sorted(found.items()):
        parts = ", ".join(f"{n} {kind} {_fmt_bytes(b)} ({b} B)"
                          for kind, (n, b) in sorted(kinds.items()))
        lines.append(f"found in the traced graphs, over the {group} group: {parts}")
    return lines


def _mesh_line(plan: Plan) -> str:
    cluster = plan.options.get("cluster") or {}
    where = f"; cluster {cluster}" if cluster else ""
    if plan.replicate_size > 1:
        return (f"mesh: {plan.mesh}; reduce-scatter over shard group {plan.group_name} "
                f"(intra-node), all-reduce over replicate group {plan.replicate_group_name} "
                f"(inter-node), each group on its own lane{where}")
    if plan.tp_size > 1 or plan.tp_group_name:
        return (f"mesh: {plan.mesh}; shardc's collectives over dp group {plan.group_name}, "
                f"tensor-parallel collectives (issued by DTensor) over tp group "
                f"{plan.tp_group_name}, each group on its own lane{where}")
    return f"mesh: {plan.mesh}{where}"


NARROW_WIDTH = 99  # the default text view fits a 100-column terminal or log


def _pack(segments: Sequence[str], width: int, indent: str = "    ", sep: str = "; ") -> list[str]:
    """``segments`` joined by ``sep`` onto lines of at most ``width`` columns (continuations
    indented); a segment is never split unless it is wider than a line by itself."""
    lines: list[str] = []
    current = ""
    for seg in segments:
        candidate = seg if not current else current + sep + seg
        if len(candidate) <= width:
            current = candidate
            continue
        if current:
            lines.append(current)
        start = indent if lines or current else ""
        if len(start + seg) <= width:
            current = start + seg
        else:
            pieces = textwrap.wrap(seg, width, initial_indent=start, subsequent_indent=indent,
                                   break_long_words=False, break_on_hyphens=False)
            lines += pieces[:-1]
            current = pieces[-1] if pieces else start
    if current:
        lines.append(current)
    return lines


def _narrow_header(lines: Sequence[str], width: int) -> list[str]:
    return [out for line in lines for out in _pack(line.split(", "), width, "  ", ", ")]


def _narrow_collectives(plan: Plan, width: int) -> list[str]:
    """One short aligned row per collective (id, kind, group, bucket, #params, buffer), then
    its schedule and its reason on indented lines, every line within ``width`` columns."""
    names = _bucket_names(plan)
    rows, details = [], []
    for c in _issue_order(plan):
        ops = plan.graphs.get(c.graph, [])
        bucket = (f"{c.bucket} {names[c.bucket]}" if c.bucket in names
                  else "-" if c.bucket < 0 else str(c.bucket))
        rows.append([c.id, c.kind, c.group, bucket, len(c.params), _fmt_bytes(c.buffer_bytes)])
        place = ("" if c.buffer_offset is None else f"pool offset {c.buffer_offset}"
                 + ("" if c.buffer_lifetime is None
                    else f" [{c.buffer_lifetime[0]}, {c.buffer_lifetime[1]})"))
        schedule = [f"{_fmt_bytes(c.bytes)} {c.dtype} on {c.stream}",
                    f"issue {_pos_label(ops, c.issue_pos)}",
                    f"wait {_pos_label(ops, c.wait_pos)}",
                    f"first use {_pos_label(ops, c.first_use_pos)}",
                    f"{_ms(c.predicted_start_s)}-{_ms(c.predicted_end_s)} ms "
                    f"(exposed {_ms(c.exposed_s)}{_stall_note(c)})"] + ([place] if place else [])
        more = _pack(schedule, width - 4, "", "; ") + _pack([f"reason: {c.reason or '-'}"],
                                                            width - 4, "  ")
        details.append(["    " + line for line in more])
    headers = ["id", "kind", "group", "bucket", "#params", "buffer"]
    # The bucket column gets what the others leave of the width (at least 8 columns).
    others = sum(max([len(headers[i]), *(len(str(r[i])) for r in rows)]) for i in (0, 1, 2, 4, 5))
    table = _format_table(
        headers, rows, right=[False, False, False, False, True, True],
        widths=[None, None, None, max(8, width - others - 2 * (len(headers) - 1)), None, None],
    )
    out = table[:2]
    for row, more in zip(table[2:], details):
        out += [row, *more]
    return out


def _narrow_buckets(plan: Plan, width: int) -> list[str]:
    rows = [[b.index, b.name, len(b.params), b.shard_numel, b.dtype, b.reduce_dtype]
            for b in plan.buckets]
    table = _format_table(
        ["index", "name", "#params", "shard numel", "dtype", "reduce dtype"], rows,
        right=[True, False, True, True, False, False], widths=[None, 28, None, None, None, None],
    )
    out = table[:2]
    for row, b in zip(table[2:], plan.buckets):
        out += [row, "    params: " + _abbrev_params(b.params, width - 12)]
    return out


def budget_lines(plan: Plan) -> list[str]:
    """The peak budget and the planner's decision for every bucket (none without a budget)."""
    b = plan.budget
    if b is None:
        return []
    margin = (f" less a {b.margin_fraction:.1%} margin for the prediction's error "
              f"({_fmt_bytes(b.margin_bytes)}): planned for {_fmt_bytes(b.planned_bytes)} "
              f"({b.planned_bytes} B)" if b.margin_bytes else "")
    lines = [f"peak budget {_fmt_bytes(b.budget_bytes)} ({b.budget_bytes} B){margin}; minimum "
             f"(every bucket resharded{_freed(b) if b.resharded_bytes else ''}) "
             f"{_fmt_bytes(b.minimum_bytes)}, chosen plan "
             f"{_fmt_bytes(b.peak_bytes)}; {len(b.kept)} of {len(b.decisions)} bucket(s) kept "
             f"gathered forward->backward; {b.trials} trial plan(s)"]
    for d in b.decisions:
        lines.append(f"  bucket {d.bucket} {d.name}: {'kept' if d.kept else 'resharded'}, "
                     f"saves {d.saved_ms:.3f} ms, costs {_fmt_bytes(d.bytes)}: {d.reason}")
    if b.blocks:
        offloaded = (f", {len(b.offloaded)} offloaded to host memory" if b.offloaded else "")
        offloaded += (f", {len(b.checkpoint_offloaded)} of them with their checkpoints "
                      "offloaded to host memory" if b.checkpoint_offloaded else "")
        in_part = sum(1 for d in b.blocks if d.recomputed_part)
        whole = len(b.recomputed) - in_part
        lines.append(f"  {whole} of {len(b.blocks)} block(s) recomputed in the backward"
                     + (f", {in_part} in part (some saved values)" if in_part else "")
                     + offloaded + (f" (fully resharded plan without recompute: "
                                   f"{_fmt_bytes(b.resharded_bytes)})" if b.resharded_bytes
                                   else ""))
    for d in b.blocks:
        lines.append(f"  block {d.block} ({d.kind}): "
                     f"{_block_lever(d)}, costs "
                     f"{_block_ms(d):.3f} ms, "
                     f"frees {_fmt_bytes(d.bytes + d.checkpoint_bytes * d.checkpoint_offloaded)}"
                     f": {d.reason}")
    if b.prefetch is not None:
        p = b.prefetch
        lines.append(f"  prefetch depth {p.depth} (options: {p.default_depth}): predicted step "
                     f"{p.step_ms:.3f} ms, peak {_fmt_bytes(p.peak_bytes)}: {p.reason}")
    c = getattr(b, "optimizer_chunks", None)
    if c is not None and c.chunked:
        lines.append(f"  optimizer step: in {c.chunks} chunks, costs {c.predicted_ms:.2f} ms per "
                     f"step, frees {_fmt_bytes(c.saved_bytes)}: {c.reason}")
    o = b.optimizer
    if o is not None:
        where = "on the host" if o.on_host else "on the device"
        if o.partial:
            where = (f"on the host for {len(o.host_params)} parameter(s) of bucket(s) "
                     f"{', '.join(map(str, o.buckets))}, the rest on the device")
        lines.append(f"  optimizer state and step: {where}, costs {o.predicted_ms:.1f} ms per "
                     f"step, frees {_fmt_bytes(o.freed_bytes)} "
                     f"(host {_fmt_bytes(o.host_bytes)}): {o.reason}")
    return lines


def _freed(b) -> str:
    """How the budget's minimum frees activations: every block recomputed or offloaded (and
    the recomputed ones' checkpoints offloaded, where the planner went that far)."""
    out = ", every block recomputed or offloaded" if b.offloaded else ", every block recomputed"
    return out + (" and checkpoints offloaded" if b.checkpoint_offloaded else "")


def _block_lever(d) -> str:
    if d.checkpoint_offloaded:
        return "recomputed, checkpoint offloaded"
    recomputed = len(getattr(d, "recomputed_part", ()))
    if d.offloaded and getattr(d, "offloaded_part", ()):
        return f"{len(d.offloaded_part)} saved value(s) offloaded" + (
            f", {recomputed} recomputed" if recomputed else "")
    if recomputed:
        return f"{recomputed} saved value(s) recomputed"
    return "offloaded" if d.offloaded else "recomputed" if d.recomputed else "saved"


def _block_ms(d) -> float:
    """What the block's lever costs: the exposed copies (offloaded), its forward (recomputed),
    plus its checkpoint's exposed copies where those are offloaded."""
    recomputed_part = d.cost_ms if d.offloaded and getattr(d, "recomputed_part", ()) else 0.0
    return (d.offload_ms + recomputed_part if d.offloaded else d.cost_ms) + (
        d.checkpoint_ms if d.checkpoint_offloaded else 0.0)


def plan_table(plan: Plan, *, wide: bool = False, width: int = NARROW_WIDTH,
               reason_width: int = 60) -> str:
    """A readable text rendering of ``plan``: header, collectives in issue order, buckets.

    By default every line fits ``width`` columns: each collective is a short row followed by
    its schedule and reason on indented lines. ``wide=True``: one row per collective with every
    field in its own column (about 300 columns; ``reason_width`` wraps the reason column)."""
    pred = plan.predicted
    lines = [
        f"shardc plan: region {plan.region}, world size {plan.world_size}, "
        f"plan hash {plan.hash()}, version {plan.version}"
        + (f", group {plan.group_name}" if plan.group_name else ""),
    ]
    if plan.mesh:
        lines.append(_mesh_line(plan))
    per_graph = []
    for g in _graph_names(plan):
        if f"{g}_time_s" in pred:
            exposed = pred.get(f"{g}_exposed_comm_s")
            per_graph.append(f"{g} {_ms(pred[f'{g}_time_s'])} ms"
                             + (f" (exposed {_ms(exposed)} ms)" if exposed is not None else ""))
    summary = []
    if "step_time_s" in pred:
        summary.append(f"step time {_ms(pred['step_time_s'])} ms")
    if "comm_time_s" in pred:
        summary.append(f"communication {_ms(pred['comm_time_s'])} ms")
    if "exposed_comm_s" in pred:
        summary.append(f"exposed communication {_ms(pred['exposed_comm_s'])} ms")
    if "peak_comm_buffer_bytes" in pred:
        peak = pred["peak_comm_buffer_bytes"]
        summary.append(f"peak communication buffers {_fmt_bytes(peak)} ({int(peak)} B)")
    if "peak_bytes" in pred:
        counted = (f" (CUDA allocator's blocks, {_fmt_bytes(pred['runtime_bytes'])} of runtime "
                   "workspaces included)" if "runtime_bytes" in pred else "")
        summary.append(f"peak memory (whole step) {_fmt_bytes(pred['peak_bytes'])}{counted}")
    if summary:
        lines.append("predicted: " + ", ".join(summary))
    if per_graph:
        lines.append("per graph: " + "; ".join(per_graph))
    by_category = pred.get("time_by_category_s") or {}
    if by_category:
        lines.append("time by category: " + "; ".join(
            f"{k} {_ms(v)} ms" for k, v in by_category.items() if v >= 5e-6))
    other = sorted(k for k in pred if k not in {
        "step_time_s", "comm_time_s", "exposed_comm_s", "peak_comm_buffer_bytes", "peak_bytes",
        "time_by_category_s",
    } and not any(k in (f"{g}_time_s", f"{g}_exposed_comm_s") for g in _graph_names(plan)))
    if other:
        lines.append("other predictions: " + ", ".join(f"{k}={pred[k]:g}" for k in other))
    opts = [f"{k}={v!r}" for k, v in plan.options.items() if k not in _NON_PLANNING_OPTIONS
            and not (k == "peak_memory_budget_bytes" and not v)]
    if opts:
        lines.append("options: " + ", ".join(opts))
    counts = ", ".join(f"{g} {len(plan.graphs[g])}" for g in _graph_names(plan) if g in plan.graphs)
    lines.append(f"{len(plan.collectives)} collectives, {len(plan.buckets)} buckets"
                 + (f"; compute ops: {counts}" if counts else ""))
    lines += _bytes_by_dtype(plan)
    for note in plan.notes:
        lines.append(f"note: {note}")
    if not wide:
        lines = _narrow_header(lines, width)
        lines += [out for line in budget_lines(plan) for out in textwrap.wrap(
            line, width, subsequent_indent="      " if line.startswith("  ") else "  ")]
        lines += ["", "collectives (issue order; positions are 'before compute op N'):"]
        lines += _narrow_collectives(plan, width)
        lines += ["", "buckets:"] + _narrow_buckets(plan, width)
        return "\n".join(lines + copy_lines(plan)) + "\n"

    lines += budget_lines(plan)
    names = _bucket_names(plan)
    headers = ["id", "kind", "group", "bucket", "#params", "bytes", "buffer", "dtype", "stream",
               "issue", "wait", "first use", "start ms", "end ms", "exposed ms", "offset",
               "lifetime", "reason"]
    right = [False, False, False, False, True, True, True, False, False, False, False, False,
             True, True, True, True, False, False]
    widths = [None, None, None, 24, None, None, None, None, None, 20, 20, 20, None, None, None,
              None, None, reason_width]
    rows = []
    for c in _issue_order(plan):
        ops = plan.graphs.get(c.graph, [])
        bucket = (f"{c.bucket} {names[c.bucket]}" if c.bucket in names
                  else "-" if c.bucket < 0 else str(c.bucket))
        lifetime = ("-" if c.buffer_lifetime is None
                    else f"[{c.buffer_lifetime[0]}, {c.buffer_lifetime[1]})")
        rows.append([
            c.id, c.kind, c.group, bucket, len(c.params), _fmt_bytes(c.bytes),
            _fmt_bytes(c.buffer_bytes),
            c.dtype, c.stream, _pos_label(ops, c.issue_pos), _pos_label(ops, c.wait_pos),
            _pos_label(ops, c.first_use_pos), _ms(c.predicted_start_s), _ms(c.predicted_end_s),
            _ms(c.exposed_s), "-" if c.buffer_offset is None else c.buffer_offset, lifetime,
            c.reason or "-",
        ])
    lines += ["", "collectives (issue order; positions are 'before compute op N'):"]
    lines += _format_table(headers, rows, right=right, widths=widths, wrap=len(headers) - 1)

    brows = [[b.index, b.name, len(b.params), b.shard_numel, b.dtype, b.reduce_dtype,
              _abbrev_params(b.params)] for b in plan.buckets]
    lines += ["", "buckets:"]
    lines += _format_table(
        ["index", "name", "#params", "shard numel", "dtype", "reduce dtype", "params"], brows,
        right=[True, False, True, True, False, False, False],
        widths=[None, 32, None, None, None, None, None],
    )
    return "\n".join(lines + copy_lines(plan)) + "\n"


# ------------------------------------------------------------------------------ chrome trace


def _graph_span_s(plan: Plan, graph: str) -> float:
    """Predicted duration of ``graph`` (the offset of the next graph on the trace's time axis)."""
    ends = [plan.predicted.get(f"{graph}_time_s", 0.0)]
    ends += [op.predicted_end_s for op in plan.graphs.get(graph, [])]
    ends += [c.predicted_end_s for c in plan.collectives if c.graph == graph]
    return max(ends, default=0.0)


def _arrival_s(ops: list[ComputeOp], exposed_at: dict[int, float], pos: int) -> float:
    """When compute reaches position ``pos`` (before waiting for the collectives waited there)."""
    if 0 <= pos < len(ops):
        return ops[pos].predicted_start_s - exposed_at.get(pos, 0.0)
    return ops[-1].predicted_end_s if ops else 0.0


def _compute_events(ops: list[ComputeOp], pid: int, tid: int, offset_us: float,
                    threshold_us: float) -> list[dict]:
    """Complete events for ``ops``: zero-duration ops dropped, runs of consecutive ops shorter than
    ``threshold_us`` merged into one event (a run ends at a gap, or once it is that long)."""
    events: list[dict] = []
    run: list[int] = []

    def flush() -> None:
        if not run:
            return
        first, last = ops[run[0]], ops[run[-1]]
        dur = (last.predicted_end_s - first.predicted_start_s) * 1e6
        if dur > 0:
            if len(run) == 1:
                events.append(_op_event(first, run[0], pid, tid, offset_us))
            else:
                events.append({
                    "name": f"{first.name} … {last.name} ({len(run)} ops)", "cat": "compute",
                    "ph": "X", "pid": pid, "tid": tid,
                    "ts": offset_us + first.predicted_start_s * 1e6, "dur": dur,
                    "args": {"pos": [run[0], run[-1]], "ops": len(run),
                             "flops": sum(ops[i].flops for i in run),
                             "bytes": sum(ops[i].bytes for i in run)},
                })
        run.clear()

    for i, op in enumerate(ops):
        dur = (op.predicted_end_s - op.predicted_start_s) * 1e6
        if dur <= 0:
            continue
        if run:
            prev = ops[run[-1]]
            gap = op.predicted_start_s - prev.predicted_end_s
            run_dur = (prev.predicted_end_s - ops[run[0]].predicted_start_s) * 1e6
            if gap * 1e6 > 1e-3 or dur >= threshold_us or run_dur >= threshold_us:
                flush()
        if dur >= threshold_us:
            events.append(_op_event(op, i, pid, tid, offset_us))
        else:
            run.append(i)
    flush()
    return events


def _op_event(op: ComputeOp, pos: int, pid: int, tid: int, offset_us: float) -> dict:
    return {
        "name": op.name, "cat": "compute", "ph": "X", "pid": pid, "tid": tid,
        "ts": offset_us + op.predicted_start_s * 1e6,
        "dur": (op.predicted_end_s - op.predicted_start_s) * 1e6,
        "args": {"pos": pos, "target": op.target, "flops": op.flops, "bytes": op.bytes},
    }


def chrome_trace(plan: Plan, *, min_op_us: float = 1.0, max_compute_events: int = 5000) -> dict:
    """The plan's predicted schedule as Chrome trace-event JSON (open in ui.perfetto.dev).

    One process per graph (forward first; backward starts where forward ends), with a "compute"
    lane (compute ops, exposed waits as "stall" slices, instant events at every issue and wait), a
    "comm: <stream>" lane per stream, that is per process group (``comm``: the shard group;
    ``replicate``: HSDP's inter-node group; ``tp``: tensor parallelism), with one complete event
    per collective and a flow arrow to where it is waited, and a counter of communication-buffer
    bytes. Timestamps are microseconds.

    Compute ops shorter than ``min_op_us`` (or than the graph's duration divided by
    ``max_compute_events``) are merged with their neighbours; zero-duration ops are dropped.
    """
    meta: list[dict] = []
    events: list[dict] = []
    offset_s = 0.0
    flow_id = 0
    for pid, graph in enumerate(_graph_names(plan), start=1):
        ops = plan.graphs.get(graph, [])
        colls = [c for c in plan.collectives if c.graph == graph]
        span_s = _graph_span_s(plan, graph)
        offset_us = offset_s * 1e6
        streams: list[str] = []
        for c in colls:
            if c.stream not in streams:
                streams.append(c.stream)
        compute_tid = 1
        stream_tid = {s: 2 + i for i, s in enumerate(streams)}
        meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                     "args": {"name": f"{graph} (region {plan.region})"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                     "args": {"sort_index": pid}})
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": compute_tid,
                     "args": {"name": "compute"}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": compute_tid,
                     "args": {"sort_index": compute_tid}})
        for s, tid in stream_tid.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                         "args": {"name": f"comm: {s}"}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                         "args": {"sort_index": tid}})

        threshold_us = max(min_op_us, span_s * 1e6 / max(max_compute_events, 1))
        events += _compute_events(ops, pid, compute_tid, offset_us, threshold_us)

        exposed_at: dict[int, float] = {}
        for c in colls:
            exposed_at[c.wait_pos] = exposed_at.get(c.wait_pos, 0.0) + _stall_s(c)
        names = _bucket_names(plan)
        for c in colls:
            tid = stream_tid[c.stream]
            start_us = offset_us + c.predicted_start_s * 1e6
            stall = _stall_s(c)
            args = {
                "id": c.id, "group": c.group, "bucket": c.bucket,
                "bucket_name": names.get(c.bucket, ""), "bytes": c.bytes,
                "buffer_bytes": c.buffer_bytes, "dtype": c.dtype, "params": len(c.params),
                "issue_pos": c.issue_pos, "wait_pos": c.wait_pos,
                "exposed_ms": c.exposed_s * 1e3, "stall_ms": stall * 1e3,
                "reason": c.reason,
            }
            if c.buffer_offset is not None:
                args["buffer_offset"] = c.buffer_offset
            if c.origin != "shardc":  # found in the traced graph: its FX nodes and tensors
                args.update(origin=c.origin, nodes=c.nodes, tensors=c.tensors)
            events.append({
                "name": c.id, "cat": c.kind, "ph": "X", "pid": pid, "tid": tid, "ts": start_us,
                "dur": (c.predicted_end_s - c.predicted_start_s) * 1e6, "args": args,
            })
            issue_us = offset_us + _arrival_s(ops, exposed_at, c.issue_pos) * 1e6
            wait_us = offset_us + _arrival_s(ops, exposed_at, c.wait_pos) * 1e6
            events.append({"name": f"issue {c.id}", "cat": "issue", "ph": "i", "s": "t",
                           "pid": pid, "tid": compute_tid, "ts": issue_us,
                           "args": {"pos": c.issue_pos}})
            events.append({"name": f"wait {c.id}", "cat": "wait", "ph": "i", "s": "t",
                           "pid": pid, "tid": compute_tid, "ts": wait_us,
                           "args": {"pos": c.wait_pos, "exposed_ms": c.exposed_s * 1e3}})
            if stall > 0:
                events.append({"name": f"stall: {c.id}", "cat": "stall", "ph": "X", "pid": pid,
                               "tid": compute_tid,
                               "ts": offset_us + (c.predicted_end_s - stall) * 1e6,
                               "dur": stall * 1e6, "args": {"id": c.id}})
            flow_id += 1
            events.append({"name": "waited by", "cat": "wait", "ph": "s", "id": flow_id,
                           "pid": pid, "tid": tid, "ts": start_us})
            events.append({"name": "waited by", "cat": "wait", "ph": "f", "bp": "e",
                           "id": flow_id, "pid": pid, "tid": compute_tid, "ts": wait_us})

        copy_meta, copy_slices = copy_events(plan, graph, pid, offset_us)
        meta += copy_meta
        events += copy_slices
        timeline = plan.memory_timeline.get(graph, [])
        previous = None
        for p, value in enumerate(timeline):
            if value == previous and p != len(timeline) - 1:
                continue
            previous = value
            ts = (_arrival_s(ops, exposed_at, p) if ops else (p / max(len(timeline), 1)) * span_s)
            events.append({"name": "comm buffers", "ph": "C", "pid": pid, "tid": 0,
                           "ts": offset_us + ts * 1e6, "args": {"bytes": value}})
        offset_s += span_s

    order = {"X": 0, "s": 1, "i": 2, "f": 3, "C": 4}
    events.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], order.get(e["ph"], 5)))
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "shardc_region": plan.region, "world_size": plan.world_size, "plan_hash": plan.hash(),
            "plan_version": plan.version,
        },
    }


# ------------------------------------------------------------------------------- memory plot


def memory_plot(plan: Plan, path: str | Path, *, capacity_bytes: float | None = None) -> Path:
    """Write a PNG of the step's memory by category over the schedule, with the device's
    capacity and the peak marked, and of the communication buffers on their own scale
    (``shardc.tools.memory_plot.step_memory_plot``; needs matplotlib)."""
    from shardc.tools.memory_plot import step_memory_plot

    return step_memory_plot(plan, path, capacity_bytes=capacity_bytes)


# ----------------------------------------------------------------------------------- dumping


def dump_plan(plan: Plan, directory: str | Path, *, rank: int = 0,
              capacity_bytes: float | None = None) -> list[Path]:
    """Write ``region{R}.rank{K}.plan.txt`` (the narrow table; ``plan_table(plan, wide=True)``
    gives the wide one), ``.plan.json``, ``.trace.json`` and ``.memory.png`` into ``directory``
    (created if needed); every rank writes its own files. The PNG is skipped, with a warning,
    when matplotlib is not installed. Returns the paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / f"region{plan.region}.rank{rank}"
    paths = []
    text_path = Path(f"{stem}.plan.txt")
    text_path.write_text(plan_table(plan))
    paths.append(text_path)
    json_path = Path(f"{stem}.plan.json")
    json_path.write_text(plan.to_json() + "\n")
    paths.append(json_path)
    trace_path = Path(f"{stem}.trace.json")
    trace_path.write_text(json.dumps(chrome_trace(plan), separators=(",", ":")))
    paths.append(trace_path)
    try:
        paths.append(memory_plot(plan, f"{stem}.memory.png", capacity_bytes=capacity_bytes))
    except ImportError as exc:
        log.warning("shardc: not writing the memory plot of region %d: %s", plan.region, exc)
    log.info("shardc: wrote the plan of region %d (rank %d) to %s", plan.region, rank, directory)
    return paths
