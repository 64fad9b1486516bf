"""The peak budget's second lever: which blocks to recompute in the backward.

When the fully resharded plan (nothing kept gathered: the first lever's choices are dropped
first) still exceeds ``peak_memory_budget_bytes``, the planner recomputes whole blocks
(``shardc.passes.recompute``) instead of saving their activations. The decision is a bounded,
deterministic search:

1. The candidates are the region's blocks that may be recomputed and free some bytes. Each has
   a predicted cost (its forward's time by the cost model: the kernels a fusing compiler makes
   of its ops, ``shardc.planning.kernels``, priced by ``shardc.planning.estimate``) and an
   estimate of the bytes it frees (its saved activations less its inputs). Both are exchanged
   between the ranks and the largest taken (``agree_on_largest``), so the ranking is the same
   everywhere. The ranking: predicted seconds per freed byte, lowest first; ties by position.
2. The fully recomputed plan (every candidate) is planned and predicted: its peak is the new
   feasible minimum; over the budget, the budget is refused naming it.
3. Otherwise the answer is a prefix of the ranking. The first prefix tried is the shortest
   whose estimated freed bytes cover the excess over the budget (a freed byte lowers the peak
   by at most a byte, so by the estimates none shorter fits; where they undercount, the
   interpolation below still tries shorter ones). Then, between a prefix known to exceed the budget
   (at first the empty one) and one known to fit (at first all of them), the next prefix tried
   is the shortest whose peak, interpolated between the two on the freed bytes, fits. Each try
   is a partition, a plan and a prediction (``evaluate``), at most :data:`MAX_TRIALS`; the
   shortest verified fitting prefix wins. The chosen plan is therefore always verified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import fx

from shardc.passes import recompute_part
from shardc.passes.fx_utils import needed_by
from shardc.passes.host_resident import ALREADY_ON_HOST
from shardc.passes.recompute import Block
from shardc.planning.estimate import kernel_seconds
from shardc.planning.kernels import group_kernels
from shardc.planning.plan import BlockDecision, is_part, split_part
from shardc.planning.profile import ClusterProfile

MAX_TRIALS = 4  # prefixes verified between the fully recomputed plan and none, whatever the model
_MiB = float(1 << 20)


@dataclass(frozen=True)
class RecomputeCandidate:
    """A block the planner may recompute: what it costs in time and frees in bytes."""

    block: str
    kind: str
    position: int
    cost_s: float  # predicted time of its forward, run again in the backward
    nbytes: int  # estimated activation bytes recomputing it frees
    # The third lever (shardc.planning.offload): its saved activations offloaded to the host
    # instead (cost_s: the copies' exposed time; nbytes: its saved bytes). Both prices kept
    # for the record: its forward's time and one copy's time.
    offload: bool = False
    forward_s: float = 0.0
    copy_s: float = 0.0
    offload_s: float = 0.0
    # Recomputed although offloading was cheaper: why the host could not take it ("host full:
    # ...", shardc.compile.budget_search.fit_offloads); "" otherwise.
    host_note: str = ""

    @property
    def ratio(self) -> float:
        """Seconds per freed byte: lower is better."""
        return self.cost_s / max(self.nbytes, 1)


def forward_seconds(gm: fx.GraphModule, block: Block, profile: ClusterProfile) -> float:
    """The predicted time of ``block``'s forward as the backward runs it again: the kernels of
    its nodes in the joint graph ``gm`` (an inline block), or of its body's forward graph less
    what only the block's output needs (a body call: the backward calls a copy of the body
    that computes only what it reads, ``shardc.passes.prune_body_outputs``)."""
    if block.kind == "body":
        call = block.nodes[0]
        graph = getattr(gm, call.args[0].target).graph
        outputs = set(block.outputs)
        nodes = _needed(graph, {g.args[1] for g in block.nodes[1:] if g not in outputs})
    else:
        graph, nodes = gm.graph, list(block.nodes)
    return sum(kernel_seconds(k, profile) for k in group_kernels(graph, nodes))


def part_seconds(gm: fx.GraphModule, block: Block, indices: Sequence[int],
                 profile: ClusterProfile) -> float:
    """The predicted time of computing ``block``'s saved values at ``indices`` (of its
    ``recomputable`` ones) again in the backward: the kernels of their cones
    (``shardc.passes.recompute_part.cheap_outputs``), copied into the region's graph."""
    call = block.nodes[0]
    body = getattr(gm, call.args[0].target)
    positions = [block.saved_values[i].args[1] for i in indices]
    cones = recompute_part.cheap_outputs(body, block.read_positions)
    nodes = {n for p in positions for n in cones.get(p, ())}
    ordered = [n for n in body.graph.nodes if n in nodes]
    return sum(kernel_seconds(k, profile) for k in group_kernels(body.graph, ordered))


