"""Training-step benchmark: shardc against FSDP2, FSDP2 + compiled blocks, SimpleFSDP and a bound.

Launch with torchrun, one process per GPU::

    torchrun --nproc-per-node 2 benchmarks/train_bench.py --model 1b --out docs/bench
    torchrun --nproc-per-node 2 benchmarks/train_bench.py --device cpu --tiny   # gloo, CPU

One command runs every mode on the same model, data and settings and writes a markdown table and
a JSON file (with the exact command, GPU name, torch version and date) under ``--out``.

Modes:

``fsdp2``
    ``torch.distributed.fsdp.fully_shard`` per transformer block plus the root, eager,
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, fp32 master parameters.
``fsdp2-compile``
    The same with every block wrapped by ``torch.compile(block)`` before sharding (torchtitan's
    way): FSDP's hooks stay eager, the block's compute is compiled by Inductor.
``simplefsdp``
    Parameters are ``Shard(0)`` DTensors read through a parametrization that redistributes them
    to ``Replicate()`` (all-gather in bf16) and returns ``to_local(grad_placements=[Partial])`` so
    that the backward reduce-scatters (in fp32); gathered parameters are tagged for recompute in
    the joint graph (reshard after forward); the whole model is compiled by Inductor with its
    overlap scheduler and collective bucketing turned on
    (``torch._inductor.config.aten_distributed_optimizations``).
``shardc``
    ``shardc.shard(model, mesh, mp_policy=...)`` then ``torch.compile(model, backend="shardc")``
    with the default plan.
``bound``
    The same model compiled by Inductor with replicated parameters (fp32 master, bf16 compute
    through a cast in the parameter read, as shardc does) and no parameter communication at all
    (not even a gradient all-reduce): the step time perfect overlap would reach.

``--fp8``: the shardc modes shard with FP8 weights,
``shardc.shard(..., fp8=shardc.Float8Policy(modules=(nn.Linear, nn.Embedding)))`` as
``predict_step.py``'s ``:fp8`` configurations do (mixed precision unchanged); the other modes
(FSDP2 and its memory baselines, SimpleFSDP, the bound) have no FP8 path and are refused before
anything runs (without ``--modes``, ``--fp8`` runs the default list's shardc modes). The report
records it (``meta.fp8``, the header, each shardc result's ``fp8``)::

    torchrun --nproc-per-node 2 benchmarks/train_bench.py --fp8 --modes shardc shardc-rswait

Measured per mode: median tokens/s per GPU over the timed steps (CUDA events), MFU
(``6 * params * tokens/s / peak``), peak memory allocated and reserved over the timed steps,
compile time (wall time of the first step), and exposed communication from a short
``torch.profiler`` trace (time in which NCCL kernels run and no other kernel does). For shardc
also the plan's predicted peak and exposed communication.

This file is the command line; the benchmark lives in ``benchmarks/train/`` (one concern per
file: ``workload``, ``setup``, ``baselines``, ``simplefsdp``, ``shardc_mode``, ``modes``,
``runner``, ``kernels``, ``goals``, ``report``, ``provenance``). It uses shardc's public API only.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gzip
import json
import os
import platform
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Noise in every distributed compile of torch 2.11 and in every profile; nothing to act on.
warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*")
warnings.filterwarnings("ignore", message=".*Profiler clears events.*")

# Runnable as a plain script from a checkout: make the repository (shardc) and benchmarks/ (the
# ``train`` package, ``bench_mesh``, ``memory_peak``) importable.
_BENCHMARKS = Path(__file__).resolve().parent
for _path in (_BENCHMARKS.parent, _BENCHMARKS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import bench_mesh  # noqa: E402
from train.goals import diagnose, evaluate_goals  # noqa: E402
from train.modes import MODES, mode_context, mode_name, modes_for_fp8  # noqa: E402
from train.provenance import (  # noqa: E402
    git_describe,
    launch_command,
    nccl_version,
    shardc_source_hash,
)
from train.report import render_markdown, rerender  # noqa: E402
from train.runner import (  # noqa: E402
    OPTIM_IMPLS,
    RunSettings,
    aggregate,
    free_memory,
    gather_objects,
    run_mode,
)
from train.shardc_mode import FP8_POLICY_TEXT  # noqa: E402
from train.units import fmt, gib  # noqa: E402
from train.workload import DEFAULT_BATCH, model_config  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Driver


def _mode(text: str) -> str:
    try:
        return mode_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("1b", "wide", "both"), default="1b")
    p.add_argument("--modes", nargs="+", type=_mode, default=None,
                   help="modes to run, in this order (FSDP2's memory baselines: "
                        "fsdp2-compile-ac, fsdp2-compile-sac, fsdp2-compile-offload, "
                        "fsdp2-compile-amb<r> with torch's activation_memory_budget r; any FSDP2 "
                        "mode + '-closs': its loss compiled too; "
                        "shardc-budget: SHARDC_PEAK_BUDGET=<bytes>|auto; "
                        "shardc-pool: shardc with comm_pool=True; shardc-plain-pool: that "
                        "with plain_inputs=True; "
                        "shardc-keeporder: diagnostic, shardc with "
                        "Inductor's reorder_for_peak_memory off; shardc-localopt: shardc with "
                        "AdamW stepping the local shards, shardc.optim.local_shard_step; "
                        f"default: {' '.join(MODES)}, with --fp8 its shardc modes)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compile)")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps (0: none)")
    p.add_argument("--wide-steps", type=int, default=None,
                   help="timed steps for the wide model (default: --steps)")
    p.add_argument("--batch", type=int, default=None,
                   help="sequences per GPU (default: 4 for 1b, 2 for wide)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense bf16 peak per GPU for MFU (H100/H200 SXM: 989)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--mesh", default=None, metavar="RxS",
                   help="HSDP: a (replicate, shard) mesh of R x S ranks (R*S = world size)")
    p.add_argument("--tp", type=int, default=1,
                   help="FSDP+TP: tensor-parallel degree; shardc/FSDP2 shard over world/tp")
    p.add_argument("--tiny", action="store_true", help="tiny models (CPU / smoke tests)")
    p.add_argument("--n-layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--out", default="docs/bench", help="directory for the markdown and JSON")
    p.add_argument("--name", default=None,
                   help="file stem of the results (default train_bench, train_bench_tiny)")
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="skip modes that would not finish this many seconds after the start "
                        "(0: no deadline)")
    p.add_argument("--mode-estimate-s", type=float, default=90.0,
                   help="time a mode is assumed to take when no earlier run of it is known")
    p.add_argument("--dump-plan", action=argparse.BooleanOptionalAction, default=True,
                   help="write shardc's plan(s) as gzipped JSON next to the results")
    p.add_argument("--loss-in-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the loss with the model in the whole-model compiled modes "
                        "(shardc, bound, simplefsdp); fsdp2 modes always compute it eagerly")
    p.add_argument("--memory-snapshot", action="store_true",
                   help="record one extra step of the shardc modes with the CUDA memory history "
                        "and report what is live at its peak")
    p.add_argument("--optim-impl", choices=tuple(OPTIM_IMPLS), default="default",
                   help="AdamW's implementation in every mode (default: torch's choice, foreach "
                        "on CUDA; fused: one kernel, no parameter-sized temporaries)")
    p.add_argument("--fp8", action="store_true",
                   help="shardc modes: FP8 weights, shardc.Float8Policy(modules=(nn.Linear, "
                        "nn.Embedding)) (predict_step's :fp8); other modes are refused; default "
                        "--modes: the shardc ones")
    p.add_argument("--timeout-s", type=float, default=900.0, help="process-group timeout")
    p.add_argument("--render", metavar="JSON", default=None,
                   help="only re-render the markdown of an earlier run's JSON (next to it)")
    args = p.parse_args(argv)
    try:
        args.modes = modes_for_fp8(args.modes, MODES, args.fp8)
    except ValueError as exc:
        p.error(str(exc))
    return args


def init_distributed(device_type: str, timeout_s: float) -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ:  # a single process: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.render:
        print(f"wrote {rerender(Path(args.render))}")
        return
    start = time.perf_counter()
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rank, world, device = init_distributed(device_type, args.timeout_s)
    mesh = bench_mesh.build_mesh(device_type, world, args.mesh, args.tp)
    if device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    seq = args.seq or (128 if args.tiny else 2048)
    name = args.name or ("train_bench_tiny" if args.tiny else "train_bench")
    out_dir = Path(args.out)
    models = ["1b", "wide"] if args.model == "both" else [args.model]
    command = launch_command(sys.argv if argv is None else ["benchmarks/train_bench.py", *argv])

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)

    meta = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(device) if device_type == "cuda" else platform.processor()
        or "cpu",
        "device": device_type,
        "world_size": world,
        "mesh": bench_mesh.describe(mesh),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl_version() if device_type == "cuda" else None,
        "python": platform.python_version(),
        "shardc_source_sha256": shardc_source_hash(),
        "git": git_describe(),
        "host_cpus": os.cpu_count(),
        "steps": args.steps,
        "warmup": args.warmup,
        "profile_steps": args.profile_steps,
        "lr": args.lr,
        "optim_impl": args.optim_impl,
        "loss_in_graph": args.loss_in_graph,
        "fp8": FP8_POLICY_TEXT if args.fp8 else None,
        "mode_order": list(args.modes),
        "peak_flops": args.peak_tflops * 1e12,
        "env": {k: os.environ[k] for k in sorted(os.environ)
                if k.startswith(("NCCL_", "TORCH_NCCL", "TORCHINDUCTOR_", "TORCH_SYMM"))
                or k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")},
    }
    report: dict[str, Any] = {"meta": meta, "models": {}}
    log(f"{command}\n  {meta['gpu']} x {world}, torch {meta['torch']}, FP8 weights: "
        f"{meta['fp8'] or 'off'}")
    durations: dict[str, float] = {}

    def write() -> None:
        if rank != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{name}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        (out_dir / f"{name}.md").write_text(render_markdown(report))

    for model_name in models:
        cfg = model_config(model_name, seq, args.tiny, args.n_layers)
        batch = args.batch or DEFAULT_BATCH[model_name]
        steps = args.wide_steps if (model_name == "wide" and args.wide_steps) else args.steps
        settings = RunSettings(model_name, cfg, batch, seq, steps, args.warmup,
                               args.profile_steps, args.lr, args.peak_tflops * 1e12, device,
                               args.memory_snapshot, args.loss_in_graph, args.optim_impl,
                               args.fp8)
        entry: dict[str, Any] = {
            "settings": {"params": cfg.num_params(), "n_layers": cfg.n_layers, "dim": cfg.dim,
                         "n_heads": cfg.n_heads, "ffn": cfg.hidden_dim, "vocab": cfg.vocab_size,
                         "batch": batch, "seq": seq, "steps": steps,
                         "tokens_per_step_per_gpu": batch * seq},
            "modes": list(args.modes), "results": {}, "goals": [], "diagnosis": [],
        }
        if steps != args.steps:
            entry["note"] = (f"This model ran {steps} timed steps (not {args.steps}) to fit the "
                             "device time.")
        report["models"][model_name] = entry
        log(f"model {model_name}: {cfg.num_params() / 1e9:.3f}B params, batch {batch} x {seq}")
        for mode in args.modes:
            # Rank 0 decides whether the mode fits before the deadline; every rank follows.
            estimate = durations.get(mode, args.mode_estimate_s)
            elapsed = time.perf_counter() - start
            decision = [bool(args.deadline_s) and elapsed + estimate > args.deadline_s]
            dist.broadcast_object_list(decision, src=0)
            if decision[0]:
                entry["results"][mode] = {
                    "mode": mode, "status": "skipped",
                    "reason": f"deadline: {elapsed:.0f}s elapsed + ~{estimate:.0f}s estimated > "
                              f"{args.deadline_s:.0f}s"}
                log(f"  {mode}: skipped ({entry['results'][mode]['reason']})")
                write()
                continue
            log(f"  {mode}: start")
            t_mode = time.perf_counter()
            try:
                with mode_context(mode):
                    res = run_mode(mode, settings, mesh, rank, log)
            except Exception as exc:  # record and go on with the next mode
                res = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}",
                       "traceback": traceback.format_exc()[-6000:]}
                print(f"[rank {rank}] {mode} failed:\n{res['traceback']}", file=sys.stderr,
                      flush=True)
            plans = res.pop("_plans", None)
            free_memory(device)
            per_rank = gather_objects(res)
            agg = aggregate(mode, per_rank, settings)
            durations[mode] = time.perf_counter() - t_mode
            agg["mode_wall_s"] = durations[mode]
            entry["results"][mode] = agg
            if rank == 0 and plans and args.dump_plan:
                out_dir.mkdir(parents=True, exist_ok=True)
                path = out_dir / f"{name}_{model_name}_{mode}_plan.json.gz"
                with gzip.open(path, "wt") as f:
                    json.dump([p.to_dict() for p in plans], f)
                agg["plan_file"] = path.name
            del plans
            if agg["status"] == "ok":
                prof = agg.get("profile") or {}
                log(f"  {mode}: {agg['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, step "
                    f"{agg['step_ms_median']:.1f} ms, peak "
                    f"{gib(agg.get('peak_alloc_bytes'))}/{gib(agg.get('peak_reserved_bytes'))}"
                    f" GiB, exposed comm {fmt(prof.get('exposed_comm_ms'), '.1f')} ms, compile "
                    f"{fmt(agg.get('compile_s'), '.1f')} s, loss {agg['loss_first']:.3f} -> "
                    f"{agg['loss_last']:.3f} ({durations[mode]:.0f}s)")
            else:
                log(f"  {mode}: {agg['status']}: {agg.get('error')}")
            entry["goals"] = evaluate_goals(entry["results"])
            entry["diagnosis"] = diagnose(entry["results"])
            write()
    if rank == 0:
        print(render_markdown(report), flush=True)
        log(f"wrote {out_dir / (name + '.md')} and {out_dir / (name + '.json')}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
