"""Where a training step's time goes: per phase and on the CPU side, shardc against the bound.

Launch like ``train_bench.py`` (one process per GPU; a plain ``python`` run is a world of one)::

    python benchmarks/step_overhead.py --model 1b --n-layers 8 16 32             # one GPU
    torchrun --nproc-per-node 2 benchmarks/step_overhead.py --model 1b --batch 1 2
    python benchmarks/step_overhead.py --device cpu --tiny --n-layers 8 --seq 16  # CPU, tiny

For each depth, batch and mode (``--modes``, in this order, every mode of one run in one process
on the same model, data and AdamW) it measures (``--rounds R``: every mode is compiled first and
the whole steps are timed in R interleaved rounds, the order reversed every other round, so a
drift of the GPU's clock over the process, e.g. its power cap, reaches every mode alike):

- ``step_ms``: the step as the training loop sees it (forward, backward, ``opt.step()``,
  ``opt.zero_grad()``, no synchronization inside; CUDA events around it on GPUs), median;
- per phase, the CPU time to issue it (``issue_ms``: wall time without synchronizing, what the
  Python side costs) and, on GPUs, its time with the device synchronized before and after it
  (``synced_ms``);
- per phase, the process's CPU time (``process_cpu_ms``, all threads, unsynchronized steps):
  the host cost without the time spent preempted, which on a shared, loaded CPU machine is
  the only stable measure of it;
- a ``torch.profiler`` trace of a few steps with CPU activities: each phase's CPU time by
  operator (self time), so per-parameter Python and DTensor work shows up by name;
- GPU idle time over the step (GPUs: the step minus the union of kernel intervals).

Modes: ``bound`` (replicated parameters, Inductor, no communication, torch's AdamW),
``shardc`` (``shardc.shard`` + ``backend="shardc"``, torch's AdamW stepping the local shards:
shardc's default since s52; torch's AdamW on the DTensor parameters before; forwards reading
plain local shards, ``plain_inputs=True``: the default since s53), ``shardc-dtensorin`` (the
forwards reading the DTensor parameters, ``plain_inputs=False``: the default before s53),
``shardc-localopt`` (the same with ``shardc.optim.local_shard_step``), ``shardc-dtensoropt``
(AdamW on the DTensor parameters: the default local step off), ``shardc-cudagraphs``
(``shardc-localopt`` compiled with ``mode="reduce-overhead"``); named only:
``shardc-noreshard`` (``reshard_after_forward=False``), ``shardc-inline``
(``compile_blocks_once=False``), ``shardc-budget`` (``peak_memory_budget_bytes`` from
``SHARDC_PEAK_BUDGET``, default ``"auto"``), ``shardc-plain`` (``shardc.shard(...,
plain_inputs=True)``: forwards read plain local shards), ``shardc-plain-budget`` (both),
``shardc-combo`` (Inductor's ``combo_kernels``: small independent kernels launched as one),
``shardc-fast`` (plain inputs, the local-shard step and CUDA graphs together),
``shardc-fast-budget`` (that with the peak budget), ``shardc-fast-budget-inline`` (that with
``compile_blocks_once=False``: Inductor fuses across the blocks' boundaries),
``shardc-fast-budget-sink`` (``shardc-fast-budget`` with ``sink_block_residual=True``: blocks
compiled once, each body's final residual add moved into the next body call),
``shardc-fast-sink`` (``shardc-fast`` with ``sink_block_residual=True``, no budget: every bucket
resharded, default shardc's peak), ``shardc-rswait`` and ``shardc-fast-rswait`` (``shardc`` and
``shardc-fast`` with ``reduce_scatter_wait_past_small_buckets=True``), ``bound-cudagraphs`` (the
bound under ``mode="reduce-overhead"``); any other ``train_bench.py`` mode by its name
(``train.modes.mode_name``); see docs/overhead.md. Results go to
``--out/<name>.json`` and ``.md``. Public API only (``shardc-combo`` sets Inductor's config).

``--fp8``: the shardc modes shard with FP8 weights, ``shardc.Float8Policy(modules=(nn.Linear,
nn.Embedding))`` as ``train_bench.py --fp8`` and ``predict_step.py``'s ``:fp8`` do (mixed
precision unchanged; any other mode is refused; without ``--modes``, the default list's shardc
modes). Two plans side by side in one process, FP8, interleaved rounds::

    torchrun --nproc-per-node 2 benchmarks/step_overhead.py --model 1b --n-layers 8 --batch 4 \
        --fp8 --modes shardc shardc-rswait --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_BENCHMARKS = Path(__file__).resolve().parent
for _path in (_BENCHMARKS.parent, _BENCHMARKS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import bench_mesh  # noqa: E402
from train.kernels import kernel_time_by_category, measure, merge_intervals  # noqa: E402
from train.modes import mode_context, mode_name, modes_for_fp8, setup_mode  # noqa: E402
from train.provenance import git_describe, launch_command  # noqa: E402
from train.runner import OPTIM_IMPLS, free_memory, gather_objects  # noqa: E402
from train.shardc_mode import FP8_POLICY_TEXT  # noqa: E402
from train.workload import DEFAULT_BATCH, model_config, synthetic_batches  # noqa: E402

MODES = ("bound", "shardc", "shardc-localopt", "shardc-dtensoropt", "shardc-cudagraphs",
         "shardc-noreshard",
         "shardc-inline", "shardc-budget", "shardc-plain", "shardc-plain-budget", "shardc-combo",
         "shardc-fast", "shardc-fast-budget", "shardc-fast-budget-inline",
         "shardc-fast-budget-sink", "shardc-fast-sink", "shardc-rswait", "shardc-fast-rswait",
         "bound-cudagraphs")
PHASES = ("forward", "backward", "optimizer.step", "zero_grad")
# The per-parameter host costs docs/overhead.md names, as profiler event names (CPU self ms
# per step, all phases): Dynamo's guards, AOTAutograd's runtime wrappers, DTensor dispatch.
HOST_CATEGORIES = {
    "dynamo_cache_lookup": lambda n: n == "TorchDynamo Cache Lookup",
    "compiled_function": lambda n: n == "CompiledFunction",
    "compiled_function_backward": lambda n: n == "CompiledFunctionBackward",
    "python_subclass": lambda n: "PythonSubclass" in n,
}


def _mode(text: str) -> str:
    """A mode of :data:`MODES` or any other ``train_bench.py`` mode (``train.modes.mode_name``)."""
    try:
        return mode_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("1b", "wide"), default="1b")
    p.add_argument("--modes", nargs="+", type=_mode, default=None,
                   help=f"modes, in this order: {', '.join(MODES)}, or any other train_bench.py "
                        f"mode (default: {' '.join(MODES[:4])}; with --fp8 its shardc modes)")
    p.add_argument("--fp8", action="store_true",
                   help="shardc modes: FP8 weights, shardc.Float8Policy(modules=(nn.Linear, "
                        "nn.Embedding)) (predict_step's :fp8); other modes are refused")
    p.add_argument("--n-layers", type=int, nargs="+", default=[None],
                   help="depths to run (default: the model's)")
    p.add_argument("--batch", type=int, nargs="+", default=[None],
                   help="sequences per GPU (default: train_bench's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="2 or more: compile every mode first (all alive at once: the device "
                        "must hold them together) and time --steps whole steps per mode in each "
                        "round, the order reversed every other round (a drift over the process "
                        "reaches every mode alike)")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--top", type=int, default=12, help="operators listed per phase")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU: intra-op threads (default: the cores over the world; 1 on a "
                        "shared, loaded machine)")
    p.add_argument("--width", type=int, default=None,
                   help="model dimension override (e.g. 32 with --tiny: a step of host time)")
    p.add_argument("--optim-impl", choices=tuple(OPTIM_IMPLS), default="default",
                   help="AdamW's implementation in every mode (default: torch's choice, foreach "
                        "on CUDA, a per-parameter loop on CPU; foreach mirrors the GPU on CPU)")
    p.add_argument("--out", default="docs/bench")
    p.add_argument("--name", default="step_overhead")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.profile_steps < 1:  # the report's per-phase CPU breakdown comes from them
        p.error("--profile-steps must be at least 1")
    try:
        args.modes = modes_for_fp8(args.modes, MODES[:4], args.fp8)
    except ValueError as exc:
        p.error(str(exc))
    return args


def init(device_type: str) -> torch.device:
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_optimizer(setup, impl: str) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(setup.params, lr=1e-4, **OPTIM_IMPLS[impl])
    if setup.prepare_optimizer is not None:  # shardc-localopt, shardc-cudagraphs
        setup.prepare_optimizer(opt)
    return opt


def phases(setup, opt, tokens, targets):
    """One step as four phases: (name, callable) in order."""
    box: dict[str, Any] = {}

    def forward():
        torch.compiler.cudagraph_mark_step_begin()  # a new step for CUDA graph trees (no-op else)
        box["loss"] = setup.loss(tokens, targets)

    return (("forward", forward), ("backward", lambda: box["loss"].backward()),
            ("optimizer.step", opt.step), ("zero_grad", lambda: opt.zero_grad(set_to_none=True)))


def timed_step(setup, opt, batch, device, synced: bool) -> dict[str, float]:
    """One step; per phase wall ms (CPU issue time, or the synced time when ``synced``)."""
    out = {}
    for name, fn in phases(setup, opt, *batch):
        if synced:
            sync(device)
        t, cpu = time.perf_counter(), time.process_time()
        with torch.profiler.record_function(f"phase:{name}"):
            fn()
        if synced:
            sync(device)
        out[name] = (time.perf_counter() - t) * 1e3
        out[f"cpu:{name}"] = (time.process_time() - cpu) * 1e3
    return out


def whole_step_ms(setup, opt, batch, device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _, fn in phases(setup, opt, *batch):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t = time.perf_counter()
    for _, fn in phases(setup, opt, *batch):
        fn()
    return (time.perf_counter() - t) * 1e3


def profile(setup, opt, batches, device, top: int) -> dict[str, Any]:
    """CPU self time per phase and operator, and GPU busy time, over ``batches``."""
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with torch.profiler.profile(activities=acts) as prof:
        t = time.perf_counter()
        for batch in batches:
            timed_step(setup, opt, batch, device, synced=False)
        sync(device)
        wall_ms = (time.perf_counter() - t) * 1e3
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text()).get("traceEvents", [])
    return summarize_trace(events, len(batches), wall_ms, top)


def summarize_trace(events: list[dict], steps: int, wall_ms: float, top: int) -> dict[str, Any]:
    """Per phase: its CPU wall ms per step, and operators by self CPU time (ms per step).

    An operator belongs to the phase whose interval (the ``phase:*`` annotations of the training
    thread) contains its start, whatever thread ran it (the autograd engine runs the backward of
    CUDA tensors on its own thread). ``[python, outside any op]`` is the phase's time on the
    training thread that no operator covers: Python (hooks, wrappers, guards, optimizer loops).
    """
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    marks = sorted((e for e in spans if str(e.get("name", "")).startswith("phase:")),
                   key=lambda e: e["ts"])
    ops_events = [e for e in spans if e.get("cat") in ("cpu_op", "user_annotation")
                  and not str(e["name"]).startswith("phase:")]
    gpu = [e for e in spans if e.get("cat") == "kernel"]

    def phase_at(ts: float) -> str:
        lo, hi = 0, len(marks)
        while lo < hi:  # last mark starting at or before ts
            mid = (lo + hi) // 2
            if marks[mid]["ts"] <= ts:
                lo = mid + 1
            else:
                hi = mid
        if lo and ts < marks[lo - 1]["ts"] + marks[lo - 1]["dur"]:
            return marks[lo - 1]["name"][len("phase:"):]
        return "outside"

    phase_ms: dict[str, float] = defaultdict(float)
    for m in marks:
        phase_ms[m["name"][len("phase:"):]] += m["dur"] / 1e3 / steps
    self_ms: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    covered: dict[str, float] = defaultdict(float)  # top-level op time on the marks' thread
    main = (marks[0].get("pid"), marks[0].get("tid")) if marks else None
    by_thread: dict[Any, list[dict]] = defaultdict(list)
    for e in ops_events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for thread, evs in by_thread.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, phase, child_us, dur]

        def pop(stack: list[list] = stack) -> None:
            _, name, phase, child, dur = stack.pop()
            self_ms[phase][name] += (dur - child) / 1e3 / steps

        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                pop()
            phase = stack[-1][2] if stack else phase_at(e["ts"])
            if stack:
                stack[-1][3] += e["dur"]
            elif thread == main:
                covered[phase] += e["dur"] / 1e3 / steps
            stack.append([e["ts"] + e["dur"], e["name"], phase, 0.0, e["dur"]])
        while stack:
            pop()
    for phase, ms in phase_ms.items():
        self_ms[phase]["[python, outside any op]"] += max(0.0, ms - covered[phase])
    top_ops = {ph: [(n, round(ms, 4)) for n, ms in sorted(d.items(), key=lambda x: -x[1])[:top]]
               for ph, d in self_ms.items()}
    host = {cat: round(sum(ms for d in self_ms.values() for n, ms in d.items() if match(n)), 4)
            for cat, match in HOST_CATEGORIES.items()}
    busy = measure(merge_intervals((e["ts"], e["ts"] + e["dur"]) for e in gpu)) / 1e3 / steps
    kernel_ms: dict[str, float] = defaultdict(float)
    for e in gpu:
        kernel_ms[str(e["name"])] += e["dur"] / 1e3 / steps
    return {"cpu_ms_per_step": {k: round(v, 4) for k, v in phase_ms.items()},
            "gpu_ms_by_category": ({k: round(v, 4) for k, v in
                                    kernel_time_by_category(spans, steps).items()}
                                   if gpu else None),
            "top_gpu_kernels_ms": [(n, round(ms, 4), sum(1 for e in gpu if e["name"] == n) / steps)
                                   for n, ms in sorted(kernel_ms.items(),
                                                       key=lambda x: -x[1])[:2 * top]],
            "top_self_ms_per_step": top_ops,
            "host_ms_by_category": host,
            "wall_ms_per_step": round(wall_ms / steps, 4),
            "gpu_busy_ms_per_step": round(busy, 4) if gpu else None}


def run_one(mode: str, model: str, layers: int | None, batch: int, args, mesh, device
            ) -> dict[str, Any]:
    with mode_context(mode):  # the mode's config around its (lazy) compiles and steps
        state = prepare(mode, model, layers, batch, args, mesh, device)
        state["steps_ms"] = [whole_step_ms(state["setup"], state["opt"], next(state["it"]), device)
                             for _ in range(args.steps)]
        return finish_row(state, args, device)


def run_interleaved(model: str, layers: int | None, batch: int, args, mesh, device
                    ) -> list[dict[str, Any]]:
    """Every mode compiled and warmed up first (all alive at once), then ``args.rounds`` rounds
    of ``args.steps`` whole steps per mode, the modes' order reversed every other round, so a
    drift of the device's clock over the process (its power cap, its temperature) reaches every
    mode alike. A row's ``step_ms`` is the median over all its rounds' steps; ``step_ms_rounds``
    the median of each round."""
    states = []
    for mode in args.modes:
        with mode_context(mode):
            states.append(prepare(mode, model, layers, batch, args, mesh, device))
    rounds: dict[str, list[list[float]]] = {st["mode"]: [] for st in states}
    # Each round's wall-clock span (Unix seconds), to line the rounds up with samples taken
    # outside the process (the device's clock and power from nvidia-smi).
    spans: dict[str, list[tuple[float, float]]] = {st["mode"]: [] for st in states}
    for r in range(args.rounds):
        for st in (states if r % 2 == 0 else states[::-1]):
            with mode_context(st["mode"]):
                start = time.time()
                rounds[st["mode"]].append(
                    [whole_step_ms(st["setup"], st["opt"], next(st["it"]), device)
                     for _ in range(args.steps)])
                spans[st["mode"]].append((round(start, 3), round(time.time(), 3)))
    rows = []
    for i, st in enumerate(states):
        mode = st["mode"]
        st["steps_ms"] = [ms for one in rounds[mode] for ms in one]
        with mode_context(mode):
            # Dynamo's caches reset after the last mode only: a reset drops every mode's
            # compiled code, and the modes after it would recompile in their issue-timed steps.
            row = finish_row(st, args, device, free=i == len(states) - 1)
        row["step_ms_rounds"] = [statistics.median(one) for one in rounds[mode]]
        row["round_spans_unix_s"] = spans[mode]
        rows.append(row)
    return rows


def prepare(mode: str, model: str, layers: int | None, batch: int, args, mesh, device
            ) -> dict[str, Any]:
    """The mode's model, optimizer and data, compiled and warmed up."""
    seq = args.seq or (128 if args.tiny else 2048)
    cfg = model_config(model, seq, args.tiny, layers, args.width)
    # warmup, whole steps (per round), issue-timed steps, synced steps (GPUs only), profiled
    n = (args.warmup + args.steps * (args.rounds + (2 if device.type == "cuda" else 1))
         + args.profile_steps)
    data = synthetic_batches(n, batch, seq, cfg.vocab_size,
                             bench_mesh.data_rank(mesh, dist.get_rank()), device)
    setup = setup_mode(mode, cfg, device, mesh, fp8=args.fp8)
    opt = make_optimizer(setup, args.optim_impl)
    it = iter(data)
    for _ in range(args.warmup):
        timed_step(setup, opt, next(it), device, synced=True)
    return {"mode": mode, "model": model, "cfg": cfg, "batch": batch, "seq": seq,
            "setup": setup, "opt": opt, "it": it}