def _needed(graph: fx.Graph, positions: set[int]) -> list[fx.Node]:
    """The computing nodes of ``graph`` that its outputs at ``positions`` need, in graph
    order."""
    out = next(iter(graph.find_nodes(op="output")))
    seen = needed_by(a for i, a in enumerate(out.args[0]) if i in positions)
    return [n for n in graph.nodes if n in seen and n.op == "call_function"]


def rank(cands: Sequence[RecomputeCandidate]) -> list[RecomputeCandidate]:
    """The candidates in the order the planner recomputes them: lowest seconds per freed byte
    first, ties by position in the graph."""
    return sorted(cands, key=lambda c: (c.ratio, c.position))


def _bytes(order: Sequence[RecomputeCandidate], k: int) -> int:
    return sum(c.nbytes for c in order[:k])


def _next_prefix(order: list[RecomputeCandidate], lo: tuple[int, int], hi: tuple[int, int],
                 budget: int) -> int:
    """The shortest prefix strictly between ``lo`` and ``hi`` (lengths with verified peaks)
    whose peak, interpolated on the freed bytes, fits ``budget``; ``hi``'s length if none."""
    (k_lo, p_lo), (k_hi, p_hi) = lo, hi
    b_lo, b_hi = _bytes(order, k_lo), _bytes(order, k_hi)
    for k in range(k_lo + 1, k_hi):
        frac = (_bytes(order, k) - b_lo) / max(b_hi - b_lo, 1)
        if p_lo + (p_hi - p_lo) * frac <= budget:
            return k
    return k_hi


def choose(cands: Sequence[RecomputeCandidate], budget: int, start: int, floor: int,
           evaluate: Callable[[tuple[str, ...]], int]) -> tuple[list[str], int, int]:
    """Which blocks to recompute: ``start`` is the verified peak with none recomputed (over
    ``budget``), ``floor`` with every candidate recomputed (within it); ``evaluate(names)``
    plans that configuration and returns its rank-uniform peak. Returns the chosen blocks (in
    ranking order), their verified peak and the number of evaluations."""
    order = rank(cands)
    lo, hi = (0, start), (len(order), floor)
    trials = 0
    # A freed byte lowers the peak by at most a byte, so by the estimates no prefix shorter
    # than the one that frees the excess fits: tried first (the interpolation reads the
    # floor's peak, which a term the candidates do not free, such as the optimizer step's,
    # can hold up). Shorter prefixes are still tried after it, between it and none.
    first = next((k for k in range(1, len(order) + 1)
                  if _bytes(order, k) >= start - budget), len(order))
    while trials < MAX_TRIALS and hi[0] - lo[0] > 1:
        k = first if trials == 0 and lo[0] < first < hi[0] else _next_prefix(order, lo, hi,
                                                                              budget)
        if k >= hi[0]:
            break
        peak = evaluate(tuple(c.block for c in order[:k]))
        trials += 1
        if peak <= budget:
            hi = (k, peak)
        else:
            lo = (k, peak)
    return [c.block for c in order[:hi[0]]], hi[1], trials


