"""The device's clock and power while each mode's timed rounds ran (``step_overhead --rounds``).

``step_overhead.py`` records each interleaved round's wall-clock span per mode
(``round_spans_unix_s``); ``nvidia-smi`` samples the device meanwhile::

    nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,\
clocks_throttle_reasons.active --format=csv -lms 200 > smi.csv &
    python benchmarks/step_overhead.py ... --rounds 3 --out R --name so
    python benchmarks/clocks_by_mode.py R/so.json smi.csv

prints, per mode, the samples inside its rounds: their count, the median SM clock and power, and
the share of samples with a power-cap (SW power cap 0x4, HW slowdown 0x8, HW power brake 0x80)
or thermal (0x20, 0x40) throttle reason set. nvidia-smi's timestamps are the device host's local
time; ``--utc-offset-h`` shifts them when that is not UTC.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from datetime import datetime, timedelta, timezone
from pathlib import Path

POWER_REASONS = 0x4 | 0x8 | 0x80
THERMAL_REASONS = 0x20 | 0x40


def read_samples(path: Path, utc_offset_h: float) -> list[dict[str, float]]:
    """nvidia-smi's CSV as ``{"t": unix s, "sm_mhz", "power_w", "reasons"}`` rows."""
    rows = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader)]
        col = {name.split(" ")[0]: i for i, name in enumerate(header)}
        # (named clocks_throttle_reasons or clocks_event_reasons, by driver)
        reasons = col[next(k for k in col if k.startswith("clocks_") and "reasons" in k)]
        for rec in reader:
            if len(rec) != len(header):
                continue
            stamp = datetime.strptime(rec[col["timestamp"]].strip(), "%Y/%m/%d %H:%M:%S.%f")
            stamp = stamp.replace(tzinfo=timezone.utc) - timedelta(hours=utc_offset_h)
            rows.append({"t": stamp.timestamp(),
                         "sm_mhz": float(rec[col["clocks.current.sm"]].split()[0]),
                         "power_w": float(rec[col["power.draw"]].split()[0]),
                         "reasons": int(rec[reasons].strip(), 16)})
    return rows


def by_mode(report: dict, samples: list[dict[str, float]]) -> list[dict[str, object]]:
    out = []
    for row in report["rows"]:
        spans = row.get("round_spans_unix_s") or []
        inside = [s for s in samples if any(a <= s["t"] <= b for a, b in spans)]
        if not inside:
            out.append({"mode": row["mode"], "samples": 0})
            continue
        out.append({
            "mode": row["mode"], "samples": len(inside),
            "step_ms": row.get("step_ms"),
            "sm_mhz_median": statistics.median(s["sm_mhz"] for s in inside),
            "sm_mhz_min": min(s["sm_mhz"] for s in inside),
            "power_w_median": statistics.median(s["power_w"] for s in inside),
            "power_capped_share": sum(bool(s["reasons"] & POWER_REASONS) for s in inside)
            / len(inside),
            "thermal_share": sum(bool(s["reasons"] & THERMAL_REASONS) for s in inside)
            / len(inside),
        })
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("report", type=Path, help="step_overhead's JSON (run with --rounds)")
    p.add_argument("samples", type=Path, help="nvidia-smi's CSV")
    p.add_argument("--utc-offset-h", type=float, default=0.0)
    args = p.parse_args()
    rows = by_mode(json.loads(args.report.read_text()),
                   read_samples(args.samples, args.utc_offset_h))
    print("| mode | step ms | samples | SM MHz median (min) | power W median | "
          "power-capped share | thermal share |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if not r["samples"]:
            print(f"| {r['mode']} | | 0 | | | | |")
            continue
        print(f"| {r['mode']} | {r['step_ms']:.2f} | {r['samples']} | {r['sm_mhz_median']:.0f} "
              f"({r['sm_mhz_min']:.0f}) | {r['power_w_median']:.0f} | "
              f"{r['power_capped_share']:.2f} | {r['thermal_share']:.2f} |")


if __name__ == "__main__":
    main()
