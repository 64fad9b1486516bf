"""Fitting and interpolating measured timings: plain arithmetic, no torch.

The cluster profile (:mod:`shardc.planning.profile`) stores measured points and a few fitted
constants; :mod:`shardc.calibrate` measures them. Everything here is a pure function of numbers so
that tests can feed synthetic timings from a known model and check that the fit recovers it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = a + b * x``; returns ``(a, b)``. Needs two distinct ``x``."""
    n = len(xs)
    if n != len(ys) or n < 2:
        raise ValueError("shardc fit: a line needs at least two (x, y) points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        raise ValueError("shardc fit: the points' x values are all equal; measure other sizes")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def fit_through_origin(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least squares ``y = b * x`` (no intercept); returns ``b``. Needs a nonzero ``x``."""
    if len(xs) != len(ys) or not any(xs):
        raise ValueError("shardc fit: a line through zero needs points with a nonzero x")
    return sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """``seconds = alpha + size / bandwidth`` by least squares, weighted so that every point
    counts by its relative error (small sizes would otherwise not count at all): returns
    ``(alpha, bandwidth)`` with ``alpha >= 0``. Raises when the timings do not grow with size."""
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError("shardc fit: alpha-beta needs at least two (size, seconds) points")
    # Weighted normal equations for t = a + x * inv_b with weights 1 / t^2.
    w = [1.0 / (t * t) for t in seconds]
    s0 = sum(w)
    s1 = sum(wi * x for wi, x in zip(w, sizes))
    s2 = sum(wi * x * x for wi, x in zip(w, sizes))
    t0 = sum(wi * t for wi, t in zip(w, seconds))
    t1 = sum(wi * x * t for wi, x, t in zip(w, sizes, seconds))
    det = s0 * s2 - s1 * s1
    if det <= 0:
        raise ValueError("shardc fit: alpha-beta needs timings of at least two different sizes")
    alpha = (t0 * s2 - t1 * s1) / det
    inv_b = (s0 * t1 - s1 * t0) / det
    if inv_b <= 0:
        raise ValueError("shardc fit: the timings do not grow with the size (no bandwidth)")
    if alpha < 0:  # latency below resolution: fit the bandwidth alone
        alpha, inv_b = 0.0, t1 / s2
    return alpha, 1.0 / inv_b


def fit_alpha_beta_ranges(sizes: Sequence[float], seconds: Sequence[float],
                          bounds: Sequence[float]) -> list[tuple[float, float, float]]:
    """One alpha-beta fit per size range: ``bounds`` are the ranges' upper ends (the last range
    is open). Returns ``[(upper, alpha, bandwidth), ...]`` for the ranges with two or more
    points (``math.inf`` for the open one)."""
    edges = [*bounds, math.inf]
    out, lo = [], -math.inf
    for hi in edges:
        pts = [(s, t) for s, t in zip(sizes, seconds) if lo < s <= hi]
        if len(pts) >= 2 and len({s for s, _ in pts}) >= 2:
            alpha, bw = fit_alpha_beta([s for s, _ in pts], [t for _, t in pts])
            out.append((hi, alpha, bw))
        lo = hi
    return out


def interp_linear(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear ``y(x)`` through ``points`` (sorted by x here); beyond the last point
    it goes on along the last segment's slope, below the first it scales the first point
    proportionally towards zero only down to its intercept (a time never drops below the
    latency the first segment implies)."""
    pts = sorted(points)
    if not pts:
        raise ValueError("shardc fit: no points to interpolate")
    if len(pts) == 1:
        x0, y0 = pts[0]
        return y0 * x / x0 if x0 else y0
    if x <= pts[0][0]:
        (x0, y0), (x1, y1) = pts[0], pts[1]
        slope = (y1 - y0) / (x1 - x0)
        return max(y0 - slope * (x0 - x), y0 - slope * x0, 0.0)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + (y1 - y0) / (x1 - x0) * (x - x1)


def interp_log(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear in ``log(x)`` through ``points``, clamped to the end values (a rate by
    size: larger than measured is as fast as the largest, smaller as slow as the smallest)."""
    pts = sorted(points)
    if not pts:
        raise ValueError("shardc fit: no points to interpolate")
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    lx = math.log(x)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            f = (lx - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + (y1 - y0) * f
    return pts[-1][1]  # not reached


def interp_nearest_log(points: Sequence[tuple[tuple[float, ...], float]],
                       key: tuple[float, ...], neighbours: int = 4) -> float:
    """A value at ``key`` from points keyed by positive tuples (e.g. a matmul's ``(m, n, k)``):
    inverse-distance weighting over the ``neighbours`` nearest points in log2 space; an exact
    match returns its value."""
    if not points:
        raise ValueError("shardc fit: no points to interpolate")
    lk = [math.log2(max(v, 1.0)) for v in key]
    dists = []
    for pkey, value in points:
        d = math.sqrt(sum((math.log2(max(v, 1.0)) - q) ** 2 for v, q in zip(pkey, lk)))
        if d < 1e-9:
            return value
        dists.append((d, value))
    dists.sort(key=lambda dv: dv[0])
    near = dists[:neighbours]
    weights = [1.0 / (d * d) for d, _ in near]
    return sum(w * v for w, (_, v) in zip(weights, near)) / sum(weights)


def fit_per_param(counts: Sequence[float], seconds: Sequence[float], what: str
                  ) -> tuple[float, float]:
    """``seconds = fixed + counts * per_param`` by least squares over timings of one phase at
    two or more parameter-tensor counts, both terms constrained to be non-negative (a bounded
    least squares); returns ``(fixed, per_param)``. ``what`` names the phase in errors.

    Why bounded: the calibration measures two depths, so the unconstrained line goes exactly
    through both points and trades one term against the other: a negative fixed part with a
    steeper slope (on 2 x H200, the forward graph -0.90 ms per step and 75.3 us per tensor)
    fits the two measured models and over-prices every deeper one. Where the unconstrained
    solution has a negative term, the optimum lies on a bound: the line through the origin
    (``fixed = 0``) or the mean (``per_param = 0``, a slope lost in noise), whichever leaves the
    smaller squared residual; timings that are all negative (a phase the other terms already
    price in full) give ``(0, 0)``."""
    if len(counts) != len(seconds) or len(set(counts)) < 2:
        raise ValueError(f"shardc fit: {what}: host seconds per parameter tensor need timings "
                         f"at two or more different parameter counts (got counts {list(counts)})")
    if any(not math.isfinite(t) for t in seconds):
        raise ValueError(f"shardc fit: {what}: a timing is not a finite number ({list(seconds)})")
    fixed, per_param = fit_line(counts, seconds)
    if fixed >= 0 and per_param >= 0:
        return fixed, per_param

    def residual(a: float, b: float) -> float:
        return sum((a + b * n - t) ** 2 for n, t in zip(counts, seconds))

    through_origin = (0.0, max(fit_through_origin(counts, seconds), 0.0))
    flat = (max(sum(seconds) / len(seconds), 0.0), 0.0)
    return min((through_origin, flat), key=lambda ab: residual(*ab))


def fit_least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float], what: str
                      ) -> list[float]:
    """Least-squares coefficients ``c`` of ``y = sum(row[j] * c[j])`` over the given rows (one
    row of regressors per point, every row as long); ``what`` names the fit in errors.

    Solved by the normal equations with each column scaled to its largest magnitude first (a
    count of hundreds beside a constant 1 would otherwise lose digits) and Gaussian elimination
    with partial pivoting. Raises ``ValueError`` where the columns are linearly dependent at
    the given points (the design cannot tell the terms apart: measure other points) or there
    are fewer points than terms."""
    if not rows or len(rows) != len(ys):
        raise ValueError(f"shardc fit: {what}: need one y per row of regressors")
    width = len(rows[0])
    if any(len(r) != width for r in rows) or len(rows) < width:
        raise ValueError(f"shardc fit: {what}: {len(rows)} points cannot fit {width} terms")
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(width)]
    x = [[r[j] / scale[j] for j in range(width)] for r in rows]
    # Normal equations [X'X | X'y], solved in place.
    a = [[sum(xr[i] * xr[j] for xr in x) for j in range(width)]
         + [sum(xr[i] * y for xr, y in zip(x, ys))] for i in range(width)]
    for col in range(width):
        pivot = max(range(col, width), key=lambda r: abs(a[r][col]))
        # Relative to the column's own scale (1 after scaling): a pivot this small means
        # the column is, to rounding, a combination of the ones before it.
        if abs(a[pivot][col]) < 1e-9 * len(rows):
            raise ValueError(f"shardc fit: {what}: the points cannot tell the terms apart "
                             "(linearly dependent regressors); measure other points")
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(width):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [v - f * p for v, p in zip(a[r], a[col])]
    return [a[j][width] / a[j][j] / scale[j] for j in range(width)]


def value_range(central: float, others: Sequence[float]) -> tuple[float, float]:
    """``(low, high)``: the smallest and largest of ``central`` and ``others`` (a fitted
    term's spread: the term fitted to all the points and to subsets of them, such as each
    round of repeated measurements)."""
    values = [central, *others]
    return min(values), max(values)
