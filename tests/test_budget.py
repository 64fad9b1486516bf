"""The peak budget's pure parts (issue 22): the greedy's decisions against a synthetic peak
model, the plan record's round trip and hash, the option's validation and ``"auto"``."""

from __future__ import annotations

import dataclasses
import operator
import warnings

import pytest
import torch
from torch import fx, nn
from torch.utils.checkpoint import CheckpointPolicy

from shardc.compile.options import ShardcOptions
from shardc.ops.gather import GATHER_OP
from shardc.ops.gather_args import GatherArgs, ReduceArgs
from shardc.planning import budget, recompute
from shardc.planning.budget import Candidate, MemoryBudgetError
from shardc.planning.estimate import elided_cast_bytes, elided_cast_seconds
from shardc.planning.plan import (
    PLAN_VERSION,
    BlockDecision,
    Bucket,
    BucketDecision,
    Collective,
    CollectiveKind,
    MemoryBudget,
    OptimizerDecision,
    Plan,
)
from shardc.planning.profile import resolve_profile

MINIMUM = 1000


def _cands() -> list[Candidate]:
    # Buckets 1-4 cost 100 bytes each and save 1 ms; bucket 5 is small and saves as much
    # (best per byte); bucket 6 saves nothing.
    cands = [Candidate(i, f"b{i}", (f"p{i}",), 1e-3, 100) for i in range(1, 5)]
    return cands + [Candidate(5, "b5", ("p5",), 1e-3, 10), Candidate(6, "b6", ("p6",), 0.0, 50)]


def _model(cost: dict[int, int]):
    """A synthetic peak: the minimum plus each kept bucket's true cost; records the calls."""
    calls = []

    def evaluate(kept: tuple[int, ...]) -> int:
        calls.append(kept)
        return MINIMUM + sum(cost[b] for b in kept)
    return evaluate, calls


@pytest.mark.parametrize("budget_bytes", [MINIMUM, 1005, 1010, 1050, 1110, 1250, 1400, 10**9])
@pytest.mark.parametrize("true_cost", [1.0, 0.3, 1.5])
def test_greedy_stays_within_the_budget(budget_bytes, true_cost):
    """For exact, optimistic and pessimistic byte estimates: the chosen plan's verified peak is
    within the budget, the work is bounded, and the choice is deterministic."""
    cost = {c.bucket: int(c.nbytes * true_cost) for c in _cands()}
    evaluate, calls = _model(cost)
    got = budget.choose(_cands(), [], budget_bytes, MINIMUM, evaluate)
    assert got.peak_bytes <= budget_bytes
    assert got.peak_bytes == MINIMUM + sum(cost[b] for b in got.kept)
    assert got.trials == len(calls) <= budget.MAX_TRIALS
    assert 6 not in got.kept  # saves nothing
    assert [d.bucket for d in got.decisions] == [1, 2, 3, 4, 5, 6]
    again = budget.choose(_cands(), [], budget_bytes, MINIMUM, _model(cost)[0])
    assert again == got


def test_greedy_prefers_time_per_byte_and_keeps_what_fits():
    evaluate, _ = _model({c.bucket: c.nbytes for c in _cands()})
    got = budget.choose(_cands(), [], MINIMUM + 215, MINIMUM, evaluate)
    assert got.kept == [1, 2, 5]  # the small bucket first, then blocks by index
    assert got.peak_bytes == MINIMUM + 210
    everything = budget.choose(_cands(), [], 10**9, MINIMUM, evaluate)
    assert everything.kept == [1, 2, 3, 4, 5]
    nothing = budget.choose(_cands(), [], MINIMUM, MINIMUM, evaluate)
    # Nothing fits: one probe (the best-ranked bucket alone) is verified, then dropped.
    assert nothing.kept == [] and nothing.peak_bytes == MINIMUM and nothing.trials == 1


