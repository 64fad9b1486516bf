"""Issue 19's predicted-against-measured matrix in one command: every mesh and configuration
measurable on this machine, each run by ``benchmarks/predict_step.py`` in its own ``torchrun``,
then one table with the goals checked (and, with ``--cpu-plans``, the same runs planned on
this machine without a GPU, as ``benchmarks/plan_vs_measured.py`` plans them).

    # on a machine with 2 GPUs (one GPU: --parts 1gpu):
    python benchmarks/predict_matrix.py --profile h200 --out docs/bench/predict/matrix \\
        -- --blocks-once --cudagraphs --memory-budget auto
    # afterwards, anywhere (no GPU): the table again from the reports in --out, with CPU plans
    python benchmarks/predict_matrix.py --merge-only --cpu-plans --out docs/bench/predict/matrix

The parts (``--parts``, default all that fit the GPUs here):

- ``1gpu``: world 1 (no communication), the 1b and wide models, 8/16/32 layers, batch 1/2/4,
  FP8, sequence 8192; with ``--gpus 0,1`` its configurations are split across those GPUs, one
  process each, run at the same time;
- ``fsdp2``, ``fsdp2-wide``: FSDP over 2 GPUs, the same configurations less the long sequence
  (two parts, so that each fits one call of a lent machine);
- ``hsdp2x1``, ``hsdp1x2``: HSDP meshes of 2 ranks (replicate x shard);
- ``tp2``: FSDP 1 x TP 2.

Each part writes ``predict_<part>[_<k>].json`` and ``.md`` under ``--out``; the table
(``predict_matrix.md``) is made from every such report there, so parts run by separate
invocations (machine calls) end in one table. Arguments after ``--`` go to every
``predict_step.py`` run (the shardc configuration: ``--blocks-once``, ``--cudagraphs``,
``--memory-budget``; ``--steps``). Goals (issue 19): the step within 10% of the measured median
(stretch 5%), exposed communication within max(2 ms, 25%), peak within 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _path in (_HERE.parent, _HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from predict_step import _ms  # noqa: E402

GIB = 1 << 30
# The 32-layer row last: it takes the longest, so a run cut short loses it alone.
SINGLE = ("1b:8:1,1b:8:2,1b:8:4,1b:16:4,wide:8:1,wide:8:2,wide:8:4,1b:8:4:fp8,1b:8:1:s8192,"
          "1b:32:4")
DOUBLE = "1b:8:1,1b:8:2,1b:8:4,1b:8:4:fp8,1b:16:4"
DOUBLE_WIDE_DEEP = "wide:8:1,wide:8:2,wide:8:4,1b:32:4"


@dataclass(frozen=True)
class Part:
    """One ``predict_step.py`` launch: ``nproc`` ranks, mesh arguments, configurations."""

    nproc: int
    mesh_args: tuple[str, ...]
    configs: str


PARTS = {
    "1gpu": Part(1, (), SINGLE),
    "fsdp2": Part(2, (), DOUBLE),
    "fsdp2-wide": Part(2, (), DOUBLE_WIDE_DEEP),
    "hsdp2x1": Part(2, ("--mesh", "2x1"), "1b:8:4,wide:8:2"),
    "hsdp1x2": Part(2, ("--mesh", "1x2"), "1b:8:4,1b:8:1"),
    "tp2": Part(2, ("--tp", "2"), "1b:8:4,wide:8:2"),
}


def split_configs(configs: str, n: int) -> list[str]:
    """``configs`` dealt round-robin into ``n`` lists (the slow ones spread out), none empty."""
    items = [c for c in configs.split(",") if c]
    groups = [",".join(items[k::n]) for k in range(n)]
    return [g for g in groups if g]


def launches(part: str, gpus: list[str], forward: list[str], out: Path
             ) -> list[tuple[list[str], dict[str, str]]]:
    """The commands (argv, extra environment) that run ``part``: one per GPU group."""
    spec = PARTS[part]
    groups = ([(gpus[k:k + 1], c) for k, c in enumerate(split_configs(spec.configs, len(gpus)))]
              if spec.nproc == 1 and len(gpus) > 1 else [(gpus[:spec.nproc], spec.configs)])
    runs = []
    for k, (devices, configs) in enumerate(groups):
        name = f"predict_{part}" + (f"_{k}" if len(groups) > 1 else "")
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                str(spec.nproc), "--master-port", str(29600 + 10 * list(PARTS).index(part) + k),
                str(_HERE / "predict_step.py"), *spec.mesh_args, "--configs", configs,
                "--out", str(out), "--name", name, *forward]
        env = {"CUDA_VISIBLE_DEVICES": ",".join(devices)} if devices else {}
        runs.append((argv, env))
    return runs


def run_parts(parts: list[str], gpus: list[str], forward: list[str], out: Path,
              deadline_s: float) -> None:
    """Each part in turn, a part's processes (one per GPU) at the same time; a process still
    running ``deadline_s`` after the start is killed (its report holds the configurations it
    finished: predict_step.py writes it after each), and no part starts within a minute of it."""
    out.mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + deadline_s
    for part in parts:
        if end - time.monotonic() < 60:
            print(f"{part}: not started (deadline)", flush=True)
            continue
        procs = []
        for argv, env in launches(part, gpus, forward, out):
            log = open(out / f"{argv[argv.index('--name') + 1]}.log", "w")
            print(f"[{time.strftime('%H:%M:%S')}] {part}: {' '.join(argv[2:])} "
                  f"{env or ''}", flush=True)
            # A session of its own: at the deadline the launcher and its ranks go together.
            procs.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                           env={**os.environ, **env}, start_new_session=True),
                          log))
        for proc, log in procs:
            try:
                proc.wait(timeout=max(end - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
            print(f"[{time.strftime('%H:%M:%S')}] {part}: exit {proc.returncode}", flush=True)


def load_reports(out: Path) -> list[dict]:
    """Every ``predict_<part>*.json`` under ``out`` (sorted by part, then name)."""
    order = {name: k for k, name in enumerate(PARTS)}

    def key(path: Path) -> tuple[int, str]:
        name = path.stem.removeprefix("predict_")  # a part, or a part's k-th process
        part = name if name in order else name.rsplit("_", 1)[0]
        return order.get(part, len(order)), path.name

    paths = sorted((p for p in out.glob("predict_*.json") if p.stem != "predict_matrix"), key=key)
    return [{**json.loads(p.read_text()), "path": str(p)} for p in paths]


@dataclass(frozen=True)
class Verdict:
    """One row's goals: each ``None`` where nothing was measured to compare with."""

    step_err: float | None
    exposed_ok: bool | None
    peak_err: float | None


