"""The host's AdamW rate timed at run time, the slowest rank's (CPU offload's host step).

The host step of CPU offload is priced at the cluster profile's host AdamW rate
(``ClusterProfile.host_adamw_rate``), bound by host memory bandwidth, which moves between
machine starts (one H200 host: about 30%; docs/cost_model.md). :func:`refine_host_adamw` times
the implementation the run steps with (calibration's
:func:`shardc.tools.calibrate.measure_host_adamw` on :data:`RUN_HOST_ADAMW`), agrees on the
slowest rank's rate (:func:`shardc.tools.host_probe.agree_on_slowest`) and returns the profile
with it in place of the calibrated rate
(:func:`shardc.planning.host_speed.with_host_adamw_rate`).
"""

from __future__ import annotations

import math
import time

import torch

from shardc.planning.host_speed import host_adamw_field, with_host_adamw_rate
from shardc.planning.optimizer_kind import RAN
from shardc.tools import calibrate
from shardc.tools.host_probe import agree_on_slowest

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
    tensors, numel = size or (RUN_HOST_ADAMW if device.type == "cuda" else calibrate.CPU_HOST_ADAMW)
    rate = calibrate.measure_host_adamw(tensors, numel, threads=threads, per_tensor=not fused)
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
    if ran not in RAN:
        raise ValueError(f"shardc host AdamW probe: ran must be one of {RAN}, got {ran!r}")
    size = size or (RUN_HOST_ADAMW if device.type == "cuda" else calibrate.CPU_HOST_ADAMW)
    threads = threads or calibrate.host_threads_per_rank()
    before = profile.host_adamw_rate(ran)
    t0 = time.perf_counter()
    rate = agreed_host_adamw(device, fused=ran == "fused", threads=threads, group=group,
                             size=size)
    info = {"ran": ran, "field": host_adamw_field(ran), "probed_params_per_s": rate,
            "profile_params_per_s": before, "ratio": rate / before if before > 0 else None,
            "threads": threads,
            "tensors": size[0], "numel": size[1], "probe_s": time.perf_counter() - t0}
    return with_host_adamw_rate(profile, rate, ran), info