def test_greedy_learns_that_keeping_costs_less_than_its_bytes():
    """Keeping a bucket often adds less than its bytes to the peak (the backward's re-gather
    buffers it removes were part of it): the trials measure it and keep more."""
    evaluate, _ = _model({c.bucket: c.nbytes // 4 for c in _cands()})
    got = budget.choose(_cands(), [], MINIMUM + 60, MINIMUM, evaluate)
    assert len(got.kept) > 1 and got.peak_bytes <= MINIMUM + 60
    # A block's bytes (100) exceed the slack (30): the probe finds it costs 25.
    probe = [c for c in _cands() if c.bucket != 5]
    got = budget.choose(probe, [], MINIMUM + 30, MINIMUM, evaluate)
    assert got.kept == [1] and got.peak_bytes == MINIMUM + 25


def test_budget_record_round_trips_and_enters_the_hash():
    plan = Plan(PLAN_VERSION, 0, 2, {}, [], [])
    before = plan.hash()
    plan.budget = MemoryBudget(2000, 1000, 1500, 2, [
        BucketDecision(1, "layers.0", True, 0.5, 100, "kept gathered: ...", ["w"]),
        BucketDecision(2, "layers.1", False, 0.5, 100, "resharded: ...", ["v"])])
    assert plan.hash() != before
    back = Plan.from_json(plan.to_json())
    assert back.budget == plan.budget and back.hash() == plan.hash()
    other = Plan.from_json(plan.to_json())
    other.budget.decisions[1].kept = True
    assert other.hash() != plan.hash()
    # Plans without a budget (and older plans) read with none, and hash as before.
    data = plan.to_dict()
    del data["budget"]
    assert Plan.from_dict(data).budget is None and Plan.from_dict(data).hash() == before
    assert "peak budget" in plan.table() and "layers.0: kept" in plan.table()


def _timed(kind: CollectiveKind, bucket: int, ms: float, elided: bool = False) -> Collective:
    return Collective(f"backward.{kind.value}.{bucket}", kind, "backward", bucket, [f"p{bucket}"],
                      400, 400, "float32", "copy", 0, 1, 1, 1, predicted_end_s=ms * 1e-3,
                      elided=elided)


def test_offload_copies_count_as_what_keeping_saves():
    # CPU offload: a bucket the backward gathers again is copied to the device again, so keeping
    # it saves the copy too, even where its gather is elided (one rank).
    plan = Plan(PLAN_VERSION, 0, 1, {}, [], [])
    plan.buckets = [Bucket(i, f"b{i}", [f"p{i}"], [10], [10], [10], "float32", "float32", 1)
                    for i in range(4)]
    gather, copy = CollectiveKind.ALL_GATHER, CollectiveKind.H2D_COPY
    plan.collectives = [_timed(gather, 1, 0.0, elided=True), _timed(gather, 2, 0.0, elided=True),
                        _timed(gather, 3, 1.0)]
    plan.copies = [_timed(copy, 1, 2.0), _timed(copy, 3, 2.0)]
    cands, fixed = budget.candidates(plan)
    assert [(c.bucket, round(c.saved_s * 1e3, 6), round(c.copy_s * 1e3, 6)) for c in cands] == \
        [(1, 2.0, 2.0), (3, 3.0, 2.0)]
    assert [d.bucket for d in fixed] == [2] and "elided" in fixed[0].reason
    decided = budget.choose(cands, fixed, 10**9, MINIMUM, lambda kept: MINIMUM)
    reasons = {d.bucket: d.reason for d in decided.decisions}
    assert decided.kept == [1, 3]
    assert ("0.000 ms of re-casting in the backward (its gathers are elided: one-rank group) "
            "and 2.000 ms of host->device copy") in reasons[1]
    assert "1.000 ms of backward all-gather and 2.000 ms of host->device copy" in reasons[3]


def test_refusal_names_the_minimum_and_its_largest_terms():
    plan = Plan(PLAN_VERSION, 3, 2, {}, [], [])
    plan.memory_by_category = {"peak": {
        "graph": "backward", "position": 7,
        "bytes": {"saved activations": 5 << 20, "optimizer state": 2 << 20, "gradients": 0},
        "largest": [["mm_3", "saved activations", 1 << 20]]}}
    text = str(budget.refuse_below_minimum(1 << 20, 7 << 20, plan))
    for part in ("peak_memory_budget_bytes=1048576", "feasible minimum 7340032 B",
                 "saved activations 5.0 MiB", "optimizer state 2.0 MiB", "mm_3", "region 3"):
        assert part in text, text


def test_peak_budget_option():
    assert ShardcOptions().peak_memory_budget_bytes == 0
    assert ShardcOptions(peak_memory_budget_bytes="auto").peak_memory_budget_bytes == "auto"
    for bad in (-1, "lots", 1.5, True):
        with pytest.raises(ValueError, match="peak_memory_budget_bytes"):
            ShardcOptions(peak_memory_budget_bytes=bad)


def test_auto_budget_needs_cuda():
    with pytest.raises(MemoryBudgetError, match="needs a CUDA device"):
        budget.resolve_budget("auto", torch.device("cpu"))
    assert budget.resolve_budget(12345, torch.device("cpu")) == 12345


def test_auto_budget_follows_the_per_process_memory_fraction(monkeypatch):
    """"auto" plans for what the caching allocator lets this process take: a GPU capped with
    ``set_per_process_memory_fraction`` (shared GPUs, an 80 GB device emulated on a larger
    one) gets a budget under the cap. CUDA's queries are faked: the suite runs without a GPU."""
    props = type("Props", (), {"total_memory": 100 << 30})()
    fraction = {"value": 1.0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction",
                        lambda device: fraction["value"])
    cuda = torch.device("cuda", 0)
    assert budget.resolve_budget("auto", cuda) == (100 << 30) - (10 << 30)  # the 10% margin
    fraction["value"] = 0.5
    assert budget.resolve_budget("auto", cuda) == (50 << 30) - (5 << 30)
    fraction["value"] = 0.1  # 10 GiB: the 2 GiB minimum margin
    assert budget.resolve_budget("auto", cuda) == int(0.1 * (100 << 30)) - (2 << 30)


def test_auto_budget_warns_when_the_allocator_can_fragment(monkeypatch):
    """"auto" plans allocated bytes up to the capacity; without expandable segments the caching
    allocator fragmented the 1b config's large-batch steps on an H200 into out-of-memory errors
    (docs/memory_budget.md), so the user is told how to turn them on."""
    props = type("Props", (), {"total_memory": 100 << 30})()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)
    settings = {"value": ""}
    monkeypatch.setattr(budget._torch, "cuda_allocator_settings", lambda: settings["value"])
    cuda = torch.device("cuda", 0)
    with pytest.warns(UserWarning, match="expandable_segments:True"):
        budget.resolve_budget("auto", cuda)
    settings["value"] = "max_split_size_mb:256,expandable_segments:True"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert budget.resolve_budget("auto", cuda) == (100 << 30) - (10 << 30)
    assert budget.fragmentation_advice("expandable_segments:False") is not None
    assert not budget.expandable_segments_on("max_split_size_mb:256")
    assert budget.expandable_segments_on(" expandable_segments : true ")


def test_memory_plot_draws_the_budget_line():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from shardc.memory.breakdown import CATEGORIES
    from shardc.tools.memory_plot import _draw_step

    plan = Plan(PLAN_VERSION, 0, 2, {}, [], [])
    plan.memory_by_category = {
        "categories": list(CATEGORIES),
        "graphs": {"forward": {"positions": [0, 1],
                               "bytes": {c: [1 << 20, 2 << 20] for c in CATEGORIES}}},
        "peak": {"graph": "forward", "position": 1, "bytes": {c: 2 << 20 for c in CATEGORIES},
                 "largest": []}}
    fig, ax = plt.subplots()
    _draw_step(ax, plan, None)
    assert not [line for line in ax.get_lines() if "peak budget" in line.get_label()]
    plan.budget = MemoryBudget(30 << 20, 14 << 20, 14 << 20)
    fig, ax = plt.subplots()
    _draw_step(ax, plan, None)
    budget_lines = [line for line in ax.get_lines() if "peak budget" in line.get_label()]
    assert len(budget_lines) == 1 and budget_lines[0].get_ydata()[0] == pytest.approx(30 / 1024)
    # The optimizer's state on the host (the last lever): its column says so.
    plan.memory_by_category["graphs"]["optimizer step"] = {
        "positions": [0], "bytes": {c: [1 << 20] for c in CATEGORIES}}
    labels = {}
    for on_host in (False, True):
        plan.budget.optimizer = OptimizerDecision(True, 1, 1, 1, 0.1, 0.1, 0.1, "...") \
            if on_host else None
        fig, ax = plt.subplots()
        _draw_step(ax, plan, None)
        labels[on_host] = [t.get_text() for t in ax.texts if "optimizer step" in t.get_text()]
    assert labels == {False: [" optimizer step"],
                      True: [" optimizer step (state on the host)"]}, labels
    plt.close("all")


def test_keep_all_when_only_keeping_fits():
    """The fully resharded plan over the budget, the fully kept one within it: every bucket
    that saves time is kept, and the record says why."""
    cands = _cands()
    got = budget.keep_all(cands, [], 1500, 1600, 1400)
    assert got.kept == [1, 2, 3, 4, 5] and got.peak_bytes == 1400 and got.minimum_bytes == 1600
    assert all("lowers it" in d.reason for d in got.decisions if d.kept)
    assert [d.bucket for d in got.decisions if not d.kept] == [6]  # saves nothing


# --- Recompute (the second lever) ------------------------------------------------------------

RESHARDED = 2000


def _blocks() -> list[recompute.RecomputeCandidate]:
    # Four equal blocks (ties by position) and one whose recompute is cheap per byte.
    cands = [recompute.RecomputeCandidate(f"layers.{i}", "body", i, 2e-3, 250) for i in range(4)]
    return cands + [recompute.RecomputeCandidate("head", "inline", 4, 1e-4, 100)]


def _recompute_model(freed: dict[str, int]):
    """A synthetic peak: the fully resharded one less what each recomputed block frees."""
    calls = []

    def evaluate(names: tuple[str, ...]) -> int:
        calls.append(names)
        return RESHARDED - sum(freed[n] for n in names)
    return evaluate, calls


def test_recompute_ranks_by_time_per_byte_then_position():
    order = [c.block for c in recompute.rank(_blocks())]
    assert order == ["head", "layers.0", "layers.1", "layers.2", "layers.3"]


@pytest.mark.parametrize("where", [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 0.999])
@pytest.mark.parametrize("true_scale", [1.0, 0.5, 1.6])
def test_recompute_chooses_a_verified_prefix_within_the_budget(where, true_scale):
    """Whatever the error of the byte estimates, for budgets from the fully recomputed plan's
    peak (``where`` 0) to just below the fully resharded one's: the chosen blocks are a prefix
    of the ranking, their verified peak is within the budget, the work is bounded and
    deterministic."""
    cands = _blocks()
    freed = {c.block: int(c.nbytes * true_scale) for c in cands}
    floor = RESHARDED - sum(freed.values())
    budget_bytes = int(floor + where * (RESHARDED - floor))
    evaluate, calls = _recompute_model(freed)
    chosen, peak, trials = recompute.choose(cands, budget_bytes, RESHARDED, floor, evaluate)
    order = [c.block for c in recompute.rank(cands)]
    assert chosen == order[:len(chosen)] and chosen
    assert peak == RESHARDED - sum(freed[n] for n in chosen) <= budget_bytes
    assert trials == len(calls) <= recompute.MAX_TRIALS
    assert (chosen, peak, trials) == recompute.choose(cands, budget_bytes, RESHARDED, floor,
                                                      _recompute_model(freed)[0])


def test_recompute_takes_the_fewest_blocks_when_estimates_are_exact():
    evaluate, _ = _recompute_model({c.block: c.nbytes for c in _blocks()})
    # 350 bytes over: the cheap head block (100) and one layer (250) cover it exactly.
    chosen, peak, _ = recompute.choose(_blocks(), 1650, RESHARDED, 900, evaluate)
    assert chosen == ["head", "layers.0"] and peak == 1650
    chosen, _, _ = recompute.choose(_blocks(), 1999, RESHARDED, 900, evaluate)
    assert chosen == ["head"]


def test_shorter_prefixes_walk_back_while_the_peak_falls():
    """Every candidate freed over the budget: the ranking's prefixes one, two short of every
    candidate are verified while each lowers the peak, at most MAX_SHORTER, stopping at one
    that fits (budget_search.shorter_prefixes; a freed block can raise the peak)."""
    from shardc.compile.budget_search import MAX_SHORTER, shorter_prefixes

    order = recompute.rank(_blocks())  # head, layers.0 ... layers.3
    full = 900

    def walk(peaks: dict[int, int], budget_bytes: int) -> list[tuple[int, int]]:
        calls = []

        def build(names: tuple[str, ...]):
            calls.append(names)
            assert names == tuple(c.block for c in order[:len(names)])  # a prefix
            return None, peaks[len(names)]
        got = shorter_prefixes(order, full, budget_bytes, build)
        assert len(calls) == len(got) <= MAX_SHORTER
        return [(k, peak) for k, _, peak in got]

    # Freeing each of the last two ranked raises the peak: both walked back, no third (the
    # bound), whatever it would peak at.
    assert walk({4: 880, 3: 870, 2: 10}, 100) == [(4, 880), (3, 870)]
    # The first step does not lower the peak: no second.
    assert walk({4: 905, 3: 800}, 100) == [(4, 905)]
    # The first step fits: no second (the caller searches the prefixes below it).
    assert walk({4: 880, 3: 870}, 890) == [(4, 880)]
    # One candidate: no shorter prefix than every one but none (the resharded plan).
    assert shorter_prefixes(order[:1], full, 100, lambda names: (None, 0)) == []


def test_blocks_are_freed_at_a_deeper_depth_where_the_shallowest_is_refused():
    """budget_search._free_at_some_depth: the shallowest depth first; a deeper one searched
    with the lowest minimum refused so far (it gives up at or above it); the decisions of the
    first depth that fits, else the refusal naming the lowest minimum."""
    from shardc.compile.budget_search import _free_at_some_depth

    def free(minima: dict[int, int | None], budget_bytes: int = 100):
        asked = []

        def free_at(depth: int, give_up_at: int | None):
            asked.append((depth, give_up_at))
            if minima[depth] is None or minima[depth] <= budget_bytes:
                return f"fits at {depth}"
            raise budget.refuse_below_minimum(budget_bytes, minima[depth],
                                              Plan(PLAN_VERSION, 0, 2, {}, [], []))
        try:
            return _free_at_some_depth(free_at, sorted(minima)), asked
        except MemoryBudgetError as refused:
            return refused.minimum_bytes, asked

    assert free({0: None, 1: 150}) == (("fits at 0", 0), [(0, None)])
    assert free({0: 300, 1: 90}) == (("fits at 1", 1), [(0, None), (1, 300)])
    assert free({0: 300, 1: 250, 2: 280}) == (250, [(0, None), (1, 300), (2, 250)])
    assert free({0: 300, 1: 300}) == (300, [(0, None), (1, 300)])  # a tie: the shallowest's


def test_recompute_decisions_say_why():
    from shardc.passes.recompute import Block

    blocks = [Block(f"layers.{i}", "body", i, (), 300, 50) for i in range(4)]
    blocks.append(Block("layers.4", "inline", 4, (), 300, 50, excluded="it draws random numbers"))
    cands = [c for c in _blocks() if c.block != "head"]
    got = recompute.decisions(blocks, cands, ["layers.0"], needed=True, peak=1500)
    assert [d.recomputed for d in got] == [True, False, False, False, False]
    assert got[0].reason.startswith("recomputed") and "rank 1 of 4" in got[0].reason
    assert got[0].cost_ms == pytest.approx(2.0) and got[0].bytes == 250
    assert "ranked 2 of 4" in got[1].reason and "random" in got[4].reason
    idle = recompute.decisions(blocks, [], [], needed=False)
    assert not any(d.recomputed for d in idle) and "without recomputing" in idle[0].reason


def test_recompute_record_round_trips_and_enters_the_hash():
    plan = Plan(PLAN_VERSION, 0, 2, {}, [], [])
    plan.budget = MemoryBudget(2000, 1000, 1500, 2, [], [
        BlockDecision("layers.0", "body", True, 0.5, 100, "recomputed: ..."),
        BlockDecision("layers.1", "body", False, 0.5, 100, "saved: ...")], resharded_bytes=1800)
    before = plan.hash()
    back = Plan.from_json(plan.to_json())
    assert back.budget == plan.budget and back.hash() == before
    assert back.budget.recomputed == ["layers.0"]
    back.budget.blocks[1].recomputed = True
    assert back.hash() != before
    text = plan.table()
    assert "1 of 2 block(s) recomputed" in text and "block layers.0 (body): recomputed" in text


# --- Activation offload (the third lever) -----------------------------------------------------

MiB = 1 << 20


def test_offload_is_chosen_when_the_copies_hide_and_recompute_when_they_do_not():
    """Per block, the cheaper way per byte freed: a block whose forward takes 10 ms and saves
    100 MiB (recomputing it frees 90 MiB). Over a fast link its copies (about 4 ms each way)
    hide behind compute and offloading costs nothing: offload. Over a slow one (about 42 ms
    each way) the copies' exposed part (32 + 22 ms) costs more per byte than the 10 ms
    forward: recompute."""
    from shardc.planning.offload import choose_lever
    from shardc.planning.profile import HostLink

    block = dict(forward_s=10e-3, recompute_bytes=90 * MiB, offload_bytes=100 * MiB,
                 can_recompute=True)
    fast_link, slow_link = HostLink(25e9, 25e9, 10e-6), HostLink(2.5e9, 2.5e9, 10e-6)
    fast = choose_lever(**block, link=fast_link)
    assert fast.offload and fast.cost_s == 0.0 and fast.nbytes == 100 * MiB
    assert fast.copy_s == pytest.approx(10e-6 + 100 * MiB / 25e9)
    slow = choose_lever(**block, link=slow_link)
    assert not slow.offload and slow.cost_s == 10e-3 and slow.nbytes == 90 * MiB
    copy = 10e-6 + 100 * MiB / 2.5e9
    assert slow.offload_s == pytest.approx((copy - 10e-3) + (copy - 20e-3))
    # The modes: never offload; offload whatever can be; a block that cannot be recomputed
    # (random numbers, collectives) can still be offloaded, even over the slow link.
    assert not choose_lever(**block, link=fast_link, mode="never").offload
    assert choose_lever(**block, link=slow_link, mode="prefer").offload
    fixed = choose_lever(**{**block, "can_recompute": False}, link=slow_link)
    assert fixed.offload and fixed.recompute_s == 0.0
    assert choose_lever(**{**block, "can_recompute": False}, link=slow_link,
                        mode="never") is None
    with pytest.raises(ValueError, match="activation_offload"):
        choose_lever(**block, link=fast_link, mode="always")


def test_offload_and_recompute_rank_together_and_the_record_says_why():
    """Offloaded candidates rank with recomputed ones by ms per byte; the decisions carry both
    prices, the record round-trips, and the offloaded blocks enter the plan hash only when
    there are any (plans without them hash as before)."""
    from shardc.passes.recompute import Block

    cands = [recompute.RecomputeCandidate("layers.0", "body", 0, 0.0, 300, offload=True,
                                          forward_s=2e-3, copy_s=1e-3, offload_s=0.0),
             recompute.RecomputeCandidate("layers.1", "body", 1, 2e-3, 250, forward_s=2e-3,
                                          copy_s=5e-3, offload_s=4e-3)]
    assert [c.block for c in recompute.rank(cands)] == ["layers.0", "layers.1"]
    blocks = [Block(f"layers.{i}", "body", i, (), 300, 50) for i in range(2)]
    got = recompute.decisions(blocks, cands, ["layers.0", "layers.1"], needed=True, peak=1500)
    assert [(d.offloaded, d.recomputed) for d in got] == [(True, False), (False, True)]
    assert got[0].reason.startswith("offloaded") and "to recompute it" in got[0].reason
    assert got[0].cost_ms == pytest.approx(2.0) and got[0].copy_ms == pytest.approx(1.0)
    assert "cheaper than offloading it" in got[1].reason and got[1].offload_ms == pytest.approx(4)
    plan = Plan(PLAN_VERSION, 0, 2, {}, [], [])
    plan.budget = MemoryBudget(2000, 1000, 1500, 2, [], recompute.decisions(
        blocks, cands, ["layers.1"], needed=True, peak=1500))
    before = plan.hash()
    plan.budget.blocks = got
    back = Plan.from_json(plan.to_json())
    assert back.budget == plan.budget and back.budget.offloaded == ["layers.0"]
    assert back.hash() == plan.hash() != before
    assert "1 offloaded to host memory" in plan.table()
    assert "block layers.0 (body): offloaded" in plan.table()
    # A record written before offload existed (no such fields) reads as offloading nothing.
    old = plan.to_dict()["budget"]
    for d in old["blocks"]:
        for key in ("offloaded", "offload_ms", "copy_ms"):
            d.pop(key)
    assert MemoryBudget.from_dict(old).offloaded == []


def test_a_blocks_hidden_part_is_first_fit_by_decreasing_size():
    """Per saved activation: the values whose copies the block's forward hides, the largest
    first, skipping one that would not fit; none where not even the smallest fits."""
    from shardc.planning.offload import hidden_part, offload_seconds
    from shardc.planning.profile import HostLink

    link = HostLink(1e9, 1e9, 0.0)  # 1 ms per MB each way
    sizes = [400_000, 3_000_000, 500_000, 2_000_000]  # 0.4, 3, 0.5, 2 ms to copy
    # 2.45 ms of forward: 3 MB does not fit; 2 MB does, then not 0.5 MB (2.5 ms) but 0.4 MB.
    got = hidden_part(sizes, 2.45e-3, link)
    assert got == (0, 3)
    total = sum(sizes[i] for i in got)
    assert offload_seconds(link.copy_seconds(total, False), 2.45e-3,
                           link.copy_seconds(total, True)) == 0.0
    assert hidden_part(sizes, 10e-3, link) == (0, 1, 2, 3)  # all of them: the whole block
    assert hidden_part(sizes, 0.3e-3, link) == ()
    assert hidden_part([0, 100], 1.0, link) == (1,)  # an empty value is never copied
    # Ties by index: the same answer on every rank for the same agreed sizes.
    assert hidden_part([5, 5, 5], 10e-9, HostLink(1e9, 1e9, 0.0)) == (0, 1)


def test_a_part_offloaded_ranks_first_and_the_record_names_it():
    """A block's hidden part is a candidate of no exposed time: it ranks before any block freed
    whole; chosen without its block, the record offloads it in part (its values' indices, its
    bytes, why, and the block's own rank), the plan names it ``block#i.j`` and hashes it, and
    the record round-trips; with its block chosen whole the part is not offloaded."""
    from shardc.compile.budget_search import without_covered_parts
    from shardc.passes.recompute import Block
    from shardc.planning.plan import part_name, split_part

    assert part_name("layers.3", (4, 0)) == "layers.3#0.4"
    assert split_part("layers.3#0.4") == ("layers.3", (0, 4))
    assert split_part("layers.3") == ("layers.3", None)
    assert without_covered_parts(["a#1", "b#0.2", "b"]) == ("a#1", "b")

    values = tuple(fx.Graph().placeholder(f"v{i}") for i in range(3))
    blocks = [Block(f"layers.{i}", "body", i, (), 300, 50, saved_values=values)
              for i in range(2)]
    cands = [recompute.RecomputeCandidate("layers.0", "body", 0, 2e-3, 250, forward_s=2e-3,
                                          copy_s=5e-3, offload_s=4e-3),
             recompute.RecomputeCandidate("layers.1", "body", 1, 2e-3, 250, forward_s=2e-3,
                                          copy_s=5e-3, offload_s=4e-3),
             recompute.RecomputeCandidate("layers.1#0.2", "body", 1, 0.0, 120, offload=True,
                                          forward_s=2e-3, copy_s=1.5e-3, offload_s=0.0)]
    assert recompute.rank(cands)[0].block == "layers.1#0.2"
    got = recompute.decisions(blocks, cands, ["layers.1#0.2", "layers.0"], needed=True,
                              peak=1500)
    assert [(d.recomputed, d.offloaded, d.offloaded_part) for d in got] == [
        (True, False, ()), (False, True, (0, 2))]
    part = got[1]
    assert part.bytes == 120 and part.offload_ms == 0.0 and part.copy_ms == pytest.approx(1.5)
    assert part.reason.startswith("offloaded in part: 2 of its 3 saved values")
    assert "rank 1 of 3" in part.reason and "the block whole ranked 3 of 3" in part.reason
    plan = Plan(PLAN_VERSION, 0, 2, {}, [], [])
    plan.budget = MemoryBudget(2000, 1000, 1500, 2, [], got)
    assert plan.budget.offloaded == ["layers.1#0.2"]
    back = Plan.from_json(plan.to_json())
    assert back.budget == plan.budget and back.hash() == plan.hash()
    assert "block layers.1 (body): 2 saved value(s) offloaded" in plan.table()
    whole = recompute.decisions(blocks, cands, ["layers.1#0.2", "layers.1"], needed=True,
                                peak=1500)[1]
    assert whole.recomputed and not whole.offloaded and whole.offloaded_part == ()


def test_parts_are_dropped_where_the_blocks_freed_whole_fit_alone():
    """The ranking's prefix takes every part before any block freed whole; where those blocks
    fit the budget without the parts (one more trial), the parts are dropped; where they do
    not, or nothing is freed whole, the prefix stays."""
    from shardc.compile.budget_search import without_needless_parts

    tried = []

    def evaluate(names):
        tried.append(names)
        return 90 if names == ("layers.2",) else 120

    chosen = ["layers.0#1", "layers.1#0.2", "layers.2"]
    assert without_needless_parts(chosen, 80, 100, evaluate) == (["layers.2"], 90)
    assert tried == [("layers.2",)]
    assert without_needless_parts(chosen, 80, 85, evaluate) == (chosen, 80)
    tried.clear()
    assert without_needless_parts(["layers.0#1"], 80, 100, evaluate) == (["layers.0#1"], 80)
    assert without_needless_parts(["layers.2"], 90, 100, evaluate) == (["layers.2"], 90)
    assert tried == []


def test_part_candidates_and_what_the_host_takes_of_them():
    """Per block, the hidden part as a candidate of no exposed time (over one rank the sizes
    are the block's own), none where the block's whole offload is hidden already, none under
    ``activation_offload='never'`` or ``'prefer'``; a host that cannot hold a part leaves it
    out (no note, no recompute in its place), while a block's own offload left out is
    recomputed instead."""
    from types import SimpleNamespace

    from shardc.compile.budget_search import fit_offloads, part_candidates
    from shardc.compile.host_memory import HostCapacity
    from shardc.passes.recompute import Block
    from shardc.planning.profile import HostLink

    def value(nbytes):
        node = fx.Graph().placeholder("v")
        node.meta["val"] = torch.empty(nbytes // 4)
        return node

    link = HostLink(1e9, 1e9, 0.0)  # 1 ms per MB
    sizes = [2_000_000, 500_000, 300_000]  # 2, 0.5, 0.3 ms to copy
    blocks = [Block(f"layers.{i}", "body", i, (), sum(sizes), 0,
                    saved_values=tuple(value(n) for n in sizes)) for i in range(2)]
    estimates = {"layers.0": (2_000_000, sum(sizes), 1e-3), "layers.1": (2_000_000, sum(sizes),
                                                                         10e-3)}
    region = SimpleNamespace(check_index=None)
    wholes = [recompute.RecomputeCandidate("layers.0", "body", 0, 1e-3, 2_000_000,
                                           forward_s=1e-3, copy_s=2.8e-3, offload_s=1.8e-3),
              recompute.RecomputeCandidate("layers.1", "body", 1, 0.0, 2_800_000, offload=True,
                                           forward_s=10e-3, copy_s=2.8e-3, offload_s=0.0)]
    parts = part_candidates(blocks, wholes, estimates, "auto", link, "", region)
    # layers.0: 1 ms of forward hides 0.5 + 0.3 MB, not the 2 MB; layers.1's whole is hidden.
    assert [(c.block, c.nbytes, c.cost_s, c.offload) for c in parts] == [
        ("layers.0#1.2", 800_000, 0.0, True)]
    for mode in ("never", "prefer"):  # nothing offloaded; blocks offloaded whole
        assert part_candidates(blocks, wholes, estimates, mode, link, "", region) == []
    capacity = HostCapacity(per_rank=1_000_000, available=1_000_000, ranks=1)
    kept, notes = fit_offloads(wholes + parts, blocks, link, 1_000_000, capacity)
    # The part fits the host's room (most time saved per byte); layers.1's whole offload does
    # not, so it is recomputed instead, and its record will say why (the note).
    assert [(c.block, c.offload) for c in kept] == [
        ("layers.0", False), ("layers.1", False), ("layers.0#1.2", True)]
    assert set(notes) == {"layers.1"}
    kept, notes = fit_offloads(wholes + parts, blocks, link, 500_000, capacity)
    assert "layers.0#1.2" not in [c.block for c in kept] and "layers.0#1.2" not in notes


def test_block_groups_offload_a_parts_values_only():
    """``block_groups`` maps a part's name to the values it names, grouped under its block;
    a block named whole, or recomputed, offloads no part of its own."""
    from shardc.passes.offload_saved import block_groups
    from shardc.passes.recompute import Block

    class Three(nn.Module):
        def forward(self, x):
            a = torch.sin(x)
            b = torch.cos(a)
            c = torch.exp(b)
            return (a, b, c)

    fw = fx.symbolic_trace(Three())
    for n in fw.graph.nodes:
        n.meta["val"] = torch.ones(4)
    a, b, c = [n for n in fw.graph.nodes if n.op == "call_function"]
    block = Block("layers.0", "inline", 0, (a, b, c), 48, 16, saved_values=(a, b, c))
    assert block_groups(fw, 0, [block], ["layers.0#0.2"]) == {"sin": "layers.0",
                                                               "exp": "layers.0"}
    assert set(block_groups(fw, 0, [block], ["layers.0#0.2", "layers.0"])) == {"sin", "cos",
                                                                              "exp"}
    assert block_groups(fw, 0, [block], ["layers.0#1"], recomputed=["layers.0"]) == {}


def test_activation_offload_option():
    assert ShardcOptions().activation_offload == "auto"
    assert ShardcOptions(activation_offload=["layers.0"]).forced_offload() == ("layers.0",)
    assert ShardcOptions(activation_offload="prefer").forced_offload() == ()
    for bad in ("always", (), ("",), 3):
        with pytest.raises(ValueError, match="activation_offload"):
            ShardcOptions(activation_offload=bad)
    with pytest.raises(ValueError, match="cannot be combined with peak_memory_budget_bytes"):
        ShardcOptions(activation_offload=("*",), peak_memory_budget_bytes=1 << 30)


def test_checkpoint_offload_option():
    """``activation_offload``'s ``"checkpoint:<block>"`` entries force recompute with the
    checkpoint offloaded (no budget), apart from the plain names (offload)."""
    both = ShardcOptions(activation_offload=("checkpoint:*", "layers.0"))
    assert both.forced_checkpoint_offload() == ("*",) and both.forced_offload() == ("layers.0",)
    only = ShardcOptions(activation_offload=["checkpoint:layers.1"])
    assert only.forced_checkpoint_offload() == ("layers.1",) and only.forced_offload() == ()
    assert ShardcOptions(activation_offload="auto").forced_checkpoint_offload() == ()
    with pytest.raises(ValueError, match="activation_offload"):
        ShardcOptions(activation_offload=("checkpoint:",))
    with pytest.raises(ValueError, match="cannot be combined with peak_memory_budget_bytes"):
        ShardcOptions(activation_offload=("checkpoint:*",), peak_memory_budget_bytes=1 << 30)


def test_checkpoints_offloaded_say_why_round_trip_and_enter_the_hash():
    """The combined lever's record: every block recomputed, the checkpoints of the first
    ranked offloaded (each with its bytes, exposed and copy ms, and why), the others kept on
    the device saying so; the record round-trips, the text says it, and the blocks enter the
    plan hash only when a checkpoint is offloaded: a record without the fields (a plan made
    before them) reads as offloading none and hashes as before."""
    from shardc.passes.recompute import Block

    blocks = [Block(f"layers.{i}", "body", i, (), 300, 50) for i in range(3)]
    cands = [recompute.RecomputeCandidate(b.name, "body", i, 2e-3, 250, forward_s=2e-3)
             for i, b in enumerate(blocks)]
    checkpoints = [recompute.RecomputeCandidate(b.name, "body", i, 0.0, 50, offload=True,
                                                forward_s=2e-3, copy_s=1e-3, offload_s=0.0)
                   for i, b in enumerate(blocks)]
    # Equal prices: the earliest blocks' checkpoints (alive longest) first.
    assert [c.block for c in recompute.rank(checkpoints)] == ["layers.0", "layers.1",
                                                               "layers.2"]
    every = [b.name for b in blocks]
    got = recompute.decisions(blocks, cands, every, needed=True, peak=1500,
                              checkpoints=checkpoints, checkpointed=["layers.0", "layers.1"],
                              freed_peak=2 << 20)
    assert [(d.recomputed, d.checkpoint_offloaded) for d in got] == [(True, True)] * 2 + [
        (True, False)]
    assert all(d.checkpoint_bytes == 50 and d.checkpoint_copy_ms == pytest.approx(1.0)
               and d.checkpoint_ms == 0.0 for d in got)
    assert "its checkpoint (~0.00 MiB: its input" in got[0].reason
    assert "left the predicted peak at 2.0 MiB, over the budget" in got[0].reason
    assert "rank 1 of 3 by ms per MiB" in got[0].reason.split("its checkpoint")[1]
    assert "stays on the device: ranked 3 of 3" in got[2].reason
    plan = Plan(PLAN_VERSION, 0, 2, {}, [], [])
    plan.budget = MemoryBudget(2000, 1000, 1500, 2, [], recompute.decisions(
        blocks, cands, every, needed=True, peak=1500))
    before = plan.hash()
    plan.budget.blocks = got
    back = Plan.from_json(plan.to_json())
    assert back.budget == plan.budget
    assert back.budget.checkpoint_offloaded == ["layers.0", "layers.1"]
    assert back.budget.recomputed == every and back.budget.offloaded == []
    assert back.hash() == plan.hash() != before
    text = plan.table()
    assert "2 of them with their checkpoints offloaded" in text
    assert "block layers.0 (body): recomputed, checkpoint offloaded" in text
    assert "block layers.2 (body): recomputed, costs" in text
    old = plan.to_dict()["budget"]
    for d in old["blocks"]:
        for key in ("checkpoint_offloaded", "checkpoint_bytes", "checkpoint_ms",
                    "checkpoint_copy_ms"):
            d.pop(key)
    plan.budget = MemoryBudget.from_dict(old)
    assert plan.budget.checkpoint_offloaded == [] and plan.hash() == before


def test_refusal_names_the_checkpoints_offloaded_minimum():
    plan = Plan(PLAN_VERSION, 3, 2, {}, [], [])
    plan.memory_by_category = {"peak": {"graph": "backward", "position": 9,
                                        "bytes": {"temporaries": 3 << 20}, "largest": []}}
    text = str(budget.refuse_below_minimum(1 << 20, 3 << 20, plan, recomputed=4,
                                           checkpoints=4))
    assert "every block that can be recomputed (4) recomputed in the backward and the " \
        "checkpoints of those recomputed (4) offloaded to host memory" in text


def test_refusal_names_the_offloaded_minimum():
    plan = Plan(PLAN_VERSION, 3, 2, {}, [], [])
    plan.memory_by_category = {"peak": {"graph": "backward", "position": 9,
                                        "bytes": {"temporaries": 3 << 20}, "largest": []}}
    text = str(budget.refuse_below_minimum(1 << 20, 3 << 20, plan, recomputed=1, offloaded=3))
    assert "every block that can be recomputed (1) recomputed in the backward" in text
    assert "every block that can be offloaded (3) offloaded to host memory" in text


def test_refusal_names_a_shorter_prefix_minimum():
    plan = Plan(PLAN_VERSION, 3, 2, {}, [], [])
    plan.memory_by_category = {"peak": {"graph": "backward", "position": 9,
                                        "bytes": {"temporaries": 3 << 20}, "largest": []}}
    text = str(budget.refuse_below_minimum(1 << 20, 3 << 20, plan, recomputed=3, left_out=1))
    assert "every candidate block but the last 1 by the ranking freed (3 recomputed in the " \
        "backward, 0 offloaded to host memory; freeing those too raises the peak)" in text
    assert "every block that can be recomputed" not in text


def test_refusal_names_the_fully_recomputed_minimum():
    plan = Plan(PLAN_VERSION, 3, 2, {}, [], [])
    plan.memory_by_category = {"peak": {"graph": "backward", "position": 9,
                                        "bytes": {"temporaries": 3 << 20}, "largest": []}}
    text = str(budget.refuse_below_minimum(1 << 20, 3 << 20, plan, recomputed=4))
    assert "feasible minimum 3145728 B" in text
    assert "every block that can be recomputed (4) recomputed in the backward" in text


def _joint(dropout_in_block: int | None = None) -> fx.GraphModule:
    """A hand-made joint graph: three inline blocks ``layers.i`` (mm, relu, and in one of them
    a random op), a forward output and a backward that reads every block's values."""
    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("primals_1")
    w = g.placeholder("primals_2")
    tangent = g.placeholder("tangents_1")
    x.meta["val"], w.meta["val"] = torch.zeros(4, 8), torch.zeros(8, 8)
    tangent.meta["val"] = torch.zeros(4, 8)
    h, saved = x, []
    for i in range(3):
        stack = {f"id{i}": (f"L['self'].layers[{i}]", nn.Module)}
        mm = g.call_function(aten.mm.default, (h, w))
        act = g.call_function(aten.relu.default, (mm,))
        nodes = [mm, act]
        if i == dropout_in_block:
            drop = g.call_function(aten.native_dropout.default, (act, 0.5, True))
            act = g.call_function(operator.getitem, (drop, 0))
            nodes += [drop, act]
        attention = g.call_function(aten._scaled_dot_product_flash_attention_for_cpu.default,
                                    (act, act, act, 0.0))
        act = g.call_function(operator.getitem, (attention, 0))
        nodes += [attention, act]
        for n in nodes:
            n.meta["nn_module_stack"] = stack
            n.meta["val"] = torch.zeros(4, 8)
        saved.append(mm)
        h = act
    grad = tangent
    for mm in reversed(saved):
        grad = g.call_function(aten.mul.Tensor, (grad, mm))
        grad.meta["val"] = torch.zeros(4, 8)
    g.output((h, grad))
    return fx.GraphModule(nn.Module(), g)


def test_blocks_are_found_by_module_and_random_ones_excluded():
    from shardc.passes.recompute import RECOMPUTE_BASE_ID, find_blocks, recompute_blocks

    names = ["layers.0", "layers.1", "layers.2"]
    blocks = find_blocks(_joint(), 1, [], names)
    assert [b.name for b in blocks] == names and [b.position for b in blocks] == [0, 1, 2]
    # SDPA with dropout_p=0 draws nothing: every block is a candidate.
    assert not any(b.excluded for b in blocks)
    assert all(b.saved_bytes == 4 * 8 * 4 for b in blocks)  # the mm the backward reads
    gm = _joint(dropout_in_block=1)
    blocks = find_blocks(gm, 1, [], names)
    assert "random" in blocks[1].excluded and not blocks[0].excluded
    with pytest.raises(ValueError, match="layers.1 cannot be recomputed"):
        recompute_blocks(gm, blocks, {"layers.1"})
    assert recompute_blocks(gm, blocks, {"layers.0", "layers.2"}) == 2
    ids = {n.meta.get("ac_graph_id") for n in blocks[2].nodes}
    assert ids == {RECOMPUTE_BASE_ID + 2}
    # A recomputed block's output that later forward nodes read (layers.0's; layers.2's is
    # only the graph's output) is saved through a must-save copy, which they now read.
    copies = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert len(copies) == 1 and copies[0].meta["recompute"] == CheckpointPolicy.MUST_SAVE
    assert copies[0].args[0] is blocks[0].outputs[0]
    assert all(u not in blocks[0].nodes for u in copies[0].users) and copies[0].users
    assert not any(n.meta.get("recompute") for n in blocks[1].nodes)


def test_checkpoints_are_the_inputs_no_other_block_reads():
    """A block's checkpoint (what it still saves when recomputed): the activations it reads
    from outside, not weights or graph inputs, that no other block reads; after
    ``recompute_blocks``, the boundary copy of the block before it. Its bytes are what
    offloading it frees."""
    from shardc.passes.offload_saved import block_groups
    from shardc.passes.recompute import (
        checkpoint_bytes,
        checkpoint_inputs,
        find_blocks,
        recompute_blocks,
    )

    names = ["layers.0", "layers.1", "layers.2"]
    gm = _joint()
    blocks = find_blocks(gm, 1, [], names)
    before = checkpoint_inputs(blocks)
    assert before["layers.0"] == []  # its input is the graph's (a placeholder)
    assert [n.name for n in before["layers.1"]] == [blocks[0].outputs[0].name]
    assert checkpoint_bytes(blocks) == {"layers.0": 0, "layers.1": 4 * 8 * 4,
                                        "layers.2": 4 * 8 * 4}
    recompute_blocks(gm, blocks, set(names))
    after = checkpoint_inputs(blocks)
    copies = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert after["layers.1"] == [copies[0]] and after["layers.2"] == [copies[1]]
    for copy in copies:  # (no fake mode in this hand-made graph: the copies get no value)
        copy.meta["val"] = torch.zeros(4, 8)
    # The lowering's groups: a block named both recomputed and offloaded offloads its
    # checkpoint under its own name (here on the joint graph's forward, as if partitioned:
    # every node is "saved").
    fw = fx.GraphModule(nn.Module(), fx.Graph())
    graph = fw.graph
    env = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output((env[copies[0]], env[copies[1]], env[blocks[0].nodes[0]]))
    fw.recompile()
    groups = block_groups(fw, 0, blocks, {"layers.1", "layers.2"}, recomputed=set(names))
    assert groups == {copies[0].name: "layers.1", copies[1].name: "layers.2"}
    # Offloaded without recompute: the block's own saved values instead.
    assert block_groups(fw, 0, blocks, {"layers.0"}) == {blocks[0].nodes[0].name: "layers.0"}


# --- The margin for the prediction's error ---------------------------------------------------


@pytest.mark.parametrize("margin", [0.0, 0.005, 0.02, 0.1])
@pytest.mark.parametrize("minimum", [1, 999, 1000, 7 << 20, 61_234_567_891])
def test_margin_arithmetic(margin, minimum):
    """The planned-for bytes leave the margin: a predicted peak within them, measured up to
    ``margin`` higher, is within the budget; the smallest budget accepted is exact."""
    for budget_bytes in (minimum, minimum + 17, 3 * minimum + 5):
        target = budget.planned_for(budget_bytes, margin)
        assert target <= budget_bytes and target * (1 + margin) <= budget_bytes * (1 + 1e-12)
        assert budget_bytes - target <= margin * (target + 1) + 1  # target = floor(B / (1+m))
    smallest = budget.smallest_budget(minimum, margin)
    assert budget.planned_for(smallest, margin) >= minimum
    assert smallest == minimum or budget.planned_for(smallest - 1, margin) < minimum
    assert smallest >= minimum * (1 + margin) - 1


def test_margin_option():
    assert ShardcOptions().peak_memory_margin == 0.02
    assert ShardcOptions(peak_memory_margin=0).peak_memory_margin == 0
    for bad in (-0.01, 1.0, 2, "2%", True):
        with pytest.raises(ValueError, match="peak_memory_margin"):
            ShardcOptions(peak_memory_margin=bad)


def test_refusal_names_the_smallest_budget_with_the_margin():
    plan = Plan(PLAN_VERSION, 3, 2, {}, [], [])
    plan.memory_by_category = {"peak": {"graph": "backward", "position": 9,
                                        "bytes": {"temporaries": 3 << 20}, "largest": []}}
    minimum = 3 << 20
    text = str(budget.refuse_below_minimum(minimum, minimum, plan, recomputed=4, margin=0.02))
    smallest = budget.smallest_budget(minimum, 0.02)
    assert smallest == 3208643  # 3 MiB * 1.02, rounded up
    target = budget.planned_for(minimum, 0.02)
    for part in (f"peak_memory_budget_bytes={minimum} (3.0 MiB) less its margin for the "
                 f"prediction's error (2.0%, peak_memory_margin: {minimum - target} B) leaves "
                 f"{target} B", f"feasible minimum {minimum} B",
                 f"the smallest budget accepted is {smallest} B (3.1 MiB, the minimum plus the "
                 "2.0% margin)", "every block that can be recomputed (4)"):
        assert part in text, text
    plain = str(budget.refuse_below_minimum(minimum - 1, minimum, plan))
    assert "margin" not in plain and f"smallest budget accepted is {minimum} B" in plain


def test_margin_record_round_trips_and_enters_the_hash():
    plan = Plan(PLAN_VERSION, 0, 2, {}, [], [])
    plan.budget = MemoryBudget(2000, 1000, 1500, 2, [
        BucketDecision(1, "layers.0", True, 0.5, 100, "kept gathered: ...", ["w"])])
    no_margin = plan.hash()
    budget.with_margin(plan.budget, 2040, 0.02)
    assert plan.budget.budget_bytes == 2040 and plan.budget.margin_bytes == 40
    assert plan.budget.planned_bytes == 2000 and plan.budget.margin_fraction == 0.02
    back = Plan.from_json(plan.to_json())
    assert back.budget == plan.budget and back.hash() == plan.hash() != no_margin
    data = plan.to_dict()
    assert data["budget"]["margin_bytes"] == 40 and data["budget"]["budget_bytes"] == 2040
    # A plan written before the margin (no such fields) reads with none, its hash unchanged.
    for key in ("margin_bytes", "margin_fraction"):
        del data["budget"][key]
    data["budget"]["budget_bytes"] = 2000
    old = Plan.from_dict(data)
    assert old.budget.margin_bytes == 0 and old.budget.planned_bytes == 2000
    assert old.hash() == no_margin
    text = plan.table()
    assert "peak budget" in text and "less a 2.0% margin" in text and "planned for" in text


def test_planner_meets_the_budget_less_the_margin():
    """The real budget planner (a plan of a tiny model at a fake world of 2, FX): a 1-byte
    budget is refused naming the smallest budget accepted (the feasible minimum plus the 2 %
    margin); at exactly that budget the plan is made, for the budget less the margin, and its
    predicted peak is within that."""
    import re

    from shardc.models.llama import LlamaConfig
    from shardc.tools.planner import PlanSetup, plan_model

    cfg = LlamaConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, max_seq_len=8)

    def plan(budget_bytes: int) -> Plan:
        return plan_model(cfg, 2, 1, 8, {"peak_memory_budget_bytes": budget_bytes},
                          template=False, setup=PlanSetup(inductor=False))[0]

    with pytest.raises(Exception, match="smallest budget accepted") as refused:
        plan(1)
    text = str(refused.value)
    minimum = int(re.search(r"feasible minimum (\d+) B", text).group(1))
    smallest = int(re.search(r"smallest budget accepted is (\d+) B", text).group(1))
    assert smallest == budget.smallest_budget(minimum, 0.02) > minimum
    record = plan(smallest).budget
    assert record.budget_bytes == smallest and record.margin_fraction == 0.02
    assert record.planned_bytes == budget.planned_for(smallest, 0.02) >= minimum
    assert record.margin_bytes == smallest - record.planned_bytes > 0
    assert record.peak_bytes <= record.planned_bytes


# Slow (54 s: four plans and a shared-partition check): the planner's prefetch lever, both
# depths tried and the chosen one in the record, text and hash, is also asserted by
# test_real_models.py::test_peak_budget_keeps_some_buckets_gathered_with_parity (world 2).
@pytest.mark.slow
def test_the_prefetch_depth_flips_with_the_budget(monkeypatch):
    """The prefetch lever (shardc.planning.prefetch) through the real planner (a tiny model at
    a fake world of 2, FX, over a slow interconnect: the cost model exposes the all-gathers).
    The optimizer's state stays on the device (``optimizer_offload="never"``), so the device's
    levers alone decide. A 1-byte budget is refused, carrying the fully resharded plan's peak at
    each depth (with no prefetch lower than at the options' depth, one bucket ahead) and naming
    the minimum (every block recomputed, lower still); at exactly the no-prefetch peak no
    prefetch is chosen (memory short: nothing recomputed); with room, prefetching two buckets
    ahead is predicted fastest and chosen; the choice is in the record, the text, the hash and
    the plan's options. The trials of the two depths share one partition (the real build takes
    it), and the plan and its graphs are those made partitioning every trial anew."""
    from shardc.models.llama import LlamaConfig
    from shardc.tools.planner import PlanSetup, plan_model

    cfg = LlamaConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=8)

    def plan(budget_bytes: int) -> Plan:
        # The levers in order (recompute_to_keep_gathered off): at the no-prefetch peak the
        # trade would recompute blocks to keep buckets, which the next tests cover.
        return plan_model(cfg, 2, 1, 8, {"peak_memory_budget_bytes": budget_bytes,
                                         "peak_memory_margin": 0.0,
                                         "optimizer_offload": "never",
                                         "recompute_to_keep_gathered": False,
                                         "cluster": {"bus_bandwidth": 1e7}},
                          template=False, setup=PlanSetup(inductor=False))[0]

    with pytest.raises(Exception, match="with no prefetch") as refused:
        plan(1)
    cause = refused.value
    while not isinstance(cause, budget.MemoryBudgetError):
        cause = cause.__cause__ or cause.inner_exception
    shallow = cause.resharded_by_depth[0]
    assert cause.minimum_bytes < shallow < cause.resharded_by_depth[1] == cause.resharded_bytes
    short = plan(shallow).budget
    assert short.prefetch.depth == 0 and "does not fit" in short.prefetch.reason, short.prefetch
    assert short.recomputed == [] and short.kept == [] and short.peak_bytes == shallow
    builds = _Builds(monkeypatch)
    roomy = builds.plan(lambda: plan(1 << 40))
    # The two depths tried of the chosen configuration share its partition (and the real build
    # takes it); every plan and graph as when each is partitioned anew.
    trials, partitions = builds.check_shared(lambda: plan(1 << 40), roomy)
    assert partitions < trials
    tried = {t.depth: t for t in roomy.budget.prefetch.tried}
    assert tried[2].step_ms < tried[1].step_ms and tried[2].peak_bytes > tried[1].peak_bytes
    assert roomy.budget.prefetch.depth == 2 and "deeper" in roomy.budget.prefetch.reason
    assert "prefetch depth 2 (options: 1)" in roomy.table()
    assert roomy.options["prefetch_depth"] == 2  # the plan was made at the chosen depth
    assert Plan.from_json(roomy.to_json()).budget == roomy.budget


