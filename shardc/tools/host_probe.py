"""The host-speed probe: one fixed host workload, timed at calibration and again at run time.

A cluster profile's host terms (``kernel_launch_s``, ``compiled_launch_s``, ``graph_call_s``,
``collective_launch_s``, the per-parameter and fixed host seconds, FP8's host seconds:
:data:`shardc.planning.profile.HOST_SECONDS_FIELDS`) are seconds of the host's Python, aten
dispatch and kernel launches. On the GPU machines the host's speed moves between machine starts
(the same host-bound step measured 33.5 to 44.3 ms on five starts), so a profile calibrated on
one start misprices host-bound steps on another. The probe times a workload of the same kind
that depends on no model: calibration stores it in the profile (``host_probe_s``, profile
version 9) and a run measures it again; the ratio rescales the host terms
(:func:`shardc.planning.host_speed.with_host_speed`).

The workload, per repeat: :data:`PROBE_LAUNCHES` eager in-place adds on a 16-element tensor
(Python, aten dispatch and, on a GPU, a kernel launch each; launched behind queued matmuls so
that the host never waits for the device, as in ``measure_kernel_overheads``), then a fixed
pure-Python loop (:func:`python_work`: building and walking small dicts, lists and strings,
what the wrappers' Python does). Both are timed on the host clock; the probe is the median of
their sum over the repeats, after a warm-up repeat. Well under a second in all.

The host's AdamW rate (CPU offload's host step, ``ClusterProfile.host_adamw_rate``) is bound
by host memory bandwidth, not by what this probe times, and moves between machine starts too:
:func:`refine_host_adamw` times it at run time (calibration's
``shardc.tools.calibrate.measure_host_adamw`` on :data:`RUN_HOST_ADAMW`, the slowest rank's)
and returns the profile with it in place of the calibrated rate.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

# Eager tiny ops per repeat, as ``measure_kernel_overheads`` launches.
PROBE_LAUNCHES = 400
# Iterations of the pure-Python loop per repeat (about 1-3 ms on the hosts seen).
PYTHON_ITERATIONS = 3000
# Matmuls queued before the launches (8192^3 bf16: about 1.5 ms each on an H100/H200), more
# device time than the launches take on the host, so none of them waits for the device.
BUSY_MATMULS = 8
BUSY_SIZE = 8192


def python_work(iterations: int = PYTHON_ITERATIONS) -> int:
    """A fixed pure-Python workload: build a small dict of a list, a tuple and a string per
    iteration and walk it. Returns a checksum (so nothing is optimized away)."""
    total = 0
    for i in range(iterations):
        item = {"index": i, "shape": [i & 7, 16, 3], "name": (f"p{i}", i % 5)}
        for key, value in item.items():
            if isinstance(value, list):
                total += sum(value) + len(key)
            elif isinstance(value, tuple):
                total += len(value[0]) + value[1]
            else:
                total += value
    return total


def _launches(x: torch.Tensor, n: int) -> float:
    """Host seconds to run (eager: dispatch and launch) ``n`` tiny in-place adds on ``x``."""
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    return time.perf_counter() - t0


def _one_repeat(x: torch.Tensor, busy: torch.Tensor | None) -> float:
    """Host seconds of one repeat of the workload; the device (if any) is idle after it."""
    if busy is not None:
        for _ in range(BUSY_MATMULS):
            busy @ busy
    seconds = _launches(x, PROBE_LAUNCHES)
    t0 = time.perf_counter()
    python_work()
    seconds += time.perf_counter() - t0
    if busy is not None:  # untimed: the next repeat starts from an idle device again
        torch.cuda.synchronize(x.device)
    return seconds


def measure_host_probe(device: torch.device, reps: int = 7) -> float:
    """Seconds of one repeat of the probe's fixed host workload on this process's host (see the
    module docstring): the median over ``reps`` repeats (at least one) after a warm-up repeat.
    ``device``: where the tiny ops run; on CUDA, behind queued matmuls (the host runs ahead of
    a busy device), elsewhere with nothing queued. Local to this process: ranks may differ
    (:func:`agreed_host_probe` agrees on one)."""
    if reps < 1:
        raise ValueError(f"shardc host probe: reps must be >= 1, got {reps}")
    x = torch.zeros(16, device=device)
    busy = None
    if device.type == "cuda":
        busy = torch.randn(BUSY_SIZE, BUSY_SIZE, device=device, dtype=torch.bfloat16)
        torch.cuda.synchronize(device)
    _one_repeat(x, busy)  # warm-up: dispatch caches, the allocator, the matmul's handle
    seconds = statistics.median(_one_repeat(x, busy) for _ in range(reps))
    if not (math.isfinite(seconds) and seconds > 0):  # a clock that did not move
        raise RuntimeError(f"shardc host probe: measured {seconds!r} s")
    return seconds


def agreed_host_probe(device: torch.device, group=None) -> float:
    """:func:`measure_host_probe` on every rank of ``group`` (default: the world), then the
    largest of the ranks' values, so every rank returns the same number: what is decided from
    it (a rescaled profile, hence plans) must be identical on every rank, and a step runs at
    the pace of its slowest host. Every rank of the group must call it (it is a collective).
    Without an initialized ``torch.distributed``, the local value. The all-reduce runs on a
    ``device`` tensor over NCCL, else on a CPU tensor (gloo)."""
    return agree_on_slowest(measure_host_probe(device), device, group, larger_is_slower=True)


def agree_on_slowest(value: float, device: torch.device, group=None, *,
                     larger_is_slower: bool) -> float:
    """The slowest rank's ``value`` over ``group`` (default: the world), the same on every
    rank: the largest where a larger value is slower (seconds), else the smallest (a rate).
    Every rank of the group must call it (a collective); without an initialized
    ``torch.distributed``, ``value`` itself. The all-reduce runs on a ``device`` tensor over
    NCCL, else on a CPU tensor (gloo)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return float(value)
    on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    tensor = torch.tensor([value], dtype=torch.float64, device=on)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if larger_is_slower else dist.ReduceOp.MIN,
                    group=group)
    return float(tensor.item())


