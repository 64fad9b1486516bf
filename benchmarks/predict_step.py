"""Predicted against measured training step: shardc's plan next to the GPU's clock.

Launch with torchrun, one process per GPU (one GPU is fine)::

    torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile h100.json --out docs/bench
    torchrun --nproc-per-node 1 benchmarks/predict_step.py --configs 1b:8:4,1b:16:4,wide:8:2:fp8
    torchrun --nproc-per-node 2 benchmarks/predict_step.py --device cpu --tiny   # gloo smoke run
    torchrun --nproc-per-node 2 benchmarks/predict_step.py --mesh 2x1 --configs 1b:8:4  # HSDP
    torchrun --nproc-per-node 2 benchmarks/predict_step.py --tp 2 --configs 1b:8:4      # FSDP+TP
    torchrun --nproc-per-node 1 benchmarks/predict_step.py --offload params --step-in-backward \
        --configs 1b:8:4                                                      # CPU offload

Each configuration ``model:layers:batch[:fp8]`` (the models of ``train_bench.py``: ``1b``,
``wide``; sequence 2048) is built, sharded with ``MixedPrecisionPolicy(bf16, fp32)`` (and
``Float8Policy(modules=(Linear, Embedding))`` with ``:fp8``), compiled with the shardc backend
(Inductor; ``--backend-option NAME=VALUE`` sets any ``ShardcOptions`` field for every
configuration, e.g. ``--backend-option reduce_scatter_wait_past_small_buckets=true``) and
trained with AdamW (torch's default ``foreach``) on synthetic tokens. The table holds, per
configuration:

- predicted (``shardc.planning.step.predict_step``): the plan's forward+backward time
  (``plan.predicted.step_time_s``, every region; the forward waits for the host's per-parameter
  entry work), what follows the last backward's device work (the gradient hand-off, the
  optimizer step, ``optimizer_step_seconds`` on the plan's parameter bytes, and zero_grad, each
  with the profile's host seconds per parameter tensor, hidden under queued device work where
  there is some; the "optimizer" columns), their sum (the step), exposed communication and
  peak memory;
- measured: the median over the timed steps of forward+backward (up to the host's return from
  ``backward()``, so with the gradient hand-off where the host is behind), of the optimizer step
  and zero_grad, and of the whole step (CUDA events), the slowest rank's; exposed communication from
  a short ``torch.profiler`` trace (NCCL kernel time with no other kernel running; world > 1
  only); peak memory allocated (with ``--cudagraphs`` also over the warm-up steps that record
  the graphs: a replay allocates nothing, so the timed steps alone miss the graphs' pool);
- the step's error, predicted over measured, minus one;
- where each phase ends (forward, backward, ``optimizer.step()``, ``zero_grad()``), ms from
  the step's start: when the host returned from it and when the device reached a CUDA event
  recorded there (equal: the device waited for the host; later: the host was ahead by the
  difference), measured beside the model's (the forward's and backward's ends, the step's);
- where the time goes: the plan's predicted time by kernel category (``Predictions.
  time_by_category_s``: matmul, attention forward/backward, fused, other, copies, waiting for
  the host) next to the GPU kernel time of the same categories, by kernel name
  (``train.kernels.kernel_category``), over the ``--profile-steps`` traced steps.

The mesh is 1-D FSDP over every rank, or the 2-D meshes of ``train_bench.py``
(``bench_mesh.py``): ``--mesh RxS`` an HSDP ``(replicate, shard)`` mesh of R x S ranks,
``--tp N`` a ``(dp, tp)`` mesh of world/N x N ranks with the Llama blocks tensor-parallelized on
``tp`` (Megatron style); the ranks of a tp group read the same batch, so ``batch`` is per tp
rank and its tp group's distinct tokens. Each row names its mesh (``mesh``: ``fsdp 2``,
``hsdp 2x1``, ``hsdp 1x2``, ``fsdp 1 x tp 2``). The prediction is every region's plan, so it
holds HSDP's replicate all-reduces and the tensor-parallel collectives the plan found in the
traced graphs, each on its process group's lane.

CPU offload: ``--offload params`` shards with ``shardc.OffloadPolicy()`` (the parameters'
shards, gradients and optimizer state on the host; AdamW, torch's default, then steps the
host masters per tensor), ``--offload optimizer`` with ``OffloadPolicy(params=False,
optimizer=True)`` (state and step on the host, inside ``optimizer.step()``), and
``--step-in-backward`` (with ``params``) overlaps each bucket's host step with the backward
(``shardc.step_in_backward``, as ``train_bench.py``'s ``shardc-offload`` modes); on a CPU mesh
the offload is simulated (``simulate_on_cpu``). The prediction is ``predict_step`` with
``OptimizerSpec(offload=..., overlap=..., impl="auto")`` (the CLI's ``python -m shardc plan
--offload ... [--step-in-backward] --optimizer adamw``) over this rank's master shard bytes.
The measured step still holds the whole host step (``optimizer.step()`` waits for the
overlapped buckets); with the overlap only its split moves: "fwd+bwd" then holds part of it.
Rows and ``meta`` name the offload (``offload``, ``step_in_backward``; the row's mesh cell).

The cluster profile is ``--profile`` (a preset name or a file from ``python -m shardc
calibrate``), else the preset for this GPU. ``--refine-host`` (a profile of format 9, with a
host probe; refused before any compile otherwise) times the host-speed probe once at the start
(``shardc.tools.host_probe.agreed_host_probe``: every rank, the slowest's) and plans and
predicts every configuration with the profile's host terms rescaled to it
(``shardc.planning.host_speed.with_host_speed``, passed to the backend as the cluster profile,
so the compiled graphs' host work is priced at this host's speed too): the probe and factor in
``meta["host_probe"]``, the rescaled profile as ``host_profile_<name>.json`` (the prediction
without it: plan the same runs on a CPU with the profile as calibrated, ``plan_vs_measured.py``).

``--probe-host-adamw`` (with ``--offload``, or a ``--memory-budget`` that may put the
optimizer on the host): CPU offload's host step, the largest part of an offloaded step, is
priced at the profile's host AdamW rate (``ClusterProfile.host_adamw_rate``: per tensor, what
torch's default AdamW runs on host tensors; fused where ``optimizer_impl`` says so), and that
rate moves by ~30% between starts of the same H200 machine, more than the prediction's goal.
Once at the start, before any compile (whose workers would share the host's cores), every rank
times that implementation (``shardc.tools.host_adamw_probe.refine_host_adamw``: calibration's
``measure_host_adamw`` on 8 tensors of 16M elements, the slowest rank's; estimated ~1.5 s
on an H200 host, not yet timed there) on the intra-op threads its ``optimizer.step()`` will
run on (``torch.get_num_threads()``, which on one GPU is torch's default, not necessarily
calibration's share of the cores), and
every configuration is predicted twice: with the profile as given (``predicted_step_s``, the
table of record) and with the probed rate in the profile's field
(``shardc.planning.host_speed.with_host_adamw_rate``; ``predicted_*_probed_adamw_s``). The
compiled graphs are planned with the profile as given either way. ``meta["host_adamw_probe"]``
holds both rates, their ratio, the threads and the probe's seconds; the report adds a table of
the probed prediction and its error. A flag, not the default with ``--offload``: it allocates
2 GiB of host memory and the table of record does not need it.
Writes ``<name>.md`` and ``<name>.json`` under
``--out`` with the command, commit, GPU, torch version and date; ``--deadline-s`` skips the
configurations that would not finish in time (the table says which).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*")
warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
_BENCHMARKS = Path(__file__).resolve().parent
for _path in (_BENCHMARKS.parent, _BENCHMARKS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import bench_mesh  # noqa: E402
from train.modes import parse_peak_budget  # noqa: E402
from train.provenance import git_describe, launch_command, nccl_version  # noqa: E402
from train.setup import compiled_loss  # noqa: E402
from train.shardc_mode import offload_policy  # noqa: E402
from train.workload import build_model, model_config, synthetic_batches  # noqa: E402

import shardc  # noqa: E402
from shardc.compile.options import ShardcOptions  # noqa: E402
from shardc.planning.host_speed import (  # noqa: E402
    host_speed_factor,
    require_host_probe,
    with_host_speed,
)
from shardc.planning.optimizer_kind import ran as optimizer_ran  # noqa: E402
from shardc.planning.profile import ClusterProfile, ProfileError, resolve_profile  # noqa: E402
from shardc.planning.step import OFFLOAD_MODES, OptimizerSpec, predict_step  # noqa: E402
from shardc.tools.calibrate import host_threads_per_rank  # noqa: E402
from shardc.tools.host_adamw_probe import refine_host_adamw  # noqa: E402
from shardc.tools.host_probe import agreed_host_probe  # noqa: E402
from shardc.tools.planner import shard_bytes  # noqa: E402

# Most telling first (a --deadline-s run keeps these): 8/16 layers, wide, batch, FP8, depth.
DEFAULT_CONFIGS = ("1b:8:4,1b:16:4,wide:8:2,1b:8:1:s8192,1b:8:2,1b:8:1,1b:8:4:fp8,1b:32:4,"
                   "wide:16:2")
GIB = 1 << 30


def parse_configs(text: str) -> list[dict[str, Any]]:
    """``model:layers:batch[:fp8|bf16][:s<seq>]`` items; ``seq`` is ``None`` unless given (then
    ``--seq``, else 2048)."""
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        extra = parts[3:]
        precision = [x for x in extra if x in ("bf16", "fp8")]
        seq = [x for x in extra if x.startswith("s") and x[1:].isdigit()]
        if (len(parts) < 3 or parts[0] not in ("1b", "wide") or not parts[1].isdigit()
                or not parts[2].isdigit() or len(precision) > 1 or len(seq) > 1
                or len(precision) + len(seq) != len(extra)):
            raise SystemExit(f"--configs: {item!r} is not model:layers:batch[:fp8|bf16][:sSEQ] "
                             "(model 1b or wide; e.g. 1b:8:1:s8192)")
        out.append({"model": parts[0], "layers": int(parts[1]), "batch": int(parts[2]),
                    "precision": precision[0] if precision else "bf16",
                    "seq": int(seq[0][1:]) if seq else None})
    return out


def _option_value(text: str) -> bool | int | float | str:
    """A backend option's value as written: ``true``/``false`` (any case) a bool, then an int,
    then a float, else the text itself."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_backend_option(text: str) -> tuple[str, bool | int | float | str]:
    """``NAME=VALUE`` (``--backend-option``): a ``ShardcOptions`` field and its value
    (:func:`_option_value`); a name that is no field is an error listing the fields."""
    name, sep, value = text.partition("=")
    name = name.strip()
    known = sorted(f.name for f in fields(ShardcOptions))
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE (NAME a ShardcOptions "
                                         f"field: {', '.join(known)})")
    if name not in known:
        raise argparse.ArgumentTypeError(f"{name!r} is not a ShardcOptions field; fields: "
                                         f"{', '.join(known)}")
    return name, _option_value(value.strip())


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"comma-separated model:layers:batch[:fp8] (default {DEFAULT_CONFIGS})")
    p.add_argument("--profile", default=None,
                   help="cluster profile: preset name (h100, h200) or JSON file (default: the "
                        "preset for this GPU)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048)")
    p.add_argument("--steps", type=int, default=8, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile)")
    p.add_argument("--profile-steps", type=int, default=2,
                   help="steps traced with torch.profiler for GPU time by kernel category and "
                        "exposed communication (GPU only; 0: none)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--tiny", action="store_true", help="tiny models (CPU smoke runs)")
    p.add_argument("--mesh", default=None, metavar="RxS",
                   help="HSDP: a (replicate, shard) mesh of R x S ranks (R*S = world size)")
    p.add_argument("--tp", type=int, default=1,
                   help="FSDP+TP: tensor-parallel degree; shardc shards over world/tp (the "
                        "ranks of a tp group read the same batch)")
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="skip configurations that would end later than this (0: no deadline)")
    p.add_argument("--blocks-once", action="store_true",
                   help="compile repeated blocks once (shardc's default since issue 18; off here "
                        "as in the measured tables, which were made with blocks inline)")
    p.add_argument("--cudagraphs", action="store_true",
                   help="compile with mode='reduce-overhead' (CUDA graphs) and predict the "
                        "step replayed (shardc.planning.step.predict_step(cudagraphs=True))")
    p.add_argument("--memory-budget", default=None, metavar="BYTES|auto",
                   help="shardc's peak_memory_budget_bytes (default: none)")
    p.add_argument("--backend-option", action="append", default=[], metavar="NAME=VALUE",
                   type=parse_backend_option,
                   help="a ShardcOptions field for every configuration's shardc backend "
                        "(repeatable; VALUE true/false, an int, a float or text; applied last, "
                        "so it wins over the options this script sets)")
    p.add_argument("--keep-traces", default=None, metavar="DIR",
                   help="write each configuration's profiled kernels (gzipped Chrome-trace "
                        "events, per rank) and its plans (JSON) under DIR, for offline analysis")
    p.add_argument("--refine-host", action="store_true",
                   help="time the host-speed probe once before the runs (every rank, the "
                        "slowest's) and plan and predict every step with the profile's host "
                        "terms rescaled by it over the profile's probe "
                        "(shardc.planning.host_speed); the profile must have a probe "
                        "(calibrated at format 9)")
    p.add_argument("--offload", choices=OFFLOAD_MODES, default="none",
                   help="CPU offload: params = shardc.OffloadPolicy() (the parameters' shards, "
                        "gradients and optimizer state on the host, the optimizer stepping "
                        "there), optimizer = OffloadPolicy(params=False, optimizer=True) (the "
                        "optimizer's state and step on the host); simulated on a CPU mesh "
                        "(default none)")
    p.add_argument("--step-in-backward", action="store_true",
                   help="with --offload params: shardc.step_in_backward, each bucket's host "
                        "optimizer step overlapped with the rest of the backward (as "
                        "train_bench.py's shardc-offload modes run it)")
    p.add_argument("--probe-host-adamw", action="store_true",
                   help="with --offload (or a --memory-budget): time the host AdamW the run "
                        "steps with once before any compile (every rank, the slowest's) and "
                        "predict every configuration also with that rate in place of the "
                        "profile's (predicted_step_s stays the profile's)")
    p.add_argument("--out", default="docs/bench")
    p.add_argument("--name", default="predict_step")
    args = p.parse_args(argv)
    if args.step_in_backward and args.offload != "params":
        p.error("--step-in-backward overlaps CPU offload's host step with the backward: it "
                "needs --offload params")
    if args.probe_host_adamw and args.offload == "none" and args.memory_budget is None:
        p.error("--probe-host-adamw times the host's AdamW, which prices only a host optimizer "
                "step: it needs --offload (or a --memory-budget that may offload the optimizer)")
    try:  # a value ShardcOptions refuses is refused here, not by every configuration's compile
        ShardcOptions(**dict(args.backend_option))
    except (TypeError, ValueError) as exc:
        p.error(f"--backend-option: {exc}")
    return args