def step_comm(r: dict) -> tuple[float | None, float | None]:
    """(least, most) communication waited for by a rank, seconds per step (the NCCL time with
    no other kernel running in reports without that measure): the least is the step's exposed
    communication (``predict_step.STEP_COMM_KEYS``; reports made before it kept the most, and
    each rank's in ``measured_per_rank``)."""
    ranks = r.get("measured_per_rank") or [r]
    values = [x.get("measured_waited_comm_s", x.get("measured_exposed_comm_s")) for x in ranks]
    values = [v for v in values if v is not None]
    return (min(values), max(values)) if values else (None, None)


def _exposed_ok(predicted: float | None, measured: float | None) -> bool | None:
    """Issue 19's goal: within 2 ms or 25% of the measured, whichever is larger (``None``
    where either is missing)."""
    if predicted is None or measured is None:
        return None
    return abs(predicted - measured) <= max(2e-3, 0.25 * measured)


def verdict(r: dict) -> Verdict:
    step = r.get("measured_step_s")
    step_err = r["predicted_step_s"] / step - 1 if step else None
    exposed_ok = _exposed_ok(r.get("predicted_exposed_comm_s"), step_comm(r)[0])
    peak = r.get("measured_peak_bytes")
    peak_err = r["predicted_peak_bytes"] / peak - 1 if peak else None
    return Verdict(step_err, exposed_ok, peak_err)


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v * 100:+.1f}%"