def _elided_plan() -> Plan:
    """World 1: two buckets whose backward gathers are elided (one-rank group), bf16 gathered."""
    buckets = [Bucket(i, f"layers.{i}", [f"w{i}"], [4], [4], [8], "torch.bfloat16",
                      "torch.float32", 1) for i in range(2)]
    colls = [Collective(f"backward.all_gather.{i}", CollectiveKind.ALL_GATHER, "backward", i,
                        [f"w{i}"], 64, 64, "torch.bfloat16", "shard", 0, 0, 0, 0, group_size=1,
                        elided=True) for i in range(2)]
    return Plan(PLAN_VERSION, 0, 1, {}, buckets, colls)


def test_elided_gathers_that_cast_are_candidates_priced_by_their_cast():
    """World 1: an elided gather is a cast of the shard; keeping it saves the backward's re-cast
    (issue 20). Without a cast (the parameter's dtype is the compute dtype) it saves nothing."""
    cands, fixed = budget.candidates(_elided_plan(), {"w0": 2e-5})
    assert [(c.bucket, c.saved_s, c.nbytes, c.elided) for c in cands] == [(0, 2e-5, 64, True)]
    assert [(d.bucket, d.kept) for d in fixed] == [(1, False)]
    assert "elided" in fixed[0].reason and "save no time" in fixed[0].reason
    got = budget.choose(cands, fixed, 10**9, MINIMUM, lambda kept: MINIMUM + 64 * len(kept))
    assert got.kept == [0]
    assert "elided" in got.decisions[0].reason and "re-cast" in got.decisions[0].reason
    assert budget.candidates(_elided_plan())[0] == []  # nothing priced: nothing to keep


