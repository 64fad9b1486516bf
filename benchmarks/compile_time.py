"""Compile-time benchmark: the first training step (cold and warm caches) by depth and mode.

Every (depth, mode, cache) run is its own fresh ``torchrun`` job. "cold" gets new, empty
``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` directories; "warm" reruns the same depth
and mode reusing that cold run's directories (a restart). Measured per run: the wall time of the
first step (compile included; the slowest rank), the median steady step, Inductor's and
AOTAutograd's cache counters, and shardc's per-stage compile times (its ``SHARDC_LOG=info``
lines, rank 0). A throwaway process runs first (:func:`prime`; ``--no-prime`` skips it), so
that the first row does not also load the machine's libraries from disk. Before the first
step's timer every mode imports what the step's CUDA-graph marker imports
(:func:`import_inductor`: Inductor), which ``fsdp2-compile``'s setup imports anyway; the table
shows that import's seconds beside the setup's. Writes ``<out>/<name>.md`` (a table) and
``<out>/<name>.json`` (with the command, the git commit, the machine and every run's record).

One GPU (NCCL)::

    python benchmarks/compile_time.py --nproc 1 --model 1b --depths 8 32 64 \\
        --modes shardc fsdp2-compile --out docs/bench --name compile_time_h100

CPU, 2 gloo ranks (Inductor's C++ backend), tiny models::

    python benchmarks/compile_time.py --device cpu --nproc 2 --tiny --depths 2 16 \\
        --modes shardc --seq 32 --batch 2 --out /tmp/ct --name compile_time_cpu

Modes: those of ``benchmarks/train_bench.py`` (``shardc``, ``fsdp2-compile``, ...), and
``shardc:KEY=VALUE,...`` for shardc with backend options (e.g. ``shardc:prefetch_depth=2``, or a
compile-once switch where the backend has one). Uses shardc's public API only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_BENCHMARKS = Path(__file__).resolve().parent
for _path in (_BENCHMARKS.parent, _BENCHMARKS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

_STAGE = re.compile(r"shardc: region (\d+): ([^:]+): (\d+\.\d+) s")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("1b", "wide"), default="1b")
    p.add_argument("--tiny", action="store_true", help="tiny model widths (CPU / smoke runs)")
    p.add_argument("--depths", type=int, nargs="+", default=[8, 32, 64], help="layer counts")
    p.add_argument("--modes", nargs="+", default=["shardc", "fsdp2-compile"])
    p.add_argument("--caches", nargs="+", choices=("cold", "warm"), default=["cold", "warm"])
    p.add_argument("--nproc", type=int, default=1, help="ranks (torchrun --nproc-per-node)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--seq", type=int, default=None, help="default: 2048 (128 with --tiny)")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank (default 4)")
    p.add_argument("--steps", type=int, default=5, help="steady steps after the first")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    p.add_argument("--shardc-autograd-cache", choices=("on", "off"), default="on",
                   help="off: SHARDC_AUTOGRAD_CACHE=0, shardc keeps AOTAutograd's cache off for "
                        "every region (before warm restarts used it; shardc/compile/warm.py)")
    p.add_argument("--optimizer", choices=("default", "dtensor", "torch", "local"),
                   default="default",
                   help="default: as shardc steps by default (the local shards where exact, "
                        "shardc.optim.default_local_step); dtensor (or torch, its name before "
                        "the default): the shardc modes' AdamW over the DTensor parameters, "
                        "whose first step is torch's DTensor sharding propagation of each "
                        "foreach op over every parameter; local: through "
                        "shardc.optim.local_shard_step")
    p.add_argument("--cache-root", default=None,
                   help="where the per-run cache directories go (default: <out>/<name>_caches)")
    p.add_argument("--keep-caches", action="store_true", help="do not delete them at the end")
    p.add_argument("--no-prime", dest="prime", action="store_false",
                   help="skip the throwaway process that runs before the rows (prime())")
    p.add_argument("--logs", default=None,
                   help="directory for the per-run logs (default: <out>/<name>_logs)")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="only merge earlier runs' JSON files (e.g. one per depth) into "
                        "<out>/<name>.md/.json")
    p.add_argument("--out", default="docs/bench")
    p.add_argument("--name", default="compile_time")
    # One run (internal): the driver launches this script under torchrun with --child.
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--n-layers", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# One run (a torchrun job)


def _parse_mode(mode: str) -> tuple[str, dict[str, Any]]:
    """``"shardc:prefetch_depth=2,inductor=True"`` -> ``("shardc", {...})``."""
    base, _, rest = mode.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        options[key] = json.loads(value.lower()) if value.lower() in (
            "true", "false", "null") or re.fullmatch(r"-?\d+(\.\d+)?", value) else value
    if options and base != "shardc":
        raise ValueError(f"--modes {mode!r}: options are for the shardc mode only")
    return base, options


def _setup(mode: str, cfg, device, mesh):
    from train.modes import setup_mode
    from train.shardc_mode import setup_shardc
    from train.workload import build_model

    base, options = _parse_mode(mode)
    if options:
        return setup_shardc(build_model(cfg, device), mesh, True, **options)
    return setup_mode(base, cfg, device, mesh)


def _check_optimizer(mode: str, optimizer: str) -> None:
    """``--optimizer local`` is for the shardc modes only (``dtensor`` changes nothing for the
    others: their AdamW steps DTensors as it is)."""
    if optimizer == "local" and not mode.startswith("shardc"):
        raise ValueError(f"--optimizer {optimizer}: {mode!r} is not a shardc mode")


def _prepare_optimizer(setup, opt, mode: str, optimizer: str) -> None:
    """What the mode does to its optimizer (``shardc-localopt``'s local step, as train_bench's
    runner does), or with ``--optimizer local`` the local step for a shardc mode."""
    import shardc

    if setup.prepare_optimizer is not None:
        setup.prepare_optimizer(opt)
    elif optimizer == "local":
        _check_optimizer(mode, optimizer)
        shardc.optim.local_shard_step(opt)
    elif optimizer in ("dtensor", "torch"):
        shardc.optim.set_default_local_step(False, opt)


def run_child(args: argparse.Namespace) -> None:
    import bench_mesh
    import torch
    import torch.distributed as dist
    from train.runner import gather_objects, sync, train_step
    from train.workload import model_config, synthetic_batches
    from train_bench import init_distributed

    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rank, world, device = init_distributed(device_type, args.timeout_s)
    if rank != 0:
        os.environ.pop("SHARDC_LOG", None)  # one rank's stage lines in the log
    if device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    mesh = bench_mesh.build_mesh(device_type, world, None, 1)
    seq = args.seq or (128 if args.tiny else 2048)
    cfg = model_config(args.model, seq, args.tiny, args.n_layers)
    data = synthetic_batches(args.steps + 1, args.batch or 4, seq, cfg.vocab_size, rank, device)
    t0 = time.perf_counter()
    setup = _setup(args.mode, cfg, device, mesh)
    opt = torch.optim.AdamW(setup.params, lr=1e-4)
    _prepare_optimizer(setup, opt, args.mode, args.optimizer)
    setup_s = time.perf_counter() - t0
    import_s = import_inductor()
    sync(device)
    t = time.perf_counter()
    loss, phases = _first_step(setup, opt, *data[0], sync=lambda: sync(device))
    first = time.perf_counter() - t
    steady = []
    if device_type == "cuda":  # the steady steps' peak (the first step's compile excluded)
        torch.cuda.reset_peak_memory_stats(device)
    for tokens, targets in data[1:]:
        sync(device)
        t = time.perf_counter()
        train_step(setup, opt, tokens, targets)
        sync(device)
        steady.append(time.perf_counter() - t)
    counters = torch._dynamo.utils.counters  # Inductor's and AOTAutograd's cache counters
    mine = {"first_step_s": first, "setup_s": setup_s, "inductor_import_s": import_s,
            "first_step_phases_s": phases,
            # torch's own timed compile events (build_guards, ...), summed over the step
            "torch_timed_s": _torch_timed_events(),
            "steady_step_s": statistics.median(steady) if steady else None, "loss": loss,
            "steady_peak_allocated_bytes": (torch.cuda.max_memory_allocated(device)
                                            if device_type == "cuda" and steady else None),
            "cache": {k: v for group in ("inductor", "aot_autograd")
                      for k, v in counters[group].items() if "cache" in k}}
    if setup.after_first_step is not None:
        summary = setup.after_first_step()
        mine["plan_hashes"] = [r["hash"] for r in summary.get("regions", [])]
    ranks = gather_objects(mine)
    if rank == 0:
        record = dict(ranks[0])
        record["first_step_s"] = max(r["first_step_s"] for r in ranks)  # the slowest rank
        record["first_step_s_per_rank"] = [r["first_step_s"] for r in ranks]
        Path(args.result).write_text(json.dumps(record, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def import_inductor() -> float:
    """Import what the training step's marker for CUDA graph trees imports on its first call
    (``torch.compiler.cudagraph_mark_step_begin``: ``torch._inductor.cudagraph_trees``, and
    Inductor with it), before the first step's timer, for every mode; returns its seconds.

    Without it the first step of a mode whose setup imported nothing of Inductor (shardc's
    backend imports it only when it compiles) carried that import, about a second on a CPU and
    1-2 s on a GPU host, while ``fsdp2-compile`` had paid it in its setup (``torch.compile`` with
    the Inductor backend imports it when called). 0 where the setup imported it already."""
    import torch

    start = time.perf_counter()
    torch.compiler.cudagraph_mark_step_begin()  # a no-op marker outside CUDA graph trees
    return time.perf_counter() - start


def _first_step(setup, opt, tokens, targets, sync) -> tuple[float, dict[str, float]]:
    """The first training step (``train.runner.train_step``) with each phase synchronized and
    timed: the forward (Dynamo, the backend's compile, guards and the first run), the backward
    (with a lazily compiled backward), and the optimizer's first step (its state created) with
    ``zero_grad``. The synchronizations cost nothing next to a compile."""
    from train.runner import train_step

    phases: dict[str, float] = {}
    last = [time.perf_counter()]

    def mark(phase: str) -> None:
        sync()
        now = time.perf_counter()
        phases[phase], last[0] = now - last[0], now

    loss = train_step(setup, opt, tokens, targets, mark=mark)
    return float(loss), phases


def _torch_timed_events() -> dict[str, float]:
    """Seconds per event of torch's ``dynamo_timed`` compile events so far (``build_guards``,
    ``compile_fx.<locals>.fw_compiler_base``...), each summed over its calls; empty where this
    torch does not report them."""
    try:
        from torch._dynamo.utils import compile_times
        names, values = compile_times(repr="csv", aggregate=True)
    except Exception:  # an analysis aid: a torch without it still gets the rest of the record
        return {}
    return {str(n): round(float(v), 4) for n, v in zip(names, values)}


# ----------------------------------------------------------------------------------------------
# The driver


def _launch(args: argparse.Namespace, mode: str, depth: int, caches: Path, result: Path,
            log_path: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", str(Path(__file__).resolve()), "--child",
           "--mode", mode, "--n-layers", str(depth), "--model", args.model,
           "--result", str(result), "--steps", str(args.steps), "--timeout-s", str(args.timeout_s),
           "--optimizer", args.optimizer]
    for flag, value in (("--device", args.device), ("--seq", args.seq), ("--batch", args.batch)):
        if value is not None:
            cmd += [flag, str(value)]
    if args.tiny:
        cmd.append("--tiny")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
               TRITON_CACHE_DIR=str(caches / "triton"), SHARDC_LOG="info",
               SHARDC_AUTOGRAD_CACHE="0" if args.shardc_autograd_cache == "off" else "1")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.timeout_s)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = "timeout"
    record: dict[str, Any] = {"wall_s": time.perf_counter() - start, "log": str(log_path)}
    if returncode == 0 and result.exists():
        record.update(json.loads(result.read_text()))
    else:
        tail = log_path.read_text(errors="replace")[-3000:]
        record["error"] = f"exit {returncode}: {tail}"
    stages: dict[str, float] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        match = _STAGE.search(line)
        if match:
            stages[match.group(2)] = stages.get(match.group(2), 0.0) + float(match.group(3))
    record["stages_rank0_s"] = stages  # summed over the regions
    return record


# What prime() runs: torch, Inductor and the device's compiler toolchain loaded once, and one
# tiny function compiled and run on the rows' device.
_PRIME = """
import sys, torch
device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
step = torch.compile(lambda x: (x * 2).sin().sum())
print(float(step(torch.randn(64, device=device))))
"""


def prime(device: str | None, caches: Path) -> float:
    """Run one throwaway process before the rows, with its own Inductor/Triton cache
    directories (deleted after), and return its seconds.

    A machine's first process reads torch's libraries, Inductor's modules and the device's
    compiler from disk; the rows after it find them in the OS page cache. Without this the
    first row of a call paid that alone (s43: 19.6 s for a row that took 14.1 s later on the
    same machine), and as the shallowest depth it made the depth ratios come out low. The rows'
    compile caches stay cold: nothing of this process is in their directories."""
    caches.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
               TRITON_CACHE_DIR=str(caches / "triton"))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", _PRIME, *([device] if device else [])], env=env,
                   check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    shutil.rmtree(caches, ignore_errors=True)
    return seconds


def _machine(device: str | None) -> dict[str, Any]:
    import torch
    from train.provenance import git_describe

    cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    return {"device": torch.cuda.get_device_name(0) if cuda else (platform.processor() or "cpu"),
            "host": platform.node(), "host_cpus": os.cpu_count(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "git": git_describe()}


def _fmt(value: float | None, unit: str = "s") -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.0f} ms" if unit == "ms" else f"{value:.1f} s"


def _phases(phases: dict[str, float] | None) -> str:
    """Rank 0's first-step phases, e.g. ``12.1 / 3.4 / 0.2 s``."""
    if not phases:
        return "-"
    return " / ".join(f"{phases.get(k, 0.0):.1f}" for k in ("forward", "backward",
                                                             "optimizer")) + " s"


