"""Analytical cost model: compute from FLOPs and bytes, communication from bytes and latency.

Communication times are sympy expressions in the world size ``W``, the bus bandwidth ``B``
(bytes/s) and the per-step latency ``alpha`` (s), so one plan can be evaluated for any cluster
(``ClusterSpec.evaluate``); planning evaluates the same expressions, compiled once per collective
kind into plain arithmetic (``ClusterSpec.collective_seconds``), so the ring model is written
once. Compute time is ``max(flops / peak_flops, bytes / mem_bandwidth)`` per op (roofline).
``calibrate`` fits bandwidth and latency to measured collective timings.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import sympy
import torch
from torch import fx

from shardc.passes.fx_utils import size_hint, subgraph_module, tensor_nbytes
from shardc.planning.plan import CollectiveKind as Kind

W, B, ALPHA = sympy.symbols("W B alpha", positive=True)
_BYTES = sympy.Symbol("bytes", positive=True)


def ring_terms(kind: str, world):
    """(latency steps, fraction of the buffer each rank puts on the wire) of one collective over
    ``world`` ranks (an int, or the symbol ``W``). Ring all-gather and reduce-scatter: one pass;
    all-reduce: a reduce-scatter then an all-gather; all-to-all: each rank sends ``(W-1)/W`` of its
    buffer; pipelined broadcast: the whole buffer crosses every link."""
    if kind in (Kind.ALL_GATHER, Kind.REDUCE_SCATTER, Kind.ALL_TO_ALL):
        return world - 1, (world - 1) / world
    if kind == Kind.ALL_REDUCE:
        return 2 * (world - 1), 2 * (world - 1) / world
    if kind == Kind.BROADCAST:
        return world - 1, 1
    raise ValueError(f"shardc cost model: unknown collective kind {kind!r}")


def collective_time_expr(kind: str, buffer_bytes: int | sympy.Expr) -> sympy.Expr:
    """Ring-algorithm time of one collective over a buffer of ``buffer_bytes`` (the full,
    gathered or unreduced, size): ``(W-1)`` latency steps and ``(W-1)/W`` of the buffer on the wire
    (twice both for an all-reduce).
    """
    steps, wire = ring_terms(kind, W)
    return steps * ALPHA + wire * buffer_bytes / B


@functools.cache
def _collective_time_fn(kind: str) -> Callable[[int, float, float, float], float]:
    """:func:`collective_time_expr` of ``kind`` as a function ``(world, bandwidth, latency,
    buffer_bytes) -> seconds`` of plain float arithmetic (sympy's code generation; built once
    per kind, cheap to call in planning loops)."""
    expr = collective_time_expr(kind, _BYTES)
    return sympy.lambdify((W, B, ALPHA, _BYTES), expr, modules="math")


@dataclass(frozen=True)
class ClusterSpec:
    """Numbers for one cluster; ``evaluate`` substitutes them into a communication expression."""

    peak_flops: float = 400e12  # dense bf16 FLOP/s a kernel reaches in practice
    mem_bandwidth: float = 3.0e12  # bytes/s of device memory
    bus_bandwidth: float = 100e9  # bytes/s per rank for collectives (intra-node)
    latency_s: float = 10e-6  # per ring step
    # HSDP's replicate dimension crosses nodes: its all-reduce runs at these (inter-node) numbers.
    inter_node_bandwidth: float = 25e9  # bytes/s per rank
    inter_node_latency_s: float = 20e-6  # per ring step

    def evaluate(self, expr: sympy.Expr, world: int) -> float:
        value = expr.subs({W: world, B: self.bus_bandwidth, ALPHA: self.latency_s})
        return float(value)

    def collective_seconds(self, kind: str, buffer_bytes: int, world: int,
                           level: str = "intra") -> float:
        """Seconds of one collective: :func:`collective_time_expr` at this cluster's numbers;
        ``level="inter"`` uses the inter-node bandwidth and latency (HSDP's replicate
        dimension)."""
        if world <= 1:
            return 0.0
        bandwidth, latency = ((self.inter_node_bandwidth, self.inter_node_latency_s)
                              if level == "inter" else (self.bus_bandwidth, self.latency_s))
        return float(_collective_time_fn(kind)(world, bandwidth, latency, buffer_bytes))

    def compute_seconds(self, flops: float, nbytes: float) -> float:
        return max(flops / self.peak_flops, nbytes / self.mem_bandwidth)


def calibrate(
    spec: ClusterSpec, samples: Sequence[tuple[str, int, int, float]]
) -> ClusterSpec:
    """Fit ``bus_bandwidth`` and ``latency_s`` to ``(kind, buffer_bytes, world, seconds)`` samples
    by least squares on ``seconds = steps * alpha + wire_bytes / B``."""
    rows = []
    for kind, nbytes, world, seconds in samples:
        steps, wire = ring_terms(kind, world)
        rows.append((steps, wire * nbytes, seconds))
    if len(rows) < 2:
        raise ValueError("shardc cost model: calibration needs at least two timings")
    # Solve [steps, wire] @ [alpha, 1/B] = seconds (normal equations, 2x2).
    s11 = sum(a * a for a, _, _ in rows)
    s12 = sum(a * b for a, b, _ in rows)
    s22 = sum(b * b for _, b, _ in rows)
    t1 = sum(a * t for a, _, t in rows)
    t2 = sum(b * t for _, b, t in rows)
    det = s11 * s22 - s12 * s12
    if abs(det) < 1e-30:
        raise ValueError(
            "shardc cost model: calibration timings do not separate latency from bandwidth"
        )
    alpha = (t1 * s22 - t2 * s12) / det
    inv_b = (s11 * t2 - s12 * t1) / det
    if inv_b <= 0:
        raise ValueError("shardc cost model: calibration gave a non-positive bandwidth")
    return replace(spec, latency_s=max(alpha, 0.0), bus_bandwidth=1.0 / inv_b)


def _numel(shape) -> int:
    # Size hints, never int(): planning must add no guard (see fx_utils.size_hint).
    return math.prod(size_hint(s) for s in shape)


def _val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


# Ops that add values into rows of a destination chosen by indices (the embedding's backward):
# a compiler writes them in place, touching the indexed rows only.
_INDEXED_ACCUMULATES = frozenset({"index_put", "index_put_", "_unsafe_index_put",
                                  "_unsafe_masked_index_put_accumulate", "index_add",
                                  "index_add_", "scatter_add", "scatter_add_"})


def _indexed_accumulate_bytes(node: fx.Node, ins: list[torch.Tensor]) -> float:
    """Bytes an indexed accumulation moves: its indices and values read, the indexed rows read
    and written (as many bytes as the values); the whole destination copied first only where
    something else still reads it (otherwise the compiler writes in place: measured on an H200,
    the 1b config's embedding backward scattered its 2048 rows in 15 us, where the
    destination's 262 MB would take 60 us to read and as long to write)."""
    dest = node.all_input_nodes[0]
    rest = float(tensor_nbytes(ins[1:]))
    values = float(tensor_nbytes(ins[-1]))
    copy = 2.0 * tensor_nbytes(ins[0]) if len(dest.users) > 1 else 0.0
    return rest + 2.0 * values + copy


def node_flops_and_bytes(node: fx.Node) -> tuple[float, float]:
    """FLOPs and bytes moved by one graph op, from the shapes on its fake values (dynamic and
    data-dependent sizes are estimated by their hints, without guarding on them)."""
    out = node.meta.get("val")
    outs = [o for o in (out if isinstance(out, (list, tuple)) else [out])
            if isinstance(o, torch.Tensor)]
    ins = [v for v in (_val(a) for a in node.all_input_nodes) if v is not None]
    nbytes = float(tensor_nbytes(ins + outs))
    name = getattr(node.target, "__name__", str(node.target))
    base = name.split(".")[0]
    flops = 0.0
    if base in ("mm", "addmm", "bmm", "baddbmm") and outs:
        a = ins[-2] if base in ("addmm", "baddbmm") else ins[0]
        flops = 2.0 * _numel(outs[0].shape) * size_hint(a.shape[-1])
    elif "scaled_dot_product" in base and len(ins) >= 3:
        q, k = ins[0], ins[1]
        flops = 4.0 * _numel(q.shape[:-1]) * size_hint(k.shape[-2]) * size_hint(q.shape[-1])
        if "backward" in base:
            flops *= 2.5
    elif base == "fused_linear_cross_entropy" and len(ins) >= 2:
        flops, nbytes = fused_loss_flops_and_bytes(node, ins)
    elif base in _INDEXED_ACCUMULATES and len(ins) >= 2:
        nbytes = _indexed_accumulate_bytes(node, ins)
    elif base == "convolution" and outs and len(ins) >= 2:
        w = ins[1]
        flops = 2.0 * _numel(outs[0].shape) * _numel(w.shape[1:])
    return flops, nbytes


def model_flops(node: fx.Node) -> float:
    """The FLOPs ``node`` computes, a call of a compiled-once block body included: the sum over
    the body's ops (:func:`node_flops_and_bytes` prices the call itself at none, the body's time
    being priced from its own kernels). For the plan's record and its MFU, not for times."""
    body = subgraph_module(node)
    if body is not None:
        return sum(model_flops(n) for n in body.graph.nodes if n.op == "call_function")
    return node_flops_and_bytes(node)[0]


@dataclass(frozen=True)
class FusedLossDims:
    """The sizes the fused cross-entropy's price depends on (``shardc.ops.fused_ce``): tokens,
    hidden and vocabulary sizes, tokens per chunk, and the bytes per element of the hidden
    states (and logits), of the softmax (fp32 where the graph upcast) and of the weight."""

    tokens: int
    hidden: int
    vocab: int
    chunk: int
    item: int
    soft: int
    weight_item: int

    @classmethod
    def of(cls, node: fx.Node, h: torch.Tensor, w: torch.Tensor) -> FusedLossDims:
        tokens = size_hint(h.shape[0])
        item = h.element_size()
        return cls(tokens, size_hint(h.shape[1]), size_hint(w.shape[0]),
                   max(1, min(int(node.args[3]), tokens)), item, 4 if node.args[6] else item,
                   w.element_size())

    def elementwise_bytes(self) -> int:
        from shardc.ops import fused_ce

        return fused_ce.elementwise_bytes(self.tokens, self.hidden, self.vocab, self.chunk,
                                          self.item, self.soft, self.weight_item)


def fused_loss_flops_and_bytes(node: fx.Node, ins: list[torch.Tensor]) -> tuple[float, float]:
    """The fused cross-entropy (``shardc.ops.fused_ce``): its three matmuls per chunk (logits,
    ``grad_h``, ``grad_W``: ``6 * T * D * V``), and the bytes it moves: ``h`` and ``grad_h``
    once, the weight read twice per chunk, and its other kernels' bytes
    (``fused_ce.elementwise_bytes``)."""
    from shardc.ops import fused_ce

    d = FusedLossDims.of(node, ins[0], ins[1])
    chunks = -(-d.tokens // d.chunk)
    weight_bytes = d.vocab * d.hidden * d.weight_item
    nbytes = (2 * d.tokens * d.hidden * d.item + chunks * 2 * weight_bytes
              + d.elementwise_bytes())
    return fused_ce.flops(d.tokens, d.hidden, d.vocab), float(nbytes)