def _gather_node(graph: fx.Graph, fqn: str, dtype: torch.dtype) -> fx.Node:
    """A one-rank gather of a 1024 x 256 fp32 shard to ``dtype`` in ``graph``."""
    shard = graph.placeholder(f"{fqn}_shard")
    shard.meta["val"] = torch.empty(1024, 256)
    node = graph.call_function(GATHER_OP, GatherArgs(shard, fqn, 1024, 1, "0", dtype,
                                                     torch.float32, True).args())
    node.meta["val"] = torch.empty(1024, 256, dtype=dtype)
    return node


def test_elided_cast_seconds_prices_only_casting_gathers():
    graph = fx.Graph()
    for fqn, dtype in (("cast", torch.bfloat16), ("same", torch.float32)):
        _gather_node(graph, fqn, dtype)
    graph.output(None)
    got = elided_cast_seconds(fx.GraphModule(nn.Module(), graph), resolve_profile(None))
    assert set(got) == {"cast"} and got["cast"] > 0


def test_elided_cast_bytes_price_the_kernels_one_rank_still_runs():
    """At one rank an elided gather is the shard cast to the compute dtype and an elided
    reduction the gradient cast to the reduce and shard dtypes (one fused kernel): each reads
    and writes its tensor once; where no dtype changes there is no kernel."""
    graph = fx.Graph()
    nodes = {}
    for fqn, dtype in (("cast", torch.bfloat16), ("same", torch.float32)):
        node = _gather_node(graph, fqn, dtype)
        nodes[f"gather_{fqn}"] = node
        grad = graph.placeholder(f"{fqn}_grad")
        grad.meta["val"] = torch.empty(1024, 256, dtype=dtype)
        red = graph.call_function(torch.ops.shardc.reduce_scatter_grad.default, ReduceArgs(
            grad, fqn, 1024, 1, "0", torch.float32, torch.float32).args())
        red.meta["val"] = torch.empty(1024, 256)
        nodes[f"reduce_{fqn}"] = red
    graph.output(None)
    numel = 1024 * 256
    assert elided_cast_bytes(nodes["gather_cast"]) == numel * (4 + 2)
    assert elided_cast_bytes(nodes["reduce_cast"]) == numel * (2 + 4)
    assert elided_cast_bytes(nodes["gather_same"]) == 0
    assert elided_cast_bytes(nodes["reduce_same"]) == 0