def _init(device_type: str) -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29513"))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def _setup(cfg, device, mesh, fp8: bool, cluster: dict | None, blocks_once: bool = False,
           cudagraphs: bool = False, budget: str | None = None,
           backend_options: dict[str, Any] | None = None, offload: str = "none"):
    """The model on ``mesh`` (``bench_mesh.build_mesh``: tensor-parallel blocks first on a
    ``(dp, tp)`` mesh, as train_bench does), sharded and compiled with the shardc backend;
    ``cudagraphs``: under ``mode="reduce-overhead"``; ``budget``: ``peak_memory_budget_bytes``
    (``"auto"`` or bytes); ``backend_options``: ``--backend-option``'s, over the others;
    ``offload``: ``--offload``'s policy (``train.shardc_mode.offload_policy``, as
    train_bench's shardc-offload modes shard; simulated on a CPU mesh)."""
    model = bench_mesh.parallelize_llama(build_model(cfg, device), mesh)
    mp = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = shardc.Float8Policy(modules=(nn.Linear, nn.Embedding)) if fp8 else None
    shardc.shard(model, mesh, mp_policy=mp, fp8=policy,
                 offload=offload_policy(offload, on_cpu=device.type == "cpu"))
    options = {"cluster": cluster} if cluster else {}
    # Blocks inline (as the measured tables were made); --blocks-once measures the default.
    options["compile_blocks_once"] = blocks_once
    if budget is not None:
        options["peak_memory_budget_bytes"] = parse_peak_budget(budget)
    if device.type != "cuda":
        options["inductor"] = False
    options.update(backend_options or {})
    mode = {"mode": "reduce-overhead"} if cudagraphs else {}
    loss = compiled_loss(model, True, backend=shardc.backend(**options), **mode)
    return model, loss