def cpu_plan(meta: dict, r: dict, profile: str | None = None) -> tuple[float, float, float]:
    """(step seconds, peak bytes, exposed communication seconds) of ``r``'s run planned here
    without a GPU, as ``plan_vs_measured.py`` plans it (the run's profile, or ``profile``
    where given: a run made with a profile file that is here under another path; mesh,
    precision, CUDA graphs and memory budget)."""
    from plan_vs_measured import plan_measured_row

    planned = plan_measured_row(meta, r, profile)
    return planned.step_s, planned.peak_bytes, planned.exposed_comm_s


def render(reports: list[dict], cpu_plans: bool = False, profile: str | None = None) -> str:
    lines = ["# Issue 19: predicted against measured, every configuration", "",
             "Made by `python benchmarks/predict_matrix.py` (the runs) and "
             "`python benchmarks/predict_matrix.py --merge-only"
             f"{' --cpu-plans' if cpu_plans else ''}` (this table). Runs:", ""]
    for rep in reports:
        m = rep["meta"]
        lines.append(f"- `{Path(rep['path']).name}`: `{m['command']}`; {m['git'][:12]}, "
                     f"{m['date']} UTC, {m['gpu']} x {m['world_size']}, torch {m['torch']}, "
                     f"profile {m['profile']}")
    head = ("| GPUs | mesh | model | layers | batch x seq | precision | predicted step ms | "
            "measured step ms | error | exposed comm pred / meas ms | peak pred / meas GiB | "
            "peak error |")
    align = "| ---: | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | --- | --- | ---: |"
    if cpu_plans:
        head += " CPU plan step ms | error | CPU plan peak GiB | error | CPU plan exposed ms |"
        align += " ---: | ---: | ---: | ---: | ---: |"
    lines += ["", head, align]
    verdicts, cpu_errs = [], []
    for rep in reports:
        m = rep["meta"]
        for r in rep["results"]:
            c = r["config"]
            cells = (f"| {m['world_size']} | {r.get('mesh', m.get('mesh'))} | {c['model']} | "
                     f"{c['layers']} | {c['batch']} x {c.get('seq') or m['seq']} | "
                     f"{c['precision']} |")
            if r.get("status") != "ok":
                lines.append(f"{cells} {r.get('status')}: {str(r.get('reason', ''))[:100]} |"
                             + " |" * (5 + (5 if cpu_plans else 0)))
                continue
            v = verdict(r)
            verdicts.append(v)
            peak = (lambda b: "–" if not b else f"{b / GIB:.2f}")
            least, most = step_comm(r)
            comm = _ms(least) + (f" ({_ms(most)})" if most is not None and most != least else "")
            row = (f"{cells} {_ms(r['predicted_step_s'])} | {_ms(r.get('measured_step_s'))} | "
                   f"{_pct(v.step_err)} | {_ms(r.get('predicted_exposed_comm_s'))} / {comm} | "
                   f"{peak(r.get('predicted_peak_bytes'))} / "
                   f"{peak(r.get('measured_peak_bytes'))} | {_pct(v.peak_err)} |")
            if cpu_plans:
                step_s, peak_bytes, exposed_s = cpu_plan(m, r, profile)
                step_err = step_s / r["measured_step_s"] - 1
                peak_err = (peak_bytes / r["measured_peak_bytes"] - 1
                            if r.get("measured_peak_bytes") else None)
                cpu_errs.append((step_err, peak_err, _exposed_ok(exposed_s, least)))
                row += (f" {step_s * 1e3:.1f} | {_pct(step_err)} | {peak_bytes / GIB:.2f} | "
                        f"{_pct(peak_err)} | {_ms(exposed_s)} |")
            lines.append(row)
    lines += ["", *summary(verdicts, cpu_errs if cpu_plans else None)]
    return "\n".join(lines) + "\n"