def _before_step(record: dict[str, Any]) -> str:
    """A row's seconds before its first step, e.g. ``1.6 / 1.9 s``: its setup (model, sharding,
    optimizer) and the Inductor import done apart (:func:`import_inductor`)."""
    if record.get("setup_s") is None:
        return "-"
    imported = record.get("inductor_import_s")
    return f"{record['setup_s']:.1f} / " + ("-" if imported is None else f"{imported:.1f}") + " s"


# What the report says of the optimizer (records before shardc's default local step say
# "torch" for AdamW over the DTensor parameters, which every step then was).
_OPTIMIZER_NOTES = {"local": "; AdamW steps the local shards (local_shard_step)",
                    "dtensor": "; the shardc modes' AdamW steps through DTensor",
                    "default": "; the shardc modes' AdamW steps the local shards (shardc's "
                               "default)"}


def render_markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [f"# Compile time: first training step by depth, mode and cache ({meta['date']})", "",
             f"`{meta['command']}`", "",
             f"{meta['machine']['device']} x {meta['nproc']}, torch {meta['machine']['torch']}, "
             f"commit {meta['machine']['git']}; model {meta['model']}"
             f"{' (tiny)' if meta['tiny'] else ''}, seq {meta['seq']}, batch {meta['batch']}/rank"
             f"{_OPTIMIZER_NOTES.get(meta.get('optimizer'), '')}."
             " Each run is a fresh process; cold: empty Inductor/Triton cache directories; warm: "
             "the cold run's directories reused.", "",
             "| layers | mode | cache | first step | forward / backward / optimizer | "
             "setup / Inductor import | steady step | FX graph cache hit/miss | "
             "AOT cache hit/miss | shardc stages (rank 0, s) |",
             "|---:|---|---|---:|---|---|---:|---|---|---|"]
    for run in report["runs"]:
        r = run["record"]
        cache = r.get("cache", {})
        stages = ", ".join(f"{k} {v:.1f}" for k, v in r.get("stages_rank0_s", {}).items())
        first = "error" if "error" in r else _fmt(r.get("first_step_s"))
        lines.append(
            f"| {run['depth']} | {run['mode']} | {run['cache']} | {first} | "
            f"{_phases(r.get('first_step_phases_s'))} | {_before_step(r)} | "
            f"{_fmt(r.get('steady_step_s'), 'ms')} | "
            f"{cache.get('fxgraph_cache_hit', 0)}/{cache.get('fxgraph_cache_miss', 0)} | "
            f"{cache.get('autograd_cache_hit', 0)}/{cache.get('autograd_cache_miss', 0)} | "
            f"{stages or '-'} |")
    ratios = _depth_ratios(report)
    if ratios:
        lines += ["", "Cold first step relative to the shallowest depth of the same mode:", ""]
        lines += [f"- {mode}: " + ", ".join(f"{d} layers {x:.2f}x" for d, x in items)
                  for mode, items in ratios.items()]
    return "\n".join(lines) + "\n"


