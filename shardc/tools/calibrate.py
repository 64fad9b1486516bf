"""``python -m shardc calibrate``: measure this machine and write a cluster profile.

    python -m shardc calibrate --out h100.json                     # one GPU, ~1-3 min
    torchrun --nproc-per-node 2 -m shardc calibrate --out 2xh200.json   # + collectives
    python -m shardc calibrate --device cpu --quick --out cpu.json     # degraded: CPU timings

Measures what :class:`shardc.planning.profile.ClusterProfile` holds: matmul throughput by shape
(bf16, fp32 and, where the GPU has it, FP8), fused attention forward/backward by sequence length
and head dimension, memory-bound kernel bandwidth by bytes moved, the device time and host
launch time of one small kernel, the host cost of compiled graphs (per kernel, per call), the
host's work per parameter tensor and per step (region entry, gradient hand-off, optimizer
step, zero_grad; :mod:`shardc.tools.host_cost`) and, where ``torch._scaled_mm`` runs, per FP8
matmul (an FP8 variant of the same model), the host-speed probe (a fixed host workload,
:mod:`shardc.tools.host_probe`, the slowest rank's), CPU offload's host rates (torch's fused CPU
AdamW on host tensors; on a GPU, pinned host<->device copies), and, when launched with more
than one process, all-gather / reduce-scatter / all-reduce time over buffer sizes 64 KiB..1 GiB
for each power-of-two group size up to the world, the ring model's bandwidth and latency fitted
to them, and how much slower a matmul runs while an all-gather runs beside it. Rank 0 writes the
profile.

Without a GPU it refuses unless ``--device cpu`` is given: then it times the same things on the
CPU (smaller shapes), which makes a profile of this CPU, useful for tests, not for a GPU plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from shardc.planning.cost_model import ring_terms
from shardc.planning.fit import fit_alpha_beta, value_range
from shardc.planning.profile import (
    FP8_HOST_FIELDS,
    AttentionPoint,
    ClusterProfile,
    CollectiveCurve,
    Link,
    MatmulPoint,
)
from shardc.tools.host_cost import (
    HOST_ROUNDS,
    CollectiveFit,
    PhaseTimes,
    measure_collective_host_cost,
    measure_fp8_host_cost,
    measure_param_host_cost,
    paired_residuals,
    residual_seconds,
    round_order,
)
from shardc.tools.host_probe import agreed_host_probe

MIB = 1 << 20
COLLECTIVE_SIZES = tuple(64 * 1024 * 4 ** i for i in range(8))  # 64 KiB .. 1 GiB
# (m, n, k): square sizes and the shapes of transformer training (tokens x dim x ffn), at 8192
# tokens per rank and at 2048 (batch 1 x 2048, where the two-H200 rows ran matmuls 6-17% slower
# than the 8192-token points predicted: docs/cost_model.md); the last 2048-token ones are the
# weight gradients' (k = tokens).
GPU_MATMULS = ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
               (8192, 2048, 2048), (8192, 5632, 2048), (8192, 2048, 5632), (8192, 32000, 2048),
               (8192, 4096, 4096), (8192, 11008, 4096), (8192, 4096, 11008),
               (2048, 2048, 8192), (4096, 11008, 8192), (16384, 2048, 2048),
               (2048, 5632, 2048), (2048, 2048, 5632), (2048, 32000, 2048),
               (2048, 11008, 4096), (2048, 4096, 11008), (5632, 2048, 2048),
               (11008, 4096, 2048))
CPU_MATMULS = ((128, 128, 128), (256, 256, 256), (512, 512, 512), (512, 1024, 256))
GPU_ATTENTION = ((1024, 128), (2048, 128), (4096, 128), (8192, 128), (2048, 64), (8192, 64))
CPU_ATTENTION = ((128, 32), (256, 32))
GPU_MEMORY = tuple(64 * 1024 * 4 ** i for i in range(8))
CPU_MEMORY = tuple(64 * 1024 * 4 ** i for i in range(5))
# CPU offload's host AdamW: (tensors, elements each). The GPU machine's host: 256M parameters
# (4 GiB of masters, gradients and moments), about as large as one rank's shard of a 1-5B model;
# a CPU-only calibration: small, for tests.
GPU_HOST_ADAMW = (16, 1 << 24)
CPU_HOST_ADAMW = (4, 1 << 16)
# The device optimizer step's ratio to its model: (tensors, elements each). GPU: 256M fp32
# parameters in 64 tensors (4 GiB with gradients and moments), the order of one rank's shards
# in the benchmarks (0.27-0.95B parameters in 75-147 tensors); CPU (a CPU profile): small, for
# tests.
GPU_DEVICE_ADAMW = (64, 1 << 22)
CPU_DEVICE_ADAMW = (4, 1 << 14)
# Launches' worth of device work queued before the timed AdamW step (Timer._busy: a 2048^3
# matmul per two, 20-80 us each): some milliseconds, more than the step's host time.
ADAMW_LEAD_CALLS = 400


class Timer:
    """Median seconds of a callable: CUDA events on a GPU, the wall clock on the CPU.

    ``median(fn, batch_s=...)`` times enough back-to-back calls to fill about ``batch_s`` and
    divides: one call between two events right after a synchronization also times the host
    launching it onto an idle device (tens of microseconds: a 1024^3 matmul came out at 15
    TFLOP/s, a 1 MB add at 35 GB/s on an H100), which a compiled step, launching ahead of a busy
    device, never pays (the step model adds the host's launch time itself). On a GPU the calls
    are queued behind a short busy kernel, so that the device runs them back to back. Leave
    ``batch_s`` at 0 for collectives: every rank must make the same calls."""

    most_calls = 256

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._spin: torch.Tensor | None = None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _busy(self, calls: int) -> None:
        """Queue device work that takes longer than the host needs to launch ``calls`` kernels
        (about 10 us each; one 2048^3 matmul takes 20-80 us on a recent GPU)."""
        if self.device.type != "cuda" or calls <= 1:
            return
        if self._spin is None:
            self._spin = torch.randn(2048, 2048, device=self.device, dtype=torch.bfloat16)
        for _ in range(calls // 2 + 1):
            self._spin @ self._spin

    def time_calls(self, fn: Callable[[], object], calls: int, lead_calls: int = 0) -> float:
        """Seconds of ``calls`` back-to-back calls of ``fn``; ``lead_calls``: queue device work
        for at least that many launches first (see :meth:`median`)."""
        self._busy(max(calls, lead_calls))  # nothing off CUDA
        if self.device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return time.perf_counter() - t0

    def median(self, fn: Callable[[], object], reps: int = 5, warmup: int = 2,
               batch_s: float = 0.0, lead_calls: int = 0) -> float:
        """``lead_calls``: for a callable that launches many kernels from Python (an optimizer
        step), queue device work long enough for the host to launch that many first, so the
        events time the kernels back to back and not the host's launching between them."""
        for _ in range(warmup):
            fn()
        self.sync()
        calls = 1
        if batch_s > 0:
            calls = calls_per_timing(self.time_calls(fn, 1, lead_calls), batch_s,
                                     self.most_calls)
        return statistics.median(self.time_calls(fn, calls, lead_calls) / calls
                                 for _ in range(reps))


def calls_per_timing(one_call_s: float, batch_s: float, most: int) -> int:
    """How many back-to-back calls fill ``batch_s`` when one call (timed alone, so with its
    launch) took ``one_call_s``: between 1 and ``most``."""
    return max(1, min(most, math.ceil(batch_s / max(one_call_s, 1e-9))))


# Compute timings run back to back for about this long (see Timer).
BATCH_S = 2e-3
# The compiled chains' host timings (:func:`measure_compiled_host_cost`): rounds, and steps
# timed back to back in each. Counts, not wall time, so the same command measures the same
# points.
COMPILED_ROUNDS = 11
COMPILED_STEPS = 20


def measure_matmuls(timer: Timer, shapes, dtypes) -> list[MatmulPoint]:
    out = []
    dev = timer.device
    for dtype in dtypes:
        for m, n, k in shapes:
            if dtype.is_floating_point and dtype.itemsize == 1:  # FP8: torch._scaled_mm
                point = _fp8_matmul(timer, m, n, k, dtype)
                if point is not None:
                    out.append(point)
                continue
            a = torch.randn(m, k, device=dev, dtype=dtype)
            b = torch.randn(k, n, device=dev, dtype=dtype)
            seconds = timer.median(functools.partial(torch.mm, a, b), batch_s=BATCH_S)
            out.append(MatmulPoint(str(dtype).removeprefix("torch."), m, n, k,
                                   2.0 * m * n * k / seconds))
    return out


def _fp8_matmul(timer: Timer, m: int, n: int, k: int, dtype: torch.dtype) -> MatmulPoint | None:
    from shardc import _torch

    dev = timer.device
    try:
        a = torch.randn(m, k, device=dev).to(dtype)
        b = torch.randn(n, k, device=dev).to(dtype).t()
        one = torch.ones((), device=dev)
        _torch.scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, TypeError):  # no FP8 on this device
        return None
    seconds = timer.median(lambda: _torch.scaled_mm(a, b, scale_a=one, scale_b=one,
                                                    out_dtype=torch.bfloat16), batch_s=BATCH_S)
    return MatmulPoint(str(dtype).removeprefix("torch."), m, n, k, 2.0 * m * n * k / seconds)


