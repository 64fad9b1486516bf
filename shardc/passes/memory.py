"""Memory: communication buffers in one static pool, and the whole step's predicted peak.

``assign_pool`` turns every planned collective's buffers into ``(start, end, size)`` lifetimes on
one timeline (forward positions, then backward positions) and places them with the offset
allocator, so the plan carries each buffer's offset and the pool's size.

``predict_peak`` walks the partitioned graphs' liveness (FX frees a value after its last use;
views share their base's storage) and adds the state that lives across the step: parameter
shards and optimizer state (``optimizer_state_factor`` bytes per parameter byte, 2 for Adam).
Gradients are the backward graph's outputs and count from where they are produced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

from shardc.passes.allocator import plan_offsets
from shardc.passes.fx_utils import size_hint
from shardc.passes.schedule import view_chain_root
from shardc.plan import Plan

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
    parallelism) allocate their own outputs, like any op of the graph."""
    offset = {"forward": 0, "backward": len(plan.graphs.get("forward", [])) + 1}
    by_id = {c.id: c for c in plan.collectives}
    out = []
    for c in plan.collectives:
        if c.kind == "all_reduce" or c.origin != "shardc":
            continue
        start = offset[c.graph] + c.issue_pos
        end = offset[c.graph] + c.wait_pos + 1
        reduced = by_id.get(c.id.replace(".reduce_scatter.", ".all_reduce."))
        recv_end = end if reduced is None else offset[c.graph] + reduced.wait_pos + 1
        send = c.bytes if c.kind == "all_gather" else c.buffer_bytes
        recv = c.buffer_bytes if c.kind == "all_gather" else c.bytes
        out.append(CommBuffer(c.id, "send", start, end, send))
        out.append(CommBuffer(c.id, "recv", start, recv_end, recv))
    return out


def assign_pool(plan: Plan, *, time_limit_s: float = 1.0) -> list[CommBuffer]:
    """Place the communication buffers in one pool (greedy: deterministic, so every rank gets
    the same pool and the same budget decisions); records offsets and the pool size in
    ``plan``. Returns the buffers, whose order matches ``plan.pool_offsets``."""
    buffers = comm_buffers(plan)
    if not buffers:
        plan.predicted["pool_bytes"] = 0
        return buffers
    result = plan_offsets([(b.start, b.end, b.nbytes) for b in buffers],
                          alignment=POOL_ALIGNMENT, time_limit_s=time_limit_s, mode="fast")
    by_id = {c.id: c for c in plan.collectives}
    for buf, off in zip(buffers, result.offsets):
        if buf.role == "recv":
            by_id[buf.collective].buffer_offset = off
            reduced = by_id.get(buf.collective.replace(".reduce_scatter.", ".all_reduce."))
            if reduced is not None:  # HSDP: the all-reduce runs in that buffer
                reduced.buffer_offset = off
    plan.pool_offsets = {f"{b.collective}.{b.role}": off for b, off in zip(buffers, result.offsets)}
    plan.predicted["pool_bytes"] = result.pool_size
    plan.predicted["pool_lower_bound_bytes"] = result.max_live
    return buffers


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):  # hints: a prediction must add no guard
        return math.prod(size_hint(s) for s in val.shape) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_nbytes(v) for v in val)
    return 0


def _is_alias(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function":
        return False
    if target is torch.ops._c10d_functional.wait_tensor.default:
        return True
    if getattr(target, "__name__", "") == "getitem":
        return True
    return isinstance(target, torch._ops.OpOverload) and target.is_view


_WAIT = torch.ops._c10d_functional.wait_tensor.default


def _is_collective(node: fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.namespace == "_c10d_functional" and target is not _WAIT)


def _has_tag(node: fx.Node, tag) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) \
        and tag in target.tags


def fused_away(node: fx.Node) -> bool:
    """Whether a fusing compiler (Inductor) keeps ``node``'s value in registers: a pointwise op
    whose every user is a pointwise op or a reduction it can fuse into (never a graph output,
    an extern kernel such as a matmul, or a view)."""
    if not _has_tag(node, torch.Tag.pointwise) or not node.users:
        return False
    return all(_has_tag(u, torch.Tag.pointwise) or _has_tag(u, torch.Tag.reduction)
               for u in node.users)


_CAT = torch.ops.aten.cat.default
_PAD = torch.ops.aten.constant_pad_nd.default


