"""The peak budget's prefetch-depth lever: how many buckets ahead an all-gather is issued.

A deeper prefetch starts each bucket's all-gather earlier, so less of it is exposed, and holds
more gathered buckets at once, so the peak is higher; no prefetch (depth 0) exposes every
all-gather and holds the fewest. Under a peak budget the planner predicts the chosen
configuration (kept buckets, recomputed and offloaded blocks) at its depth and one deeper, up to
:data:`MAX_DEPTH` (:func:`depths_to_try`: one trial more per budgeted compile; a shallower
depth, which holds less, is only predicted faster where compute slows beside communication,
and is not tried there), each prediction's step time and peak the largest over the ranks, and
takes (:func:`choose_depth`) the fastest depth whose peak fits the budget; ties go to the
options' depth, then to the shallower (less memory). Where even the fully resharded plan at the
options' depth is over the budget, a shallower depth is tried before recomputing or offloading
anything (:func:`shallower_depths`): the cheapest lever when memory is short, since it only
exposes some all-gathers. Every input is the same on every rank, so the depth is too.
"""

from __future__ import annotations

from shardc.planning.plan import PrefetchDecision, PrefetchTrial

MAX_DEPTH = 2  # the deepest prefetch the planner tries of its own


def depths_to_try(current: int) -> tuple[int, ...]:
    """The depths predicted for the chosen configuration, made at ``current``: it, and one
    deeper up to :data:`MAX_DEPTH`."""
    return (current, current + 1) if current < MAX_DEPTH else (current,)


def shallower_depths(default: int) -> tuple[int, ...]:
    """The depths tried, deepest first, when the fully resharded plan at ``default`` is over
    the budget."""
    return tuple(range(default - 1, -1, -1))


def choose_depth(trials: list[PrefetchTrial], default: int, budget_bytes: int,
                 why: str = "") -> PrefetchDecision:
    """The fastest fitting depth of ``trials`` (ties: ``default``, then the shallower); the
    ``default`` depth's trial if none fits. ``why``: how the configuration was reached (for the
    reason)."""
    trials = sorted(trials, key=lambda t: t.depth)
    fitting = [t for t in trials if t.fits]
    if not fitting:
        best = next(t for t in trials if t.depth == default)
        reason = (f"prefetch depth {default} (the options'): no depth fits the budget "
                  f"({budget_bytes} B)")
    else:
        best = min(fitting, key=lambda t: (round(t.step_ms, 6), t.depth != default, t.depth))
        others = ", ".join(f"{t.depth}: {t.step_ms:.3f} ms, {t.peak_bytes} B"
                           + ("" if t.fits else " (over the budget)")
                           for t in trials if t is not best)
        if best.depth == default:
            verdict = "the options' depth, the fastest that fits"
        elif best.depth > default:
            verdict = "deeper than the options' (room in the budget, and faster by the cost model)"
        elif any(t.fits and t.depth == default for t in trials):
            verdict = "shallower than the options' (faster by the cost model)"
        else:  # the fully resharded plan at the options' depth was over the budget
            verdict = "shallower than the options' (memory short: the options' depth does not fit"\
                      " the budget)"
        reason = (f"prefetch depth {best.depth}: {verdict}; predicted step {best.step_ms:.3f} ms, "
                  f"peak {best.peak_bytes} B within {budget_bytes} B"
                  + (f"; other depths: {others}" if others else ""))
    return PrefetchDecision(best.depth, default, best.step_ms, best.peak_bytes,
                            reason + (f"; {why}" if why else ""), trials)