def summary(verdicts: list[Verdict], cpu_errs: list | None) -> list[str]:
    """How many rows meet each goal."""
    steps = [abs(v.step_err) for v in verdicts if v.step_err is not None]
    comm = [v.exposed_ok for v in verdicts if v.exposed_ok is not None]
    peaks = [abs(v.peak_err) for v in verdicts if v.peak_err is not None]
    out = [f"- step within 10%: {sum(e <= 0.10 for e in steps)} of {len(steps)} rows "
           f"(within 5%: {sum(e <= 0.05 for e in steps)}; largest |error| "
           f"{max(steps, default=0) * 100:.1f}%)",
           "- exposed communication within max(2 ms, 25%) of the measured (the least a rank "
           f"waited for; the other rank's in brackets): "
           f"{sum(comm)} of {len(comm)} rows with communication measured",
           f"- peak within 5%: {sum(e <= 0.05 for e in peaks)} of {len(peaks)} rows (largest "
           f"|error| {max(peaks, default=0) * 100:.1f}%)"]
    if cpu_errs is not None:
        cs = [abs(s) for s, _, _ in cpu_errs]
        cp = [abs(p) for _, p, _ in cpu_errs if p is not None]
        ce = [ok for _, _, ok in cpu_errs if ok is not None]
        out += [f"- CPU plans: step within 10% on {sum(e <= 0.10 for e in cs)} of {len(cs)} "
                f"rows, peak within 5% on {sum(e <= 0.05 for e in cp)} of {len(cp)}, exposed "
                f"communication within max(2 ms, 25%) on {sum(ce)} of {len(ce)}"]
    return out


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=None,
                   help=f"comma-separated parts of {', '.join(PARTS)} (default: those the GPUs "
                        "here can run)")
    p.add_argument("--profile", default=None, help="cluster profile for every run, and with "
                   "--merge-only --cpu-plans the one the CPU plans use (preset or "
                   "file); default: the preset for the GPU")
    p.add_argument("--gpus", default=None, help="GPU indices to use (default: all visible)")
    p.add_argument("--out", default="docs/bench/predict/matrix")
    p.add_argument("--deadline-s", type=float, default=24 * 3600.0,
                   help="stop (kill the runs in flight, start no more) this long after the start")
    p.add_argument("--merge-only", action="store_true",
                   help="no runs: the table from the reports under --out")
    p.add_argument("--cpu-plans", action="store_true",
                   help="also plan every row here without a GPU (plan_vs_measured.py's way)")
    p.add_argument("forward", nargs="*", help="after --: arguments for predict_step.py")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    out = Path(args.out)
    if not args.merge_only:
        import torch

        gpus = (args.gpus.split(",") if args.gpus
                else [str(k) for k in range(torch.cuda.device_count())])
        if not gpus:
            raise SystemExit("predict_matrix: no GPU here; use --merge-only to make the table")
        parts = (args.parts.split(",") if args.parts
                 else [n for n, p in PARTS.items() if p.nproc <= len(gpus)])
        unknown = [p for p in parts if p not in PARTS]
        if unknown:
            raise SystemExit(f"--parts: unknown {unknown}; choose from {list(PARTS)}")
        too_big = [p for p in parts if PARTS[p].nproc > len(gpus)]
        if too_big:
            raise SystemExit(f"--parts: {too_big} need {max(PARTS[p].nproc for p in too_big)} "
                             f"GPUs; {len(gpus)} here ({','.join(gpus)})")
        forward = list(args.forward)
        if args.profile:
            forward += ["--profile", args.profile]
        run_parts(parts, gpus, forward, out, args.deadline_s)
    reports = load_reports(out)
    if not reports:
        raise SystemExit(f"predict_matrix: no predict_*.json under {out}")
    # With --merge-only, --profile is the profile the CPU plans use (default: each run's).
    text = render(reports, cpu_plans=args.cpu_plans,
                  profile=args.profile if args.merge_only else None)
    (out / "predict_matrix.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