def finish_row(state: dict[str, Any], args, device, free: bool = True) -> dict[str, Any]:
    """The row of a prepared mode whose whole steps were timed (``state["steps_ms"]``): the
    issue-timed, synced and profiled steps, then the mode's memory is freed (``free``: and
    Dynamo's caches reset, every mode's compiled code with them)."""
    setup, opt, it, cfg = state["setup"], state["opt"], state["it"], state["cfg"]
    issue = [timed_step(setup, opt, next(it), device, synced=False) for _ in range(args.steps)]
    synced = ([timed_step(setup, opt, next(it), device, synced=True)
               for _ in range(args.steps)] if device.type == "cuda" else issue)
    prof = profile(setup, opt, [next(it) for _ in range(args.profile_steps)], device, args.top)
    out = {
        "mode": state["mode"], "model": state["model"], "n_layers": cfg.n_layers,
        "batch": state["batch"], "seq": state["seq"],
        "params": cfg.num_params(), "n_param_tensors": len(setup.params),
        "step_ms": statistics.median(state["steps_ms"]),
        "issue_ms": {ph: statistics.median(s[ph] for s in issue) for ph in PHASES},
        "synced_ms": {ph: statistics.median(s[ph] for s in synced) for ph in PHASES},
        # The process's CPU time per phase (all its threads), from the unsynchronized steps:
        # on a shared, loaded CPU machine the host cost without the time spent preempted.
        "process_cpu_ms": {ph: statistics.median(s[f"cpu:{ph}"] for s in issue)
                           for ph in PHASES},
        "profile": prof,
    }
    if prof["gpu_busy_ms_per_step"] is not None:
        out["gpu_idle_ms"] = out["step_ms"] - prof["gpu_busy_ms_per_step"]
    state.clear()
    del setup, opt, it
    if free:
        free_memory(device)
    return out


