"""The communication pool: every planned collective's buffers placed in one static pool.

:func:`assign_pool` turns the buffers into ``(start, end, size)`` lifetimes on one timeline
(forward positions, then backward positions) and places them with the offset allocator
(:mod:`shardc.memory.allocator`, its deterministic greedy mode: every rank computes the same
offsets), so the plan carries each buffer's offset and the pool's size. The lowering
(:mod:`shardc.passes.lower`) makes each buffer a view of the pool at its offset; the compile
pipeline (:mod:`shardc.compile.pipeline`) allocates the pool and bounds it by the memory budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.memory.allocator import plan_offsets
from shardc.planning.plan import CollectiveKind, Plan

POOL_ALIGNMENT = 512  # bytes; the CUDA caching allocator's granularity


@dataclass(frozen=True)
class CommBuffer:
    collective: str
    role: str  # "send" | "recv"
    start: int
    end: int
    nbytes: int


def comm_buffers(plan: Plan) -> list[CommBuffer]:
    """The buffers of every collective, on one timeline: forward, then backward.

    HSDP's all-reduce reduces its reduce-scatter's receive buffer in place (``lower.py``), which
    therefore lives until the all-reduce's wait; collectives found in the graph (tensor
    parallelism) allocate their own outputs, like any op of the graph. An elided collective
    (a one-rank group) has no buffer, except an elided reduce-scatter chained with an HSDP
    all-reduce: its gradients are packed into the receive buffer the all-reduce runs in."""
    offset = {"forward": 0, "backward": len(plan.graphs.get("forward", [])) + 1}
    out = []
    for c in plan.collectives:
        if c.kind == CollectiveKind.ALL_REDUCE or c.origin != "shardc":
            continue
        start = offset[c.graph] + c.issue_pos
        end = offset[c.graph] + c.wait_pos + 1
        reduced = plan.linked(c)
        recv_end = end if reduced is None else offset[c.graph] + reduced.wait_pos + 1
        gather = c.kind == CollectiveKind.ALL_GATHER
        send = c.bytes if gather else c.buffer_bytes
        recv = c.buffer_bytes if gather else c.bytes
        if c.elided:
            if reduced is not None:
                out.append(CommBuffer(c.id, "recv", start, recv_end, recv))
            continue
        out.append(CommBuffer(c.id, "send", start, end, send))
        out.append(CommBuffer(c.id, "recv", start, recv_end, recv))
    return out


def assign_pool(plan: Plan) -> list[CommBuffer]:
    """Place the communication buffers in one pool (greedy: deterministic, so every rank gets
    the same pool and the same budget decisions); records offsets and the pool size in
    ``plan``. Returns the buffers, whose order matches ``plan.pool_offsets``."""
    buffers = comm_buffers(plan)
    if not buffers:
        plan.predicted.pool_bytes = 0
        return buffers
    result = plan_offsets([(b.start, b.end, b.nbytes) for b in buffers],
                          alignment=POOL_ALIGNMENT)
    by_id = {c.id: c for c in plan.collectives}
    for buf, off in zip(buffers, result.offsets):
        if buf.role == "recv":
            by_id[buf.collective].buffer_offset = off
            reduced = plan.linked(by_id[buf.collective])
            if reduced is not None:  # HSDP: the all-reduce runs in that buffer
                reduced.buffer_offset = off
    plan.pool_offsets = {f"{b.collective}.{b.role}": off for b, off in zip(buffers, result.offsets)}
    plan.predicted.pool_bytes = result.pool_size
    plan.predicted.pool_lower_bound_bytes = result.max_live
    return buffers
