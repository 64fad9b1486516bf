"""Measured peak against the whole-step peak budget (issue 22), over a sweep of budgets, and the
FSDP2 configurations it is compared with.

Runs ``train_bench.py --modes shardc-budget`` once per budget (``SHARDC_PEAK_BUDGET``), each in
its own ``torchrun``, and prints per budget: the planner's minimum, its predicted peak, the
buckets it kept gathered, the blocks it recomputed, the measured peak (``max_memory_allocated``)
and tokens/s. Without ``--budgets`` it first runs ``auto`` (the device's capacity less a
margin), reads the predicted peak from it, then runs a 1-byte budget, which is refused naming
the feasible minimum (every bucket resharded, every block that can be recomputed recomputed)
and the smallest budget accepted (the minimum plus the margin for the prediction's error,
``peak_memory_margin``), and sweeps ``--count`` budgets evenly between the two, plus one
just below the smallest (which must be refused at compile time). Budgets below the fully
resharded plan's peak recompute blocks.

``--offload-budgets B ...`` runs shardc sharded with ``shardc.OffloadPolicy()`` (its parameter
shards, gradients and optimizer state on the host; mode ``shardc-offload-budget``) under each
budget too: rows labelled ``shardc offload <budget>``, shardc's points beside FSDP2's
``CPUOffloadPolicy`` (offloading the parameters is the user's choice at ``shardc.shard``, which
the budget's refusal names; the planner does not move them itself).

``--baselines`` (no value: FSDP2 alone with compiled blocks, with full activation
checkpointing, with selective checkpointing, with torch's ``activation_memory_budget`` 0.5 and
with ``CPUOffloadPolicy``; or name the modes, e.g. ``fsdp2-compile-amb0.3``) runs each FSDP2
configuration in its own ``torchrun`` too; ``--no-sweep`` runs the baselines only.

Every row is merged into ``<out>/curve_rows.json`` (a row replaces the earlier one with the
same label and configuration; rows of another configuration, i.e. model, layers, batch,
sequence or world size, are dropped with a note, ``--fresh`` starts over), and after every row
the curve is written from all of them: ``<out>/curve.md`` (a table with, per budget, the best
FSDP2 configuration whose measured peak fits it, and the goals) and ``<out>/curve.svg`` (tokens/s
against measured peak, drawn by hand: no plotting package needed; also ``curve.png`` where
matplotlib is installed). So a long sweep can be run
in pieces (``--budgets``, ``--no-sweep --baselines``) into one directory, each piece under the
device's time limit: with ``--deadline-s`` no run starts that would end past it, and the same
command run again skips what has a row already (a run that trained or was refused; ``--redo``
runs them again) and reuses the budgets derived from the first ``auto`` and 1-byte runs
(``<out>/sweep_budgets.json``).

    python benchmarks/budget_sweep.py --nproc 1 --model 1b --count 8 -- --n-layers 8
    python benchmarks/budget_sweep.py --nproc 1 --model 1b --no-sweep --baselines -- --n-layers 8
    python benchmarks/budget_sweep.py --nproc 2 --model 1b --budgets 30e9 32e9   # a chunk
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Runnable from a checkout, shardc uninstalled: the repository (shardc) and benchmarks/ (train).
for _path in (HERE.parent, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from train.curve import curve_markdown, curve_png, curve_svg  # noqa: E402
from train.modes import CURVE_BASELINES  # noqa: E402

ROWS = "curve_rows.json"
OFFLOAD_LABEL = "shardc offload"  # rows of --offload-budgets: "shardc offload <budget>"
_RUNNING: list[subprocess.Popen] = []  # the torchrun in flight (its own process session)


def stop(proc: subprocess.Popen) -> None:
    """Stop a torchrun and its workers: SIGTERM first (torchrun stops its workers, which run
    in sessions of their own, out of reach of a signal to its group), SIGKILL after 30 s."""
    for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _kill_running(signum: int, frame) -> None:
    """Killed (``timeout``, Ctrl-C): take the torchrun in flight and its workers along, which
    their own sessions would otherwise keep running on the GPU."""
    for proc in list(_RUNNING):
        stop(proc)
    raise SystemExit(128 + signum)


def kill_runs_on_exit() -> None:
    """Install :func:`_kill_running` for SIGTERM and SIGINT (the scripts' ``main`` calls it)."""
    signal.signal(signal.SIGTERM, _kill_running)
    signal.signal(signal.SIGINT, _kill_running)


def torchrun(mode: str, name: str, args, out: Path, env: dict[str, str] | None = None,
             extra: list[str] | None = None, steps: int | None = None) -> tuple[dict, str]:
    """One ``train_bench.py`` run of ``mode`` in its own ``torchrun`` (a fresh process: an
    out-of-memory cannot poison the next run), killed with its workers after
    ``--run-timeout-s``. Returns (the mode's result and settings, or ``{}``; the output's tail)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
           str(HERE / "train_bench.py"), "--model", args.model, "--modes", mode,
           "--steps", str(steps or args.steps), "--warmup", "2", "--profile-steps", "0",
           "--no-dump-plan", "--out", str(out), "--name", name, *(extra or []), *args.extra]
    path = out / f"{name}.json"
    path.unlink(missing_ok=True)
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    _RUNNING.append(proc)
    try:
        text, _ = proc.communicate(timeout=args.run_timeout_s)
    except subprocess.TimeoutExpired:
        stop(proc)
        text, _ = proc.communicate()
        text += f"\n[killed after {args.run_timeout_s:.0f} s]"
    finally:
        _RUNNING.remove(proc)
    if not path.exists():
        return {}, f"no report (rc {proc.returncode}): " + text[-1500:]
    report = json.loads(path.read_text())
    model = report["models"][args.model]
    result = dict(model["results"][mode])
    s = model["settings"]
    result["config"] = (f"{args.model} layers={s['n_layers']} batch={s['batch']} seq={s['seq']} "
                        f"world={report['meta']['world_size']}")
    return result, text[-1500:]


def _common(result: dict) -> dict:
    return {"status": result.get("status"), "error": str(result.get("error", ""))[:700],
            "config": result.get("config"),
            "measured_peak_bytes": result.get("peak_alloc_bytes"),
            "peak_reserved_bytes": result.get("peak_reserved_bytes"),
            "tokens_per_s_per_gpu": result.get("tokens_per_s_per_gpu"),
            "step_ms_median": result.get("step_ms_median")}


def run(budget: str, args, out: Path, offload: bool = False) -> dict:
    """shardc under one budget (bytes or ``auto``): a row of the sweep; ``offload``: sharded
    with ``shardc.OffloadPolicy()`` (``shardc-offload-budget``)."""
    name, label = (f"offload_budget_{budget}", f"{OFFLOAD_LABEL} {budget}") if offload \
        else (f"budget_{budget}", f"shardc {budget}")
    env = {"SHARDC_PEAK_BUDGET": budget}
    if args.margin is not None:
        env["SHARDC_PEAK_MARGIN"] = str(args.margin)
    mode = "shardc-offload-budget" if offload else "shardc-budget"
    result, tail = torchrun(mode, name, args, out, env)
    if not result:
        return {"kind": "shardc", "label": label, "budget": budget,
                "status": "no report", "tail": tail}
    region = max(result.get("regions", [{}]), key=lambda r: r.get("budget", {}).get(
        "peak_bytes", 0), default={})
    error = str(result.get("error", ""))
    named = re.search(r"feasible minimum (\d+) B", error)  # a refusal names the minimum
    # ... and the smallest budget accepted (the minimum plus the prediction's margin).
    smallest = re.search(r"smallest budget accepted is (\d+) B", error)
    return {"kind": "shardc", "label": label, "budget": budget, **_common(result),
            "named_minimum_bytes": int(named.group(1)) if named else None,
            "smallest_budget_bytes": int(smallest.group(1)) if smallest else None,
            "budget_bytes": int(budget) if budget.isdigit() else None,
            **region.get("budget", {})}


def run_baseline(mode: str, args, out: Path) -> dict:
    """One FSDP2 configuration: a point of the curve."""
    result, tail = torchrun(mode, f"baseline_{mode}", args, out)
    if not result:
        return {"kind": "baseline", "label": mode, "status": "no report", "tail": tail}
    return {"kind": "baseline", "label": mode, **_common(result),
            **{k: result[k] for k in ("checkpoint", "offload", "activation_memory_budget")
               if k in result}}


def merge(rows: list[dict], row: dict) -> list[dict]:
    """``rows`` with ``row`` replacing the one with its label; rows of another configuration
    dropped (said once on stderr)."""
    config = row.get("config")
    if config:
        other = [r for r in rows if r.get("config") and r["config"] != config]
        if other:
            print(f"dropping {len(other)} earlier row(s) of another configuration "
                  f"({other[0]['config']}; this one: {config})", file=sys.stderr)
        rows = [r for r in rows if not r.get("config") or r["config"] == config]
    return [r for r in rows if r.get("label") != row.get("label")] + [row]


def write_curve(rows: list[dict], out: Path, title: str) -> None:
    (out / ROWS).write_text(json.dumps(rows, indent=1) + "\n")
    (out / "curve.md").write_text(curve_markdown(rows, title))
    (out / "curve.svg").write_text(curve_svg(rows, title))
    curve_png(rows, str(out / "curve.png"), title)  # where matplotlib is installed


def sweep_budgets(args, out: Path, add) -> list[str]:
    """The budgets to sweep: ``--budgets``; or those an earlier invocation derived with the same
    arguments (``<out>/sweep_budgets.json``, unless ``--fresh``); or derived now from an
    ``auto`` run and a refused 1-byte one (and saved there)."""
    if args.budgets:
        return [_budget_arg(b) for b in args.budgets]
    saved, key = out / "sweep_budgets.json", _sweep_key(args)
    if saved.exists() and not args.fresh:
        data = json.loads(saved.read_text())
        if data.get("key") == key:
            print(f"budgets from {saved} (an earlier invocation's auto and 1-byte runs)")
            return data["budgets"]
    budgets = derive_budgets(args, out, add)
    saved.write_text(json.dumps({"key": key, "budgets": budgets}, indent=1) + "\n")
    return budgets


def _budget_arg(budget: str) -> str:
    """A budget argument as the runs name it: ``auto``, or whole bytes."""
    return budget if budget == "auto" else str(int(float(budget)))


def _sweep_key(args) -> list:
    return [args.model, args.nproc, args.count, args.margin, list(args.extra)]


def derive_budgets(args, out: Path, add) -> list[str]:
    """``--count`` budgets from the smallest accepted to the unconstrained plan's, and one
    below the smallest; from an ``auto`` run and a refused 1-byte one."""
    auto = add(run("auto", args, out))
    low, high = auto.get("minimum_bytes"), auto.get("peak_bytes")
    if not low:
        print(json.dumps(auto, indent=1))
        sys.exit("the auto run gave no budget record")
    # The refusal of a 1-byte budget names the smallest budget accepted: the feasible
    # minimum with recompute, plus the margin for the prediction's error.
    probe = run("1", args, out)
    low = probe.get("smallest_budget_bytes") or probe.get("named_minimum_bytes") or low
    # Keeping everything can predict a lower peak than resharding everything (the backward's
    # re-gather buffers go); then sweep from the lower one up 10 %. The predicted peak of the
    # auto run is planned for less the margin: the budget that allows it is higher.
    high = int(high * (1 + (auto.get("margin_fraction") or 0.0)))
    low, high = min(low, high), max(high, low)
    high = max(high, int(low * 1.1))
    step = (high - low) / max(args.count - 1, 1)
    return [str(int(low + i * step)) for i in range(args.count)] + [str(low - 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--model", default="1b")
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--budgets", nargs="*", default=None, help="bytes (floats allowed) or auto")
    p.add_argument("--margin", type=float, default=None,
                   help="shardc's peak_memory_margin (default: shardc's, 0.02)")
    p.add_argument("--baselines", nargs="*", default=None, metavar="MODE",
                   help="also run these FSDP2 modes (no value: "
                        f"{' '.join(CURVE_BASELINES)})")
    p.add_argument("--offload-budgets", nargs="*", default=None, metavar="B",
                   help="also run shardc sharded with shardc.OffloadPolicy() (parameter "
                        "shards, gradients and optimizer state on the host) under these budgets "
                        "(bytes or auto): the shardc points to set beside FSDP2's "
                        "CPUOffloadPolicy")
    p.add_argument("--no-sweep", action="store_true", help="run no shardc budget")
    p.add_argument("--fresh", action="store_true",
                   help=f"start {ROWS} (and the derived budgets) over")
    p.add_argument("--redo", action="store_true",
                   help="run budgets and baselines again that have a row already")
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="start no run that would end past this many seconds (estimated from "
                        "the slowest run so far); the same command again goes on (0: none)")
    p.add_argument("--run-estimate-s", type=float, default=90.0,
                   help="a run's time before one was measured (for --deadline-s)")
    p.add_argument("--run-timeout-s", type=float, default=600.0,
                   help="kill a run (torchrun and its workers) after this many seconds")
    p.add_argument("--out", default="docs/bench/budget")
    p.add_argument("extra", nargs="*", help="more train_bench.py arguments (after --)")
    args = p.parse_args()
    kill_runs_on_exit()
    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ROWS
    rows: list[dict] = [] if args.fresh or not path.exists() else json.loads(path.read_text())
    title = f"{args.model} {' '.join(args.extra)} on {args.nproc} GPU(s)".replace("  ", " ")

    def add(row: dict) -> dict:
        nonlocal rows
        rows = merge(rows, row)
        write_curve(rows, out, title)
        print(json.dumps({k: v for k, v in row.items() if k not in ("decisions", "tail")}),
              flush=True)
        return row

    todo: list[tuple[str, str]] = []
    if not args.no_sweep:
        todo += [("shardc", b) for b in sweep_budgets(args, out, add)]
    todo += [("offload", _budget_arg(b)) for b in args.offload_budgets or ()]
    if args.baselines is not None:
        todo += [("baseline", m) for m in args.baselines or CURVE_BASELINES]
    done = {r["label"] for r in rows if r.get("status") in ("ok", "error")}
    slowest = args.run_estimate_s
    labels = {"shardc": "shardc {}", "offload": OFFLOAD_LABEL + " {}", "baseline": "{}"}
    for kind, what in todo:
        label = labels[kind].format(what)
        if label in done and not args.redo:
            print(f"{label}: done in {path} (--redo runs it again)")
            continue
        if args.deadline_s and time.monotonic() - t0 + slowest > args.deadline_s:
            print(f"stopped: no time for {label} before --deadline-s {args.deadline_s:.0f}; "
                  "run the same command again to go on", flush=True)
            break
        t = time.monotonic()
        add(run_baseline(what, args, out) if kind == "baseline"
            else run(what, args, out, offload=kind == "offload"))
        slowest = max(slowest, time.monotonic() - t)
    print("\nbudget B | status | minimum B | planned for B | predicted peak B | measured peak B "
          "| measured <= budget | kept | recomputed | offloaded | tokens/s/GPU")
    for r in rows:
        if r.get("kind") != "shardc":
            continue
        measured, budget = r.get("measured_peak_bytes"), r.get("budget_bytes")
        ok = "-" if not (measured and budget) else str(measured <= budget)
        planned = budget - r.get("margin_bytes", 0) if budget else None
        print(f"{r['budget']} | {r.get('status')} | {r.get('minimum_bytes')} | {planned} | "
              f"{r.get('peak_bytes')} | {measured} | {ok} | {r.get('kept')} | "
              f"{r.get('recomputed')} | {r.get('offloaded')} | {r.get('tokens_per_s_per_gpu')}")
    print()
    print((out / "curve.md").read_text() if (out / "curve.md").exists() else "no rows")
    print(f"wrote {out / 'curve.md'}, {out / 'curve.svg'}, {path}")


if __name__ == "__main__":
    main()