def render(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [f"# Step overhead: {meta['command']}", "",
             f"{meta['device']} x {meta['world']}, torch {meta['torch']}, git {meta['git']}; "
             f"FP8 weights (`--fp8`): {meta.get('fp8') or 'off'}", "",
             "| model | layers | batch | mode | step ms | fwd | bwd | opt.step | zero_grad | "
             "issue ms (fwd/bwd/opt/zero) | GPU idle ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        s, i = r["synced_ms"], r["issue_ms"]
        idle = r.get("gpu_idle_ms")
        lines.append(
            f"| {r['model']} | {r['n_layers']} | {r['batch']} | {r['mode']} | "
            f"{r['step_ms']:.2f} | {s['forward']:.2f} | {s['backward']:.2f} | "
            f"{s['optimizer.step']:.2f} | {s['zero_grad']:.2f} | "
            f"{i['forward']:.2f}/{i['backward']:.2f}/{i['optimizer.step']:.2f}/"
            f"{i['zero_grad']:.2f} | {'' if idle is None else f'{idle:.2f}'} |")
    rounds = [r for r in report["rows"] if r.get("step_ms_rounds")]
    if rounds:
        lines += ["", "Interleaved rounds (`--rounds`): median step ms of each round, and x the "
                  "first mode of the same depth and batch in that round:", "",
                  "| model | layers | batch | mode | step ms per round | x first mode per round |",
                  "|---|---|---|---|---|---|"]
        for r in rounds:
            first = next(o for o in rounds if (o["n_layers"], o["batch"]) ==
                         (r["n_layers"], r["batch"]))
            ratios = [f / m for f, m in zip(first["step_ms_rounds"], r["step_ms_rounds"])]
            lines.append(f"| {r['model']} | {r['n_layers']} | {r['batch']} | {r['mode']} | "
                         + ", ".join(f"{m:.2f}" for m in r["step_ms_rounds"]) + " | "
                         + ", ".join(f"{x:.4f}" for x in ratios) + " |")
    lines += ["", "Process CPU time per step (ms, median; all threads; unsynchronized steps):", "",
              "| model | layers | batch | mode | forward | backward | optimizer.step | zero_grad "
              "| step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        c = r.get("process_cpu_ms")
        if c:
            lines.append(f"| {r['model']} | {r['n_layers']} | {r['batch']} | {r['mode']} | "
                         + " | ".join(f"{c[ph]:.2f}" for ph in PHASES)
                         + f" | {sum(c.values()):.2f} |")
    cats = list(HOST_CATEGORIES)
    lines += ["", "Host CPU self time per step by category (ms, profiled, all phases):", "",
              "| model | layers | batch | mode | " + " | ".join(cats) + " |",
              "|---|---|---|---|" + "---|" * len(cats)]
    for r in report["rows"]:
        host = r["profile"].get("host_ms_by_category", {})
        lines.append(f"| {r['model']} | {r['n_layers']} | {r['batch']} | {r['mode']} | "
                     + " | ".join(f"{host.get(c, 0.0):.3f}" for c in cats) + " |")
    for r in report["rows"]:
        lines += ["", f"## {r['model']} {r['n_layers']} layers, batch {r['batch']}, {r['mode']}: "
                  "CPU self time per phase (ms per step, profiled)", ""]
        for phase, ops in r["profile"]["top_self_ms_per_step"].items():
            total = r["profile"]["cpu_ms_per_step"].get(phase)
            head = f"- **{phase}**" + (f" ({total:.2f} ms)" if total is not None else "")
            lines.append(head + ": " + ", ".join(f"`{n}` {ms:.3f}" for n, ms in ops))
        cats = r["profile"].get("gpu_ms_by_category")
        if cats:
            lines += ["", "GPU kernel ms per step by category: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in cats.items()), "",
                      "Top GPU kernels (ms per step, launches per step): "
                      + ", ".join(f"`{n[:90]}` {ms:.3f} ({cnt:g})"
                                  for n, ms, cnt in r["profile"]["top_gpu_kernels_ms"])]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device = init(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    world, rank = dist.get_world_size(), dist.get_rank()
    if device.type == "cpu":
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // world))
    mesh = bench_mesh.build_mesh(device.type, world, None, 1)
    rows: list[dict[str, Any]] = []
    meta = {"command": launch_command(sys.argv if argv is None else
                                      ["benchmarks/step_overhead.py", *argv]),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "world": world, "torch": torch.__version__, "git": git_describe(),
            "optim_impl": args.optim_impl, "fp8": FP8_POLICY_TEXT if args.fp8 else None}

    def write() -> None:  # after every row: a run cut short keeps what it measured
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {"meta": meta, "rows": rows}
        (out / f"{args.name}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        (out / f"{args.name}.md").write_text(render(report))

    for layers in args.n_layers:
        for batch in args.batch:
            batch = batch or DEFAULT_BATCH[args.model]
            if args.rounds > 1:
                measured = run_interleaved(args.model, layers, batch, args, mesh, device)
            else:
                measured = (run_one(mode, args.model, layers, batch, args, mesh, device)
                            for mode in args.modes)
            for row in measured:
                per_rank = gather_objects(row)
                row["step_ms"] = max(r["step_ms"] for r in per_rank)  # the slowest rank
                if "step_ms_rounds" in row:
                    row["step_ms_rounds"] = [max(r["step_ms_rounds"][i] for r in per_rank)
                                             for i in range(len(row["step_ms_rounds"]))]
                rows.append(row)
                if rank == 0:
                    print(f"{args.model} L{row['n_layers']} b{batch} {row['mode']}: step "
                          f"{row['step_ms']:.2f} ms, issue {row['issue_ms']}", flush=True)
                    write()
    if rank == 0:
        print(render({"meta": meta, "rows": rows}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
