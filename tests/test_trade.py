"""The budget's levers together (``shardc.planning.trade``) on a synthetic region: peaks and
predicted steps made by known formulas, so that every decision has one right answer.

Three buckets, each saving 10 ms of backward copies for 100 B held; four blocks, each costing
1 ms of recompute and freeing 100 B. The peak is 1000 B, plus 100 B per bucket kept, less
100 B per block recomputed; the step 50 ms, less 10 ms per bucket kept, plus 1 ms per block
recomputed. (The training path with such a plan: tests/test_budget_combos.py.)"""

from __future__ import annotations

import pytest

from shardc.passes.recompute import Block
from shardc.planning import budget, recompute, trade
from shardc.planning.plan import MemoryBudget

BUCKETS = [budget.Candidate(i, f"layers.{i}", (f"w{i}",), 10e-3, 100, copy_s=10e-3)
           for i in range(3)]
BLOCKS = [Block(f"layers.{i}", "body", i, (), 150, 50) for i in range(4)]
RECOMPUTE = [recompute.RecomputeCandidate(b.name, b.kind, b.position, 1e-3, 100)
             for b in BLOCKS]


def evaluate(kept: frozenset[str], recomputed: frozenset[str]) -> tuple[int, float]:
    calls.append((kept, recomputed))
    return 1000 + 100 * len(kept) - 100 * len(recomputed), \
        50e-3 - 10e-3 * len(kept) + 1e-3 * len(recomputed)


calls: list = []


def _decided(budget_bytes: int, recomputed: int) -> MemoryBudget:
    """The levers in order: every bucket resharded, the first ``recomputed`` blocks freed."""
    names = [b.name for b in BLOCKS[:recomputed]]
    peak = 1000 - 100 * recomputed
    return MemoryBudget(budget_bytes, 600, peak, 0, budget.reshard_all(BUCKETS, [], 1000),
                        recompute.decisions(BLOCKS, RECOMPUTE, names, needed=True, peak=peak),
                        resharded_bytes=1000)


@pytest.fixture(autouse=True)
def _fresh_calls():
    calls.clear()


def test_blocks_are_recomputed_to_keep_every_bucket_gathered():
    # 950 B: the levers in order recompute one block (900 B, 51 ms); recomputing all four makes
    # room for the three buckets (900 B, 24 ms), and fewer than four do not fit.
    out = trade.trade_recompute_for_kept(_decided(950, 1), BUCKETS, [], BLOCKS, RECOMPUTE, 950,
                                         evaluate)
    assert out is not None
    assert out.kept == [0, 1, 2] and out.recomputed == [b.name for b in BLOCKS]
    assert out.peak_bytes == 900 and out.minimum_bytes == 600 and out.resharded_bytes == 1000
    assert all("recomputed so that 3 bucket(s) stay gathered" in d.reason
               and "predicted step 24.0 ms against 51.0 ms" in d.reason for d in out.blocks)
    assert all(d.reason.endswith("with 4 block(s) recomputed to make room")
               and "verified peak 0.0 MiB" in d.reason for d in out.decisions)
    assert len(calls) <= 1 + 1 + budget.MAX_TRIALS + 1 + recompute.MAX_TRIALS + 1  # bounded


def test_the_shortest_recompute_prefix_that_fits_is_taken():
    # 1150 B: the three buckets need only two blocks recomputed (1100 B, 22 ms).
    out = trade.trade_recompute_for_kept(_decided(1150, 0), BUCKETS, [], BLOCKS, RECOMPUTE,
                                         1150, evaluate)
    assert out.kept == [0, 1, 2] and out.recomputed == ["layers.0", "layers.1"]
    assert out.peak_bytes == 1100


def test_nothing_changes_where_the_trade_does_not_pay_or_does_not_apply():
    cheap = [budget.Candidate(c.bucket, c.name, c.params, 0.1e-3, c.nbytes) for c in BUCKETS]
    # The buckets save less than the blocks that would make room for them cost: no trial.
    assert trade.trade_recompute_for_kept(_decided(950, 1), cheap, [], BLOCKS, RECOMPUTE, 950,
                                          evaluate) is None
    assert calls == []
    # Every useful bucket kept already; or no block can be recomputed.
    kept = MemoryBudget(2000, 1000, 1300, 0, [
        d.__class__(d.bucket, d.name, True, d.saved_ms, d.bytes, "kept", d.params)
        for d in budget.reshard_all(BUCKETS, [], 1000)])
    assert trade.trade_recompute_for_kept(kept, BUCKETS, [], BLOCKS, RECOMPUTE, 2000,
                                          evaluate) is None
    assert trade.trade_recompute_for_kept(_decided(950, 1), BUCKETS, [], BLOCKS, [], 950,
                                          evaluate) is None
    # Every block recomputed and nothing kept is still over the budget.
    assert trade.trade_recompute_for_kept(_decided(550, 4), BUCKETS, [], BLOCKS, RECOMPUTE,
                                          550, evaluate) is None


def test_buckets_that_fit_with_nothing_recomputed_are_left_to_the_first_lever():
    # 1350 B: the three buckets fit with no block recomputed (1300 B): not a trade.
    assert trade.trade_recompute_for_kept(_decided(1350, 0), BUCKETS, [], BLOCKS, RECOMPUTE,
                                          1350, evaluate) is None


def test_a_slower_trade_is_not_taken():
    def slow(kept, recomputed):  # recomputing costs more than keeping saves
        peak, _ = evaluate(kept, recomputed)
        return peak, 50e-3 - 1e-3 * len(kept) + 20e-3 * len(recomputed)

    assert trade.trade_recompute_for_kept(_decided(950, 1), BUCKETS, [], BLOCKS, RECOMPUTE, 950,
                                          slow) is None