# Slow (suite time, s29): the planner's optimizer offload trains in real_models'
# peak_budget_optimizer
@pytest.mark.slow
def test_optimizer_offload_is_the_last_lever_of_the_planner(monkeypatch):
    """The real budget planner (a tiny model at a fake world of 2, FX, no margin): at the device
    levers' feasible minimum the optimizer stays on the device; a byte below it the planner puts
    the optimizer's state and step of the fewest buckets on the host (the largest, layers.0: a
    strict subset; the prediction leaves only their state and step temporaries out of the
    device, the host holds their masters, gradients and state) and records which, why and at
    what price; at what every parameter's state on the host reaches, all of it goes; below
    that it refuses, naming the new minimum and OffloadPolicy() and (a lower bound of) the
    minimum with the state on the device; with optimizer_offload='never' a budget below the
    device minimum is refused saying what 'auto' would do. (``plan_model`` plans the GPU run:
    its 'auto' is 'simulate', the lever on a CPU mesh too.) The trials of one configuration
    under several optimizer placements share its lowering, and the plan and its graphs are
    those made partitioning and lowering every trial anew."""
    import re

    from shardc.models.llama import LlamaConfig
    from shardc.tools.planner import PlanSetup, plan_model

    cfg = LlamaConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, max_seq_len=8)

    def plan(budget_bytes: int, mode: str) -> Plan:
        # fused_loss off: the loss lever, priced before the search, would add its own trial's
        # partition to those counted here (tests/test_fused_loss.py tests it).
        return plan_model(cfg, 2, 1, 8, {"peak_memory_budget_bytes": budget_bytes,
                                         "peak_memory_margin": 0.0, "optimizer_offload": mode,
                                         "fused_loss": False},
                          template=False, setup=PlanSetup(inductor=False))[0]

    def refusal(budget_bytes: int, mode: str) -> str:
        with pytest.raises(Exception, match="feasible minimum") as refused:
            plan(budget_bytes, mode)
        return str(refused.value)

    text = refusal(1, "never")  # the device levers' feasible minimum
    floor = int(re.search(r"feasible minimum (\d+) B", text).group(1))
    assert "optimizer_offload='never': with 'auto'" in text and "OffloadPolicy()" not in text
    new = refusal(1, "simulate")  # below what even the state on the host reaches
    new_floor = int(re.search(r"feasible minimum (\d+) B", new).group(1))
    # 1 byte is below the optimizer step's peak alone: the device levers' search is skipped.
    step = int(re.search(r"with it on the device the minimum is at least (\d+) B", new).group(1))
    assert step <= floor and "offload=shardc.OffloadPolicy(params='auto')" in new, new
    assert "OffloadPolicy() places them" in new, new
    at_floor = plan(floor, "simulate")
    assert at_floor.budget.optimizer is None and at_floor.predicted.optimizer_state_bytes > 0

    # A byte below the device minimum: the largest bucket's state is enough.
    builds = _Builds(monkeypatch)
    below = builds.plan(lambda: plan(floor - 1, "simulate"))
    # Trials of one configuration under several optimizer placements share its lowering;
    # deterministic, and the plan and its graphs are those made without sharing.
    builds_lowered = len(builds.lowerings)
    trials, _ = builds.check_shared(lambda: plan(floor - 1, "simulate"), below)
    assert builds_lowered - 1 < trials
    record, p = below.budget, below.predicted
    names = {fqn for b in below.buckets for fqn in b.params}
    o = record.optimizer
    assert record.optimizer_on_host and o.partial and o.buckets == [1], o
    assert set(o.host_params) < names and all(n.startswith("layers.0.") for n in o.host_params)
    assert record.peak_bytes <= floor - 1 and p.peak_bytes <= floor - 1
    host = p.optimizer_host_param_bytes
    assert 0 < host < p.param_bytes
    assert p.optimizer_state_bytes == 2 * (p.param_bytes - host)  # the device part's state
    assert p.optimizer_step_peak_bytes == p.param_bytes + p.grad_bytes + p.pool_bytes \
        + 3 * (p.param_bytes - host)
    assert p.host_bytes == 4 * host  # the chosen masters, their gradients, Adam's moments
    assert o.freed_bytes == 3 * host and o.host_bytes == p.host_bytes
    assert o.d2h_ms > 0 and o.step_ms > 0 and o.h2d_ms > 0 and 0 < o.params
    assert o.predicted_ms == pytest.approx(o.d2h_ms + o.step_ms + o.h2d_ms)
    assert o.reason.startswith("on the host: the other levers' feasible minimum" if floor - 1
                               >= step else "on the host: the optimizer step's peak"), o.reason
    assert "the state of 1 of 3 bucket(s), largest first (layers.0:" in o.reason, o.reason
    assert "optimizer state and step: on the host for 9 parameter(s) of bucket(s) 1" \
        in below.table()
    back = Plan.from_json(below.to_json())
    assert back.budget == record and back.hash() == below.hash()
    assert ("optimizer_on_host", True) in below.budget_signature()
    assert ("optimizer_host_params", o.host_params) in below.budget_signature()

    # At what every parameter's state on the host reaches: all of it.
    everything = plan(new_floor, "simulate")
    record, p = everything.budget, everything.predicted
    o = record.optimizer
    assert record.optimizer_on_host and not o.partial and o.host_params is None, o
    assert record.peak_bytes <= new_floor and p.peak_bytes <= new_floor
    assert p.optimizer_state_bytes == 0 and p.optimizer_host_param_bytes is None
    # The step holds the shards, the gradients and the communication pool, nothing else.
    assert p.optimizer_step_peak_bytes == p.param_bytes + p.grad_bytes + p.pool_bytes
    assert p.host_bytes == 4 * p.param_bytes  # masters, their gradients, Adam's two moments
    assert o.freed_bytes == 3 * p.param_bytes and o.host_bytes == p.host_bytes
    assert "every parameter's state (" in o.reason, o.reason  # and why not fewer
    assert "optimizer state and step: on the host," in everything.table()
    assert ("optimizer_host_params", None) not in everything.budget_signature()
    assert new_floor < floor - p.param_bytes, (new_floor, floor)  # the state is gone


