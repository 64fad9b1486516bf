"""Whether a training region's output projection + cross-entropy is fused (``fused_loss``).

``fused_loss=True`` or a number of tokens per chunk: :func:`forced` fuses every match
(``shardc.passes.fused_loss``). ``"auto"`` (the default) changes nothing without a peak
budget; with one, :func:`choose` prices the lever before the budget search runs: it is the
search's first lever when the budget needs bytes (the fully resharded plan, the search's own
first configuration, is over it), fusing frees at least :func:`min_saved_bytes` at the
predicted peak (a few KiB is the peak model's noise, not a saving: see there), and its
predicted time cost (the fully resharded plan's step time with it, less without) is not above
the cheapest block's recompute (the next lever's cheapest step). Every figure compared is the
largest over the ranks (``agree_on_largest``; the minimum is computed from the agreed unfused
peak), so every rank decides the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import fx

from shardc.compile import budget_search
from shardc.compile.options import ShardcOptions
from shardc.passes import fused_loss
from shardc.passes.fused_loss import Fused, Refused
from shardc.passes.fx_utils import copy_graph_module
from shardc.planning import budget, recompute
from shardc.planning.estimate import kernel_seconds
from shardc.planning.kernels import EXTERN, Kernel
from shardc.planning.plan import FusedLossDecision
from shardc.planning.profile import resolve_profile
from shardc.planning.schedule import device_name
from shardc.runtime.plan_check import agree_on_largest, agree_on_largest_each

log = logging.getLogger("shardc")

# (graph module) -> SearchInputs, the pipeline's search_inputs with the region bound.
MakeInputs = Callable[[fx.GraphModule], budget_search.SearchInputs]


# What fusing must free at the predicted peak to count: MIN_SAVED_FRACTION of the unfused peak,
# and MIN_SAVED_BYTES on any model (min_saved_bytes).
MIN_SAVED_BYTES = 64 * 1024
MIN_SAVED_FRACTION = 1 / 1024


def min_saved_bytes(peak_bytes: int) -> int:
    """The fewest bytes the lever must free at a predicted peak of ``peak_bytes`` (unfused) to
    be taken: ``max(64 KiB, peak / 1024)``.

    Below it the difference is the peak model's noise, not the logits: on llama-wide
    (docs/memory_budget.md, gap22) the unfused trial's peak in the backward differed by a
    4,096 B mask between torch versions, and that alone fused the loss on one and not the
    other; shardc's decomposition of the loss ops and Inductor's differ by ~100 B. What the
    lever really frees is the logits' [tokens, vocab] values, hundreds of MiB on a real model
    (or nothing, when the peak is elsewhere): 0.1% of the peak (7.3 MiB at 7.5 GB) is far under
    that and far over such noise. The floor is not 1 MiB so that small models still take a
    real saving (the tests' tiny Llama, vocabulary 1024: 0.65-1.1 MB of a 1.9-2.4 MB peak)."""
    return max(MIN_SAVED_BYTES, int(peak_bytes * MIN_SAVED_FRACTION))


def predicted_seconds(gm: fx.GraphModule, options: ShardcOptions) -> float:
    """The fused ops' predicted time in ``gm`` (the cost model's, ``estimate.kernel_seconds``)."""
    profile = resolve_profile(options.cluster, device_name(gm))
    return sum(kernel_seconds(Kernel(EXTERN, [n]), profile) for n in gm.graph.nodes
               if fused_loss.is_fused_loss(n))


def _decision(done: list[Fused], refused: list[Refused], gm: fx.GraphModule,
              options: ShardcOptions, reason: str, mode: str, **extra) -> FusedLossDecision:
    return FusedLossDecision(
        fused=[f.where for f in done], chunks=[f.chunk for f in done],
        logits_bytes=sum(f.logits_bytes for f in done),
        workspace_bytes=sum(f.workspace_bytes for f in done),
        predicted_ms=predicted_seconds(gm, options) * 1e3 if done else 0.0, reason=reason,
        mode=mode, refused=[f"{r.where}: {r.reason}" for r in refused], **extra)


def _none_found(refused: list[Refused]) -> str:
    if not refused:
        return "no output projection + cross-entropy in this region"
    return "left alone: " + "; ".join(f"{r.where}: {r.reason}" for r in refused)


def forced(gm: fx.GraphModule, options: ShardcOptions) -> FusedLossDecision:
    """Fuse every match in the joint graph ``gm`` (``fused_loss=True`` or a chunk)."""
    done, refused = fused_loss.fuse(gm, options.fused_loss_chunk())
    _decompose_rest(gm, options)
    mode = "forced" if options.fused_loss is True else f"forced, {options.fused_loss} tokens"
    reason = "fused_loss forces it" if done else _none_found(refused)
    decision = _decision(done, refused, gm, options, reason, mode)
    _log(decision)
    return decision


def choose(gm: fx.GraphModule, options: ShardcOptions, region, make_inputs: MakeInputs
           ) -> tuple[FusedLossDecision, budget_search.SearchInputs]:
    """``fused_loss="auto"`` under a peak budget: fuse ``gm`` (in place) or not (see the
    module); returns the decision and the budget search's inputs of the graph chosen."""
    probe = copy_graph_module(gm)
    done, refused = fused_loss.fuse(probe, options.fused_loss_chunk())
    _decompose_rest(probe, options)
    whole = copy_graph_module(gm) if done else None  # what the lever fuses, if chosen
    _decompose_rest(gm, options)  # the unfused graph, as Inductor would have decomposed it
    unfused = make_inputs(gm)
    if not done:
        decision = _decision(done, refused, probe, options, _none_found(refused), "auto")
        _log(decision)
        return decision, unfused
    depth = budget_search.depth_of(options)
    base = unfused.trial(set(), (), (), depth)
    group, index = base.group_name, region.check_index
    target = budget.planned_for(budget.resolve_budget(options.peak_memory_budget_bytes,
                                                      budget_search.gather_device(gm)),
                                options.peak_memory_margin)
    peak_u = agree_on_largest(group, index, "fused_loss/unfused",
                              int(base.predicted.peak_bytes or 0))
    ns_u = agree_on_largest(group, index, "fused_loss/unfused/ns",
                            int((base.predicted.step_time_s or 0.0) * 1e9))

    def no(reason: str, **extra) -> tuple[FusedLossDecision, budget_search.SearchInputs]:
        decision = _decision([], refused, probe, options, reason, "auto", **extra)
        _log(decision)
        return decision, unfused

    if peak_u <= target:
        return no(f"the fully resharded plan's predicted peak {peak_u} B is within the budget "
                  f"(planned for {target} B): no bytes needed")
    fused = make_inputs(probe)
    fbase = fused.trial(set(), (), (), depth)
    peak_f = agree_on_largest(group, index, "fused_loss/fused", int(fbase.predicted.peak_bytes
                                                                     or 0))
    ns_f = agree_on_largest(group, index, "fused_loss/fused/ns",
                            int((fbase.predicted.step_time_s or 0.0) * 1e9))
    saved, cost_ns = peak_u - peak_f, ns_f - ns_u
    measured = {"peak_saved_bytes": saved, "cost_ms": cost_ns * 1e-6}
    if saved <= 0:
        return no(f"it frees nothing at the predicted peak ({peak_u} B unfused, {peak_f} B "
                  "fused)", **measured)
    least = min_saved_bytes(peak_u)
    if saved < least:
        return no(f"it frees too little to count: {saved} B at the predicted peak ({peak_u} B "
                  f"unfused, {peak_f} B fused), under the {least} B minimum (max(64 KiB, 1/1024 "
                  "of the peak): less is the peak model's noise, not the logits)", **measured)
    cheapest = _cheapest_recompute_ns(unfused, options, group, index)
    if cheapest is not None and cost_ns > cheapest:
        return no(f"its predicted time cost {cost_ns * 1e-6:.3f} ms is above the cheapest "
                  f"block recompute's {cheapest * 1e-6:.3f} ms", **measured)
    _use_graph_of(gm, whole)
    fused_loss.fuse(gm, options.fused_loss_chunk())  # the graph the probe's trials built
    _decompose_rest(gm, options)
    than = (f"not above the cheapest block recompute's {cheapest * 1e-6:.3f} ms"
            if cheapest is not None else "no block to recompute instead")
    decision = _decision(done, refused, probe, options,
                         f"the budget needs bytes (fully resharded peak {peak_u} B over the "
                         f"planned-for {target} B); it frees {saved} B at the peak for a "
                         f"predicted {cost_ns * 1e-6:.3f} ms ({than})", "auto", **measured)
    _log(decision)
    return decision, fused


def _decompose_rest(gm: fx.GraphModule, options: ShardcOptions) -> None:
    """Under Inductor, the loss ops kept whole for the pattern and not fused are decomposed as
    Inductor would have (``fused_loss.decompose_whole_loss_ops``)."""
    if options.keeps_loss_ops_whole():
        fused_loss.decompose_whole_loss_ops(gm)


def _use_graph_of(gm: fx.GraphModule, source: fx.GraphModule) -> None:
    """Give ``gm`` (changed in place: the caller's joint graph) a copy of ``source``'s graph
    (a copy of ``gm`` made before it was changed)."""
    gm.graph = copy_graph_module(source).graph
    gm.recompile()


def _cheapest_recompute_ns(inputs: budget_search.SearchInputs, options: ShardcOptions,
                           group: str, index: int | None) -> int | None:
    """The smallest predicted forward time of a block (what recomputing it costs), the
    largest over the ranks; None where the region has no block."""
    if not inputs.blocks:
        return None
    profile = resolve_profile(options.cluster, device_name(inputs.probe))
    local = [int(recompute.forward_seconds(inputs.probe, b, profile) * 1e9)
             for b in inputs.blocks]
    return min(agree_on_largest_each(group, index, "fused_loss/blocks", local))


def _log(decision: FusedLossDecision) -> None:
    log.info("shardc: %s", decision.note())
