"""Compare the host terms of calibrated profiles with their fit's spread (profile format 10;
issue 19): ``PYTHONPATH=$PWD python3 scripts/compare_host_fits.py P1.json P2.json ...``.

For each host term that calibration fits from several models (the per-parameter and fixed
terms, ``collective_launch_s``) prints every profile's value and ``[low, high]`` (the range of
the term fitted to each round alone), the spread's half-width relative to the value, and
whether every profile's value lies within every other profile's spread (``agree``: two
calibrations of the same code agree within their own noise; ``DISAGREE`` otherwise). Terms that
are zero in every profile are left out. A profile without a spread (before format 10) shows
``-``. Exits 0; it reports, it does not judge.
"""

from __future__ import annotations

import sys

from shardc.planning.profile import FIXED_FIELDS, PER_PARAM_FIELDS, ClusterProfile, load_profile

TERMS = (*PER_PARAM_FIELDS, *FIXED_FIELDS, "collective_launch_s")


def _cell(p: ClusterProfile, term: str) -> str:
    """``value [low, high] +-x%`` in us (per tensor, per collective) or ms (per step)."""
    scale, unit = (1e3, "ms") if term.endswith("_fixed_s") else (1e6, "us")
    value, spread = getattr(p, term), p.fit_spread(term)
    if spread is None:
        return f"{value * scale:.3g} {unit} -"
    low, high = spread
    rel = f" +-{(high - low) / 2 / value:.0%}" if value > 0 else ""
    return f"{value * scale:.3g} {unit} [{low * scale:.3g}, {high * scale:.3g}]{rel}"


def agree(profiles: list[ClusterProfile], term: str) -> bool | None:
    """Whether every profile's ``term`` lies within every other's spread (None where one has
    no spread for it)."""
    spreads = [p.fit_spread(term) for p in profiles]
    if any(s is None for s in spreads):
        return None
    return all(low <= getattr(p, term) <= high
               for p in profiles for (low, high) in spreads)


def main(paths: list[str]) -> int:
    profiles = [load_profile(path) for path in paths]
    for path, p in zip(paths, profiles):
        print(f"{path}: {p.name}, {p.device}, {p.gpus} rank(s), {p.date}, format {p.version}")
    for term in TERMS:
        if all(getattr(p, term) == 0 for p in profiles):
            continue
        verdict = {True: "agree", False: "DISAGREE", None: "-"}[agree(profiles, term)]
        print(f"{term:28s} " + " | ".join(_cell(p, term) for p in profiles) + f"  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