# The step's phases, in order: each ends where the host returns from it.
PHASES = ("forward", "backward", "optimizer.step", "zero_grad")


def _events(device):
    """One CUDA event before the step and one after each phase (GPUs; None on the CPU)."""
    return [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)] \
        if device.type == "cuda" else None


def phase_boundaries(host: list[float], ev) -> dict[str, dict[str, float]]:
    """Where one step's phases end, in ms from its start: ``host`` the host's clock when it
    returned from each phase (``time.perf_counter`` before the first event, then after each
    phase), ``device`` when the device reached the event recorded there (the later of the
    device finishing the work queued before it and the host recording it: where the device is
    still busy, the host is ahead by ``device - host``; where they meet, the device waited for
    the host)."""
    out = {}
    for i, name in enumerate(PHASES, start=1):
        out[name] = {"host": (host[i] - host[0]) * 1e3}
        if ev:
            out[name]["device"] = ev[0].elapsed_time(ev[i])
    return out


def config_seq(c: dict, args) -> int:
    return c.get("seq") or args.seq or (128 if args.tiny else 2048)


LEFT_REPORTED_BYTES = 64 << 20


def leftover_tensors(device: torch.device, top: int = 4) -> list[str]:
    """The largest device tensors the garbage collector still sees, each with the types of
    what refers to it (a diagnosis of a previous row's memory held into the next)."""
    found: dict[int, torch.Tensor] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device == device:
                found.setdefault(obj.untyped_storage().data_ptr(), obj)
        except Exception:  # a tensor subclass or a half-built object: skip it
            continue
    largest = sorted(found.values(), key=lambda t: -t.untyped_storage().nbytes())[:top]
    values = list(found.values())
    out = []
    for t in largest:
        holders = {type(r).__name__ for r in gc.get_referrers(t) if r is not found
                   and r is not values and r is not largest}
        out.append(f"{t.untyped_storage().nbytes() / 2**20:.0f} MiB {type(t).__name__}"
                   f"{tuple(t.shape)} <- {sorted(holders)[:6]}")
    return out


