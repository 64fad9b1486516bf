"""The offset allocator's search: a better pool than greedy, under a time limit (benchmark).

``shardc.memory.allocator`` places the runtime's communication pool with greedy best fit
(deterministic). This module adds the portfolio below as ``plan_offsets(mode="best")``;
``benchmarks/allocator.py`` measures both and ``tests/test_allocator.py`` checks both. It is not
part of the package: its result depends on the time limit, so ranks could disagree on offsets.

Given buffers with half-open lifetimes ``[start, end)`` and byte sizes, pick an address offset
for each so that two buffers whose lifetimes intersect never share an address, and the pool
(``max(offset + size)``) is as small as we can make it. The lower bound is *max-live*: the largest
sum of sizes live at one step.

Entry point: :func:`plan_offsets`. Pure Python standard library only (no torch or numpy).

Algorithm (the portfolio behind ``mode="best"``)
-----------------------------------------------
1. **Greedy best fit** over several buffer orders (by size, size then start, area, conflict
   count, conflict-weighted size, lifetime length, start). Each buffer goes into the smallest
   address gap left free by the already placed buffers whose lifetimes intersect its own (lowest
   such gap on ties; the top of the stack if no gap fits). The placed buffers live in a segment
   tree over compressed time whose nodes keep *merged* address-interval unions, so finding the
   gaps for one buffer touches O(log T) short lists instead of every placed buffer. Time is
   compressed to the distinct start steps (two lifetimes intersect iff one holds the other's
   start), which halves the tree.
2. **Exact-style search** for small and medium instances, in the spirit of MiniMalloc (Moffitt,
   ASPLOS 2023), written from the paper's ideas: a depth-first search over *canonical* solutions
   (buffers placed in non-decreasing offset order, each at the lowest offset its placed
   conflicts allow), with
   - section inference: in every time section, the unplaced buffers must stack above the
     section's floor, and above the current offset (placements never go down again);
   - an unallocated floor: a section's floor is at least the smallest minimum offset of its
     unplaced buffers, which exposes gaps that can no longer be filled;
   - dominance pruning: a buffer is never placed at or above the lowest height some other
     unplaced buffer could reach, since that buffer could be slid under it;
   - dynamic temporal decomposition: once no unplaced buffer crosses a section boundary, the two
     sides are solved independently.
   The search answers "does everything fit in capacity C?" under a node budget. The driver
   first asks the exact question (C = max-live) with MiniMalloc's default pre-order, then runs
   rounds over a dozen static pre-orders (the search is heavy-tailed: one order often solves in
   a few hundred nodes what another cannot in a million), each asking for max-live and then
   walking down a ladder of capacities (max-live plus 25 % .. 0.1 %) below the best pool found
   so far; the node budget doubles each round. A search that finishes without finding a fit
   *proves* that capacity infeasible, which raises the lower bound and enables bisection.
   Used for instances up to ``_EXACT_MAX_BUFFERS`` buffers / ``_EXACT_MAX_PAIRS`` conflicts.
3. **Core search** for larger instances: only a small core of buffers (a few hundred to two
   thousand on real training traces) lives where the live total is near the peak. That core is
   packed by step 2 as its own problem, and every improved core packing is completed by
   best-fit greedy for the other buffers around it.
4. **Perturbed greedy** with whatever time is left on large instances: best fit from size
   orders whose keys are jittered by a seeded RNG.

The search stops as soon as the pool equals max-live (optimal).

Determinism: no result depends on the clock except through the time limit. Every phase runs a
fixed schedule (fixed orders, node budgets, RNG seeds and round counts), so two runs that
finish the schedule inside ``time_limit_s`` return identical plans on any machine. The limit
only truncates the schedule (searches stop at 96 % of it, leaving the rest for wrapping up); a
run cut short returns the best plan found so far, which on a slower or busier machine can be a
worse, still valid, plan. ``mode="fast"`` never looks at the clock.
"""


from __future__ import annotations

import random
import sys
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate
from operator import itemgetter
from typing import Any

from shardc.memory.allocator import (
    _INF,
    OffsetPlan,
    _check_alignment,
    _greedy,
    _greedy_orders,
    _normalize,
    _Problem,
    max_live,
)

__all__ = ["OffsetPlan", "max_live", "plan_offsets"]