def measure_attention(timer: Timer, shapes, dtype, tokens: int) -> list[AttentionPoint]:
    """Fused causal attention (the backend SDPA picks: flash on Hopper) over ``tokens`` tokens
    per batch, ``dim / head_dim`` heads of a 2048-wide model; backward timed as forward plus
    backward less forward."""
    from shardc.planning.estimate import attention_flops

    out = []
    dev = timer.device
    for seq, head_dim in shapes:
        batch, heads = max(1, tokens // seq), max(1, 2048 // head_dim)
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device=dev, dtype=dtype,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)

        fwd = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True)

        def fwd_bwd(fwd=fwd, inputs=(q, k, v), grad=grad):
            torch.autograd.grad(fwd(), inputs, grad)

        t_f = timer.median(fwd, batch_s=BATCH_S)
        t_fb = timer.median(fwd_bwd, batch_s=BATCH_S)
        shape = [batch, heads, seq, head_dim]
        name = str(dtype).removeprefix("torch.")
        out.append(AttentionPoint(name, seq, head_dim, True, "forward",
                                  attention_flops(shape, seq, True, False) / t_f))
        out.append(AttentionPoint(name, seq, head_dim, True, "backward",
                                  attention_flops(shape, seq, True, True) / max(t_fb - t_f,
                                                                                1e-9)))
    return out