def run_config(c: dict, args, device, mesh, cluster: dict | None, log,
               probed: ClusterProfile | None = None) -> dict[str, Any]:
    """One configuration measured and predicted; ``probed``: the profile with the host AdamW
    rate timed at the start (``--probe-host-adamw``), a second prediction beside the
    profile's."""
    seq = config_seq(c, args)
    cfg = model_config(c["model"], seq, args.tiny, c["layers"])
    model, loss_fn = _setup(cfg, device, mesh, c["precision"] == "fp8", cluster,
                            args.blocks_once, args.cudagraphs, args.memory_budget,
                            dict(args.backend_option), args.offload)
    # torch's default AdamW: foreach on device tensors, per tensor in a group holding host
    # tensors (CPU offload's masters), which is what the spec's impl "auto" prices.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # --step-in-backward: as train_bench's shardc-offload modes (train.modes). The loop is
    # unchanged: optimizer.step() waits for the buckets the worker is still stepping and steps
    # the rest, so the measured step (start to start) still holds the whole host step; only
    # the split between "fwd+bwd" and "optimizer" moves (part of the step runs inside
    # backward()).
    overlap = shardc.step_in_backward(model, opt) if args.step_in_backward else None
    # A tp group reads one batch (its dp coordinate's); every other rank its own.
    data = synthetic_batches(args.warmup + 2 * args.steps + args.profile_steps, c["batch"], seq,
                             cfg.vocab_size, bench_mesh.data_rank(mesh, dist.get_rank()), device)
    it = iter(data)
    t0 = time.perf_counter()
    warm_peak = 0
    for i in range(args.warmup):
        tokens, targets = next(it)
        torch.compiler.cudagraph_mark_step_begin()  # a new step for CUDA graph trees
        loss_fn(tokens, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i == 0 and args.cudagraphs and device.type == "cuda":
            # A replayed graph allocates nothing, so the timed steps' allocator peak misses
            # its pool: the peak of a graphed step is read from the steps that warm up and
            # record the graphs (those after the first, which compiles).
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if args.cudagraphs and args.warmup > 1:
            warm_peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    compile_s = time.perf_counter() - t0
    synced = _run_steps(loss_fn, opt, it, args.steps, device, synced=True)
    fwd_bwd = [_span(host, ev, 0, 2) for host, ev in synced]
    step = [_span(host, ev, 0, 4) for host, ev in synced]
    phases = [phase_boundaries(host, ev) for host, ev in synced]
    steady = _steady_steps(_run_steps(loss_fn, opt, it, args.steps, device, synced=False))
    res: dict[str, Any] = {
        "measured_fwd_bwd_s": statistics.median(steady["fwd_bwd"]),
        "measured_optimizer_s": statistics.median(steady["optimizer"]),
        "measured_step_s": statistics.median(steady["step"]),
        "measured_synced_step_s": statistics.median(step),
        "measured_synced_fwd_bwd_s": statistics.median(fwd_bwd),
        "compile_s": compile_s,
        "measured_phases_ms": {name: {k: statistics.median(p[name][k] for p in phases)
                                      for k in phases[0][name]} for name in PHASES},
    }
    if device.type == "cuda":
        res["measured_peak_bytes"] = max(warm_peak, torch.cuda.max_memory_allocated(device))
    keep = _trace_stem(args, c) if args.keep_traces else None
    if args.profile_steps and device.type == "cuda":
        exposed, waited, by_category = _profiled(loss_fn, opt, it, args.profile_steps, device,
                                                 keep)
        res["measured_ms_by_category"] = by_category
        if dist.get_world_size() > 1:
            res["measured_exposed_comm_s"] = exposed
            res["measured_waited_comm_s"] = waited
    plans = shardc.explain_all(model)
    if keep:
        with open(f"{keep}.plans.json", "w") as f:
            f.write("[" + ",\n".join(p.to_json() for p in plans) + "]\n")
    profile = resolve_profile(cluster, torch.cuda.get_device_name(device)
                              if device.type == "cuda" else None)
    options = plans[0].options if plans else {}
    # The optimizer's fp32 master bytes: the plans' device shards, or with offload (masters on
    # the host, which the plans' device memory does not count) this rank's local shards.
    param_bytes = (sum(p.predicted.get("param_bytes", 0.0) for p in plans)
                   if args.offload == "none" else shard_bytes(model)[0])
    n_params = sum(1 for _ in model.parameters())
    spec = optimizer_spec(args, options, param_bytes, n_params)
    step = predict_step(plans, profile, spec, cudagraphs=args.cudagraphs)
    res.update({
        "profile": profile.name,
        "predicted_fwd_bwd_s": step.graphs_s,
        # The optimizer, gradient hand-off and zero_grad as they add to the step (device time,
        # and the device's idle waiting for the host's per-parameter work beyond it).
        "predicted_optimizer_s": step.after_s,
        "predicted_optimizer_device_s": step.optimizer_device_s,
        # What communication adds to the step (stalls for collectives that no host wait
        # absorbs), the measured "waited for" figure's counterpart (shardc.planning.step).
        "predicted_exposed_comm_s": step.exposed_comm_s,
        "predicted_peak_bytes": max((p.predicted.get("peak_bytes", 0.0) for p in plans),
                                    default=0.0),
        "params": cfg.num_params(), "regions": len(plans), "param_tensors": n_params,
    })
    # The step back to back (the host running ahead, as the measured step), and from an idle
    # device (as the synced step); shardc.planning.step.
    res["predicted_step_s"] = step.steady_s
    res["predicted_synced_step_s"] = step.step_s
    res["predicted_host_s"] = step.host_s
    res["predicted_device_s"] = step.device_s
    res["predicted_comm_by_group"] = comm_by_group(plans)
    res["predicted_phases_ms"] = predicted_boundaries(plans, step)
    res["predicted_ms_by_category"] = predicted_by_category(
        [p.predicted.get("time_by_category_s") or {} for p in plans], step.by_category)
    res["predicted_optimizer"] = step.optimizer
    res["predicted_optimizer_param_bytes"] = spec.param_bytes  # the master bytes it steps
    res["predicted_optimizer_host_s"] = step.optimizer_host_s
    if probed is not None:
        res.update(probed_predictions(predict_step(plans, probed, spec,
                                                   cudagraphs=args.cudagraphs)))
    if overlap is not None:
        # Parameters stepped during backwards (signalled: handed over by the compiled graphs)
        # and left to optimizer.step(), over every step run: the overlap really happened.
        res["step_in_backward_counts"] = {"early": overlap.early, "signalled": overlap.signalled,
                                          "late": overlap.late}
        overlap.remove()
    del model, loss_fn, opt, data, it, plans, overlap
    return res


def optimizer_spec(args, options: dict[str, Any], param_bytes: float, n_params: int
                   ) -> OptimizerSpec:
    """The step's optimizer as run: torch's default ``AdamW(lr=...)`` (the plan's
    ``optimizer_*`` options, by default the CLI's ``--optimizer adamw``: impl ``"auto"``,
    foreach on the device, per tensor where a group holds host tensors) over ``param_bytes``
    in ``n_params`` tensors, stepping where ``--offload`` puts it, overlapped with the backward
    under ``--step-in-backward``."""
    impl = options.get("optimizer_impl", "auto")
    # As the CLI names --optimizer adamw on the device; on the host the step's report adds
    # "torch.optim runs it per tensor".
    name = "AdamW (foreach)" if args.offload == "none" else "AdamW (torch's default)"
    if impl != "auto":
        name = f"AdamW ({impl})"
    return OptimizerSpec(
        param_bytes, n_params, state_factor=options.get("optimizer_state_factor", 2.0),
        temp_factor=options.get("optimizer_temp_factor", 1.0), name=name,
        offload=args.offload, overlap=args.step_in_backward, impl=impl)


def offload_label(offload: str | None, step_in_backward: bool = False) -> str | None:
    """How a row or report names its CPU offload (None without: reports from before
    ``--offload`` ran none)."""
    if not offload or offload == "none":
        return None
    return f"offload {offload}" + (" + step_in_backward" if step_in_backward else "")


def probed_predictions(step) -> dict[str, float]:
    """A row's predictions with the host AdamW rate probed at the start (a
    ``StepPrediction`` with the probed profile), under the profile's keys suffixed
    ``_probed_adamw``."""
    return {"predicted_step_probed_adamw_s": step.steady_s,
            "predicted_synced_step_probed_adamw_s": step.step_s,
            "predicted_optimizer_probed_adamw_s": step.after_s,
            "predicted_optimizer_host_probed_adamw_s": step.optimizer_host_s}


def probed_log(r: dict) -> str:
    """The progress line's part for the probed prediction (empty without one)."""
    probed = r.get("predicted_step_probed_adamw_s")
    if probed is None:
        return ""
    return f"; probed AdamW: predicted {_ms(probed)} ms ({_err(probed, r['measured_step_s'])})"


def host_adamw_ran(args) -> str:
    """The AdamW implementation that steps host tensors in this run's prediction
    (``OptimizerSpec.ran(host_in_group=True)`` with the backend's optimizer options,
    ``--backend-option``'s over ``ShardcOptions``' defaults): per tensor for torch's default,
    fused where ``optimizer_impl`` (or ``optimizer_temp_factor=0``) says so."""
    options = ShardcOptions(**dict(args.backend_option))
    return optimizer_ran(options.optimizer_impl, options.optimizer_temp_factor,
                         host_in_group=True)


def probe_host_adamw_setup(profile: ClusterProfile, args, device: torch.device
                           ) -> tuple[ClusterProfile, dict[str, Any]]:
    """``--probe-host-adamw`` at setup, before any compile (every rank: a collective): the
    profile with the host AdamW rate of :func:`host_adamw_ran` timed on this process's
    intra-op threads (those its ``optimizer.step()`` runs on), the slowest rank's
    (``shardc.tools.host_adamw_probe.refine_host_adamw``), and ``meta["host_adamw_probe"]``: the
    probe's report plus the rank's share of the host's cores that calibration times on
    (``host_threads_per_rank``), for comparison."""
    probed, info = refine_host_adamw(profile, device, host_adamw_ran(args),
                                     threads=torch.get_num_threads())
    return probed, {**info, "profile": profile.name,
                    "calibration_threads": host_threads_per_rank()}


def refine_host_setup(profile: ClusterProfile, device: torch.device) -> dict[str, float]:
    """``--refine-host`` at setup, before any compile: refuse a profile without a host probe
    (every rank alike: they read the same profile), else time the probe on every rank (the
    slowest's, :func:`shardc.tools.host_probe.agreed_host_probe`). Returns the report's
    ``meta["host_probe"]``: the probe now (``run_s``), the profile's (``calibrated_s``) and the
    factor its host terms are multiplied by."""
    try:
        require_host_probe(profile)
    except ProfileError as exc:
        raise SystemExit(f"predict_step.py --refine-host: {exc}") from exc
    probe = agreed_host_probe(device)
    return {"run_s": probe, "calibrated_s": profile.host_probe_s,
            "factor": host_speed_factor(profile, probe)}


def _run_steps(loss_fn, opt, it, steps: int, device, synced: bool) -> list[tuple[list, Any]]:
    """``steps`` training steps, each as ``(host, ev)``: the host's clock at the step's start
    and where each phase (:data:`PHASES`) returned, and (GPUs) an event at each. ``synced``:
    each step waits for the device before the next starts (timed from an idle device, so it
    also holds the host's work before the first kernel); else back to back, as training runs
    them (the host free to run ahead), one wait after the last."""
    out = []
    for _ in range(steps):
        tokens, targets = next(it)
        ev, host = _events(device), [time.perf_counter()]
        if ev:
            ev[0].record()
        torch.compiler.cudagraph_mark_step_begin()
        loss = loss_fn(tokens, targets)
        _mark(host, ev, 1)
        loss.backward()
        _mark(host, ev, 2)
        opt.step()
        _mark(host, ev, 3)
        opt.zero_grad(set_to_none=True)
        _mark(host, ev, 4)
        if ev and synced:
            ev[4].synchronize()
        out.append((host, ev))
    if out and out[-1][1]:
        out[-1][1][4].synchronize()
    return out


def _span(host: list[float], ev, start: int, end: int) -> float:
    """Seconds from mark ``start`` to mark ``end`` of one step: the device's (events) on GPUs,
    else the host's."""
    return ev[start].elapsed_time(ev[end]) / 1e3 if ev else host[end] - host[start]


def _steady_steps(steps: list[tuple[list, Any]]) -> dict[str, list[float]]:
    """Back-to-back steps (:func:`_run_steps`, not synced) as training sees them: ``step`` from
    each step's start to the next one's (the last: to its end), ``fwd_bwd`` to where
    ``backward()`` returned, ``optimizer`` from there to the end of ``zero_grad``."""
    out: dict[str, list[float]] = {"step": [], "fwd_bwd": [], "optimizer": []}
    for i, (host, ev) in enumerate(steps):
        if i + 1 < len(steps):
            nxt_host, nxt_ev = steps[i + 1]
            out["step"].append(ev[0].elapsed_time(nxt_ev[0]) / 1e3 if ev
                               else nxt_host[0] - host[0])
        else:
            out["step"].append(_span(host, ev, 0, 4))
        out["fwd_bwd"].append(_span(host, ev, 0, 2))
        out["optimizer"].append(_span(host, ev, 2, 4))
    return out


def _mark(host: list[float], ev, i: int) -> None:
    """The host's clock and (GPUs) an event where phase ``i`` returned."""
    host.append(time.perf_counter())
    if ev:
        ev[i].record()


def predicted_boundaries(plans, step) -> dict[str, dict[str, float]]:
    """The model's side of :func:`phase_boundaries` where it says it (ms from the step's
    start): the forward and backward returning on the host (the graphs' device ends less the
    device work still queued, and for the backward plus the gradient hand-off) and on the
    device (the event's time: the later of the device's end and the host), and the step's end.
    For one region exactly the timeline :mod:`shardc.planning.step` adds up; with several,
    the sums of their graphs."""
    def total(key: str) -> float:
        return sum(p.predicted.get(key) or 0.0 for p in plans) * 1e3

    last = min(plans, key=lambda p: p.region, default=None)
    forward = total("forward_time_s")
    fw_host = forward - (last.predicted.get("forward_queued_s") or 0.0) * 1e3 if last else forward
    graphs = step.graphs_s * 1e3
    bw_host = graphs
    if last is not None:
        bw_host += ((last.predicted.get("grad_handoff_s") or 0.0)
                    - (last.predicted.get("backward_queued_s") or 0.0)) * 1e3
    return {"forward": {"host": fw_host, "device": forward},
            "backward": {"host": bw_host, "device": max(graphs, bw_host)},
            "zero_grad": {"device": step.step_s * 1e3}}


def comm_by_group(plans) -> dict[str, dict[str, float]]:
    """The plans' collectives per step by process group and kind (``shard/all_gather``,
    ``replicate/all_reduce``: HSDP's, ``tp/all_reduce``: the tensor-parallel ones found in the
    traced graphs, ...): how many run (``n``; ``elided``: over a one-rank group, not run), their
    buffers' MiB, and the predicted ms on their lane and exposed (what the step's prediction
    holds of them)."""
    out: dict[str, dict[str, float]] = {}
    for plan in plans:
        for c in plan.collectives:
            row = out.setdefault(f"{c.group}/{c.kind}", dict.fromkeys(
                ("n", "elided", "mib", "ms", "exposed_ms"), 0.0))
            if c.elided:
                row["elided"] += 1
                continue
            row["n"] += 1
            row["mib"] += c.buffer_bytes / (1 << 20)
            row["ms"] += c.predicted_s * 1e3
            row["exposed_ms"] += c.exposed_s * 1e3
    return out


def predicted_by_category(tables: list[dict[str, float]], after: dict[str, float]
                          ) -> dict[str, float]:
    """Milliseconds per step by category from the plans' ``time_by_category_s`` (summed over
    regions and graphs, plus the per-graph keys) and the part of the step after the graphs
    (``StepPrediction.by_category``: ``optimizer``, the optimizer's device time, and
    ``param_host``, the device waiting for the host's per-parameter work; also under
    ``step/<category>``)."""
    out: dict[str, float] = {}
    for table in tables + [{f"step/{k}": v for k, v in after.items()}]:
        for key, seconds in table.items():
            category = key.split("/", 1)[-1]
            out[category] = out.get(category, 0.0) + seconds * 1e3
            out[key] = out.get(key, 0.0) + seconds * 1e3
    return out


def _trace_stem(args, c: dict) -> str:
    """Where one configuration's kept trace and plans go (``--keep-traces``), per rank."""
    os.makedirs(args.keep_traces, exist_ok=True)
    tag = f"{c['model']}_{c['layers']}L_b{c['batch']}_{c['precision']}"
    return os.path.join(args.keep_traces, f"{args.name}_{tag}_rank{dist.get_rank()}")


def _keep_kernels(events: list, path: str) -> None:
    """The trace's device events (kernels, copies, sets: name, stream, start and duration in
    us), gzipped: what an offline look at exposed communication needs, at a fraction of the
    full trace's size."""
    import gzip

    keep = [{k: ev[k] for k in ("name", "cat", "ts", "dur", "tid") if k in ev}
            for ev in events if ev.get("ph") == "X"
            and ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    with gzip.open(path, "wt") as f:
        json.dump(keep, f)


def _profiled(loss_fn, opt, it, steps: int, device, keep: str | None = None
              ) -> tuple[float, float, dict[str, float]]:
    """Exposed communication and the part of it the compute waited for (seconds per step,
    ``train.kernels.kernel_breakdown``) and GPU time by kernel category (ms per step,
    ``train.kernels.kernel_time_by_category``) over ``steps`` traced steps; with ``keep``, the
    device events are also written to ``<keep>.kernels.json.gz``."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile
    from train.kernels import kernel_breakdown, kernel_time_by_category

    torch.cuda.synchronize(device)
    dist.barrier()  # the ranks enter the traced steps together (not one waiting at the first)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            tokens, targets = next(it)
            torch.compiler.cudagraph_mark_step_begin()
            loss_fn(tokens, targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    if keep:
        _keep_kernels(events, f"{keep}.kernels.json.gz")
    split = kernel_breakdown(events, steps)
    return (split.get("exposed_comm_ms", 0.0) / 1e3, split.get("waited_comm_ms", 0.0) / 1e3,
            kernel_time_by_category(events, steps))


def _exposed(r: dict) -> str:
    """The measured exposed communication as the report shows it: the part the compute waited
    for, then all NCCL time with no other kernel running (which also holds launch gaps)."""
    if r.get("measured_exposed_comm_s") is None:
        return "–"
    return f"{_ms(r.get('measured_waited_comm_s'))} ({_ms(r['measured_exposed_comm_s'])})"


# The step's exposed communication is the least any rank waited: ranks run in lock step at
# the collectives, so every rank's step lasts its compute plus its waits, and the rank with the
# most compute waits least. What it waits is what communication adds to the step; a faster
# rank's further waiting is for its peer's compute (rank imbalance, or a rank that reached the
# profiled steps later), not for the network.
STEP_COMM_KEYS = ("measured_exposed_comm_s", "measured_waited_comm_s")


def _slowest(per_rank: list[dict]) -> dict:
    """The ranks' results merged: each measured number the largest of the ranks' (so the
    step and the optimizer may come from different ranks), the exposed communication the
    smallest (:data:`STEP_COMM_KEYS`), the
    measured tables (phase ends, time by category) rank 0's; ``measured_per_rank`` keeps every
    rank's measurements (world > 1), which is what tells a rank waiting for its peer at the
    collectives from one waiting for its own host."""
    out = dict(per_rank[0])
    for key in out:
        if key.startswith("measured") and all(isinstance(r.get(key), float | int)
                                              for r in per_rank):
            pick = min if key in STEP_COMM_KEYS else max
            out[key] = pick(r[key] for r in per_rank)
    if len(per_rank) > 1:
        out["measured_per_rank"] = [{k: v for k, v in r.items() if k.startswith("measured")}
                                    for r in per_rank]
    return out


def _ms(v) -> str:
    return "–" if v is None else f"{v * 1e3:.1f}"


def _err(pred, meas) -> str:
    return "–" if not pred or not meas else f"{(pred / meas - 1) * 100:+.1f}%"


def row_head(r: dict, seq: int) -> str:
    """A table row's first cells: its mesh (``bench_mesh.label``; ``–`` in reports made before
    the rows named it) and CPU offload (:func:`offload_label`, where set), model, layers,
    batch x sequence."""
    c = r["config"]
    mesh = r.get("mesh") or "–"
    offload = offload_label(r.get("offload"), bool(r.get("step_in_backward")))
    if offload:
        mesh += f", {offload}"
    return (f"| {mesh} | {c['model']} | {c['layers']} | "
            f"{c['batch']} x {c.get('seq') or seq} |")


HEAD = "| mesh | model | layers | batch x seq |"  # the mesh cell names the offload where set
HEAD_ALIGN = "| --- | --- | ---: | ---: |"


def backend_options_line(meta: dict) -> list[str]:
    """The report's line naming ``--backend-option``'s options (none where the run set none,
    or ran before the flag)."""
    options = meta.get("backend_options") or {}
    if not options:
        return []
    return ["- backend options (every row): "
            + ", ".join(f"`{k}={v!r}`" for k, v in sorted(options.items()))]


def offload_lines(meta: dict) -> list[str]:
    """The report's line on its CPU offload (none where the run had none, or ran before
    ``--offload``)."""
    label = offload_label(meta.get("offload"), bool(meta.get("step_in_backward")))
    if not label:
        return []
    text = {"params": "`shardc.OffloadPolicy()`: the parameters' shards, gradients and "
                      "optimizer state on the host, the optimizer stepping there",
            "optimizer": "`shardc.OffloadPolicy(params=False, optimizer=True)`: the "
                         "optimizer's state and step on the host, inside optimizer.step()"
            }.get(meta["offload"], meta["offload"])
    if meta.get("step_in_backward"):
        text += ("; `shardc.step_in_backward`: each bucket's host step runs under the rest of "
                 "the backward, so measured fwd+bwd holds part of the host step and "
                 "optimizer.step() waits for the rest (the step holds all of it)")
    return [f"- CPU offload (every row): {label}: {text}"]


def render(report: dict) -> str:
    m = report["meta"]
    lines = [
        "# Predicted vs measured training step",
        "",
        f"- command: `{m['command']}`",
        f"- commit: {m['git']}; date (UTC): {m['date']}",
        f"- device: {m['gpu']} x {m['world_size']}; mesh {m.get('mesh') or 'fsdp'}; torch "
        f"{m['torch']}; NCCL {m['nccl']}",
        f"- cluster profile: {m['profile']}",
        *backend_options_line(m),
        *offload_lines(m),
        f"- sequence {m['seq']} unless a row names another; {m['steps']} timed steps (median), "
        f"{m['warmup']} warm-up; {m.get('optimizer') or 'AdamW (foreach)'}; bf16 compute, fp32 "
        "master weights and reduction",
        "",
        f"{HEAD} precision | predicted step ms | measured step ms | error | "
        "pred synced step ms | synced step ms | synced error | pred fwd+bwd ms | "
        "meas fwd+bwd ms | pred optimizer ms | "
        "meas optimizer ms | "
        "pred exposed comm ms | meas exposed comm ms: waited for (NCCL alone) | pred peak GiB | "
        "meas peak GiB |",
        f"{HEAD_ALIGN} --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
        "---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["results"]:
        head = f"{row_head(r, m['seq'])} {r['config']['precision']} |"
        if r.get("status") != "ok":
            lines.append(f"{head} {r.get('status')}: {r.get('reason', '')[:120]} |" + " |" * 13)
            continue
        peak = (lambda v: "–" if not v else f"{v / GIB:.2f}")
        # Reports from before the back-to-back step predicted the synced step only.
        synced = r.get("predicted_synced_step_s", r["predicted_step_s"])
        lines.append(
            f"{head} {_ms(r['predicted_step_s'])} | {_ms(r['measured_step_s'])} | "
            f"{_err(r['predicted_step_s'], r['measured_step_s'])} | "
            f"{_ms(synced)} | {_ms(r.get('measured_synced_step_s'))} | "
            f"{_err(synced, r.get('measured_synced_step_s'))} | "
            f"{_ms(r['predicted_fwd_bwd_s'])} | {_ms(r['measured_fwd_bwd_s'])} | "
            f"{_ms(r['predicted_optimizer_s'])} | {_ms(r['measured_optimizer_s'])} | "
            f"{_ms(r['predicted_exposed_comm_s'])} | {_exposed(r)} | "
            f"{peak(r.get('predicted_peak_bytes'))} | {peak(r.get('measured_peak_bytes'))} |")
    ok = [r for r in report["results"] if r.get("status") == "ok"]
    if ok:
        errs = [abs(r["predicted_step_s"] / r["measured_step_s"] - 1) for r in ok]
        lines += ["", f"Step error: mean |error| {statistics.fmean(errs) * 100:.1f}%, max "
                  f"{max(errs) * 100:.1f}% over {len(ok)} configuration(s); goal: within 10% "
                  "(stretch 5%)."]
    lines += adamw_probe_table(report, m["seq"])
    lines += comm_table(report["results"], m["seq"])
    lines += category_table(report["results"], m["seq"])
    lines += phase_table(report["results"], m["seq"])
    lines += ["", "Predicted step = the plan's forward+backward (fused kernels, attention as one "
              "kernel, launch overhead, the host's per-parameter entry work, collectives on their "
              "lanes) + what follows the graphs (`shardc.planning.step`: the gradient hand-off, "
              "the optimizer step model and zero_grad, host work hidden under queued device work "
              "where there is some; the optimizer columns), back to back: the longer of the "
              "step's host work and its device work less the device's waits for the host (the "
              "host runs ahead of the device across steps; `StepPrediction.steady_s`). Pred "
              "synced step: the same step from an idle device (`step_s`). Measured times are "
              "the slowest rank's "
              "medians (CUDA events) over back-to-back steps, the host free to run ahead as in "
              "training (step: from one step's start to the next's); measured forward+backward "
              "ends when the host returns from backward(), so it holds the hand-off where the "
              "host is behind. Synced step: each step timed from an idle device (synchronized "
              "before it), which adds the host's work before the first kernel; the phase table "
              "below comes from those steps."]
    return "\n".join(lines) + "\n"


# (predicted categories, measured categories) per column of the table by category.
CATEGORY_COLUMNS = (
    ("matmul", ("matmul",), ("matmul",)),
    ("attention fwd", ("attention_forward",), ("attention_forward",)),
    ("attention bwd", ("attention_backward",), ("attention_backward",)),
    # The pack/unpack copies around shardc's collectives are Triton kernels on the GPU (by
    # name "fused"; the profiler's memcpy/memset events are what it calls copies): on 2 x H200
    # predicted copies 3.0-10.0 ms against 0.1-0.3 measured, fused 1.7-8.2 against 4.9-14.9,
    # their sums within -8% to +2%. Compared together.
    ("fused + copies", ("fused", "copies"), ("fused", "copies")),
    ("other kernels", ("other",), ("other",)),
    ("comm", ("exposed_comm",), ("comm",)),
    ("optimizer", ("optimizer",), ("optimizer",)),
    ("device idle", ("launch_bound", "param_host"), ("idle",)),
)


def adamw_probe_table(report: dict, seq: int) -> list[str]:
    """``--probe-host-adamw``'s section: the host AdamW rate probed at the start against the
    profile's, and per row the step predicted with each next to the measured one (and the
    optimizer phase: the host step's part); nothing for a report without the probe."""
    probe = report["meta"].get("host_adamw_probe")
    rows = [r for r in report["results"]
            if r.get("status") == "ok" and r.get("predicted_step_probed_adamw_s")]
    if not probe or not rows:
        return []
    ratio = f" (x{probe['ratio']:.3f})" if probe.get("ratio") else ""
    lines = ["", f"Host AdamW probed at the start (`--probe-host-adamw`, {probe['ran']}, "
             f"{probe['tensors']} x {probe['numel'] / (1 << 20):g}M elements on "
             f"{probe['threads']} intra-op thread(s), the slowest rank's, "
             f"{probe['probe_s']:.2f} s): "
             f"{probe['probed_params_per_s'] / 1e9:.3f} G params/s against the profile's "
             f"{probe['profile_params_per_s'] / 1e9:.3f}{ratio} (`{probe['field']}`). The "
             "step predicted with each (the table above: the profile's):", "",
             f"{HEAD} pred step ms (profile) | pred step ms (probed AdamW) | measured step ms | "
             "error (profile) | error (probed) | pred optimizer ms (probed) | "
             "meas optimizer ms |",
             HEAD_ALIGN + " ---: |" * 7]
    for r in rows:
        probed, meas = r["predicted_step_probed_adamw_s"], r["measured_step_s"]
        lines.append(
            f"{row_head(r, seq)} {_ms(r['predicted_step_s'])} | {_ms(probed)} | {_ms(meas)} | "
            f"{_err(r['predicted_step_s'], meas)} | {_err(probed, meas)} | "
            f"{_ms(r.get('predicted_optimizer_probed_adamw_s'))} | "
            f"{_ms(r.get('measured_optimizer_s'))} |")
    return lines