def decisions(blocks: Sequence[Block], cands: Sequence[RecomputeCandidate],
              chosen: Sequence[str], *, needed: bool, peak: int = 0,
              note: str = "", checkpoints: Sequence[RecomputeCandidate] = (),
              checkpointed: Sequence[str] = (), freed_peak: int = 0,
              host_notes: dict[str, str] | None = None) -> list[BlockDecision]:
    """One decision per block, in graph order, with its reason. ``needed``: the fully
    resharded plan exceeded the budget (else nothing is recomputed); ``note``: appended to the
    reasons of the recomputed blocks (why not offloaded). ``checkpoints``: where every
    candidate freed was not enough (``freed_peak``: that plan's peak), the recomputed blocks
    whose checkpoints may be offloaded (each a candidate of its checkpoint's bytes and exposed
    copy time), ``checkpointed`` those offloaded. ``host_notes``: per block (or
    ``"checkpoint:<block>"``) whose offload the host could not take, why ("host full: ...")."""
    host_notes = host_notes or {}
    by_name = {c.block: c for c in cands}
    parts = {split_part(c.block)[0]: c for c in cands if is_part(c.block) and c.offload}
    recomputed_parts = {split_part(c.block)[0]: c for c in cands
                        if is_part(c.block) and not c.offload}
    order = [c.block for c in rank(cands)]
    ck = {c.block: c for c in checkpoints}
    ck_rank = {c.block: i + 1 for i, c in enumerate(rank(checkpoints))}
    out = []
    for b in blocks:
        c = by_name.get(b.name)
        cost_ms = (c.forward_s if c.offload else c.cost_s) * 1e3 if c else 0.0
        nbytes = c.nbytes if c else b.freed_bytes
        offloaded = b.name in chosen and c is not None and c.offload
        # Its part offloaded, the block itself not freed whole (which would take the part).
        part = parts.get(b.name)
        part = part if b.name not in chosen and part is not None and part.block in chosen \
            else None
        rpart = recomputed_parts.get(b.name)
        rpart = rpart if b.name not in chosen and rpart is not None and rpart.block in chosen \
            else None
        if offloaded:
            reason = (f"offloaded: frees ~{nbytes / _MiB:.2f} MiB of saved activations, copied "
                      f"to the host and back ({c.copy_s * 1e3:.3f} ms each way on the copy lane,"
                      f" {c.offload_s * 1e3:.3f} ms not hidden by compute) against "
                      + (f"{c.forward_s * 1e3:.3f} ms to recompute it" if not b.excluded
                         else f"never recomputed: {b.excluded}")
                      + f" (rank {order.index(b.name) + 1} of {len(order)} by ms per MiB); "
                      f"verified peak {peak / _MiB:.1f} MiB within the budget"
                      + (f"; {b.host_saved_bytes} B of its saved values not offloaded: "
                         f"{ALREADY_ON_HOST}" if b.host_saved_bytes else ""))
        elif b.name in chosen:
            reason = (f"recomputed: frees ~{nbytes / _MiB:.2f} MiB of saved activations for "
                      f"{cost_ms:.3f} ms of forward in the backward (rank {order.index(b.name) + 1}"
                      f" of {len(order)} by ms per MiB)"
                      + (f", not offloaded ({c.offload_s * 1e3:.3f} ms of copies not hidden): "
                         f"{c.host_note}" if c.host_note else
                         f", cheaper than offloading it ({c.offload_s * 1e3:.3f} ms of "
                         f"{c.copy_s * 1e3:.3f} ms copies not hidden)" if c.copy_s else "")
                      + f"; verified peak {peak / _MiB:.1f} MiB within the budget{note}")
        elif part is not None or rpart is not None:
            reason = "; ".join(
                ([_recomputed_part_reason(b, rpart, order)] if rpart is not None else [])
                + ([_part_reason(b, part, c, order, peak)] if part is not None else []))
            if part is None:
                reason += "; " + _rest_saved(b, c, order, peak)
        elif b.excluded and c is None:
            reason = f"saved: never recomputed, {b.excluded}" + (
                f"; not offloaded: {host_notes[b.name]}" if b.name in host_notes else "")
        elif not needed:
            reason = ("saved: the plan fits the budget without recomputing (the first lever, "
                      "keeping buckets gathered, is enough)")
        elif c is None:
            reason = "saved: recomputing it would free no saved bytes" + (
                f"; not offloaded: {host_notes[b.name]}" if b.name in host_notes else "")
        else:
            reason = (f"saved: ranked {order.index(b.name) + 1} of {len(order)} "
                      f"({c.ratio * 1e3 * _MiB:.4f} ms/MiB); the blocks ranked before it "
                      "already bring the peak within the budget")
        k = ck.get(b.name)
        if k is not None and b.name in checkpointed:
            reason += (f"; its checkpoint (~{k.nbytes / _MiB:.2f} MiB: its input, what it still "
                       "saves) offloaded to the host, because every block freed left the "
                       f"predicted peak at {freed_peak / _MiB:.1f} MiB, over the budget: "
                       f"{k.copy_s * 1e3:.3f} ms each way on the copy lane, "
                       f"{k.offload_s * 1e3:.3f} ms not hidden by compute (rank "
                       f"{ck_rank[b.name]} of {len(ck_rank)} by ms per MiB)")
        elif f"checkpoint:{b.name}" in host_notes:
            reason += (f"; its checkpoint stays on the device: "
                       f"{host_notes[f'checkpoint:{b.name}']}")
        elif k is not None:
            reason += (f"; its checkpoint (~{k.nbytes / _MiB:.2f} MiB) stays on the device: "
                       f"ranked {ck_rank[b.name]} of {len(ck_rank)}, the "
                       "checkpoints ranked before it already bring the peak within the budget")
        if part is not None or rpart is not None:
            out.append(BlockDecision(
                b.name, b.kind, False,
                (rpart.cost_s if rpart is not None else part.forward_s) * 1e3,
                (part.nbytes if part is not None else 0)
                + (rpart.nbytes if rpart is not None else 0),
                reason, offloaded=part is not None, offload_ms=0.0,
                copy_ms=part.copy_s * 1e3 if part is not None else 0.0,
                offloaded_part=split_part(part.block)[1] or () if part is not None else (),
                recomputed_part=split_part(rpart.block)[1] or () if rpart is not None else ()))
            continue
        out.append(BlockDecision(
            b.name, b.kind, b.name in chosen and not offloaded, cost_ms, nbytes, reason,
            offloaded=offloaded, offload_ms=c.offload_s * 1e3 if c else 0.0,
            copy_ms=c.copy_s * 1e3 if c else 0.0,
            checkpoint_offloaded=k is not None and b.name in checkpointed,
            checkpoint_bytes=k.nbytes if k else 0,
            checkpoint_ms=k.offload_s * 1e3 if k else 0.0,
            checkpoint_copy_ms=k.copy_s * 1e3 if k else 0.0))
    return out