def _depth_ratios(report: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    cold: dict[str, dict[int, float]] = {}
    for run in report["runs"]:
        first = run["record"].get("first_step_s")
        if run["cache"] == "cold" and first:
            cold.setdefault(run["mode"], {})[run["depth"]] = first
    out = {}
    for mode, by_depth in cold.items():
        base = by_depth[min(by_depth)]
        out[mode] = [(d, by_depth[d] / base) for d in sorted(by_depth)[1:]]
    return {m: v for m, v in out.items() if v}


def merge(paths: Sequence[str], out: Path, name: str) -> None:
    """One report from several (the runs in order; the first report's meta, with every
    command)."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    merged = {"meta": dict(reports[0]["meta"]), "runs": [r for rep in reports for r in rep["runs"]]}
    merged["meta"]["command"] = " ; ".join(rep["meta"]["command"] for rep in reports)
    merged["meta"]["merged_from"] = list(paths)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(merged, indent=1) + "\n")
    (out / f"{name}.md").write_text(render_markdown(merged))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return
    if args.merge:
        merge(args.merge, Path(args.out), args.name)
        return
    for mode in args.modes:
        _parse_mode(mode)  # a bad mode fails now, not after an hour
        _check_optimizer(mode, args.optimizer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(args.cache_root or out / f"{args.name}_caches").resolve()
    logs = Path(args.logs or out / f"{args.name}_logs")
    logs.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join([
        "benchmarks/compile_time.py", *(sys.argv[1:] if argv is None else argv)])
    report: dict[str, Any] = {"meta": {
        "command": command, "machine": _machine(args.device), "nproc": args.nproc,
        "model": args.model, "tiny": args.tiny, "seq": args.seq or (128 if args.tiny else 2048),
        "batch": args.batch or 4, "steps": args.steps, "optimizer": args.optimizer,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
    }, "runs": []}

    def write() -> None:
        (out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / f"{args.name}.md").write_text(render_markdown(report))

    if args.prime:
        report["meta"]["prime_s"] = prime(args.device, root / "prime")

    for depth in args.depths:
        for mode in args.modes:
            label = re.sub(r"[^A-Za-z0-9_.=-]", "_", f"{mode}_L{depth}")
            caches = root / label
            for cache in args.caches:
                if cache == "cold":
                    shutil.rmtree(caches, ignore_errors=True)
                caches.mkdir(parents=True, exist_ok=True)
                result = root / f"{label}_{cache}.json"
                result.unlink(missing_ok=True)
                record = _launch(args, mode, depth, caches, result,
                                 logs / f"{label}_{cache}.log")
                report["runs"].append({"depth": depth, "mode": mode, "cache": cache,
                                       "record": record})
                print(f"{depth:4d} layers  {mode:24s} {cache}: first step "
                      f"{_fmt(record.get('first_step_s'))}"
                      f"{'  ERROR (see ' + record['log'] + ')' if 'error' in record else ''}",
                      flush=True)
                write()
    if not args.keep_caches:
        shutil.rmtree(root, ignore_errors=True)
    write()
    print(f"wrote {out / (args.name + '.md')} and {out / (args.name + '.json')}")


if __name__ == "__main__":
    main()