def comm_table(results: list[dict], seq: int) -> list[str]:
    """The plans' collectives per row (:func:`comm_by_group`): ``group/kind: n x MiB, ms on its
    lane (exposed)``, the elided ones counted apart."""
    rows = [r for r in results if r.get("status") == "ok" and r.get("predicted_comm_by_group")]
    if not rows:
        return []
    lines = ["", "Collectives in the plans per step, by process group (`shard`: FSDP's or HSDP's "
             "shard group, `replicate`: HSDP's all-reduce, `tp`: tensor parallelism's, found in "
             "the traced graphs): count, MiB, predicted ms on the group's lane (exposed ms):", "",
             f"{HEAD} collectives |", f"{HEAD_ALIGN} --- |"]
    for r in rows:
        cells = []
        for key, v in sorted(r["predicted_comm_by_group"].items()):
            cell = (f"{key}: {v['n']:.0f} x, {v['mib']:.1f} MiB, {v['ms']:.1f} ms "
                    f"({v['exposed_ms']:.1f})") if v["n"] else f"{key}: –"
            if v["elided"]:
                cell += f", {v['elided']:.0f} elided"
            cells.append(cell)
        lines.append(f"{row_head(r, seq)} {'; '.join(cells)} |")
    return lines


def category_table(results: list[dict], seq: int) -> list[str]:
    """Predicted and measured milliseconds per step by kernel category, one row per
    configuration (``pred / meas``). The measured side is the GPU's kernel time by kernel name
    over the profiled steps (the optimizer's foreach kernels under ``optimizer``, aten's other
    kernels under ``other kernels``); the predicted side is the plan's kernel groups and the
    optimizer model. ``comm``: predicted exposed vs measured NCCL kernel time; ``device idle``:
    predicted waiting for the host's launches vs measured time with no kernel running."""
    rows = [r for r in results if r.get("status") == "ok" and r.get("predicted_ms_by_category")]
    if not rows:
        return []
    lines = ["", "Where the time goes, ms per step (predicted / measured; measured from "
             "torch.profiler kernel names, `–` where not profiled):", "",
             f"{HEAD} " + " | ".join(name for name, _, _ in CATEGORY_COLUMNS) + " |",
             HEAD_ALIGN + " ---: |" * len(CATEGORY_COLUMNS)]
    for r in rows:
        pred, meas = r["predicted_ms_by_category"], r.get("measured_ms_by_category") or {}
        cells = []
        for _, pkeys, mkeys in CATEGORY_COLUMNS:
            p = sum(pred.get(k, 0.0) for k in pkeys)
            m = f"{sum(meas.get(k, 0.0) for k in mkeys):.1f}" if meas else "–"
            cells.append(f"{p:.1f} / {m}")
        lines.append(f"{row_head(r, seq)} " + " | ".join(cells) + " |")
    return lines


