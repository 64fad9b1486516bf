"""The budget's levers together: recompute blocks so that buckets can stay gathered.

The peak budget's levers are tried in order (``shardc.compile.budget_search``): keep buckets
gathered while the fully resharded plan fits, else recompute (or offload) blocks with every
bucket resharded. That order misses the plans where both levers pay at once: recomputing a
block frees its saved activations for the cost of its forward, and the room can hold buckets
gathered from the forward to the backward, each saving its backward re-gather (under CPU
offload, the host->device copy of its shards). On the wide config at world 1 under CPU offload,
for instance, one block's recompute costs about 2 ms and frees 1.4 GiB, while one bucket kept
saves about 22 ms of copies for 0.4 GiB.

:func:`trade_recompute_for_kept` looks for such a plan after the levers in order decided, with a
bounded, deterministic search (counts, never a clock; every number it reads is agreed over the
ranks by the caller's ``evaluate``):

1. Estimate first, with no trial: the buckets not kept and what they would save, against the
   cheapest blocks (by seconds per freed byte) whose freed bytes cover theirs. Where the saving
   does not exceed the recompute cost, nothing is tried.
2. Every candidate block recomputed, then buckets kept by the first lever's greedy
   (``shardc.planning.budget.choose``, at most its trials) under the budget.
3. With those buckets kept, the shortest prefix of the blocks' ranking that still fits
   (``shardc.planning.recompute.choose``, at most its trials).
4. The configuration with the lowest predicted step among the decided one and those verified
   within the budget wins; the decided one on ties. Its record says why each block is
   recomputed and each bucket kept. Where the kept buckets fit with no block recomputed, that
   is a better choice of the first lever alone, not a trade, and nothing changes here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from shardc.passes.recompute import Block
from shardc.planning import budget, recompute
from shardc.planning.plan import BucketDecision, MemoryBudget

_MiB = float(1 << 20)
_VERIFIED = re.compile(r"verified peak [0-9.]+ MiB within the budget")

# (parameters kept gathered, blocks recomputed) -> (rank-uniform peak bytes, predicted step s)
Evaluate = Callable[[frozenset[str], frozenset[str]], tuple[int, float]]


@dataclass(frozen=True)
class Config:
    """One verified configuration of the two levers."""

    kept: tuple[int, ...]  # bucket indices
    recomputed: tuple[str, ...]  # block names, in ranking order
    peak: int
    step_s: float


def worth_trying(cands: Sequence[budget.Candidate], kept: Sequence[int],
                 blocks: Sequence[recompute.RecomputeCandidate],
                 recomputed: Sequence[str]) -> bool:
    """Whether, by the estimates alone, recomputing more blocks to keep the buckets not kept
    could shorten the step: the buckets' saving exceeds the forward time of the cheapest blocks
    not yet recomputed whose freed bytes cover the buckets' bytes (all of them if none do)."""
    waiting = [c for c in cands if c.saved_s > 0 and c.bucket not in kept]
    if not waiting:
        return False
    need = sum(c.nbytes for c in waiting)
    cost, freed = 0.0, 0
    for b in recompute.rank([b for b in blocks if b.block not in recomputed]):
        if freed >= need:
            break
        cost += b.cost_s
        freed += b.nbytes
    return freed > 0 and sum(c.saved_s for c in waiting) > cost


def _params(cands: Sequence[budget.Candidate], kept: Sequence[int]) -> frozenset[str]:
    by_bucket = {c.bucket: c.params for c in cands}
    return frozenset(p for b in kept for p in by_bucket[b])


