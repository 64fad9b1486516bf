"""Benchmark for shardc.passes.allocator (static-pool offset assignment).

Usage::

    python benchmarks/allocator.py [--data ../shared/bench-data/dsa] [--out docs/allocator.md]

Relative paths resolve against the repository root (the parent of this script's folder), not
the current directory. For every ``*.csv`` trace (header ``id,lower,upper,size``, lifetimes
``[lower, upper)``) it reports max-live and, for four allocators, the pool, its excess over the
bound and the wall time:

(a) slot-style left-edge colouring: buffers sorted by start take the lowest free slot; each
    slot is as large as its largest buffer (what a naive "reuse a freed tensor's slot" planner
    does);
(b) plain greedy by size with best fit (each buffer, largest first, goes into the smallest gap
    left by the placed buffers it conflicts with), written naively here as the reference;
(c) ``plan_offsets(mode="fast")``;
(d) ``plan_offsets(mode="best")`` with 30 s for SOMAS traces and 10 s for the challenging ones.

The bound is max-live, except for MiniMalloc's challenging files where it is the capacity the
instance is known to fit (the number in the file name). A 20,000-buffer random instance checks
the fast mode's speed. The results go to a markdown file together with the command, date and
machine, and whether each goal is met.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import heapq
import os
import platform
import random
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.allocator_search import max_live, plan_offsets  # noqa: E402

Buffer = tuple[int, int, int]

SOMAS_LIMIT_S = 30.0
CHALLENGING_LIMIT_S = 10.0
SOMAS_GOAL = 1.003
CHALLENGING_GOAL = 1.05
RANDOM_N = 20_000
RANDOM_GOAL_S = 2.0


def load(path: Path) -> list[Buffer]:
    with path.open() as f:
        rows = csv.DictReader(f)
        return [(int(r["lower"]), int(r["upper"]), int(r["size"])) for r in rows]


# --------------------------------------------------------------------------------------------
# Baselines (kept here on purpose: the library should not carry them)
# --------------------------------------------------------------------------------------------


def slot_left_edge(bufs: list[Buffer]) -> int:
    """Left-edge interval colouring; pool = sum over colours of the colour's largest buffer."""
    order = sorted(range(len(bufs)), key=lambda i: (bufs[i][0], bufs[i][1], i))
    busy: list[tuple[int, int]] = []  # (end, slot)
    free: list[int] = []
    slot_size: list[int] = []
    for i in order:
        s, e, z = bufs[i]
        while busy and busy[0][0] <= s:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            k = heapq.heappop(free)
        else:
            k = len(slot_size)
            slot_size.append(0)
        slot_size[k] = max(slot_size[k], z)
        heapq.heappush(busy, (e, k))
    return sum(slot_size)