def fused_start(node: fx.Node, index: dict[fx.Node, int]) -> int:
    """Where a fusing compiler first writes a concatenation (a collective's send buffer): it
    fuses the casts, padding and copies that fill it into the kernels right after the producers
    of its pieces, so the buffer exists from the earliest of those casts, not from the ``cat``."""
    start = index[node]
    stack, seen = list(node.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if _has_tag(n, torch.Tag.pointwise) or n.target is _PAD or _is_alias(n):
            start = min(start, index[n])
            stack.extend(n.all_input_nodes)
    return start


def liveness_peak(gm: fx.GraphModule, skip: set[fx.Node], *,
                  fusion: bool = False) -> tuple[int, list[int]]:
    """Peak bytes of values alive while ``gm`` runs (``skip``: placeholders counted elsewhere).

    A value is alive from its definition to the last use of it or of any view of it; graph
    outputs stay alive to the end. ``fusion``: values :func:`fused_away` take no memory and
    concatenations are born at :func:`fused_start`.
    """
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    storage: dict[fx.Node, fx.Node] = {}
    size: dict[fx.Node, int] = {}
    last: dict[fx.Node, int] = {}
    end = len(nodes)
    pending: dict[fx.Node, list[fx.Node]] = {}
    for i, node in enumerate(nodes):
        if node.op == "output":
            for arg in node.all_input_nodes:
                last[storage[arg]] = end
            continue
        if _is_alias(node) and node.all_input_nodes:
            storage[node] = storage[node.all_input_nodes[0]]
        else:
            storage[node] = node
            dropped = node in skip or (fusion and fused_away(node))
            size[node] = 0 if dropped else _nbytes(node.meta.get("val"))
            last[node] = i
        for arg in node.all_input_nodes:
            key = storage[arg]
            last[key] = max(last[key], i)
        if _is_collective(node):
            pending[node] = [storage[a] for a in node.all_input_nodes]
        elif node.op == "call_function" and node.target is _WAIT:
            # A collective's inputs stay referenced by its work until the wait (the process
            # group holds them so the compute stream cannot reuse them while it runs).
            for key in pending.pop(node.args[0], ()):
                last[key] = max(last[key], i)
    delta = [0] * (end + 2)
    for key, nbytes in size.items():
        born = fused_start(key, index) if fusion and key.target is _CAT else index[key]
        delta[born] += nbytes
        delta[last[key] + 1] -= nbytes
    timeline, live = [], 0
    for d in delta[:end + 1]:
        live += d
        timeline.append(live)
    return max(timeline, default=0), timeline


def param_placeholders(gm: fx.GraphModule) -> set[fx.Node]:
    """Placeholders holding parameter shards (found through the gathers: call before lowering)."""
    from shardc.runtime.ops import GATHER_OP

    roots = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is GATHER_OP:
            root = view_chain_root(node.args[0])
            if root is not None:
                roots.add(root)
    return roots


def predict_peak(
    forward: fx.GraphModule,
    backward: fx.GraphModule | None,
    plan: Plan,
    params: set[fx.Node],
    bw_params: set[fx.Node],
    *,
    optimizer_state_factor: float = 2.0,
    fusion: bool = False,
) -> dict[str, int]:
    """Whole-step peak prediction from the lowered graphs; ``params``/``bw_params`` are the
    parameter-shard placeholders (:func:`param_placeholders`, taken before lowering).

    Returns (and records in ``plan.predicted``) ``param_bytes``, ``optimizer_state_bytes``,
    ``forward_peak_bytes``, ``backward_peak_bytes`` and ``peak_bytes``.
    """
    param_bytes = sum(_nbytes(p.meta.get("val")) for p in params)
    optim = int(param_bytes * optimizer_state_factor)
    fw_peak, _ = liveness_peak(forward, params, fusion=fusion)
    out = {"param_bytes": param_bytes, "optimizer_state_bytes": optim,
           "forward_peak_bytes": param_bytes + optim + fw_peak}
    peak = out["forward_peak_bytes"]
    if backward is not None:
        bw_peak, _ = liveness_peak(backward, bw_params, fusion=fusion)
        out["backward_peak_bytes"] = param_bytes + optim + bw_peak
        peak = max(peak, out["backward_peak_bytes"])
    out["peak_bytes"] = peak
    plan.predicted.update({k: float(v) for k, v in out.items()})
    return out
