"""Exposed communication from a profiler trace: interval arithmetic over kernel events.

Contract: pure functions of Chrome-trace events (``ts`` / ``dur`` in microseconds); no torch.
"""

from __future__ import annotations

import bisect
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


# A compute kernel that starts this soon (us) after a collective ends waited for it.
WAIT_SLACK_US = 15.0


def waited_comm(compute_u: Sequence[tuple[float, float]], comm_u: Sequence[tuple[float, float]],
                slack_us: float = WAIT_SLACK_US) -> float:
    """Communication the compute waited for (us): over the gaps between the disjoint compute
    intervals ``compute_u``, the NCCL time (``comm_u``, disjoint) inside those gaps that end
    within ``slack_us`` of a collective's end (compute resumed when it finished). NCCL time in
    the other gaps, a launch gap or a step boundary that would be idle anyway, is not counted."""
    ends = [end for _, end in comm_u]
    total = 0.0
    for (_, gap_start), (gap_end, _) in zip(compute_u, compute_u[1:]):
        inside = intersection_measure([(gap_start, gap_end)], comm_u)
        if inside <= 0:
            continue
        i = bisect.bisect_right(ends, gap_end)
        if i and gap_end - ends[i - 1] <= slack_us:
            total += inside
    return total


def kernel_breakdown(events: Iterable[dict[str, Any]], steps: int) -> dict[str, float]:
    """Per-step GPU time split from Chrome-trace kernel events (``ts``/``dur`` in us).

    ``exposed_comm_ms``: union of NCCL kernel intervals minus its intersection with the union of
    all other kernels; ``waited_comm_ms``: the part of it the compute waited for
    (:func:`waited_comm`); ``comm_ms``: the NCCL union; ``compute_ms``: the non-NCCL union;
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
        "waited_comm_ms": waited_comm(compute_u, comm_u) * per,
        "comm_ms": measure(comm_u) * per,
        "overlapped_comm_ms": overlap * per,
        "compute_ms": measure(compute_u) * per,
        "idle_ms": ((hi - lo) - busy) * per,
        "window_ms": (hi - lo) * per,
        "n_comm_kernels": len(comm) / max(steps, 1),
        "n_compute_kernels": len(compute) / max(steps, 1),
    }


# What GPU kernels are, by name, in the categories the plan predicts
# (shardc.planning.estimate.KERNEL_CATEGORIES) plus communication and the optimizer's kernels.
KERNEL_CATEGORIES = ("matmul", "attention_forward", "attention_backward", "fused", "other",
                     "comm", "optimizer", "copies")
_ATTENTION_MARKS = ("flash", "fmha", "attention", "sdpa", "dot_product")
_ATTENTION_BACKWARD_MARKS = ("bwd", "backward", "bprop", "cutlassb", "dq_dk_dv", "dkdv")
_MATMUL_MARKS = ("gemm", "sm90_xmma", "xmma", "cutlass", "nvjet", "cublas", "wgmma", "matmul")
_OPTIMIZER_MARKS = ("multi_tensor_apply", "foreach", "adam")
# cuDNN SDPA's backward runs two helper kernels beside its main one (the rowwise dot of dO and O
# before it, dQ's cast to 16 bits after it), named without any attention mark: part of the
# attention backward the plan prices as one kernel (2 x H200 traces, nineteenth session: 1.0 ms
# per step at the wide model's 8 layers, batch 4, shown under "other" until then).
_CUDNN_ATTENTION_BACKWARD = ("cudnn::fusion::compute_dot_do_o", "cudnn::fusion::convert_dq_to_")


def kernel_category(name: str) -> str:
    """The category of one GPU kernel by its name (one of :data:`KERNEL_CATEGORIES` but
    ``copies``, which is for memcpy/memset events): NCCL's are ``comm``; fused attention
    (flash, cuDNN SDPA, memory-efficient ``fmha_cutlass``) ``attention_forward`` or
    ``attention_backward``; cuBLAS/CUTLASS matmuls (``sm90_xmma``, ``nvjet``, ``*gemm*``)
    ``matmul``; Triton's (Inductor's fused kernels) ``fused``; the foreach optimizer's
    ``optimizer``; anything else (aten's elementwise, reduction and copy kernels) ``other``."""
    low = name.lower()
    if is_comm_kernel(low):
        return "comm"
    if any(m in low for m in _CUDNN_ATTENTION_BACKWARD):
        return "attention_backward"
    if any(m in low for m in _ATTENTION_MARKS):
        return ("attention_backward" if any(m in low for m in _ATTENTION_BACKWARD_MARKS)
                else "attention_forward")
    if low.startswith("triton") or "triton_" in low:
        return "fused"
    if any(m in low for m in _MATMUL_MARKS):
        return "matmul"
    if any(m in low for m in _OPTIMIZER_MARKS):
        return "optimizer"
    return "other"


def kernel_time_by_category(events: Iterable[dict[str, Any]], steps: int) -> dict[str, float]:
    """Milliseconds per step of GPU kernel time by :func:`kernel_category` (kernels' own
    durations, summed: overlapping kernels each count), ``copies`` for memcpy/memset events, and
    ``idle``: time in the traced window with nothing running on the device (the host not
    keeping up, or waits)."""
    out = dict.fromkeys(KERNEL_CATEGORIES, 0.0)
    spans = []
    lo, hi = math.inf, -math.inf
    for ev in events:
        cat = ev.get("cat")
        if ev.get("ph") != "X" or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        start, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
        lo, hi = min(lo, start), max(hi, start + dur)
        spans.append((start, start + dur))
        key = kernel_category(str(ev.get("name", ""))) if cat == "kernel" else "copies"
        out[key] += dur
    if not spans:
        return {}
    per = 1e-3 / max(steps, 1)  # us -> ms per step
    out = {k: v * per for k, v in out.items()}
    out["idle"] = ((hi - lo) - measure(merge_intervals(spans))) * per
    return out