def test_the_fewest_buckets_largest_state_first():
    """``optimizer_offload.units`` orders the buckets by their shards' bytes (ties by index),
    counting a parameter once and leaving out those already on the host; ``take`` adds the
    fewest units that cover the excess at the bytes freed per shard byte (at least one)."""
    from shardc.planning import optimizer_offload

    plan = Plan(PLAN_VERSION, 0, 2, {}, [
        Bucket(0, "emb", ["e"], [8], [4], [4], "float32", "float32", 2),
        Bucket(1, "a", ["a1", "a2"], [4, 4], [2, 2], [4, 4], "float32", "float32", 2),
        Bucket(2, "b", ["b", "e"], [8], [4], [8], "float32", "float32", 2),
        Bucket(3, "c", ["c"], [2], [1], [4], "float32", "float32", 2),
    ], [])
    sizes = {"e": 64, "a1": 32, "a2": 32, "b": 128, "c": 16}
    asked = []

    def bytes_of(bucket, params):
        asked.append(bucket)
        return sum(sizes[p] for p in params)

    order = optimizer_offload.units(plan, bytes_of)
    assert [(u.bucket, u.nbytes) for u in order] == [(2, 128), (0, 64), (1, 64), (3, 16)]
    assert order[0].params == ("b",) and order[0].numel == 32 and asked == [0, 1, 2, 3]
    assert [u.bucket for u in optimizer_offload.units(plan, bytes_of, {"b", "a1"})] == \
        [0, 1, 3]
    assert optimizer_offload.take(order, 0, 1, 2.0) == 1
    assert optimizer_offload.take(order, 0, 256, 2.0) == 1  # 128 bytes free 256
    assert optimizer_offload.take(order, 0, 257, 2.0) == 2
    assert optimizer_offload.take(order, 1, 0, 2.0) == 2  # a failed subset grows by one
    assert optimizer_offload.take(order, 0, 10**9, 3.0) == len(order)
    assert optimizer_offload.take(order, 0, 1, 0.0) == len(order)  # no state: all of it


