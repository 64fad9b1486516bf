"""Tests for the static-pool offset assignment: the runtime's greedy placement
(``shardc.memory.allocator``) and the search benchmark built on it
(``benchmarks/allocator_search.py``, ``mode="best"``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.allocator_search import OffsetPlan, max_live, plan_offsets
from shardc.memory import allocator as runtime_allocator

# --------------------------------------------------------------------------------------------
# Independent reference checks (deliberately naive: O(n^2), no shared code with the module)
# --------------------------------------------------------------------------------------------


def _aligned(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


def _naive_max_live(bufs, alignment=1) -> int:
    steps = {s for s, _, _ in bufs}
    return max(
        (sum(_aligned(z, alignment) for s, e, z in bufs if s <= t < e) for t in steps),
        default=0,
    )


def _assert_valid(bufs, plan: OffsetPlan, alignment: int = 1) -> None:
    assert len(plan.offsets) == len(bufs)
    assert plan.max_live == _naive_max_live(bufs, alignment)
    assert plan.pool_size >= plan.max_live
    tops = [o + _aligned(z, alignment) for o, (_, _, z) in zip(plan.offsets, bufs)]
    assert plan.pool_size == max((t for t, b in zip(tops, bufs) if b[2]), default=0)
    for i, (s, e, z) in enumerate(bufs):
        o = plan.offsets[i]
        assert o >= 0 and o % alignment == 0
        for j in range(i):
            s2, e2, z2 = bufs[j]
            if z and z2 and s < e2 and s2 < e:
                o2 = plan.offsets[j]
                assert tops[i] <= o2 or tops[j] <= o, (i, j, bufs[i], bufs[j], o, o2)
    plan.check(bufs)


def _brute_force_optimum(bufs) -> int:
    """Smallest pool over all canonical placements (fine for n <= 6)."""
    n = len(bufs)
    best = sum(z for _, _, z in bufs)
    for perm in itertools.permutations(range(n)):
        offs = [0] * n
        for k, i in enumerate(perm):
            s, e, _ = bufs[i]
            offs[i] = max(
                [offs[j] + bufs[j][2] for j in perm[:k] if s < bufs[j][1] and bufs[j][0] < e],
                default=0,
            )
        best = min(best, max((o + z for o, (_, _, z) in zip(offs, bufs)), default=0))
    return best


# --------------------------------------------------------------------------------------------
# Property tests
# --------------------------------------------------------------------------------------------


@st.composite
def _instances(draw, max_n: int = 40, max_t: int = 30, max_size: int = 100):
    n = draw(st.integers(0, max_n))
    bufs = []
    for _ in range(n):
        s = draw(st.integers(0, max_t - 1))
        e = draw(st.integers(s + 1, max_t))
        z = draw(st.integers(0, max_size))
        bufs.append((s, e, z))
    return bufs


_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@_SETTINGS
@given(bufs=_instances(), alignment=st.sampled_from([1, 2, 8, 64]))
def test_fast_mode_valid(bufs, alignment):
    plan = plan_offsets(bufs, alignment=alignment, mode="fast")
    _assert_valid(bufs, plan, alignment)
    assert plan == plan_offsets(bufs, alignment=alignment, mode="fast")


@_SETTINGS
@given(bufs=_instances(max_n=25), alignment=st.sampled_from([1, 4, 16]))
def test_best_mode_valid_and_deterministic(bufs, alignment):
    plan = plan_offsets(bufs, alignment=alignment, time_limit_s=2.0)
    _assert_valid(bufs, plan, alignment)
    assert plan == plan_offsets(bufs, alignment=alignment, time_limit_s=2.0)
    fast = plan_offsets(bufs, alignment=alignment, mode="fast")
    assert plan.pool_size <= fast.pool_size


@settings(max_examples=40, deadline=None)
@given(bufs=_instances(max_n=6, max_t=8, max_size=20))
def test_best_mode_reaches_brute_force_optimum(bufs):
    plan = plan_offsets(bufs, time_limit_s=2.0)
    _assert_valid(bufs, plan)
    assert plan.pool_size == _brute_force_optimum(bufs)


@_SETTINGS
@given(bufs=_instances(max_n=15), alignment=st.sampled_from([1, 8]))
def test_max_live_matches_naive(bufs, alignment):
    assert max_live(bufs, alignment) == _naive_max_live(bufs, alignment)


# --------------------------------------------------------------------------------------------
# Hand-made cases with a known optimum
# --------------------------------------------------------------------------------------------


def test_minimalloc_readme_example_is_optimal():
    # The example instance from MiniMalloc's README: it fits a capacity of 12 exactly.
    bufs = [(0, 3, 4), (3, 9, 4), (0, 9, 4), (9, 21, 4), (0, 21, 4)]
    plan = plan_offsets(bufs, time_limit_s=1.0)
    _assert_valid(bufs, plan)
    assert plan.pool_size == plan.max_live == 12


def test_greedy_trap_beaten_by_portfolio():
    # Greedy by size puts the 4 at [0, 4) and the long 3 on top of it at [4, 7); at step 3 the
    # two short 3s then get [0, 3) and [7, 10): pool 10. With the long 3 at the bottom: 9.
    bufs = [(2, 3, 4), (3, 4, 3), (0, 5, 3), (3, 4, 3)]
    assert plan_offsets(bufs, mode="fast").pool_size == 10
    plan = plan_offsets(bufs, time_limit_s=1.0)
    _assert_valid(bufs, plan)
    assert plan.pool_size == _brute_force_optimum(bufs) == plan.max_live == 9


def test_interval_graph_with_unit_sizes_is_colored_optimally():
    # Equal sizes: an optimal allocation is an optimal interval colouring, pool = max-live.
    bufs = [(i, i + 3 + (i % 4), 1) for i in range(50)]
    plan = plan_offsets(bufs, time_limit_s=1.0)
    _assert_valid(bufs, plan)
    assert plan.pool_size == plan.max_live


def test_disjoint_lifetimes_share_address_zero():
    bufs = [(0, 1, 10), (1, 2, 20), (2, 5, 5)]
    plan = plan_offsets(bufs, mode="fast")
    assert plan.offsets == (0, 0, 0)
    assert plan.pool_size == plan.max_live == 20


def test_empty_and_zero_size_buffers():
    assert plan_offsets([]) == OffsetPlan((), 0, 0, plan_offsets([]).method, 1)
    bufs = [(0, 5, 0), (0, 5, 7), (2, 3, 0)]
    plan = plan_offsets(bufs)
    _assert_valid(bufs, plan)
    assert plan.pool_size == 7 and plan.offsets[0] == 0 and plan.offsets[2] == 0


def test_alignment_rounds_sizes_and_offsets():
    bufs = [(0, 4, 3), (0, 4, 5), (2, 6, 1)]
    plan = plan_offsets(bufs, alignment=8, time_limit_s=1.0)
    _assert_valid(bufs, plan, 8)
    assert plan.max_live == 24 and plan.pool_size == 24


def test_accepts_objects_with_attributes():
    @dataclass
    class Buf:
        start: int
        end: int
        size: int

    bufs = [Buf(0, 2, 4), Buf(1, 3, 4)]
    plan = plan_offsets(bufs)
    assert plan.pool_size == 8
    plan.check(bufs)


def test_check_rejects_broken_plans():
    bufs = [(0, 2, 4), (1, 3, 4)]
    plan = plan_offsets(bufs)
    with pytest.raises(ValueError, match="overlap"):
        OffsetPlan((0, 0), 8, 8, "manual").check(bufs)
    with pytest.raises(ValueError, match="pool_size"):
        OffsetPlan(plan.offsets, 7, 8, "manual").check(bufs)
    with pytest.raises(ValueError, match="multiple of alignment"):
        OffsetPlan((0, 4), 16, 16, "manual", alignment=8).check(bufs)
    with pytest.raises(ValueError, match="offsets"):
        OffsetPlan((0,), 8, 8, "manual").check(bufs)


def test_fast_mode_handles_thousands_of_buffers():
    # A smoke test of the fast path on a mid-sized instance (the 20k timing is in benchmarks/).
    import random

    rng = random.Random(7)
    bufs = []
    for _ in range(3000):
        s = rng.randrange(0, 3000)
        bufs.append((s, s + 1 + int(rng.expovariate(1 / 40)), rng.randrange(1, 1 << 20)))
    plan = plan_offsets(bufs, mode="fast")
    plan.check(bufs)
    assert plan.pool_size >= plan.max_live


# --------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "what"),
    [
        ((0, 4, -1), "negative size"),
        ((3, 3, 1), "end must be greater than start"),
        ((5, 2, 1), "end must be greater than start"),
        ((0, 4.0, 1), "not an integer"),
        ((0, 4, 1.5), "not an integer"),
        ((True, 4, 1), "not an integer"),
        ((0, 4, False), "not an integer"),
        (("0", 4, 1), "not an integer"),
        ((0, 4), "triple"),
        (None, "triple"),
    ],
)
@pytest.mark.parametrize("mode", ["fast", "best"])
def test_bad_buffer_names_index_and_problem(bad, what, mode):
    bufs = [(0, 1, 1), (1, 2, 2), bad]
    with pytest.raises(ValueError, match="buffer 2") as info:
        plan_offsets(bufs, mode=mode)
    assert what in str(info.value)
    if isinstance(bad, tuple):
        for v in bad:
            assert repr(v) in str(info.value) or str(v) in str(info.value)


@given(
    bufs=_instances(max_n=10),
    pos=st.integers(0, 10),
    bad=st.sampled_from([(0, 1, -5), (2, 2, 1), (0, 1.0, 1), (0, 1, True)]),
)
@settings(max_examples=30, deadline=None)
def test_bad_buffer_anywhere_reports_its_index(bufs, pos, bad):
    pos = min(pos, len(bufs))
    bufs = bufs[:pos] + [bad] + bufs[pos:]
    with pytest.raises(ValueError, match=f"buffer {pos}\\b"):
        plan_offsets(bufs, mode="fast")


@pytest.mark.parametrize("alignment", [0, -8, True, 2.0, None])
def test_bad_alignment(alignment):
    with pytest.raises(ValueError, match="alignment"):
        plan_offsets([(0, 1, 1)], alignment=alignment)


def test_bad_mode():
    with pytest.raises(ValueError, match="mode"):
        plan_offsets([(0, 1, 1)], mode="optimal")


@_SETTINGS
@given(bufs=_instances(), alignment=st.sampled_from([1, 4, 512]))
def test_runtime_allocator_is_the_fast_mode(bufs, alignment):
    """The package places the pool with exactly the benchmark's fast mode (no clock, no search)."""
    assert runtime_allocator.plan_offsets(bufs, alignment=alignment) == plan_offsets(
        bufs, alignment=alignment, mode="fast")