# Largest instance (buffers, conflicting pairs) that the exact-style search is run on. Its
# per-node cost is linear in the number of unplaced buffers, so beyond this the time is better
# spent on perturbed greedy runs.
_EXACT_MAX_BUFFERS = 3000
_EXACT_MAX_PAIRS = 400_000
# The core of a large trace is nearly a clique (everything in it lives around the peak), so it
# is allowed more pairs: its searches are short dives, not long tree walks.
_CORE_MAX_PAIRS = 2_500_000

# Static pre-orders tried round-robin by the search. Letters: T = largest section total the
# buffer lives in, W = lifetime length, A = area (size x length), Z = size, S = start (earlier
# first), E = end (later first), O = number of conflicting buffers. Earlier letters dominate.
_PREORDERS = ("TWA", "TO", "SZ", "EW", "TAW", "WAT", "EZ", "OZ", "SA", "ET", "ZW", "AT")

# Capacities tried by the search: max-live times (1 + f), largest first, below the best pool.
_LADDER = (0.25, 0.15, 0.10, 0.07, 0.05, 0.035, 0.025, 0.015, 0.01, 0.005, 0.0025, 0.001, 0.0)

_SEARCH_ROUNDS = 10  # node budget doubles every round, starting at max(256, n)
_PERTURB_ITERS = 64  # perturbed greedy runs for large instances

_OK, _NOTFOUND, _ABORT = 1, 0, 2

# Canonical depth-first search (MiniMalloc-style)
# --------------------------------------------------------------------------------------------


