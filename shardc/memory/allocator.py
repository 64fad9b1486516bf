"""Static-pool offset assignment (dynamic storage allocation, DSA), as the runtime uses it.

Given buffers with half-open lifetimes ``[start, end)`` and byte sizes, pick an address offset
for each so that two buffers whose lifetimes intersect never share an address, and the pool
(``max(offset + size)``) is small. The lower bound is *max-live*: the largest sum of sizes live
at one step.

Public entry point: :func:`plan_offsets`. Pure Python standard library only (this module must not
import torch or numpy), and written for speed in CPython.

Algorithm: **greedy best fit** by size. Each buffer, largest first, goes into the smallest
address gap left free by the already placed buffers whose lifetimes intersect its own (lowest
such gap on ties; the top of the stack if no gap fits). The placed buffers live in a segment tree
over compressed time whose nodes keep *merged* address-interval unions, so finding the gaps for
one buffer touches O(log T) short lists instead of every placed buffer. Time is compressed to the
distinct start steps (two lifetimes intersect iff one holds the other's start), which halves the
tree. About 1 s for 20,000 buffers.

Determinism: the result depends on the buffers only (never on the clock), so every rank places
the same pool. The search that closes the gap to max-live on hard instances (a MiniMalloc-style
exact search and a perturbed greedy portfolio, under a time limit) is a benchmark, not part of
the runtime: ``benchmarks/allocator_search.py`` (see ``docs/allocator.md``); it builds on the
pieces here.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from numbers import Integral
from typing import Any

__all__ = ["OffsetPlan", "max_live", "plan_offsets"]

_INF = 1 << 62


@dataclass(frozen=True)
class OffsetPlan:
    """Result of :func:`plan_offsets`.

    Attributes:
        offsets: byte offset of each buffer, in input order; a multiple of ``alignment``.
        pool_size: bytes the pool needs: ``max(offset + aligned size)`` (0 if nothing is live).
        max_live: the lower bound: the largest sum of alignment-rounded sizes live at one step.
        method: name of the portfolio strategy whose plan won.
        alignment: the alignment the plan was made for.
    """

    offsets: tuple[int, ...]
    pool_size: int
    max_live: int
    method: str
    alignment: int = 1

    def check(self, buffers: Sequence[Any]) -> None:
        """Re-verify this plan against ``buffers``; raise ``ValueError`` on any violation.

        Checks: one offset per buffer; offsets are non-negative multiples of ``alignment``;
        every buffer (with its size rounded up to ``alignment``) lies within ``pool_size``; no
        two buffers whose lifetimes intersect overlap in address. Runs in O(n log n + n * k)
        where k is the number of buffers live at once.
        """
        starts, ends, sizes = _normalize(buffers)
        n = len(starts)
        a = self.alignment
        if len(self.offsets) != n:
            raise ValueError(f"plan has {len(self.offsets)} offsets for {n} buffers")
        asz = [-(-s // a) * a for s in sizes]
        for i, o in enumerate(self.offsets):
            if not isinstance(o, int) or isinstance(o, bool) or o < 0:
                raise ValueError(f"buffer {i}: offset {o!r} is not a non-negative integer")
            if o % a:
                raise ValueError(f"buffer {i}: offset {o} is not a multiple of alignment {a}")
            if o + asz[i] > self.pool_size:
                raise ValueError(
                    f"buffer {i}: [{o}, {o + asz[i]}) exceeds pool_size {self.pool_size}"
                )
        # Sweep over time; the live buffers must be pairwise disjoint in address, so keeping
        # them sorted by offset and checking the two neighbours of each newcomer suffices.
        events = sorted(
            [(starts[i], 1, i) for i in range(n) if asz[i]]
            + [(ends[i], 0, i) for i in range(n) if asz[i]]
        )
        live: list[tuple[int, int, int]] = []
        for _, kind, i in events:
            item = (self.offsets[i], self.offsets[i] + asz[i], i)
            if kind == 0:
                del live[bisect_left(live, item)]
                continue
            k = bisect_left(live, item)
            if k and live[k - 1][1] > item[0]:
                j = live[k - 1][2]
                raise ValueError(f"buffers {j} and {i} overlap in time and in address")
            if k < len(live) and live[k][0] < item[1]:
                j = live[k][2]
                raise ValueError(f"buffers {i} and {j} overlap in time and in address")
            live.insert(k, item)


# --------------------------------------------------------------------------------------------
# Input handling
# --------------------------------------------------------------------------------------------


def _as_int(v: Any, idx: int, name: str, buf: Any) -> int:
    # bool is an Integral subclass but a flag, not a quantity; floats are rejected even when
    # integral-valued so that unit mistakes (seconds vs steps, MB vs bytes) surface early.
    if isinstance(v, bool) or not isinstance(v, Integral):
        raise ValueError(f"buffer {idx} {buf!r}: {name} {v!r} is not an integer")
    return int(v)


def _normalize(buffers: Sequence[Any]) -> tuple[list[int], list[int], list[int]]:
    """Validate ``buffers`` and return parallel ``starts, ends, sizes`` lists of ints."""
    starts: list[int] = []
    ends: list[int] = []
    sizes: list[int] = []
    for idx, b in enumerate(buffers):
        # Fast path for the common case: a well-formed tuple of plain ints.
        if type(b) is tuple and len(b) == 3:
            s, e, z = b
            if type(s) is int and type(e) is int and type(z) is int and z >= 0 and e > s:
                starts.append(s)
                ends.append(e)
                sizes.append(z)
                continue
        if hasattr(b, "start") and hasattr(b, "end") and hasattr(b, "size"):
            s, e, z = b.start, b.end, b.size
        else:
            try:
                s, e, z = b
            except (TypeError, ValueError):
                raise ValueError(
                    f"buffer {idx} {b!r}: expected a (start, end, size) triple or an object "
                    "with .start/.end/.size"
                ) from None
        s = _as_int(s, idx, "start", b)
        e = _as_int(e, idx, "end", b)
        z = _as_int(z, idx, "size", b)
        if z < 0:
            raise ValueError(f"buffer {idx} (start={s}, end={e}, size={z}): negative size")
        if e <= s:
            raise ValueError(
                f"buffer {idx} (start={s}, end={e}, size={z}): end must be greater than start"
            )
        starts.append(s)
        ends.append(e)
        sizes.append(z)
    return starts, ends, sizes


def max_live(buffers: Sequence[Any], alignment: int = 1) -> int:
    """Largest sum of alignment-rounded sizes live at one step (the pool's lower bound)."""
    _check_alignment(alignment)
    starts, ends, sizes = _normalize(buffers)
    units = [-(-z // alignment) for z in sizes]
    return _max_live_units(starts, ends, units) * alignment


def _max_live_units(starts: list[int], ends: list[int], sizes: list[int]) -> int:
    # Ends sort before starts at the same step because the intervals are half-open.
    ev = sorted(chain(zip(ends, (-z for z in sizes)), zip(starts, sizes)))
    cur = best = 0
    for _, d in ev:
        cur += d
        if cur > best:
            best = cur
    return best


def _check_alignment(alignment: Any) -> None:
    if isinstance(alignment, bool) or not isinstance(alignment, Integral) or alignment < 1:
        raise ValueError(f"alignment must be an integer >= 1, got {alignment!r}")


# --------------------------------------------------------------------------------------------
# Problem in compressed form
# --------------------------------------------------------------------------------------------


class _Problem:
    """Buffers in alignment units over compressed time.

    Time is compressed to *sections*, one per distinct start step. Buffer ``i`` lives in
    sections ``[sl[i], sr[i])``; two buffers conflict iff those ranges intersect, exactly as
    their original half-open lifetimes do, and the live total of a section is the live total
    at its step (the maximum over the steps it stands for).
    """

    def __init__(self, starts: list[int], ends: list[int], units: list[int]) -> None:
        self.n = len(units)
        self.starts = starts
        self.ends = ends
        self.z = units
        # Only start points matter: two lifetimes intersect iff one contains the other's start,
        # so section k is "the step of the k-th distinct start" and buffer i lives in sections
        # [index of its start, number of distinct starts before its end). This halves the
        # sections compared with using every endpoint.
        pts = sorted(set(starts))
        index = {p: k for k, p in enumerate(pts)}
        self.sl = [index[s] for s in starts]
        self.sr = [bisect_left(pts, e) for e in ends]
        self.S = len(pts)
        self.lb = _max_live_units(starts, ends, units)
        self._deg: list[int] | None = None

    def degrees(self) -> list[int]:
        """Number of other buffers each buffer conflicts with (size-0 buffers included)."""
        if self._deg is None:
            ss = sorted(self.sl)
            es = sorted(self.sr)
            self._deg = [
                bisect_left(ss, s1) - bisect_right(es, s0) - 1 for s0, s1 in zip(self.sl, self.sr)
            ]
        return self._deg

    def pairs(self) -> int:
        return sum(self.degrees()) // 2

    def pool_of(self, offs: list[int]) -> int:
        return max((o + z for o, z in zip(offs, self.z) if z), default=0)


# --------------------------------------------------------------------------------------------
# Greedy best fit
# --------------------------------------------------------------------------------------------


def _union_insert(u: list[tuple[int, int]], a: int, b: int) -> None:
    """Insert ``[a, b)`` into ``u``, a sorted list of disjoint, non-touching intervals."""
    i = bisect_left(u, (a,))
    if i and u[i - 1][1] >= a:
        i -= 1
        if u[i][0] < a:
            a = u[i][0]
    j = i
    n = len(u)
    while j < n:
        lo, hi = u[j]
        if lo > b:
            break
        if hi > b:
            b = hi
        j += 1
    u[i:j] = [(a, b)]


def _greedy(
    p: _Problem, order: Sequence[int], fixed: Sequence[tuple[int, int]] = ()
) -> tuple[list[int], int]:
    """Best-fit placement of the buffers in ``order``; returns (offsets in units, pool units).

    ``fixed`` holds ``(buffer, offset)`` pairs placed first, as given (they must not conflict
    with each other); ``order`` should then list only the remaining buffers.

    Segment tree over sections, node ``v`` covering a range of sections. A placed buffer is
    stored at the O(log S) canonical nodes that tile its section range: in ``own[v]`` there,
    and in ``sub[u]`` for those nodes and all their ancestors. Both are merged address-interval
    unions, so packed neighbours collapse into one interval and the lists stay short. The
    buffers conflicting with a query range are exactly those in ``sub`` of the query's canonical
    nodes plus those in ``own`` of the nodes on the two boundary root paths.
    """
    sl, sr, z = p.sl, p.sr, p.z
    N = 1
    while N < p.S:
        N *= 2
    own: list[list[tuple[int, int]]] = [[] for _ in range(2 * N)]
    sub: list[list[tuple[int, int]]] = [[] for _ in range(2 * N)]
    offs = [0] * p.n
    pool = 0
    insert = _union_insert
    big = 1 << 62
    for k, best in fixed:
        offs[k] = best
        top = best + z[k]
        if not z[k]:
            continue
        pool = max(pool, top)
        lo = sl[k] + N
        hi = sr[k] + N
        while lo < hi:
            if lo & 1:
                insert(own[lo], best, top)
                insert(sub[lo], best, top)
                lo += 1
            if hi & 1:
                hi -= 1
                insert(own[hi], best, top)
                insert(sub[hi], best, top)
            lo >>= 1
            hi >>= 1
        v = (sl[k] + N) >> 1
        w = (sr[k] - 1 + N) >> 1
        while v:
            insert(sub[v], best, top)
            if w != v:
                insert(sub[w], best, top)
            v >>= 1
            w >>= 1
    for k in order:
        size = z[k]
        if not size:
            continue
        s0 = sl[k]
        s1 = sr[k]
        # Canonical cover of [s0, s1) and the two boundary root paths (merged once they meet).
        cover = []
        lo = s0 + N
        hi = s1 + N
        while lo < hi:
            if lo & 1:
                cover.append(lo)
                lo += 1
            if hi & 1:
                hi -= 1
                cover.append(hi)
            lo >>= 1
            hi >>= 1
        path = []
        v = (s0 + N) >> 1
        w = (s1 - 1 + N) >> 1
        while v != w:
            path.append(v)
            path.append(w)
            v >>= 1
            w >>= 1
        while v:
            path.append(v)
            v >>= 1
        pieces = [u for u in [sub[c] for c in cover] + [own[c] for c in path] if u]
        cur = 0
        best = -1
        bestlen = big
        if pieces:
            ivs = pieces[0] if len(pieces) == 1 else sorted(chain.from_iterable(pieces))
            for a, b in ivs:
                if a > cur:
                    g = a - cur
                    if size <= g < bestlen:
                        best = cur
                        bestlen = g
                        if g == size:
                            break
                if b > cur:
                    cur = b
        if best < 0:
            best = cur
        offs[k] = best
        top = best + size
        if top > pool:
            pool = top
        # Insert [best, top) into every affected union (inlined _union_insert: this loop is
        # the hot spot of the whole greedy).
        key = (best,)
        for u in [own[c] for c in cover] + [sub[c] for c in cover] + [sub[c] for c in path]:
            if not u:
                u.append((best, top))
                continue
            i = bisect_left(u, key)
            a = best
            b = top
            if i and u[i - 1][1] >= a:
                i -= 1
                if u[i][0] < a:
                    a = u[i][0]
            j = i
            n = len(u)
            while j < n:
                ulo, uhi = u[j]
                if ulo > b:
                    break
                if uhi > b:
                    b = uhi
                j += 1
            u[i:j] = [(a, b)]
    return offs, pool


def _greedy_orders(p: _Problem, full: bool) -> list[tuple[str, list[int]]]:
    """Buffer orders for the greedy portfolio; only greedy-by-size unless ``full``."""
    n = p.n
    z, st = p.z, p.starts
    ln = [e - s for s, e in zip(p.starts, p.ends)]
    idx = range(n)
    orders = [("greedy-size", sorted(idx, key=lambda i: (-z[i], -ln[i], st[i], i)))]
    if not full:
        return orders
    deg = p.degrees()
    orders += [
        ("greedy-size-start", sorted(idx, key=lambda i: (-z[i], st[i], i))),
        ("greedy-area", sorted(idx, key=lambda i: (-z[i] * ln[i], -z[i], i))),
        ("greedy-conflicts", sorted(idx, key=lambda i: (-deg[i], -z[i], i))),
        ("greedy-conflict-size", sorted(idx, key=lambda i: (-deg[i] * z[i], -z[i], i))),
        ("greedy-lifetime", sorted(idx, key=lambda i: (-ln[i], -z[i], i))),
        ("greedy-start", sorted(idx, key=lambda i: (st[i], -z[i], i))),
    ]
    return orders


# --------------------------------------------------------------------------------------------


def plan_offsets(buffers: Sequence[Any], *, alignment: int = 1) -> OffsetPlan:
    """Assign a pool offset to every buffer so that buffers live at the same time never overlap
    (greedy by size with best fit; deterministic).

    Args:
        buffers: ``(start, end, size)`` integer triples, or objects with ``.start``, ``.end`` and
            ``.size``; lifetimes are half-open ``[start, end)`` with ``end > start``, sizes are
            bytes ``>= 0``. Size-0 buffers get offset 0.
        alignment: every offset is a multiple of this; sizes are rounded up to it for packing
            (so ``max_live`` and ``pool_size`` are in rounded sizes).

    Returns:
        An :class:`OffsetPlan`; ``pool_size >= max_live`` always, with equality meaning optimal.

    Raises:
        ValueError: malformed buffer (message names its index and values) or alignment < 1.
    """
    _check_alignment(alignment)
    starts, ends, sizes = _normalize(buffers)
    p = _Problem(starts, ends, [-(-z // alignment) for z in sizes])
    ((method, order),) = _greedy_orders(p, full=False)
    offs, pool = _greedy(p, order)
    return OffsetPlan(
        offsets=tuple(o * alignment for o in offs),
        pool_size=pool * alignment,
        max_live=p.lb * alignment,
        method=method,
        alignment=alignment,
    )
