"""Running and measuring one mode: warm-up, timed steps, memory, profile, and the ranks' merge.

Contract: :func:`run_mode` returns this rank's metrics for one mode (collective only through what
the mode's training step does); :func:`aggregate` merges every rank's metrics into the mode's
result (step time and memory: the worst rank; profile: the mean), whose keys are the JSON's.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import bench_mesh
import torch
import torch.distributed as dist

from shardc.models.llama import LlamaConfig
from train.kernels import kernel_breakdown
from train.modes import setup_mode
from train.setup import Setup
from train.workload import synthetic_batches


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gather_objects(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@dataclass
class RunSettings:
    """Global settings shared by every mode of one run."""

    model: str
    cfg: LlamaConfig
    batch: int
    seq: int
    steps: int
    warmup: int
    profile_steps: int
    lr: float
    peak_flops: float
    device: torch.device
    memory_snapshot: bool = False
    loss_in_graph: bool = True  # --loss-in-graph (whole-model compiled modes)
    optim_impl: str = "default"  # --optim-impl: AdamW's implementation in every mode
    fp8: bool = False  # --fp8: the shardc modes shard with FP8 weights (modes.setup_mode)


# AdamW's keyword arguments for each --optim-impl (default: torch's choice, foreach on CUDA).
OPTIM_IMPLS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def train_step(setup: Setup, opt: torch.optim.Optimizer, tokens: torch.Tensor,
               targets: torch.Tensor, mark: Callable[[str], None] | None = None
               ) -> torch.Tensor:
    """One training step; ``mark(phase)`` (if given) is called as each of ``forward``,
    ``backward`` and ``optimizer`` ends (compile_time.py times the first step's phases)."""
    torch.compiler.cudagraph_mark_step_begin()  # a new step for CUDA graph trees (no-op else)
    loss = setup.loss(tokens, targets)
    if mark is not None:
        mark("forward")
    loss.backward()
    if mark is not None:
        mark("backward")
    opt.step()
    opt.zero_grad(set_to_none=True)
    if mark is not None:
        mark("optimizer")
    # A copy: under CUDA graphs (shardc-cudagraphs) the next replay overwrites the output.
    return loss.detach().clone()


def _allocator_counts(device) -> dict[str, int]:
    """The CUDA caching allocator's cumulative retries (cache flushed to satisfy a request) and
    device allocations and frees (cudaMalloc / cudaFree or segment maps)."""
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc",
                                               "num_device_free")}