# The run-time host AdamW probe's workload on a GPU machine's host: (tensors, elements each).
# Calibration's tensor size (``calibrate.GPU_HOST_ADAMW``: 16M elements, so the per-tensor loop
# runs over the same sizes and the probed rate compares with the profile's) in half as many
# tensors: 128M parameters, 2 GiB of masters, gradients and moments. Its four steps (a warm-up
# that creates the moments, then the median of three) would take about 0.9 s at the h200
# preset's per-tensor rate (0.57e9 parameters/s), an estimated 1.5 s with the allocation;
# calibration's 16 tensors would take about 2.5 s, over 3 s on a start a quarter slower. Off a
# GPU (tests, CPU smoke runs): calibration's CPU size.
RUN_HOST_ADAMW = (8, 1 << 24)


def agreed_host_adamw(device: torch.device, *, fused: bool = False,
                      threads: int | None = None, group=None,
                      size: tuple[int, int] | None = None) -> float:
    """Parameters per second of the host's AdamW now, the slowest rank's (every rank of
    ``group`` must call it): :func:`shardc.tools.calibrate.measure_host_adamw` (``fused``:
    ``AdamW(fused=True)``, else the per-tensor loop torch's default AdamW runs on host tensors)
    on ``size`` (default :data:`RUN_HOST_ADAMW` for a CUDA ``device``'s host, else
    ``calibrate.CPU_HOST_ADAMW``) and ``threads`` intra-op threads (default: the rank's share of
    the host's cores, ``calibrate.host_threads_per_rank``), then the smallest rate over the
    ranks (:func:`agree_on_slowest`): the host step of every rank waits for the slowest."""
    from shardc.tools.calibrate import CPU_HOST_ADAMW, measure_host_adamw

    tensors, numel = size or (RUN_HOST_ADAMW if device.type == "cuda" else CPU_HOST_ADAMW)
    rate = measure_host_adamw(tensors, numel, threads=threads, per_tensor=not fused)
    if not (math.isfinite(rate) and rate > 0):
        raise RuntimeError(f"shardc host AdamW probe: measured {rate!r} parameters/s")
    return agree_on_slowest(rate, device, group, larger_is_slower=False)


def refine_host_adamw(profile, device: torch.device, ran: str = "per_tensor", *,
                      threads: int | None = None, group=None,
                      size: tuple[int, int] | None = None):
    """``profile`` (a ``ClusterProfile``) with the host AdamW rate that ``ran`` (the
    implementation that steps host tensors, ``shardc.planning.optimizer_kind.RAN``) is priced
    at replaced by this host's now (:func:`agreed_host_adamw`, the slowest rank's; fused for
    ``"fused"``, else the per-tensor loop), and what was measured: ``ran``, the probed and the
    profile's rates (``probed_params_per_s``, ``profile_params_per_s``), their ratio, the
    ``field`` replaced, ``threads``, ``tensors``, ``numel`` and the probe's wall seconds
    (``probe_s``). A collective (every rank of ``group`` calls it); run it before compiling,
    whose worker processes would share the host's cores.
    (:func:`shardc.planning.host_speed.with_host_adamw_rate`.)"""
    from shardc.planning.host_speed import host_adamw_field, with_host_adamw_rate
    from shardc.planning.optimizer_kind import RAN
    from shardc.tools.calibrate import CPU_HOST_ADAMW, host_threads_per_rank

    if ran not in RAN:
        raise ValueError(f"shardc host AdamW probe: ran must be one of {RAN}, got {ran!r}")
    size = size or (RUN_HOST_ADAMW if device.type == "cuda" else CPU_HOST_ADAMW)
    threads = threads or host_threads_per_rank()
    before = profile.host_adamw_rate(ran)
    t0 = time.perf_counter()
    rate = agreed_host_adamw(device, fused=ran == "fused", threads=threads, group=group,
                             size=size)
    info = {"ran": ran, "field": host_adamw_field(ran), "probed_params_per_s": rate,
            "profile_params_per_s": before, "ratio": rate / before if before > 0 else None,
            "threads": threads,
            "tensors": size[0], "numel": size[1], "probe_s": time.perf_counter() - t0}
    return with_host_adamw_rate(profile, rate, ran), info