def phase_table(results: list[dict], seq: int) -> list[str]:
    """Where each phase ends, ms from the step's start, host / device (see
    :func:`phase_boundaries`), measured (medians over the timed steps) and predicted where the
    model says it (``–`` where not)."""
    rows = [r for r in results if r.get("status") == "ok" and r.get("measured_phases_ms")]
    if not rows:
        return []
    lines = ["", "Phase ends, ms from the step's start, host returned / device reached (the "
             "device's time is the later of its queued work and the host: where they are equal "
             "the device waited for the host; measured medians, then predicted):", "",
             f"{HEAD} " + " | ".join(f"{name} meas | {name} pred" for name in PHASES) + " |",
             HEAD_ALIGN + " ---: | ---: |" * len(PHASES)]

    def cell(v: dict | None) -> str:
        if not v:
            return "–"
        return " / ".join("–" if v.get(k) is None else f"{v[k]:.1f}" for k in ("host", "device"))

    for r in rows:
        meas, pred = r["measured_phases_ms"], r.get("predicted_phases_ms") or {}
        cells = [f"{cell(meas.get(name))} | {cell(pred.get(name))}" for name in PHASES]
        lines.append(f"{row_head(r, seq)} " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    args = _args(argv)
    configs = parse_configs(args.configs)
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rank, world, device = _init(device_type)
    mesh = bench_mesh.build_mesh(device_type, world, args.mesh, args.tp)
    mesh_label = bench_mesh.label(mesh)
    cluster = {"profile": args.profile} if args.profile else None
    start = time.perf_counter()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        platform.processor() or "cpu")
    profile = resolve_profile(cluster, gpu if device.type == "cuda" else None)
    host_probe = refine_host_setup(profile, device) if args.refine_host else None
    if host_probe is not None:
        log(f"host probe {host_probe['run_s'] * 1e3:.3f} ms, profile "
            f"{host_probe['calibrated_s'] * 1e3:.3f} ms: host terms x{host_probe['factor']:.3f}")
        # Every rank agreed on the probe, so every rank plans with the same profile.
        profile = with_host_speed(profile, host_probe["run_s"])
        cluster = profile.to_dict()
    probed, adamw_probe = (probe_host_adamw_setup(profile, args, device)
                           if args.probe_host_adamw else (None, None))
    if adamw_probe is not None:
        log(f"host AdamW ({adamw_probe['ran']}) {adamw_probe['probed_params_per_s'] / 1e9:.3f} "
            f"G params/s on {adamw_probe['threads']} threads, profile "
            f"{adamw_probe['profile_params_per_s'] / 1e9:.3f} (probe "
            f"{adamw_probe['probe_s']:.2f} s)")
    meta = {
        "command": launch_command(sys.argv if argv is None
                                  else ["benchmarks/predict_step.py", *argv]),
        "git": git_describe(), "gpu": gpu, "world_size": world, "torch": torch.__version__,
        "nccl": nccl_version() if device.type == "cuda" else None,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "profile": f"{profile.name} ({profile.source[:60]}; {profile.date})",
        "profile_arg": args.profile, "tiny": args.tiny, "blocks_once": args.blocks_once,
        "cudagraphs": args.cudagraphs, "memory_budget": args.memory_budget,
        # --backend-option's ShardcOptions fields, on every row (plan_vs_measured.py plans
        # the rows with them too).
        "backend_options": dict(args.backend_option),
        "seq": args.seq or (128 if args.tiny else 2048), "steps": args.steps,
        "warmup": args.warmup,
        # --offload (none, params, optimizer) and --step-in-backward, on every row too.
        "offload": args.offload, "step_in_backward": args.step_in_backward,
        "optimizer": "AdamW(lr=1e-4), torch's default implementation (foreach on device "
                     "tensors, per tensor in a group holding host tensors)",
        # The mesh every row ran on (also each result's "mesh"); plan_vs_measured.py plans the
        # same one (mesh_shape: HSDP's (replicate, shard); tp: the tensor-parallel degree).
        "mesh": mesh_label, "mesh_shape": bench_mesh.parse_mesh(args.mesh, world),
        "tp": args.tp,
        # --refine-host: the probe now and the profile's, and the factor (else None).
        "host_probe": host_probe,
        # --probe-host-adamw: the host AdamW rate now and the profile's (else None).
        "host_adamw_probe": adamw_probe,
    }
    report: dict[str, Any] = {"meta": meta, "results": []}
    out = Path(args.out)
    if host_probe is not None and rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"host_profile_{args.name}.json").write_text(profile.to_json())
    durations: list[float] = []
    for c in configs:
        estimate = max(durations, default=60.0) * (c["layers"] / 8)
        late = [bool(args.deadline_s) and time.perf_counter() - start + estimate
                > args.deadline_s]
        dist.broadcast_object_list(late, src=0)
        if late[0]:
            report["results"].append({"config": c, "mesh": mesh_label, "status": "skipped",
                                      "offload": args.offload,
                                      "step_in_backward": args.step_in_backward,
                                      "reason": f"deadline {args.deadline_s:.0f}s"})
            continue
        label = offload_label(args.offload, args.step_in_backward)
        log(f"{c} on {mesh_label}{', ' + label if label else ''}: start")
        t = time.perf_counter()
        try:
            res = run_config(c, args, device, mesh, cluster, log, probed)
            res["status"] = "ok"
        except Exception as exc:  # record it and go on
            res = {"status": "error", "reason": f"{type(exc).__name__}: {str(exc)[:500]}"}
        # gc once more after the reset, as train_bench's runner does: what Dynamo's caches held
        # of this model (reference cycles of its sharded modules) is freed only by a collection
        # after them. Without it the next row measured the previous model's packed parameters
        # as well (s71: 1.5-6.1 GiB over the plan after the first row, on one H100).
        gc.collect()
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            # What the row left allocated after its cleanup: the next row's measured peak
            # includes it (s71's rows after the first measured 1.5-6.1 GiB over their plans).
            res["left_allocated_bytes"] = torch.cuda.memory_allocated(device)
            if res["left_allocated_bytes"] > LEFT_REPORTED_BYTES:
                log(f"{c}: {res['left_allocated_bytes'] / 2**30:.2f} GiB still allocated after "
                    f"the cleanup; Python-visible: {leftover_tensors(device)}")
        per_rank: list[Any] = [None] * world
        dist.all_gather_object(per_rank, res)
        merged = _slowest(per_rank) if all(r["status"] == "ok" for r in per_rank) else next(
            r for r in per_rank if r["status"] != "ok")
        merged["config"] = c
        merged["mesh"] = mesh_label
        merged["offload"] = args.offload
        merged["step_in_backward"] = args.step_in_backward
        merged["wall_s"] = time.perf_counter() - t
        durations.append(merged["wall_s"] / (c["layers"] / 8))
        report["results"].append(merged)
        if merged["status"] == "ok":
            log(f"{c}: predicted {merged['predicted_step_s'] * 1e3:.1f} ms, measured "
                f"{merged['measured_step_s'] * 1e3:.1f} ms "
                f"({_err(merged['predicted_step_s'], merged['measured_step_s'])}); "
                f"fwd+bwd {_ms(merged['predicted_fwd_bwd_s'])}/"
                f"{_ms(merged['measured_fwd_bwd_s'])}, optimizer "
                f"{_ms(merged['predicted_optimizer_s'])}/{_ms(merged['measured_optimizer_s'])}"
                + probed_log(merged))
        else:
            log(f"{c}: {merged['status']}: {merged.get('reason')}")
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{args.name}.json").write_text(json.dumps(report, indent=1, default=str))
            (out / f"{args.name}.md").write_text(render(report))
    if rank == 0:
        print(render(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
