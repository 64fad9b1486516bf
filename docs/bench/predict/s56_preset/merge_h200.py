"""Write the shipped ``h200`` preset from two H200 calibrations (issue 19, fifty-sixth session).

    python docs/bench/predict/s56_preset/merge_h200.py            # rewrites the preset
    python docs/bench/predict/s56_preset/merge_h200.py --check    # exit 1 if it would differ

The one-GPU calibration of 2026-12-05 (``docs/bench/compile_time/s55/gpu/h200_s55_profile.json``)
was made with the plain parameter reads, shardc's default since the fifty-third session, which
cut the host's seconds per parameter tensor; the preset's device, host, optimizer, FP8, host-link
and runtime terms come from it. One process times no collective, so its collective terms are
the format's defaults; those come from the 2 x H200 calibration of 2026-11-30
(``docs/bench/predict/s25_fit10/p1.json``, the preset until now, made with DTensor reads).
``command``, ``date`` and the first note name both runs and which fields each gave; every note
of a run keeps its source's date in front.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from shardc.planning.profile import ClusterProfile  # noqa: E402

ONE_GPU = ROOT / "docs/bench/compile_time/s55/gpu/h200_s55_profile.json"
TWO_GPU = ROOT / "docs/bench/predict/s25_fit10/p1.json"
PRESET = ROOT / "shardc/planning/profiles/h200.json"
# What only a calibration over several ranks measures: the collective curves, the links fitted
# to them, the host seconds per collective issued, compute's slowdown beside a collective, and
# the ranks it ran on. The GPUs per node is the format's default in both (one host cannot see
# the cluster's nodes), taken with the rest of the network's description.
FROM_TWO_GPU = ("collectives", "intra", "inter", "collective_launch_s", "overlap_slowdown",
                "node_size", "gpus")
# Provenance, written here rather than taken from either run.
PROVENANCE = ("name", "source", "command", "date", "notes", "host_fit_spread")
# Fields the two runs must agree on for one profile to describe both.
SAME_IN_BOTH = ("device", "torch", "device_memory_bytes", "version")
# The one-GPU run's note that its collective terms are the format's defaults: not true of the
# merged profile, so left out.
ONE_GPU_DEFAULTS_NOTE = "one process: no collective timings"


def merge(one_gpu: ClusterProfile, two_gpu: ClusterProfile) -> ClusterProfile:
    """``one_gpu`` with the fields of :data:`FROM_TWO_GPU` from ``two_gpu`` and provenance
    naming both."""
    for name in SAME_IN_BOTH:
        if getattr(one_gpu, name) != getattr(two_gpu, name):
            raise SystemExit(f"merge_h200: {name} differs ({getattr(one_gpu, name)!r} vs "
                             f"{getattr(two_gpu, name)!r}); one profile cannot hold both")
    if one_gpu.collectives:
        raise SystemExit("merge_h200: the one-GPU profile has collective curves; expected none")
    taken = {name: getattr(two_gpu, name) for name in FROM_TWO_GPU}
    # The spread of each fitted host term goes with the term: collective_launch_s's from the
    # run that fitted it, the others from the one-GPU run.
    spread = tuple(e for e in one_gpu.host_fit_spread if e[0] not in FROM_TWO_GPU) + tuple(
        e for e in two_gpu.host_fit_spread if e[0] in FROM_TWO_GPU)
    one_date, two_date = one_gpu.date, two_gpu.date
    merged_from = (
        f"merged by docs/bench/predict/s56_preset/merge_h200.py from two calibrations: "
        f"{', '.join(FROM_TWO_GPU)} and the spread of collective_launch_s from `{two_gpu.command}` "
        f"on 2 x H200 ({two_date}; docs/bench/predict/s25_fit10/p1.json, parameters read as "
        f"DTensors in compiled regions); every other measured field from `{one_gpu.command}` on "
        f"one H200 ({one_date}; docs/bench/compile_time/s55/gpu/h200_s55_profile.json, plain "
        "parameter reads, the default since the fifty-third session)")
    probe_note = (
        f"collective_launch_s ({two_gpu.collective_launch_s * 1e6:.1f} us) is kept as the "
        f"2 x H200 run fitted it, on a host whose probe timed "
        f"{two_gpu.host_probe_s * 1e3:.2f} ms with DTensor reads; host_probe_s is the one-GPU "
        f"run's ({one_gpu.host_probe_s * 1e3:.2f} ms), so a host-speed rescale "
        "(--refine-host) scales collective_launch_s as if it had been timed at that probe. "
        "No 2-GPU calibration with the plain reads exists yet")
    notes = (merged_from, probe_note,
             *(f"[{one_date}, one H200] {n}" for n in one_gpu.notes
               if not n.startswith(ONE_GPU_DEFAULTS_NOTE)),
             *(f"[{two_date}, 2 x H200] {n}" for n in two_gpu.notes
               if n.startswith("host per collective")))
    return dataclasses.replace(
        one_gpu, **taken, name="h200", source="measured",
        command=f"{one_gpu.command} (one H200, {one_date}) + {two_gpu.command} (2 x H200, "
                f"{two_date}: {', '.join(FROM_TWO_GPU)})",
        date=f"{one_date} + {two_date} (collectives)", host_fit_spread=spread, notes=notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one-gpu", default=str(ONE_GPU))
    parser.add_argument("--two-gpu", default=str(TWO_GPU))
    parser.add_argument("--out", default=None, help="default: the shipped h200 preset")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the preset differs from the merge")
    args = parser.parse_args(argv)
    merged = merge(ClusterProfile.from_json(Path(args.one_gpu).read_text()),
                   ClusterProfile.from_json(Path(args.two_gpu).read_text()))
    text = merged.to_json()
    out = Path(args.out) if args.out else PRESET
    if args.check:
        same = out.read_text() == text
        print(f"{out}: {'the merge' if same else 'differs from the merge'}")
        return 0 if same else 1
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