def run_mode(mode: str, s: RunSettings, mesh, rank: int, log: Callable[[str], None]
             ) -> dict[str, Any]:
    """Build, warm up, time and profile one mode on this rank; returns this rank's metrics."""
    device = s.device
    res: dict[str, Any] = {}
    t0 = time.perf_counter()
    data = synthetic_batches(s.warmup + s.steps + s.profile_steps + 1, s.batch, s.seq,
                             s.cfg.vocab_size, bench_mesh.data_rank(mesh, rank), device)
    setup = setup_mode(mode, s.cfg, device, mesh, s.loss_in_graph, fp8=s.fp8)
    opt = torch.optim.AdamW(setup.params, lr=s.lr, **OPTIM_IMPLS[s.optim_impl])
    if setup.prepare_optimizer is not None:
        setup.prepare_optimizer(opt)
    res["setup_s"] = time.perf_counter() - t0
    res["optimizer_impl"] = {k: opt.defaults.get(k) for k in ("foreach", "fused")}
    res.update(setup.info)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    it = iter(data)

    # Warm-up: the first step compiles (compiled modes) and initializes lazily (all modes).
    warm_times, losses = [], []
    for i in range(s.warmup):
        tokens, targets = next(it)
        sync(device)
        t = time.perf_counter()
        loss = train_step(setup, opt, tokens, targets)
        sync(device)
        warm_times.append(time.perf_counter() - t)
        losses.append(float(loss))
        if i == 0:
            log(f"    {mode}: first step {warm_times[0]:.1f}s, loss {losses[0]:.4f}")
            if setup.after_first_step is not None:
                res.update(setup.after_first_step())
            if device.type == "cuda":  # the steps after the compile record the CUDA graphs
                torch.cuda.reset_peak_memory_stats(device)
    res["warmup_step_s"] = warm_times
    res["compile_s"] = warm_times[0] if warm_times else None
    recorded_peak = (torch.cuda.max_memory_allocated(device)
                     if device.type == "cuda" and s.warmup > 1 else 0)

    # Timed steps.
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = _allocator_counts(device)
    step_ms = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(s.steps)]
        for start, end in events:
            tokens, targets = next(it)
            start.record()
            loss = train_step(setup, opt, tokens, targets)
            end.record()
            losses.append(loss)
        torch.cuda.synchronize(device)
        step_ms = [a.elapsed_time(b) for a, b in events]
        res["peak_alloc_bytes"] = torch.cuda.max_memory_allocated(device)
        if setup.cudagraphs:  # replays allocate nothing: the recording steps hold the peak
            res["peak_alloc_timed_bytes"] = res["peak_alloc_bytes"]
            res["peak_alloc_bytes"] = max(res["peak_alloc_bytes"], recorded_peak)
        res["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        # Near the device's capacity the caching allocator frees its cache and retries
        # (synchronizing the device), which costs throughput the step time then shows.
        after = _allocator_counts(device)
        res["allocator_per_timed_steps"] = {k: after[k] - before[k] for k in after}
    else:
        for _ in range(s.steps):
            tokens, targets = next(it)
            t = time.perf_counter()
            loss = train_step(setup, opt, tokens, targets)
            step_ms.append((time.perf_counter() - t) * 1e3)
            losses.append(loss)
    losses = [float(x) for x in losses]
    res["step_ms"] = step_ms
    res["losses"] = losses

    if s.memory_snapshot and device.type == "cuda" and mode.startswith("shardc"):
        from memory_peak import record_and_summarize

        tokens, targets = next(it)
        res["memory_at_peak"] = record_and_summarize(
            device.index or 0, functools.partial(train_step, setup, opt, tokens, targets))

    # A short profile: kernel intervals of a few steps.
    if s.profile_steps > 0:
        res.update(profile_steps(setup, opt, it, s))
    res["total_s"] = time.perf_counter() - t0
    del setup, opt, data, it, loss
    return res


def profile_steps(setup: Setup, opt: torch.optim.Optimizer, it, s: RunSettings
                  ) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if s.device.type == "cuda" else [ProfilerActivity.CPU]
    sync(s.device)
    with profile(activities=activities) as prof:
        for _ in range(s.profile_steps):
            tokens, targets = next(it)
            train_step(setup, opt, tokens, targets)
        sync(s.device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return {"profile": kernel_breakdown(events, s.profile_steps)}


def free_memory(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def aggregate(mode: str, per_rank: list[dict[str, Any]], s: RunSettings) -> dict[str, Any]:
    """Combine the ranks' metrics: step time and memory take the worst rank, profile the mean."""
    errors = [r["error"] for r in per_rank if r.get("error")]
    out: dict[str, Any] = {"mode": mode}
    if errors:
        out["status"] = "error"
        out["error"] = errors[0]
        out["traceback"] = next(r.get("traceback") for r in per_rank if r.get("error"))
        out["ranks_failed"] = [i for i, r in enumerate(per_rank) if r.get("error")]
        return out
    r0 = per_rank[0]
    tokens = s.batch * s.seq
    medians = [statistics.median(r["step_ms"]) for r in per_rank]
    step_ms = max(medians)
    tps = tokens / (step_ms / 1e3)
    out.update({
        "status": "ok",
        "step_ms_median": step_ms,
        "step_ms_min": min(min(r["step_ms"]) for r in per_rank),
        "step_ms_max": max(max(r["step_ms"]) for r in per_rank),
        "step_ms_rank_medians": medians,
        "step_ms_rank0": list(r0["step_ms"]),  # every timed step, in order (the spread)
        "timed_steps": len(r0["step_ms"]),
        "tokens_per_s_per_gpu": tps,
        "mfu": 6 * s.cfg.num_params() * tps / s.peak_flops,
        "compile_s": max(r["compile_s"] for r in per_rank) if r0.get("compile_s") else None,
        "warmup_step_s": r0["warmup_step_s"],
        "setup_s": max(r["setup_s"] for r in per_rank),
        "total_s": max(r["total_s"] for r in per_rank),
        "loss_first": statistics.fmean(r["losses"][0] for r in per_rank),
        "loss_last": statistics.fmean(r["losses"][-1] for r in per_rank),
    })
    if "allocator_per_timed_steps" in r0:
        out["allocator_per_timed_steps_per_rank"] = [r["allocator_per_timed_steps"]
                                                     for r in per_rank]
    if "peak_alloc_bytes" in r0:
        out["peak_alloc_bytes"] = max(r["peak_alloc_bytes"] for r in per_rank)
        out["peak_reserved_bytes"] = max(r["peak_reserved_bytes"] for r in per_rank)
        out["peak_alloc_bytes_per_rank"] = [r["peak_alloc_bytes"] for r in per_rank]
    profiles = [r.get("profile") or {} for r in per_rank]
    if all(profiles):
        out["profile"] = {k: statistics.fmean(p[k] for p in profiles) for k in profiles[0]}
        out["profile_per_rank"] = profiles
    for key in ("mp_policy", "compile", "inductor_config", "grad_reduce_op",
                "reshard_after_forward", "tagged_gathers", "options", "compute", "communication",
                "loss", "memory_at_peak", "optimizer", "optimizer_impl", "checkpoint",
                "offload", "activation_memory_budget", "fp8"):
        if key in r0:
            out[key] = r0[key]
    if mode.startswith("shardc"):
        for key, value in r0.items():
            if key.startswith("predicted") or key in ("regions", "n_regions"):
                out[key] = value
    return out