class _Search:
    """Decision search: place every non-empty buffer within a capacity, or report failure.

    Precomputes per-section buffer lists and per-buffer conflict lists once; each
    :meth:`solve` call then runs one depth-first search with a given pre-order, capacity and
    node budget.
    """

    def __init__(self, p: _Problem) -> None:
        self.p = p
        # Only non-empty buffers take part; empty ones never conflict in address.
        self.ids = [i for i in range(p.n) if p.z[i]]
        m = len(self.ids)
        z = [p.z[i] for i in self.ids]
        sl = [p.sl[i] for i in self.ids]
        sr = [p.sr[i] for i in self.ids]
        S = p.S
        sec: list[list[int]] = [[] for _ in range(S)]
        for j in range(m):
            for s in range(sl[j], sr[j]):
                sec[s].append(j)
        # Conflicts by sweeping sections: a buffer starting in section s conflicts with every
        # buffer already live there and with the others starting there; each pair once.
        ov: list[list[int]] = [[] for _ in range(m)]
        starting: list[list[int]] = [[] for _ in range(S)]
        for j in range(m):
            starting[sl[j]].append(j)
        live: list[int] = []
        for s in range(S):
            new = starting[s]
            if new:
                live = [j for j in live if sr[j] > s]
                for a in new:
                    ov[a].extend(live)
                    for b in live:
                        ov[b].append(a)
                for x in range(len(new)):
                    a = new[x]
                    for y in range(x + 1, len(new)):
                        b = new[y]
                        ov[a].append(b)
                        ov[b].append(a)
                live.extend(new)
        tot = [sum(z[j] for j in sb) for sb in sec]
        self.m, self.z, self.sl, self.sr, self.S = m, z, sl, sr, S
        self.sec, self.ov, self.tot = sec, ov, tot
        self.maxtot = [max(tot[sl[j]:sr[j]]) for j in range(m)]
        self.length = [p.ends[i] - p.starts[i] for i in self.ids]
        self.start = [p.starts[i] for i in self.ids]
        self.end = [p.ends[i] for i in self.ids]
        # itemgetters give C-speed "minimum offset over a section" lookups; pad singletons so
        # the getter always returns a tuple.
        self.sec_get = [
            itemgetter(*sb) if len(sb) > 1 else itemgetter(sb[0], sb[0]) if sb else None
            for sb in sec
        ]

    def preorder(self, letters: str) -> list[int]:
        """Buffers sorted by the heuristic ``letters`` (see ``_PREORDERS``), index last."""
        z, ln, mt, st, en = self.z, self.length, self.maxtot, self.start, self.end
        deg = [len(o) for o in self.ov]
        crit = {
            "T": mt,
            "W": ln,
            "A": [a * b for a, b in zip(z, ln)],
            "Z": z,
            "S": [-s for s in st],
            "E": en,
            "O": deg,
        }
        cols = [crit[c] for c in letters]
        return sorted(range(self.m), key=lambda j: tuple(-c[j] for c in cols) + (j,))

    def solve(
        self, C: int, order: list[int], node_limit: int, deadline: float
    ) -> tuple[int, list[int] | None]:
        """Search for a placement within capacity ``C``.

        Returns ``(_OK, offsets)`` with offsets indexed like the original problem (empty buffers
        at 0), ``(_NOTFOUND, None)`` if the search space was exhausted (``C`` is infeasible), or
        ``(_ABORT, None)`` if the node budget or the deadline ran out first.
        """
        m, S = self.m, self.S
        z, sl, sr, ov, sec_get = self.z, self.sl, self.sr, self.ov, self.sec_get
        if m == 0:
            return _OK, [0] * self.p.n
        if max(self.tot, default=0) > C:
            return _NOTFOUND, None
        rk = [0] * m
        for rank, j in enumerate(order):
            rk[j] = rank
        R = m
        mo = [0] * m  # lowest offset allowed by the placed conflicts (_INF once placed)
        kv = [rk[j] for j in range(m)]  # mo[j] * R + rk[j]: the canonical sort key
        hv = list(z)  # mo[j] + z[j]: the lowest top buffer j can have
        floor = [0] * S  # top of the highest placed buffer in each section
        total = list(self.tot)  # sum of unplaced sizes in each section
        cuts = [0] * S  # cuts[k]: unplaced buffers crossing the boundary after section k
        for j in range(m):
            for k in range(sl[j], sr[j] - 1):
                cuts[k] += 1
        sol = [0] * m
        nodes = 0
        perf = time.perf_counter

        def split(un: list[int], a: int, b: int, s0: int, s1: int) -> list[tuple]:
            """Independent sub-problems of ``un`` after boundaries in [s0, s1-1) hit zero."""
            pts = [k + 1 for k in range(s0, s1 - 1) if cuts[k] == 0]
            groups: list[list[int]] = [[] for _ in range(len(pts) + 1)]
            for j in un:
                groups[bisect_right(pts, sl[j])].append(j)
            bounds = [a, *pts, b]
            return [(g, bounds[q], bounds[q + 1]) for q, g in enumerate(groups) if g]

        def search(un: list[int], a: int, b: int, last_key: int) -> int:
            """Place the unplaced buffers ``un`` (sections [a, b)) after ``last_key``."""
            nonlocal nodes
            nodes += 1
            if nodes > node_limit:
                return _ABORT
            if not nodes & 31 and perf() > deadline:
                return _ABORT
            if not un:
                return _OK
            # Canonical order: candidates sorted by (minimum offset, pre-order rank), and only
            # those after the last placement in that order may be placed next. kv and hv mirror
            # mo so that these run at C speed.
            ks = sorted(map(kv.__getitem__, un))
            min_h = min(map(hv.__getitem__, un))
            seg = total[a:b]
            M = max(seg)
            pmax: list[int] | None = None
            cur_o = -1
            hlo = b
            hhi = a - 1
            for key in ks[bisect_right(ks, last_key):]:
                o = key // R
                if o >= min_h:
                    # Dominance: some unplaced buffer fits entirely below o; placing it first
                    # gives a solution at least as good, so this branch is redundant.
                    break
                if o != cur_o:
                    cur_o = o
                    # Every later placement is at >= o, so sections whose unplaced total
                    # exceeds C - o ("hot") must be covered by this very buffer.
                    lim = C - o
                    if M > lim:
                        if pmax is None:
                            # Running maxima from both ends turn "first / last hot section"
                            # into two bisections.
                            pmax = list(accumulate(seg, max))
                            smax = list(accumulate(reversed(seg), max))
                        hlo = a + bisect_right(pmax, lim)
                        hhi = b - 1 - bisect_right(smax, lim)
                i = order[key - o * R]
                s0 = sl[i]
                s1 = sr[i]
                if s0 > hlo or s1 <= hhi:
                    continue
                zi = z[i]
                t = o + zi
                old_total = total[s0:s1]
                if t + max(old_total) - zi > C:
                    continue  # the rest of its sections would not fit above it
                mo[i] = _INF
                sol[i] = o
                ch = [j for j in ov[i] if mo[j] < t]  # conflicts whose minimum offset rises
                olds = [mo[j] for j in ch]
                tR = t * R
                for j in ch:
                    mo[j] = t
                    kv[j] = tR + rk[j]
                    hv[j] = t + z[j]
                old_floor = floor[s0:s1]
                floor[s0:s1] = [t] * (s1 - s0)
                total[s0:s1] = [x - zi for x in old_total]
                good = True
                if ch:
                    # Unallocated floor: nothing unplaced in a section can go below the smallest
                    # minimum offset there, so the space under it is lost.
                    lim = C - t
                    A = min(map(sl.__getitem__, ch))
                    B = max(map(sr.__getitem__, ch))
                    for s in range(A, B):
                        if total[s] > lim and floor[s] < t and min(sec_get[s](mo)) + total[s] > C:
                            good = False
                            break
                status = _NOTFOUND
                if good:
                    pos = un.index(i)
                    child = un[:pos] + un[pos + 1 :]
                    if s1 - s0 > 1:
                        cuts[s0 : s1 - 1] = [c - 1 for c in cuts[s0 : s1 - 1]]
                        if 0 in cuts[s0 : s1 - 1]:
                            status = _OK
                            for sp, c0, c1 in split(child, a, b, s0, s1):
                                st = search(sp, c0, c1, -1)
                                if st != _OK:
                                    status = st
                                    break
                        else:
                            status = search(child, a, b, key)
                        cuts[s0 : s1 - 1] = [c + 1 for c in cuts[s0 : s1 - 1]]
                    else:
                        status = search(child, a, b, key)
                floor[s0:s1] = old_floor
                total[s0:s1] = old_total
                for j, v in zip(ch, olds):
                    mo[j] = v
                    kv[j] = v * R + rk[j]
                    hv[j] = v + z[j]
                mo[i] = o
                if status != _NOTFOUND:
                    return status
            return _NOTFOUND

        old_limit = sys.getrecursionlimit()
        # Recursion depth is at most one frame per buffer plus one per decomposition.
        sys.setrecursionlimit(max(old_limit, 3 * m + 1000))
        try:
            status = _OK
            parts = split(list(range(m)), 0, S, 0, S) if S > 1 else [(list(range(m)), 0, S)]
            for sp, c0, c1 in parts:
                status = search(sp, c0, c1, -1)
                if status != _OK:
                    break
        finally:
            sys.setrecursionlimit(old_limit)
        if status != _OK:
            return status, None
        offs = [0] * self.p.n
        for j, i in enumerate(self.ids):
            offs[i] = sol[j]
        return _OK, offs


