"""CPU offload's copies in the plan's renderings (kept apart from ``render.py``'s own code).

``copy_lines``: the copies as text (one line each, within the narrow width). ``copy_events``:
their Chrome/Perfetto slices on a lane of their own ("copy: host<->device") under each graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the plan renders itself through shardc.tools.render: no import cycle)
    from shardc.planning.plan import Plan

COPY_TID = 99  # the trace lane of the copies, after the compute and collective lanes


def _kib(n: float) -> str:
    return f"{n / 1024:.2f} KiB" if n < 2 ** 20 else f"{n / 2 ** 20:.2f} MiB"


def copy_lines(plan: Plan) -> list[str]:
    """Text lines for the plan's host<->device copies (none without offload)."""
    if not plan.copies:
        return []
    lines = ["", "offload copies (copy lane; positions are 'before compute op N'):"]
    for c in plan.copies:
        lines.append(f"{c.id:<26} {len(c.params):3d} params {_kib(c.buffer_bytes):>12} "
                     f"{c.dtype}; issue {c.issue_pos}, wait {c.wait_pos}; "
                     f"{c.predicted_s * 1e3:.3f} ms "
                     f"(exposed {c.exposed_s * 1e3:.3f})")
    host, dev = plan.predicted.host_bytes, plan.predicted.device_copy_bytes
    if host is not None:
        what = ("masters, gradients, optimizer state"
                if any(c.origin == "shardc" for c in plan.copies) else "")
        if any(c.origin == "activation" for c in plan.copies):
            what = f"{what}; offloaded activations" if what else "offloaded activations"
        lines.append(f"host memory ({what}): {_kib(host)}; "
                     f"device copies alive at once: {_kib(dev or 0)}")
    return lines


def copy_events(plan: Plan, graph: str, pid: int, offset_us: float) -> tuple[list, list]:
    """(metadata, slices) of ``graph``'s copies on their own trace lane."""
    copies = [c for c in plan.copies if c.graph == graph]
    if not copies:
        return [], []
    meta = [{"name": "thread_name", "ph": "M", "pid": pid, "tid": COPY_TID,
             "args": {"name": "copy: host<->device"}},
            {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": COPY_TID,
             "args": {"sort_index": COPY_TID}}]
    events = [{
        "name": c.id, "cat": c.kind, "ph": "X", "pid": pid, "tid": COPY_TID,
        "ts": offset_us + c.predicted_start_s * 1e6,
        "dur": (c.predicted_end_s - c.predicted_start_s) * 1e6,
        "args": {"id": c.id, "bucket": c.bucket, "bytes": c.bytes, "params": len(c.params),
                 "issue_pos": c.issue_pos, "wait_pos": c.wait_pos,
                 "exposed_ms": c.exposed_s * 1e3, "reason": c.reason},
    } for c in copies]
    return meta, events