def search(cands: Sequence[budget.Candidate], fixed: list[BucketDecision],
           blocks: Sequence[recompute.RecomputeCandidate], budget_bytes: int,
           current: Config, evaluate: Evaluate
           ) -> tuple[Config, MemoryBudget | None, int]:
    """Steps 2-4 of the module docstring from the decided configuration ``current``. Returns
    the best configuration, where it is a new one the bucket decisions that kept its buckets
    (None: ``current`` stays), and the peak with every block recomputed and nothing kept."""
    every = tuple(b.block for b in recompute.rank(blocks))
    floor, _ = evaluate(frozenset(), frozenset(every))
    if floor > budget_bytes:
        return current, None, floor
    kept_decided = budget.choose(
        list(cands), fixed, budget_bytes, floor,
        lambda kept: evaluate(_params(cands, kept), frozenset(every))[0])
    kept = tuple(kept_decided.kept)
    if not kept:
        return current, None, floor
    params = _params(cands, kept)
    peak, step_s = evaluate(params, frozenset(every))
    best = Config(kept, every, peak, step_s)
    start, _ = evaluate(params, frozenset())
    if start <= budget_bytes:
        # Those buckets fit with nothing recomputed: a better choice of the first lever alone,
        # not a trade (left to it).
        return current, None, floor
    chosen, _, _ = recompute.choose(  # fewer blocks recomputed, the same buckets kept
        blocks, budget_bytes, start, peak, lambda names: evaluate(params, frozenset(names))[0])
    if len(chosen) < len(every):
        prefix_peak, prefix_step = evaluate(params, frozenset(chosen))
        if prefix_peak <= budget_bytes and prefix_step <= best.step_s:
            best = Config(kept, tuple(chosen), prefix_peak, prefix_step)
    if best.step_s >= current.step_s:
        return current, None, floor
    return best, kept_decided, floor


def trade_recompute_for_kept(decided: MemoryBudget, cands: Sequence[budget.Candidate],
                             fixed: list[BucketDecision], blocks: Sequence[Block],
                             block_cands: Sequence[recompute.RecomputeCandidate],
                             budget_bytes: int, evaluate: Evaluate) -> MemoryBudget | None:
    """A new record where recomputing blocks to keep buckets gathered (see the module
    docstring) beats ``decided`` by the predicted step; None where it does not, where nothing
    was worth trying, or where ``decided`` offloads blocks or checkpoints whole (its host
    levers are left as they are; parts offloaded, hidden behind compute, are compared as the
    same configuration without them, and dropped where the trade wins).
    ``block_cands``: the blocks that may be recomputed (recompute levers only);
    ``evaluate``: plans a configuration and returns its agreed peak and predicted step."""
    if decided.offloaded_whole or decided.checkpoint_offloaded or not block_cands:
        return None
    if not worth_trying(cands, decided.kept, block_cands, decided.recomputed):
        return None
    peak, step_s = evaluate(_params(cands, decided.kept), frozenset(decided.recomputed))
    current = Config(tuple(decided.kept), tuple(decided.recomputed), peak, step_s)
    best, kept_decided, floor = search(cands, fixed, block_cands, budget_bytes, current,
                                       evaluate)
    if kept_decided is None:
        return None
    note = (f"; recomputed so that {len(best.kept)} bucket(s) stay gathered from the forward "
            f"to the backward: predicted step {best.step_s * 1e3:.1f} ms against "
            f"{current.step_s * 1e3:.1f} ms with {len(current.recomputed)} block(s) recomputed "
            f"and {len(current.kept)} bucket(s) kept")
    # The least the levers reach is now every block recomputed, nothing kept (``floor``); the
    # fully resharded plan's peak, the fixed policy's, is kept beside it.
    resharded = decided.resharded_bytes or decided.minimum_bytes
    return MemoryBudget(
        decided.budget_bytes, min(decided.minimum_bytes, floor), best.peak, decided.trials,
        [_trade_reason(d, best) for d in kept_decided.decisions],
        recompute.decisions(blocks, block_cands, best.recomputed, needed=True, peak=best.peak,
                            note=note),
        resharded_bytes=resharded)


def _trade_reason(d: BucketDecision, best: Config) -> BucketDecision:
    """A kept bucket's reason names the trade that made room for it."""
    if not d.kept or not best.recomputed:
        return d
    # The greedy verified its buckets with every block recomputed; the chosen plan recomputes
    # the shortest prefix that still fits, whose peak the reason names.
    reason = _VERIFIED.sub(f"verified peak {best.peak / _MiB:.1f} MiB within the budget",
                           d.reason)
    return replace(d, reason=f"{reason}, with {len(best.recomputed)} block(s) recomputed to "
                             "make room")