# --------------------------------------------------------------------------------------------
# Portfolio
# --------------------------------------------------------------------------------------------


class _Best:
    """Best plan so far (in units)."""

    def __init__(self, offs: list[int], pool: int, method: str) -> None:
        self.offs, self.pool, self.method = offs, pool, method

    def offer(self, offs: list[int], pool: int, method: str) -> bool:
        if pool < self.pool:
            self.offs, self.pool, self.method = offs, pool, method
            return True
        return False


def _run_search(
    p: _Problem,
    best: _Best,
    lb: int,
    deadline: float,
    stop: Callable[[], bool] = lambda: False,
    opening: bool = True,
) -> int:
    """Capacity-ladder search; improves ``best`` in place. Returns the (maybe raised) bound.

    Schedule (fixed, so the result does not depend on machine speed unless the deadline cuts
    it short): ``_SEARCH_ROUNDS`` rounds with the node budget doubling from ``max(256, n)``;
    in each round every pre-order in ``_PREORDERS`` (1) asks for the bound itself, since tight
    capacities prune hardest and the exact question is often the easiest one (which pre-order
    answers it fast varies wildly), (2) walks down ``_LADDER`` below the best pool until a
    capacity is not reached within the budget, and (3) if no search was cut off by the budget,
    bisects between the bound and the best pool.
    """
    srch = _Search(p)
    orders = [(h, srch.preorder(h)) for h in _PREORDERS]
    budget = max(256, srch.m)

    def probe(C: int, h: str, order: list[int], nodes: int = 0) -> int:
        nonlocal lb
        st, offs = srch.solve(C, order, nodes or budget, deadline)
        if st == _OK:
            assert offs is not None
            best.offer(offs, p.pool_of(offs), f"search-{h}")
        elif st == _NOTFOUND:
            # Exhausted: no canonical solution, hence no solution at all, fits C.
            lb = max(lb, C + 1)
        return st

    # Opening move: MiniMalloc's default pre-order on the exact question, with a budget large
    # enough for the typical "solved after a few thousand nodes" case.
    if opening:
        probe(lb, orders[0][0], orders[0][1], 8 * budget)
    for _ in range(_SEARCH_ROUNDS):
        for h, order in orders:
            if best.pool <= lb or stop() or time.perf_counter() > deadline:
                return lb
            aborted = probe(lb, h, order) == _ABORT
            last = lb
            for f in _LADDER:
                C = lb + int(lb * f)
                if C >= best.pool or C == last or best.pool <= lb:
                    continue
                last = C
                if probe(C, h, order) == _ABORT:
                    aborted = True
                    break
            while not aborted and lb < best.pool and time.perf_counter() <= deadline:
                aborted = probe((lb + best.pool - 1) // 2, h, order) == _ABORT
        budget *= 2
    return lb


def _section_totals(p: _Problem) -> list[int]:
    d = [0] * (p.S + 1)
    for a, b, z in zip(p.sl, p.sr, p.z):
        d[a] += z
        d[b] -= z
    out = []
    acc = 0
    for k in range(p.S):
        acc += d[k]
        out.append(acc)
    return out


def _core_search(p: _Problem, best: _Best, lb: int, deadline: float, est: float) -> None:
    """Search the hot core exactly, then fill in the rest by best fit; improves ``best``.

    On large traces only a small *core* of buffers lives in the sections whose live total is
    near the peak; everywhere else there is slack. The core (the buffers live in any section
    above a threshold fraction of max-live, the threshold picked so the core suits the
    exact-style search) is packed by :func:`_run_search` as its own problem; the remaining
    buffers then go around it by best fit, largest first.
    """
    tot = _section_totals(p)
    pre = [0]
    for theta in (0.9, 0.95, 0.98, 0.99, 0.995):
        pre = [0]
        for t in tot:
            pre.append(pre[-1] + (t > theta * lb))
        core = [i for i in range(p.n) if p.z[i] and pre[p.sr[i]] > pre[p.sl[i]]]
        if len(core) <= _EXACT_MAX_BUFFERS:
            sub = _Problem(
                [p.starts[i] for i in core], [p.ends[i] for i in core], [p.z[i] for i in core]
            )
            if sub.pairs() <= _CORE_MAX_PAIRS:
                break
    else:
        return
    in_core = set(core)
    z, ln, st = p.z, [e - s for s, e in zip(p.starts, p.ends)], p.starts
    rest = sorted(
        (i for i in range(p.n) if i not in in_core), key=lambda i: (-z[i], -ln[i], st[i], i)
    )
    tried: set[tuple[int, ...]] = set()

    fill_dur = est

    def fill(sub_offs: list[int], how: str) -> None:
        nonlocal fill_dur
        key = tuple(sub_offs)
        t1 = time.perf_counter()
        if key in tried or t1 + fill_dur > deadline:
            return
        tried.add(key)
        offs, pool = _greedy(p, rest, list(zip(core, sub_offs)))
        fill_dur = time.perf_counter() - t1
        best.offer(offs, pool, how)

    sub_orders = _greedy_orders(sub, full=False)
    offs0, pool0 = _greedy(sub, sub_orders[0][1])
    sub_best = _Best(offs0, pool0, "core-greedy")
    if pool0 < best.pool:
        fill(offs0, "core-greedy")

    class _Fill(_Best):
        # Every improved core packing is tried as the frame for the full plan.
        def offer(self, offs: list[int], pool: int, method: str) -> bool:
            if super().offer(offs, pool, method):
                # The full pool is at least the core's, so only a core packing below the best
                # full pool can help; completing it costs a whole greedy run.
                if pool < best.pool:
                    fill(offs, "core-" + method)
                return True
            return False

    hook = _Fill(sub_best.offs, sub_best.pool, sub_best.method)
    # Leave room for completing the last core packing found.
    # No opening probe: core nodes are expensive (the core is nearly a clique), so start with
    # the cheap small-budget round.
    _run_search(
        sub, hook, sub.lb, deadline - fill_dur, stop=lambda: best.pool <= lb, opening=False
    )


def _perturbed_greedy(p: _Problem, best: _Best, lb: int, deadline: float, est: float) -> None:
    """Greedy best fit from seeded, jittered orders; improves ``best`` in place."""
    rng = random.Random(0x5EED)
    z, st = p.z, p.starts
    ln = [e - s for s, e in zip(p.starts, p.ends)]
    idx = range(p.n)
    dur = est  # expected duration of one greedy run
    for it in range(_PERTURB_ITERS):
        t1 = time.perf_counter()
        if best.pool <= lb or t1 + dur > deadline:
            return
        noise = 0.02 + 0.1 * (it % 4)
        key = [z[i] * (1.0 + noise * rng.random()) for i in idx]
        order = sorted(idx, key=lambda i: (-key[i], -ln[i], st[i], i))
        offs, pool = _greedy(p, order)
        dur = time.perf_counter() - t1
        best.offer(offs, pool, "greedy-perturbed")


def plan_offsets(
    buffers: Sequence[Any],
    *,
    alignment: int = 1,
    time_limit_s: float = 5.0,
    mode: str = "best",
) -> OffsetPlan:
    """Assign a pool offset to every buffer so that buffers live at the same time never overlap.

    Args:
        buffers: ``(start, end, size)`` integer triples, or objects with ``.start``, ``.end`` and
            ``.size``; lifetimes are half-open ``[start, end)`` with ``end > start``, sizes are
            bytes ``>= 0``. Size-0 buffers get offset 0.
        alignment: every offset is a multiple of this; sizes are rounded up to it for packing
            (so ``max_live`` and ``pool_size`` are in rounded sizes).
        time_limit_s: wall-clock budget for ``mode="best"`` (ignored by ``"fast"``). The search
            follows a fixed schedule and stops early when the schedule ends or the pool reaches
            the lower bound; the limit only truncates it.
        mode: ``"fast"`` = greedy by size with best fit only (about 1 s for 20,000 buffers);
            ``"best"`` = the full portfolio (see the module docstring).

    Returns:
        An :class:`OffsetPlan`; ``pool_size >= max_live`` always, with equality meaning optimal.

    Raises:
        ValueError: malformed buffer (message names its index and values), alignment < 1, or an
            unknown mode.
    """
    _check_alignment(alignment)
    if mode not in ("fast", "best"):
        raise ValueError(f"mode must be 'fast' or 'best', got {mode!r}")
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)):
        raise ValueError(f"time_limit_s must be a number, got {time_limit_s!r}")
    t0 = time.perf_counter()
    # Searches stop at 96 % of the limit: the remaining work (finishing a probe or a greedy
    # run, building the plan) must fit in the rest.
    deadline = t0 + 0.96 * max(0.0, float(time_limit_s))
    starts, ends, sizes = _normalize(buffers)
    units = [-(-z // alignment) for z in sizes]
    p = _Problem(starts, ends, units)
    lb = p.lb
    best: _Best | None = None
    dur = 0.0
    large = mode == "best" and not (p.n <= _EXACT_MAX_BUFFERS and p.pairs() <= _EXACT_MAX_PAIRS)
    orders = _greedy_orders(p, full=mode == "best")
    if large:
        # On large traces the core search is what closes the gap; run it right after plain
        # greedy (with three quarters of the time) and the other greedy orders afterwards.
        offs, pool = _greedy(p, orders[0][1])
        dur = time.perf_counter() - t0
        best = _Best(offs, pool, orders[0][0])
        if pool > lb:
            _core_search(p, best, lb, t0 + 0.75 * (deadline - t0), dur)
        orders = orders[1:]
    for name, order in orders:
        # Skip a run that would likely end past the deadline (the first one always runs).
        t1 = time.perf_counter()
        if best is not None and (t1 + dur > deadline or best.pool <= lb):
            break
        offs, pool = _greedy(p, order)
        dur = time.perf_counter() - t1
        if best is None:
            best = _Best(offs, pool, name)
        else:
            best.offer(offs, pool, name)
        if best.pool <= lb:
            break
    assert best is not None
    if mode == "best" and best.pool > lb:
        if not large:
            _run_search(p, best, lb, deadline)
        else:
            _perturbed_greedy(p, best, lb, deadline, dur)
    return OffsetPlan(
        offsets=tuple(o * alignment for o in best.offs),
        pool_size=best.pool * alignment,
        max_live=lb * alignment,
        method=best.method,
        alignment=alignment,
    )
