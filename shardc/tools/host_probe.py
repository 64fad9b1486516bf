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
:func:`shardc.tools.host_adamw_probe.refine_host_adamw` times it at run time (its own module:
it reuses calibration's measurement, and calibration imports this probe).
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