def _recomputed_part_reason(block: Block, part: RecomputeCandidate, order: list[str]) -> str:
    """Why some of a block's saved values are recomputed (``shardc.passes.recompute_part``)."""
    count = len(split_part(part.block)[1] or ())
    return (f"{count} of its {len(block.saved_values)} saved values recomputed "
            f"(~{part.nbytes / _MiB:.2f} MiB), those its body computes from the others by "
            f"elementwise work alone: {part.cost_s * 1e3:.3f} ms in the backward against "
            f"{part.forward_s * 1e3:.3f} ms for its whole forward (rank "
            f"{order.index(part.block) + 1} of {len(order)} by ms per MiB)")


def _rest_saved(block: Block, whole: RecomputeCandidate | None, order: list[str],
                peak: int) -> str:
    return ((f"the rest saved: the block whole ranked {order.index(block.name) + 1} of "
             f"{len(order)} ({whole.ratio * 1e3 * _MiB:.4f} ms/MiB by "
             f"{'offloading' if whole.offload else 'recomputing'} it), and the candidates "
             "ranked before it already bring the peak within the budget" if whole is not None
             else "the rest saved: the block frees nothing more by a lever of its own")
            + f"; verified peak {peak / _MiB:.1f} MiB within the budget")


def _part_reason(block: Block, part: RecomputeCandidate, whole: RecomputeCandidate | None,
                 order: list[str], peak: int) -> str:
    """Why a block's saved values are offloaded in part (``shardc.planning.offload``)."""
    count = len(split_part(part.block)[1] or ())
    rest = (f"the rest saved: the block whole ranked {order.index(block.name) + 1} of "
            f"{len(order)} ({whole.ratio * 1e3 * _MiB:.4f} ms/MiB by "
            f"{'offloading' if whole.offload else 'recomputing'} it), and the candidates ranked "
            "before it already bring the peak within the budget" if whole is not None else
            "the rest saved: the block frees nothing more by a lever of its own"
            + (f" ({block.excluded})" if block.excluded else ""))
    return (f"offloaded in part: {count} of its {len(block.saved_values)} saved values "
            f"(~{part.nbytes / _MiB:.2f} MiB), those whose copies its forward hides "
            f"({part.copy_s * 1e3:.3f} ms each way on the copy lane against "
            f"{part.forward_s * 1e3:.3f} ms of forward: 0 ms not hidden; rank "
            f"{order.index(part.block) + 1} of {len(order)} by ms per MiB); {rest}; verified "
            f"peak {peak / _MiB:.1f} MiB within the budget")