def test_optimizer_offload_option_and_price():
    from shardc.planning import optimizer_offload

    assert ShardcOptions().optimizer_offload == "auto"
    for mode in ("never", "simulate"):
        assert ShardcOptions(optimizer_offload=mode).optimizer_offload == mode
    with pytest.raises(ValueError, match="optimizer_offload must be 'auto', 'never'"):
        ShardcOptions(optimizer_offload="always")
    profile = resolve_profile(None)  # the h100 preset: its measured host link
    d2h, step, h2d = optimizer_offload.price(4 << 30, 4 << 30, 1 << 30, profile)
    # 8 GiB to the host at 55.96 GB/s (two copies of 16.3 us), 1 Gi parameters at the
    # profile's host rate, 4 GiB back at 56.12 GB/s.
    assert d2h == pytest.approx(2 * 16.295e-6 + (8 << 30) / 55.955e9, rel=1e-4)
    assert step == pytest.approx((1 << 30) / profile.host_adamw_params_per_s)
    assert h2d == pytest.approx(16.295e-6 + (4 << 30) / 56.1197e9, rel=1e-4)
    # Each way at its own rate: to the host at device_to_host_bytes_per_s, back at
    # host_to_device_bytes_per_s, and the profile's latency per copy (shards and gradients
    # are two copies to the host: optimizer_offload.copy_seconds, as predict_step prices them).
    skewed = dataclasses.replace(profile, device_to_host_bytes_per_s=10e9,
                                 host_to_device_bytes_per_s=40e9, host_copy_latency_s=1e-3)
    d2h, _, h2d = optimizer_offload.price(4 << 30, 4 << 30, 1 << 30, skewed)
    assert d2h == pytest.approx(2e-3 + (8 << 30) / 10e9)
    assert h2d == pytest.approx(1e-3 + (4 << 30) / 40e9)
    assert optimizer_offload.why_not("auto", "cuda", None, False, False) == ""
    assert "already sharded" in optimizer_offload.why_not("auto", "cuda", object(), False, False)
    assert "FP8" in optimizer_offload.why_not("auto", "cuda", None, True, False)
    assert "FSDP+TP" in optimizer_offload.why_not("auto", "cuda", None, False, True)
    assert "on the CPU" in optimizer_offload.why_not("auto", "cpu", None, False, False)
    assert optimizer_offload.why_not("simulate", "cpu", None, False, False) == ""
    never = optimizer_offload.refusal_hint(False, optimizer_offload.why_not(
        "never", "cuda", None, False, False))
    assert "optimizer_offload='never': with 'auto'" in never and "OffloadPolicy" not in never
    assert optimizer_offload.refusal_hint(False, "the model has FP8 parameters") == ""


