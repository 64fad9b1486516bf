"""Write the shipped ``h100`` preset from the one-H100 calibration of 2026-12-05 (issue 19,
fifty-eighth session).

    python docs/bench/predict/s58_h100/write_h100.py            # rewrites the preset
    python docs/bench/predict/s58_h100/write_h100.py --check    # exit 1 if it would differ

The preset is that calibration (``h100_s58.json`` here, as ``python -m shardc calibrate`` wrote
it) with two changes: its ``command`` names where the files are, and its FP8 host terms are
refitted by :func:`shardc.tools.host_cost.fp8_host_term` (the line through zero where the
two-depth line starts below zero, since the same day) from what the calibration's FP8 note
records was left per graph after the bf16 terms, printed to 10 us. A note says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from shardc.planning.profile import ClusterProfile  # noqa: E402
from shardc.tools.host_cost import fp8_host_term  # noqa: E402

CALIBRATION = ROOT / "docs/bench/predict/s58_h100/h100_s58.json"
PRESET = ROOT / "shardc/planning/profiles/h100.json"
COMMAND = ("python -m shardc calibrate --out /root/out/r/h100_s58.json (one H100 80GB HBM3, torch "
           "2.11, main 2c39ffd: plain parameter reads; docs/bench/predict/s58_h100/callA.sh, the "
           "file as written: docs/bench/predict/s58_h100/h100_s58.json)")
# The calibration's FP8 note: per FP8 model, its _scaled_mm count and what the bf16 terms left of
# the graph (seconds, as printed: to 10 us), forward and backward.
FP8_LEFT = {"fp8_forward_per_scaled_mm_s": ((15, 43), (1.17e-3, 5.15e-3)),
            "fp8_backward_per_scaled_mm_s": ((30, 86), (1.88e-3, 5.92e-3))}


def preset(calibration: ClusterProfile) -> ClusterProfile:
    """``calibration`` with :data:`COMMAND` and the refitted FP8 host terms, and a note."""
    fw, bw = (fp8_host_term(*FP8_LEFT[name]) for name in FP8_LEFT)
    note = ("FP8 host terms refitted on 2026-12-05 with the fit of "
            "shardc.tools.host_cost.fit_fp8_host_cost as changed that day (a line whose "
            "intercept is negative is replaced by the line through zero), from the residuals the "
            "FP8 note above prints (to 10 us): forward 1.17 / 5.15 ms at 15 / 43 _scaled_mm "
            f"(the line: -0.96 ms and 142.1 us) -> {fw * 1e6:.1f} us, backward 1.88 / 5.92 ms "
            f"at 30 / 86 (the line: -0.28 ms and 72.2 us) -> {bw * 1e6:.1f} us; the calibration "
            f"wrote {calibration.fp8_forward_per_scaled_mm_s * 1e6:.1f} / "
            f"{calibration.fp8_backward_per_scaled_mm_s * 1e6:.1f} us")
    return dataclasses.replace(calibration, command=COMMAND, fp8_forward_per_scaled_mm_s=fw,
                               fp8_backward_per_scaled_mm_s=bw,
                               notes=(*calibration.notes, note))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="default: the shipped h100 preset")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the preset differs from what it writes")
    args = parser.parse_args(argv)
    text = preset(ClusterProfile.from_json(CALIBRATION.read_text())).to_json()
    out = Path(args.out) if args.out else PRESET
    if args.check:
        same = out.read_text() == text
        print(f"{out}: {'as written' if same else 'differs from what the script writes'}")
        return 0 if same else 1
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
