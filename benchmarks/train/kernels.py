"""Exposed communication from a profiler trace: interval arithmetic over kernel events.

Contract: pure functions of Chrome-trace events (``ts`` / ``dur`` in microseconds); no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of half-open intervals ``(start, end)``."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def measure(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length of disjoint intervals."""
    return sum(end - start for start, end in intervals)


def intersection_measure(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]
                         ) -> float:
    """Length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def is_comm_kernel(name: str) -> bool:
    return "nccl" in name.lower()


def kernel_breakdown(events: Iterable[dict[str, Any]], steps: int) -> dict[str, float]:
    """Per-step GPU time split from Chrome-trace kernel events (``ts``/``dur`` in us).

    ``exposed_comm_ms``: union of NCCL kernel intervals minus its intersection with the union of
    all other kernels; ``comm_ms``: the NCCL union; ``compute_ms``: the non-NCCL union;
    ``idle_ms``: time in the profiled window with no kernel running.
    """
    comm, compute = [], []
    lo, hi = math.inf, -math.inf
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") != "kernel":
            continue
        start, end = float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0))
        lo, hi = min(lo, start), max(hi, end)
        (comm if is_comm_kernel(str(ev.get("name", ""))) else compute).append((start, end))
    if not comm and not compute:
        return {}
    comm_u, compute_u = merge_intervals(comm), merge_intervals(compute)
    overlap = intersection_measure(comm_u, compute_u)
    busy = measure(merge_intervals(comm + compute))
    per = 1e-3 / max(steps, 1)  # us -> ms per step
    return {
        "exposed_comm_ms": (measure(comm_u) - overlap) * per,
        "comm_ms": measure(comm_u) * per,
        "overlapped_comm_ms": overlap * per,
        "compute_ms": measure(compute_u) * per,
        "idle_ms": ((hi - lo) - busy) * per,
        "window_ms": (hi - lo) * per,
        "n_comm_kernels": len(comm) / max(steps, 1),
        "n_compute_kernels": len(compute) / max(steps, 1),
    }