class _Builds:
    """Through the real planner: the budget search's trials (configuration and optimizer
    placement), its partitions (``True``: the real build's) and lowerings, and the lowered
    graphs' code; :meth:`plan` plans with the trials sharing their partitions and lowerings
    (``shardc.compile.pipeline._SHARE_PARTITIONS``, the default) or each trial and the real
    build partitioning and lowering anew (as before they were shared)."""

    def __init__(self, monkeypatch) -> None:
        from shardc.compile import pipeline

        self.monkeypatch, self.pipeline = monkeypatch, pipeline
        self.partitions, self.lowerings, self.trials, self.code = [], [], [], []
        partition, lower = pipeline.partition, pipeline.lower
        search_inputs, plan_and_lower = pipeline.search_inputs, pipeline.plan_and_lower

        def counted_partition(gm, joint_inputs, *, record=True, **kwargs):
            self.partitions.append(record)
            return partition(gm, joint_inputs, record=record, **kwargs)

        def counted_lower(*args, **kwargs):
            self.lowerings.append(1)
            return lower(*args, **kwargs)

        def counted_search_inputs(gm, joint_inputs, options, region, kwargs):
            inputs = search_inputs(gm, joint_inputs, options, region, kwargs)

            def trial(kept, recomputed, offloaded, depth):
                self.trials.append((frozenset(kept), frozenset(recomputed), frozenset(offloaded),
                                    depth, region.optimizer_on_host,
                                    region.optimizer_host_params))
                return inputs.trial(kept, recomputed, offloaded, depth)
            return dataclasses.replace(inputs, trial=trial)

        def recorded(fw, bw, *args, **kwargs):
            try:
                return plan_and_lower(fw, bw, *args, **kwargs)
            finally:  # plan_only stops with PlannedOnly once the region is lowered
                self.code.append(fw.code + bw.code)

        for name, fn in (("partition", counted_partition), ("lower", counted_lower),
                         ("search_inputs", counted_search_inputs),
                         ("plan_and_lower", recorded)):
            monkeypatch.setattr(pipeline, name, fn)

    def plan(self, make, share: bool = True):
        self.monkeypatch.setattr(self.pipeline, "_SHARE_PARTITIONS", share)
        for seen in (self.partitions, self.lowerings, self.trials, self.code):
            seen.clear()
        return make()

    def check_shared(self, make, plan: Plan) -> tuple[int, int]:
        """``plan`` (made by ``make``, shared) equals the one made anew, with its graphs; the
        shared search partitioned each configuration and lowered each at each depth once, the
        real build took the chosen partition. Returns the trials and partitions made."""
        assert self.partitions and plan.budget is not None
        trials, code = list(self.trials), list(self.code)
        configurations = {t[:3] for t in trials}
        assert self.partitions == [False] * len(configurations)  # trials only
        assert len(self.lowerings) == len({t[:4] for t in trials}) + 1  # + the real build
        anew = self.plan(make, share=False)
        assert self.trials == trials  # the same trials, in the same order
        assert self.partitions == [False] * len(trials) + [True]
        assert len(self.lowerings) == len(trials) + 1
        assert anew.hash() == plan.hash() and anew.to_dict() == plan.to_dict()
        assert self.code == code and len(code) == 1
        self.monkeypatch.setattr(self.pipeline, "_SHARE_PARTITIONS", True)
        return len(trials), len(configurations)