def greedy_by_size_best_fit(bufs: list[Buffer]) -> int:
    """Plain greedy by size with best fit; the placed buffers are bucketed by time block."""
    n = len(bufs)
    pts = sorted({p for s, e, _ in bufs for p in (s, e)})
    index = {p: k for k, p in enumerate(pts)}
    span = [(index[s], index[e]) for s, e, _ in bufs]
    block = 32
    buckets: list[list[int]] = [[] for _ in range(len(pts) // block + 1)]
    offs = [0] * n
    seen = [-1] * n
    pool = 0
    order = sorted(range(n), key=lambda i: (-bufs[i][2], bufs[i][0] - bufs[i][1], bufs[i][0], i))
    for i in order:
        a, b = span[i]
        z = bufs[i][2]
        if z == 0:
            continue
        ivs = []
        for q in range(a // block, (b - 1) // block + 1):
            for j in buckets[q]:
                if seen[j] != i and span[j][0] < b and a < span[j][1]:
                    seen[j] = i
                    ivs.append((offs[j], offs[j] + bufs[j][2]))
        ivs.sort()
        cur = 0
        best, best_gap = -1, None
        for lo, hi in ivs:
            if lo - cur >= z and (best_gap is None or lo - cur < best_gap):
                best, best_gap = cur, lo - cur
            cur = max(cur, hi)
        offs[i] = cur if best < 0 else best
        pool = max(pool, offs[i] + z)
        for q in range(a // block, (b - 1) // block + 1):
            buckets[q].append(i)
    return pool


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def timed(fn, *args, **kw):
    t = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t


def random_instance(n: int, seed: int = 0) -> list[Buffer]:
    """Starts uniform over 20,000 steps, lifetimes ~ 1 + Exp(mean 100), sizes log-uniform."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = rng.randrange(0, 20_000)
        out.append((s, s + 1 + int(rng.expovariate(1 / 100)), int(2 ** rng.uniform(6, 24))))
    return out


def pct(pool: int, bound: int) -> str:
    return f"{(pool / bound - 1) * 100:+.3f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="../shared/bench-data/dsa")
    ap.add_argument("--out", default="docs/allocator.md")
    ap.add_argument("--only", default="", help="regex: run only files whose name matches")
    args = ap.parse_args()
    data = Path(args.data)
    data = data if data.is_absolute() else (REPO / data).resolve()
    out = Path(args.out)
    out = out if out.is_absolute() else REPO / out
    files = sorted(data.glob("*.csv"), key=lambda p: ("somas" in p.name, p.name))
    if args.only:
        files = [f for f in files if re.search(args.only, f.name)]

    rows = []
    goals = {"somas": True, "challenging": True, "beat_greedy": True}
    for path in files:
        bufs = load(path)
        ml = max_live(bufs)
        m = re.search(r"\.(\d+)\.csv$", path.name)
        challenging = path.name.startswith("minimalloc") and m is not None
        bound = int(m.group(1)) if challenging else ml
        limit = CHALLENGING_LIMIT_S if challenging else SOMAS_LIMIT_S
        slot, t_slot = timed(slot_left_edge, bufs)
        greedy, t_greedy = timed(greedy_by_size_best_fit, bufs)
        fast, t_fast = timed(plan_offsets, bufs, mode="fast")
        best, t_best = timed(plan_offsets, bufs, mode="best", time_limit_s=limit)
        fast.check(bufs)
        best.check(bufs)
        if challenging:
            ok = best.pool_size <= CHALLENGING_GOAL * bound and t_best <= limit
            goals["challenging"] &= ok
        else:
            ok = best.pool_size <= SOMAS_GOAL * ml and t_best <= limit
            goals["somas"] &= ok
            beat = best.pool_size < greedy or best.pool_size == ml
            goals["beat_greedy"] &= beat
            ok = ok and beat
        row = (
            path.name, len(bufs), ml, bound,
            (slot, t_slot), (greedy, t_greedy), (fast.pool_size, t_fast),
            (best.pool_size, t_best), best.method, ok,
        )
        rows.append(row)
        print(
            f"{path.name}: n={len(bufs)} max-live={ml} slot {pct(slot, bound)} "
            f"greedy {pct(greedy, bound)} fast {pct(fast.pool_size, bound)} ({t_fast:.2f}s) "
            f"best {pct(best.pool_size, bound)} ({t_best:.2f}s, {best.method}) "
            f"{'ok' if ok else 'MISSED'}",
            flush=True,
        )

    rnd = random_instance(RANDOM_N)
    cpu = time.process_time()
    rplan, t_rnd = timed(plan_offsets, rnd, mode="fast")
    cpu = time.process_time() - cpu
    rplan.check(rnd)
    rnd_ok = t_rnd < RANDOM_GOAL_S
    print(
        f"random {RANDOM_N}: fast {t_rnd:.2f}s (cpu {cpu:.2f}s) "
        f"pool {pct(rplan.pool_size, rplan.max_live)}"
    )

    write_report(out, rows, goals, (rplan, t_rnd, rnd_ok, cpu), args)


def write_report(out: Path, rows, goals, rnd, args) -> None:
    rplan, t_rnd, rnd_ok, cpu = rnd
    try:
        load_avg = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load_avg = "n/a"
    cmd = "python benchmarks/allocator.py" + "".join(
        f" --{k} {v}" for k, v in vars(args).items() if v and v != DEFAULTS.get(k)
    )
    yes = {True: "met", False: "**not met**"}
    lines = [
        "# Static-pool offset assignment: benchmark",
        "",
        f"- Command: `{cmd}` (from the repository root)",
        f"- Date: {dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()} ({platform.python_implementation()}), "
        f"load average at the end {load_avg} (the machine was shared with other jobs, so wall "
        "times are pessimistic)",
        "- Data: `shared/bench-data/dsa` (SOMAS traces from the idealloc project, MIT; "
        "MiniMalloc's challenging set, Apache-2.0)",
        "",
        "## Results",
        "",
        "Pool excess over the bound (max-live; for `minimalloc_*` the known capacity 1,048,576) "
        "and wall time. Slot = left-edge colouring with one slot per colour; greedy = plain "
        "greedy by size with best fit (both in this script); fast / best = `plan_offsets` modes "
        f"(best: {SOMAS_LIMIT_S:.0f} s limit for SOMAS, {CHALLENGING_LIMIT_S:.0f} s for "
        "challenging).",
        "",
        "| file | n | max-live | slot | greedy | fast | best | best time "
        "| bytes over bound: greedy / best | winner | goal |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for name, n, ml, bound, slot, greedy, fast, best, method, ok in rows:
        lines.append(
            f"| {name} | {n} | {ml:,} | {pct(slot[0], bound)} ({slot[1]:.2f} s) "
            f"| {pct(greedy[0], bound)} ({greedy[1]:.2f} s) | {pct(fast[0], bound)} "
            f"({fast[1]:.2f} s) | {pct(best[0], bound)} | {best[1]:.2f} s "
            f"| {greedy[0] - bound:,} / {best[0] - bound:,} | {method} "
            f"| {'yes' if ok else '**no**'} |"
        )
    lines += [
        "",
        f"Random instance, {RANDOM_N:,} buffers (`random_instance` in the script): fast mode "
        f"{t_rnd:.2f} s wall ({cpu:.2f} s of CPU time), pool "
        f"{pct(rplan.pool_size, rplan.max_live)} over max-live.",
        "",
        "## Goals",
        "",
        f"- SOMAS traces: pool <= {SOMAS_GOAL} x max-live within {SOMAS_LIMIT_S:.0f} s each: "
        f"{yes[goals['somas']]}.",
        "- SOMAS traces: better than plain greedy by size on every file (or optimal where "
        f"greedy already is): {yes[goals['beat_greedy']]}.",
        f"- Challenging set: pool <= {CHALLENGING_GOAL} x 1,048,576 within "
        f"{CHALLENGING_LIMIT_S:.0f} s each: {yes[goals['challenging']]}.",
        f"- {RANDOM_N:,} random buffers in fast mode under {RANDOM_GOAL_S:.0f} s: "
        f"{yes[rnd_ok]}.",
        "",
        "## How it works",
        "",
        "`plan_offsets(buffers, alignment=1, time_limit_s=5.0, mode='best')` "
        "(`shardc/passes/allocator.py`, pure Python) runs a portfolio and keeps the smallest "
        "pool, stopping as soon as it equals max-live:",
        "",
        "1. **Greedy best fit** in seven orders (size, size then start, area, conflicts, "
        "conflicts x size, lifetime, start). Placed buffers sit in a segment tree over "
        "compressed time whose nodes hold merged address-interval unions, so finding the free "
        "gaps for a buffer touches O(log T) short lists. `mode='fast'` is this with the size "
        "order only.",
        "2. **Canonical depth-first search** (after MiniMalloc, Moffitt ASPLOS 2023) for "
        "instances up to 3,000 buffers: buffers are placed in non-decreasing offset order, each "
        "at the lowest offset its placed conflicts allow; a branch is cut when some time "
        "section cannot hold its unplaced buffers above its floor and above the current offset "
        "(section inference, with the floor raised to the lowest offset any unplaced buffer "
        "there can take), when a buffer would sit above the lowest height another unplaced "
        "buffer could reach (dominance), and the problem splits into independent time ranges "
        "once no unplaced buffer crosses a section boundary. The driver asks this decision "
        "search whether everything fits in max-live (first with MiniMalloc's default "
        "pre-order, then round-robin over twelve static pre-orders, since which one answers "
        "fast varies wildly), and walks down a ladder of capacities (max-live + 25 % .. 0.1 %) "
        "below the best pool, with node budgets doubling each round; an exhausted search "
        "proves a capacity infeasible. The schedule is fixed, so results do not depend on "
        "machine speed unless the time limit cuts it short.",
        "3. **Core search** for large traces: the buffers live where the live total is near "
        "the peak (a few hundred to two thousand of them) are packed by the same search as "
        "their own problem, and every improved core packing is completed by best fit for the "
        "remaining buffers, largest first. Perturbed greedy runs use any time left.",
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


DEFAULTS = {"data": "../shared/bench-data/dsa", "out": "docs/allocator.md", "only": ""}

if __name__ == "__main__":
    main()