def measure_memory(timer: Timer, sizes) -> list[tuple[int, float]]:
    """Bytes/s of ``z = x + y`` (a fused kernel's typical traffic: two reads, one write) by the
    bytes it moves."""
    out = []
    for moved in sizes:
        n = max(1, moved // 12)  # three fp32 tensors
        x, y, z = (torch.ones(n, device=timer.device) for _ in range(3))
        seconds = timer.median(functools.partial(torch.add, x, y, out=z), reps=7,
                               batch_s=BATCH_S)
        out.append((12 * n, 12 * n / seconds))
    return out


def host_threads_per_rank() -> int:
    """The host cores one rank of this machine gets: the cores this process may run on over
    the ranks torchrun started here (``LOCAL_WORLD_SIZE``; 1 without torchrun), as
    ``benchmarks/train_bench.py`` sets a training run's threads."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() or 1)
    return max(1, cores // max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1))


def measure_host_adamw(tensors: int, numel: int, reps: int = 3,
                       threads: int | None = None, per_tensor: bool = False) -> float:
    """Parameters per second of torch's fused CPU AdamW (``torch.optim.AdamW(fused=True)``;
    ``per_tensor``: ``foreach=False``, what AdamW with both unset runs on host tensors,
    ``ClusterProfile.host_adamw_per_tensor_params_per_s``)
    stepping ``tensors`` fp32 host tensors of ``numel`` elements each, with gradients, after a
    warm-up step (which creates the moments): CPU offload's host step
    (``ClusterProfile.host_adamw_params_per_s``). The median of ``reps`` steps, on ``threads``
    intra-op threads (default :func:`host_threads_per_rank`; the caller's setting is restored):
    torchrun sets ``OMP_NUM_THREADS=1``, and a rate timed on one thread (0.45e9 parameters/s
    on the 2 x H200 host against 4.6e9 on the H100's) is not the host step of a run that uses
    its cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or host_threads_per_rank())
    try:
        params = [torch.zeros(numel, requires_grad=True) for _ in range(tensors)]
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        try:
            opt = torch.optim.AdamW(params, lr=1e-4, **(
                {"foreach": False} if per_tensor else {"fused": True}))
            opt.step()
        except RuntimeError:  # a torch without the fused CPU kernel: the default implementation
            opt = torch.optim.AdamW(params, lr=1e-4)
            opt.step()
        times = []
        for _ in range(max(reps, 1)):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return tensors * numel / statistics.median(times)


def measure_device_adamw_scales(timer: Timer, profile: ClusterProfile, tensors: int,
                                numel: int) -> dict[str, float]:
    """``device_adamw_foreach_scale`` and ``device_adamw_fused_scale`` (profile version 8):
    torch's AdamW (``foreach=True``, ``fused=True``) stepping ``tensors`` fp32 tensors of
    ``numel`` elements on the timer's device, with gradients, after a step that creates the
    moments, timed behind queued device work (``ADAMW_LEAD_CALLS``): the median step's
    seconds over what :func:`shardc.planning.estimate.optimizer_step_seconds` gives for them
    with ``profile`` (its bandwidth and kernel costs, no scale yet). 0 for an implementation
    this torch or device lacks (not measured)."""
    from shardc.planning.estimate import optimizer_step_seconds

    params = [torch.zeros(numel, device=timer.device, requires_grad=True)
              for _ in range(tensors)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    out = {}
    for impl in ("foreach", "fused"):
        try:
            opt = torch.optim.AdamW(params, lr=1e-4, **{impl: True})
            opt.step()
        except RuntimeError:  # no such kernel for this device in this torch
            out[f"device_adamw_{impl}_scale"] = 0.0
            continue
        # Behind queued work: the step model prices the device's kernels here and the host's
        # per-tensor Python apart (``ClusterProfile.optimizer_per_param_s``); timed alone on an
        # idle device, a foreach step's kernels wait for its Python between them.
        seconds = timer.median(opt.step, reps=3, warmup=1, lead_calls=ADAMW_LEAD_CALLS)
        modelled = optimizer_step_seconds(4.0 * tensors * numel, tensors, profile, ran=impl)
        out[f"device_adamw_{impl}_scale"] = seconds / modelled if modelled > 0 else 0.0
        del opt
    return out


def measure_kernel_overheads(timer: Timer) -> tuple[float, float]:
    """(device seconds of one tiny kernel back to back, host seconds to launch one)."""
    dev, n = timer.device, 400
    x = torch.ones(16, device=dev)
    if dev.type != "cuda":
        seconds = timer.median(lambda: [x.add_(1) for _ in range(n)], reps=3) / n
        return seconds, seconds
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(2):  # keep the device busy so the host runs ahead and queues all launches
        for _ in range(8):
            big @ big
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        t0 = time.perf_counter()
        for _ in range(n):
            x.add_(1)
        host = (time.perf_counter() - t0) / n
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / 1e3 / n, host


def fit_compiled_host_cost(short: tuple[float, float], long: tuple[float, float]
                           ) -> tuple[float, float]:
    """(host seconds per kernel, host seconds per graph call) from two compiled chains, each
    ``(kernels per training step, host seconds per training step)``: the line through them.
    A training step calls two graphs (forward, backward): the call cost is split between them."""
    (k1, t1), (k2, t2) = short, long
    if k2 <= k1:
        raise ValueError(f"calibrate: the long chain launched {k2} kernels, the short {k1}")
    per_kernel = max((t2 - t1) / (k2 - k1), 0.0)
    return per_kernel, max(t1 - k1 * per_kernel, 0.0) / 2


@dataclasses.dataclass(frozen=True)
class CompiledHostFit:
    """The compiled graphs' host terms (:func:`fit_compiled_host_rounds`): seconds per kernel
    and per graph call, fitted to each chain's median over the rounds, with each term's range
    over the fits to each round alone."""

    per_kernel_s: float
    per_call_s: float
    spread: dict[str, tuple[float, float]]


def fit_compiled_host_rounds(kernels: tuple[int, int],
                             rounds: Sequence[tuple[float, float]]) -> CompiledHostFit:
    """:func:`fit_compiled_host_cost` over interleaved rounds: ``kernels`` the short and the
    long chain's kernels per training step, ``rounds`` each round's host seconds per step of
    the two. The terms are fitted to the medians over the rounds (a round that a burst of
    other host work slowed moves no term), and the spread of ``compiled_launch_s`` and
    ``graph_call_s`` is the range of the terms fitted to each round alone."""
    if not rounds:
        raise ValueError("calibrate: the compiled graphs' host cost needs one round or more")
    short, long = (statistics.median(r[i] for r in rounds) for i in (0, 1))
    per_kernel, per_call = fit_compiled_host_cost((kernels[0], short), (kernels[1], long))
    by_round = [fit_compiled_host_cost((kernels[0], a), (kernels[1], b)) for a, b in rounds]
    spread = {"compiled_launch_s": value_range(per_kernel, [k for k, _ in by_round]),
              "graph_call_s": value_range(per_call, [c for _, c in by_round])}
    return CompiledHostFit(per_kernel, per_call, spread)


def interleaved_rounds(steps_of: Sequence[Callable[[], None]], rounds: int, steps: int,
                       sync: Callable[[], None]) -> list[tuple[float, ...]]:
    """Each callable's host seconds per call, ``[round][callable]``: in every round each runs
    one untimed call and then ``steps`` timed ones back to back (``sync`` before and after),
    every other round in reverse order, so that a drift of the host's speed (another process,
    the clock) hits every callable alike instead of the one timed last."""
    if rounds < 1 or steps < 1:
        raise ValueError(f"calibrate: host timings need rounds >= 1 and steps >= 1 (got {rounds}, "
                         f"{steps})")
    out = []
    for r in range(rounds):
        row = [0.0] * len(steps_of)
        for i in round_order(len(steps_of), r):
            steps_of[i]()
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                steps_of[i]()
            sync()
            row[i] = (time.perf_counter() - start) / steps
        out.append(tuple(row))
    return out


def measure_compiled_host_cost(device: torch.device, lengths: tuple[int, int] = (4, 32),
                               rounds: int = COMPILED_ROUNDS, steps: int = COMPILED_STEPS
                               ) -> CompiledHostFit:
    """Host seconds per kernel of a compiled training graph and per graph call (see
    :func:`fit_compiled_host_rounds`), from Inductor-compiled chains of tiny matmul + ReLU
    layers trained forward and backward: the kernels take a few microseconds, so the step is
    bound by the host, which is what is measured (the wall time of ``steps`` steps). Every
    layer multiplies by the same weight, so both chains have one parameter: the host's work
    per parameter tensor is measured apart (:mod:`shardc.tools.host_cost`) and is not folded
    into the cost per kernel. Both chains are compiled and their kernels counted (under
    ``torch.profiler``) before any is timed; the timings are :func:`interleaved_rounds`.
    Until the sixtieth session each chain was timed once, right after its own compile; on a
    lent H100's host one such timing falls anywhere in a range of about 40% from one round to
    the next (docs/bench/predict/s60_h100/summary.md)."""
    from torch.profiler import ProfilerActivity, profile

    steps_of, kernels = [], []
    for length in lengths:
        weight = torch.randn(64, 64, device=device, requires_grad=True)
        x = torch.randn(64, 64, device=device)

        def chain(inp: torch.Tensor, w=weight, n=length) -> torch.Tensor:
            for _ in range(n):
                inp = torch.relu(inp @ w)
            return inp

        compiled = torch.compile(chain)

        def step(fn=compiled, inp=x) -> None:
            fn(inp).sum().backward()

        for _ in range(3):
            step()
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize(device)
        kernels.append(sum(1 for e in prof.events() if e.device_type.name == "CUDA"))
        steps_of.append(step)
    timed = interleaved_rounds(steps_of, rounds, steps,
                               functools.partial(torch.cuda.synchronize, device))
    return fit_compiled_host_rounds((kernels[0], kernels[1]), timed)


def _phase_note(times: list[PhaseTimes]) -> str:
    """The per-parameter fit's inputs, for the profile's notes."""
    def kernels(counted: int, model: int | None) -> str:
        return f"{counted} kernels" + (f", {model} in the model" if model is not None else "")

    rows = "; ".join(
        f"{t.params} params: forward {t.forward_s * 1e3:.2f} ms ("
        + kernels(t.forward_kernels, t.forward_model_kernels)
        + (f", {t.forward_prelaunch_s * 1e3:.2f} ms before the first"
           if t.forward_prelaunch_s is not None else "") + "), "
        f"backward {t.backward_s * 1e3:.2f} ms ("
        + kernels(t.backward_kernels, t.backward_model_kernels) + "), optimizer "
        f"{t.optimizer_s * 1e3:.2f} ms"
        + (f" ({t.optimizer_prelaunch_s * 1e3:.2f} ms before its first kernel)"
           if t.optimizer_prelaunch_s is not None else "")
        + f", zero_grad {t.zero_grad_s * 1e3:.3f} ms" for t in times)
    return (f"host per parameter tensor fitted to (median host time per phase over "
            f"{HOST_ROUNDS} interleaved rounds): {rows}")


def _collective_note(world: int, fit: CollectiveFit, per_param: dict[str, float],
                     compiled_launch_s: float, graph_call_s: float) -> str:
    """The collective host fit's inputs and result, for the profile's notes."""
    rows = []
    for t in fit.times:
        forward, backward = residual_seconds(t, per_param, compiled_launch_s, graph_call_s)
        rows.append(f"{t.params} params, {t.bucket_by} buckets, {t.forward_collectives} / "
                    f"{t.backward_collectives} collectives: forward {t.forward_s * 1e3:.2f} ms, "
                    f"backward {t.backward_s * 1e3:.2f} ms, {(forward + backward) * 1e3:.2f} ms "
                    "beyond the one-rank terms")
    low, high = fit.spread
    return (f"host per collective fitted over {world} ranks (the per-parameter model sharded "
            f"over all of them, medians of {HOST_ROUNDS} interleaved rounds): "
            f"{fit.launch_s * 1e6:.1f} us (rounds {low * 1e6:.1f}..{high * 1e6:.1f}); beside it "
            f"{fit.parts['per_param'] * 1e6:.2f} us per parameter tensor and "
            f"{fit.parts['fixed'] * 1e3:.3f} ms per step that the one-rank terms left (not "
            "priced); " + "; ".join(rows))


def _spread_note(terms: dict[str, float], spread: dict[str, tuple[float, float]]) -> str:
    """Each fitted host term with its spread over the rounds, for the log and the notes."""
    def one(name: str) -> str:
        per_param = name.endswith("_per_param_s")
        scale, unit = (1e6, "us") if per_param or name == "collective_launch_s" else (1e3, "ms")
        short = name.removesuffix("_per_param_s").removesuffix("_fixed_s").removesuffix("_s")
        low, high = spread[name]
        return f"{short} {terms[name] * scale:.3g} {unit} [{low * scale:.3g}, {high * scale:.3g}]"

    per_param = [n for n in terms if n.endswith("_per_param_s")]
    other = [n for n in terms if n not in per_param]
    return ("per parameter tensor: " + ", ".join(map(one, per_param))
            + "; per step: " + ", ".join(map(one, other)))


def _fp8_note(times: list[PhaseTimes], bf16: list[PhaseTimes], terms: dict[str, float],
              per_param: dict[str, float], compiled_launch_s: float, graph_call_s: float) -> str:
    """The FP8 fit's inputs and what was left per graph, for the profile's notes."""
    rows = []
    for t, b, (fw_left, bw_left) in zip(times, bf16, paired_residuals(
            times, per_param, compiled_launch_s, graph_call_s, bf16)):
        rows.append(f"{t.params} params, {t.forward_scaled_mms} / {t.backward_scaled_mms} "
                    f"_scaled_mm: forward {t.forward_s * 1e3:.2f} ms ({t.forward_kernels} "
                    f"kernels, {t.forward_model_kernels} in the model; bf16 "
                    f"{b.forward_s * 1e3:.2f} ms, {b.forward_model_kernels}), backward "
                    f"{t.backward_s * 1e3:.2f} ms ({t.backward_kernels} kernels, "
                    f"{t.backward_model_kernels} in the model; bf16 {b.backward_s * 1e3:.2f} ms, "
                    f"{b.backward_model_kernels}); left beyond the bf16 twin "
                    f"{fw_left * 1e3:.2f} / {bw_left * 1e3:.2f} ms")
    fitted = ", ".join(f"{k} {terms[k] * 1e6:.1f} us" for k in FP8_HOST_FIELDS)
    return (f"FP8 host work ({fitted}) fitted to the FP8 tiny Llama, each depth less the same "
            "model without FP8 timed in the same rounds: " + "; ".join(rows))


# ------------------------------------------------------------------------------ collectives


def _groups(world: int):
    """Power-of-two group sizes up to the world (and the world), each with the group holding
    rank 0; every rank creates every group (``new_group`` is collective)."""
    import torch.distributed as dist

    sizes = sorted({s for s in (2 ** i for i in range(1, world.bit_length())) if s <= world}
                   | {world})
    out = []
    for size in sizes:
        group = dist.group.WORLD if size == world else dist.new_group(list(range(size)))
        out.append((size, group))
    return out


def measure_collectives(timer: Timer, sizes, quick: bool) -> list[CollectiveCurve]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    curves = []
    for size, group in _groups(world):
        member = rank < size
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            points = []
            for nbytes in sizes:
                seconds = _time_collective(timer, kind, nbytes, size, group, member, quick)
                # The slowest rank's median: a collective ends when its last rank does.
                t = torch.tensor([seconds], device=timer.device, dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                points.append((int(nbytes), float(t.item())))
            curves.append(CollectiveCurve(kind, size, "intra", tuple(points)))
    return curves


def _time_collective(timer: Timer, kind: str, nbytes: int, size: int, group, member: bool,
                     quick: bool) -> float:
    import torch.distributed as dist

    if not member:
        return 0.0
    dev = timer.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    numel = max(size, nbytes // dtype.itemsize // size * size)
    full = torch.empty(numel, device=dev, dtype=dtype)
    part = torch.empty(numel // size, device=dev, dtype=dtype)
    if kind == "all_gather":
        def fn():
            dist.all_gather_into_tensor(full, part, group=group)
    elif kind == "reduce_scatter":
        def fn():
            dist.reduce_scatter_tensor(part, full, group=group)
    else:
        def fn():
            dist.all_reduce(full, group=group)
    reps = 3 if quick or nbytes >= 256 * MIB else 5
    return timer.median(fn, reps=reps, warmup=1 if nbytes >= 256 * MIB else 2)


def fit_link(curves: list[CollectiveCurve]) -> Link | None:
    """The ring model's per-rank bus bandwidth and per-step latency from measured curves: per
    curve, an alpha-beta fit of time against wire bytes over its sizes of 16 MiB and more gives
    a bandwidth, and its smallest size's time less the wire time, per ring step, a latency; the
    link takes the median of each."""
    bandwidths, latencies = [], []
    for c in curves:
        steps, frac = ring_terms(c.kind, c.group_size)
        large = [(frac * n, t) for n, t in c.points if n >= 16 * MIB]
        if len(large) < 2:
            continue
        _, bandwidth = fit_alpha_beta([w for w, _ in large], [t for _, t in large])
        n, t = min(c.points)
        bandwidths.append(bandwidth)
        latencies.append(max(0.0, (t - frac * n / bandwidth) / steps))
    if not bandwidths:
        return None
    return Link(statistics.median(bandwidths), statistics.median(latencies))


def measure_overlap(timer: Timer) -> float | None:
    """Compute slowdown while an all-gather runs on another stream: a matmul loop's time beside
    a longer all-gather loop over its time alone (the slowest rank's)."""
    import torch.distributed as dist

    if timer.device.type != "cuda":
        return None
    dev = timer.device
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    world = dist.get_world_size()
    part = torch.empty(128 * MIB // world, device=dev, dtype=torch.bfloat16)
    full = torch.empty(part.numel() * world, device=dev, dtype=torch.bfloat16)

    def compute():
        for _ in range(20):
            a @ a

    alone = timer.median(compute)
    comm = torch.cuda.Stream(dev)

    beside = []
    for _ in range(3):
        comm.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(comm):
            for _ in range(40):  # longer than the matmuls: they run beside it throughout
                dist.all_gather_into_tensor(full, part)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        compute()
        end.record()
        torch.cuda.current_stream(dev).wait_stream(comm)
        torch.cuda.synchronize(dev)
        beside.append(start.elapsed_time(end) / 1e3)
    t = torch.tensor([statistics.median(beside) / alone], device=dev, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return max(1.0, float(t.item()))


# Sizes of the host link's copies: a small one for the latency, large ones for the bandwidth
# (an offloaded block's saved values or a bucket's shards: tens to hundreds of MiB).
HOST_LINK_SIZES = (64 << 10, 16 * MIB, 128 * MIB)


def measure_host_link(timer: Timer, sizes=HOST_LINK_SIZES) -> tuple[float, float, float] | None:
    """(host->device bytes/s, device->host bytes/s, latency s) of copies between pinned host
    memory and the device, non-blocking as shardc's copies are: a line through each direction's
    median seconds by bytes (:func:`fit_alpha_beta`), the latency the larger intercept. None
    without a GPU."""
    if timer.device.type != "cuda":
        return None
    fits = []
    for to_device in (True, False):
        seconds = []
        for nbytes in sizes:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(nbytes, dtype=torch.uint8, device=timer.device)
            src, dst = (host, dev) if to_device else (dev, host)
            seconds.append(timer.median(functools.partial(dst.copy_, src, non_blocking=True),
                                        reps=5))
        fits.append(fit_alpha_beta([float(n) for n in sizes], seconds))
    (h2d_latency, h2d_rate), (d2h_latency, d2h_rate) = fits
    return h2d_rate, d2h_rate, max(h2d_latency, d2h_latency)


# ------------------------------------------------------------------------------ driver


def _measure_fp8(device: torch.device, matmuls: list[MatmulPoint], per_param: dict[str, float],
                 compiled_launch_s: float, graph_call_s: float, log: Callable[[str], None],
                 t0: float) -> tuple[dict[str, float], str]:
    """FP8's host terms and a note: measured where ``torch._scaled_mm`` ran in the matmul
    timings (a GPU with FP8: Hopper and later), else none (the profile's zeros: FP8 steps are
    then priced as before)."""
    if device.type != "cuda" or not any(p.dtype.startswith("float8") for p in matmuls):
        return {}, "FP8 host work not measured (torch._scaled_mm does not run here): 0"
    try:
        terms, times, bf16 = measure_fp8_host_cost(device, per_param, compiled_launch_s,
                                                   graph_call_s)
    except (RuntimeError, ValueError) as exc:  # the profile stays usable without them
        log(f"FP8 host work not measured: {exc}")
        return {}, f"FP8 host work not measured ({exc}): 0"
    log("FP8 host work: " + ", ".join(f"{k} {terms[k] * 1e6:.1f} us" for k in FP8_HOST_FIELDS)
        + f" ({time.perf_counter() - t0:.0f} s)")
    return terms, _fp8_note(times, bf16, terms, per_param, compiled_launch_s, graph_call_s)


def measure_runtime_bytes(device: torch.device) -> int:
    """Device bytes the runtime holds once its kernels have run (the profile's
    ``runtime_allocated_bytes``): after an fp32 matmul's forward and backward (the backward on
    autograd's device thread, whose cuBLAS handle has a workspace of its own) with every tensor
    of theirs freed, ``torch.cuda.memory_allocated``. Anything else this process still holds on
    the device counts too (an over-count, on the budget's safe side); 0 off CUDA."""
    import gc

    if device.type != "cuda":
        return 0
    a = torch.randn(1024, 1024, device=device, requires_grad=True)
    b = torch.randn(1024, 1024, device=device, requires_grad=True)
    (a @ b).sum().backward()
    del a, b
    gc.collect()
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device))


def calibrate(device: torch.device, *, quick: bool = False, name: str | None = None,
              command: str = "", log: Callable[[str], None] = print) -> ClusterProfile:
    """Measure this device (and the process group, if one is initialized with more than one
    rank) and return the profile. Every rank must call it."""
    import torch.distributed as dist

    timer = Timer(device)
    gpu = device.type == "cuda"
    t0 = time.perf_counter()
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = False
        shapes = GPU_MATMULS[:6] if quick else GPU_MATMULS
        dtypes = [torch.bfloat16, torch.float8_e4m3fn]
        mm = measure_matmuls(timer, shapes, dtypes)
        mm += measure_matmuls(timer, ((4096, 4096, 4096), (8192, 8192, 8192)), [torch.float32])
        log(f"matmul: {len(mm)} shapes ({time.perf_counter() - t0:.0f} s)")
        attn = measure_attention(timer, GPU_ATTENTION[:3] if quick else GPU_ATTENTION,
                                 torch.bfloat16, tokens=8192)
        mem = measure_memory(timer, GPU_MEMORY)
        dev_name = torch.cuda.get_device_name(device)
        capacity = torch.cuda.get_device_properties(device).total_memory
    else:
        mm = measure_matmuls(timer, CPU_MATMULS, [torch.float32, torch.bfloat16])
        attn = measure_attention(timer, CPU_ATTENTION, torch.float32, tokens=512)
        mem = measure_memory(timer, CPU_MEMORY)
        dev_name, capacity = f"CPU ({os.cpu_count()} cores)", 0
    log(f"attention and memory ({time.perf_counter() - t0:.0f} s)")
    gpu_s, launch_s = measure_kernel_overheads(timer)
    # The host-speed probe (profile version 9), on a warm device and before any compile (whose
    # worker processes would share the host): every rank times it and takes the slowest's.
    host_probe_s = agreed_host_probe(device)
    log(f"host probe: {host_probe_s * 1e3:.3f} ms ({time.perf_counter() - t0:.0f} s)")
    compiled = measure_compiled_host_cost(device) if gpu else None
    compiled_launch_s, graph_call_s = ((compiled.per_kernel_s, compiled.per_call_s) if compiled
                                       else (None, 0.0))
    if compiled:
        log(f"compiled graphs: {compiled_launch_s * 1e6:.1f} us per kernel "
            f"[{compiled.spread['compiled_launch_s'][0] * 1e6:.1f}, "
            f"{compiled.spread['compiled_launch_s'][1] * 1e6:.1f}], {graph_call_s * 1e6:.0f} us "
            f"per call ({time.perf_counter() - t0:.0f} s)")
    host_fit = measure_param_host_cost(device, compiled_launch_s or 0.0, graph_call_s)
    per_param, phase_times, spread = host_fit.terms, host_fit.times, dict(host_fit.spread)
    if compiled:
        spread.update(compiled.spread)
    log("host (fit [low, high] over the rounds) " + _spread_note(per_param, spread)
        + f" ({time.perf_counter() - t0:.0f} s)")
    fp8_terms, fp8_note = _measure_fp8(device, mm, per_param, compiled_launch_s or 0.0,
                                       graph_call_s, log, t0)
    adamw = measure_host_adamw(*(GPU_HOST_ADAMW if gpu else CPU_HOST_ADAMW))
    adamw_per_tensor = measure_host_adamw(*(GPU_HOST_ADAMW if gpu else CPU_HOST_ADAMW),
                                          per_tensor=True)
    log(f"host: fused CPU AdamW {adamw / 1e9:.2f} G params/s, per tensor "
        f"{adamw_per_tensor / 1e9:.2f} G params/s on {host_threads_per_rank()} threads "
        f"({time.perf_counter() - t0:.0f} s)")
    host_link = measure_host_link(timer)
    if host_link is not None:
        log(f"host link (pinned): {host_link[0] / 1e9:.1f} GB/s to the device, "
            f"{host_link[1] / 1e9:.1f} GB/s to the host, {host_link[2] * 1e6:.1f} us "
            f"({time.perf_counter() - t0:.0f} s)")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    curves, link, slowdown = [], None, None
    if world > 1:
        sizes = COLLECTIVE_SIZES if gpu else COLLECTIVE_SIZES[:4]
        curves = measure_collectives(timer, sizes, quick)
        link = fit_link(curves)
        slowdown = measure_overlap(timer)
        log(f"collectives over {world} ranks ({time.perf_counter() - t0:.0f} s)")
    defaults = ClusterProfile(name="", device="", source="", command="", date="")
    notes = [f"calibrated in {time.perf_counter() - t0:.0f} s", _phase_note(phase_times),
             "host terms fitted (medians of each model over the rounds) with their spread "
             "[the lowest, the highest fitted to each round alone]: "
             + _spread_note(per_param, spread), fp8_note]
    collective_host = {}
    if world > 1:
        coll = measure_collective_host_cost(device, host_fit, compiled_launch_s or 0.0,
                                            graph_call_s)
        collective_host["collective_launch_s"] = coll.launch_s
        spread["collective_launch_s"] = coll.spread
        log(f"host per collective over {world} ranks: {coll.launch_s * 1e6:.1f} us [rounds "
            f"{coll.spread[0] * 1e6:.1f}, {coll.spread[1] * 1e6:.1f}]; the one-rank terms left "
            f"{coll.parts['per_param'] * 1e6:.2f} us per parameter tensor, "
            f"{coll.parts['fixed'] * 1e3:.3f} ms per step ({time.perf_counter() - t0:.0f} s)")
        notes.append(_collective_note(world, coll, per_param, compiled_launch_s or 0.0,
                                      graph_call_s))
    else:
        notes.append("one process: no collective timings; the links, the overlap slowdown and "
                     "the host's seconds per collective are the defaults (ring model, "
                     f"{defaults.collective_launch_s * 1e6:.0f} us)")
    if host_link is None:
        notes.append("no GPU: the host link is the default (25 GB/s each way, 10 us)")
        host_link = (defaults.host_to_device_bytes_per_s, defaults.device_to_host_bytes_per_s,
                     defaults.host_copy_latency_s)
    profile = ClusterProfile(
        name=name or (dev_name.split()[1].lower() if gpu and len(dev_name.split()) > 1
                      else "cpu"),
        device=dev_name, source="measured", command=command,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        torch=torch.__version__, device_memory_bytes=int(capacity), gpus=world,
        node_size=max(defaults.node_size, int(os.environ.get("LOCAL_WORLD_SIZE", 1))),
        matmul=tuple(mm), attention=tuple(attn), memory=tuple(mem),
        kernel_gpu_s=gpu_s, kernel_launch_s=launch_s, compiled_launch_s=compiled_launch_s,
        graph_call_s=graph_call_s, **per_param, **fp8_terms, **collective_host,
        collectives=tuple(curves), intra=link or defaults.intra,
        overlap_slowdown=slowdown if slowdown is not None else defaults.overlap_slowdown,
        host_to_device_bytes_per_s=host_link[0], device_to_host_bytes_per_s=host_link[1],
        host_copy_latency_s=host_link[2], host_adamw_params_per_s=adamw,
        host_adamw_per_tensor_params_per_s=adamw_per_tensor, host_probe_s=host_probe_s,
        host_fit_spread=tuple((n, float(low), float(high)) for n, (low, high) in spread.items()),
        notes=tuple(notes))
    # Last: the optimizer step against its model, which reads the bandwidth measured above.
    scales = measure_device_adamw_scales(timer, profile,
                                         *(GPU_DEVICE_ADAMW if gpu else CPU_DEVICE_ADAMW))
    log("device AdamW, measured over modelled: " + ", ".join(
        f"{k.removeprefix('device_adamw_').removesuffix('_scale')} {v:.2f}"
        for k, v in scales.items()) + f" ({time.perf_counter() - t0:.0f} s)")
    # Last, with nothing of the measurements alive: the runtime's own device memory.
    runtime = measure_runtime_bytes(device)
    if gpu:
        log(f"runtime (cuBLAS workspaces): {runtime / 2**20:.1f} MiB allocated with no tensor "
            "alive")
    return dataclasses.replace(profile, runtime_allocated_bytes=runtime, **scales)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardc calibrate",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="profile JSON to write (default: print it)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda; cpu only when asked (a degraded, CPU-only profile)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    p.add_argument("--name", default=None, help="the profile's name (default: from the GPU)")
    args = p.parse_args(argv)
    device_type = args.device or "cuda"
    if device_type == "cuda" and not torch.cuda.is_available():
        print("shardc calibrate: no CUDA device here. Calibrate on the GPU machine you plan for; "
              "without one, plan with a preset (h100, h200), or pass --device cpu for a "
              "CPU-only profile (tests).", file=sys.stderr)
        return 2
    import torch.distributed as dist

    launched = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched:
        local = int(os.environ.get("LOCAL_RANK", 0))
        if device_type == "cuda":
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
            dist.init_process_group("nccl", device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" \
            else torch.device("cpu")
    rank = dist.get_rank() if launched else 0
    command = " ".join(["python -m shardc calibrate", *(argv if argv is not None
                                                        else sys.argv[2:])])
    if launched:
        command = f"torchrun --nproc-per-node {dist.get_world_size()} -m shardc calibrate " \
            + command.removeprefix("python -m shardc calibrate ")

    def log(msg: str) -> None:
        if rank == 0:
            print(f"calibrate: {msg}", file=sys.stderr, flush=True)

    profile = calibrate(device, quick=args.quick, name=args.name, command=command, log=log)
    if rank == 0:
        if args.out:
            with open(args.out, "w") as f:
                f.write(profile.to_json())
            log(f"wrote {args.out}")
        else:
            print(profile.to_json())
    if launched:
        dist.barrier()
        dist.destroy_process_group()
    return 0
