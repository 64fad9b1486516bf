"""The cluster profile: what one device and its interconnect can do, measured or estimated.

A :class:`ClusterProfile` is versioned, frozen data with a JSON form (``PROFILE_VERSION``). It
holds measured points and a few fitted constants, and answers the cost estimator's questions
(:mod:`shardc.planning.estimate`): how long a matmul of this shape takes, an attention kernel, a
memory-bound kernel that moves this many bytes, a collective of this size over a group of this
many ranks, what launching a kernel costs, and how much slower compute runs while a collective
runs beside it. ``python -m shardc calibrate`` (:mod:`shardc.calibrate`) measures one; the
presets in ``shardc/planning/profiles/`` ship with the package, each naming the command and date
that made it (or, for an estimate, its sources; a preset merged from two calibrations names both
in ``command`` and ``date``, and its first note says which fields each gave).

Lookups interpolate (:mod:`shardc.planning.fit`): matmul and attention rates by shape (inverse-
distance weighting in log space over the nearest measured shapes), memory-bound bandwidth by the
bytes a kernel moves, collective time piecewise-linearly over the measured sizes of that kind
and group size; group sizes never measured (planning for 1024 ranks) use the ring model of
:mod:`shardc.planning.cost_model` at the profile's fitted link bandwidth and latency.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from shardc.planning.cost_model import ClusterSpec
from shardc.planning.fit import interp_linear, interp_log, interp_nearest_log

PROFILE_FORMAT = "shardc-cluster-profile"
# Version 2 added ``compiled_launch_s`` and ``graph_call_s`` (the host cost of compiled graphs);
# a version-1 profile reads with the launch of an eager kernel for both and no call cost.
# Version 3 added the host seconds per parameter tensor (:data:`PER_PARAM_FIELDS`); a version-1
# or 2 profile reads with zeros for them (its predictions are unchanged).
# Version 4 added each phase's fixed host seconds per step (:data:`FIXED_FIELDS`, the
# intercepts of the same fits) and the backward's host work before its first launch
# (``backward_entry_per_param_s``, split from the hand-off); an older profile reads with zeros
# for them and predicts as before; from version 4 the backward's call and entry also hide under
# the device work the forward left queued (shardc.planning.schedule.plan_region).
# Version 5 added the host: its link (``host_to_device_bytes_per_s``,
# ``device_to_host_bytes_per_s``, ``host_copy_latency_s``: pinned copies between host and
# device, what CPU offload's copies and activation offload are priced at) and torch's fused CPU
# AdamW (``host_adamw_params_per_s``, CPU offload's host step); an older profile reads with the
# constants used before (:data:`DEFAULT_HOST_LINK_BYTES_PER_S` each way,
# :data:`DEFAULT_HOST_COPY_LATENCY_S`) and :data:`DEFAULT_HOST_ADAMW_PARAMS_PER_S`.
# Version 6 added FP8's host work (:data:`FP8_HOST_FIELDS`: host seconds per ``_scaled_mm`` of
# a compiled forward and backward, beyond the parameter terms and the model's launches); an older
# profile reads with zeros for them and predicts as before.
# Version 7 added the per-tensor CPU AdamW's rate (``host_adamw_per_tensor_params_per_s``: the
# host step of an optimizer whose ``foreach``/``fused`` are unset, which steps host tensors per
# tensor); an older profile reads with 0 (not measured: the fused rate over
# ``shardc.planning.optimizer_kind.DEFAULT_PER_TENSOR_HOST_SLOWDOWN``).
# Version 8 added the device optimizer step's measured time over its modelled one
# (``device_adamw_foreach_scale``, ``device_adamw_fused_scale``: torch's AdamW on device tensors
# against :func:`shardc.planning.estimate.optimizer_step_seconds`); an older profile reads with
# 0 (not measured: the model as it is) and predicts as before.
# Version 9 added the host-speed probe (``host_probe_s``: seconds of a fixed host workload,
# :func:`shardc.tools.host_probe.measure_host_probe`, timed at calibration); a run that times
# it again rescales the host terms (:data:`HOST_SECONDS_FIELDS`) by the ratio
# (:func:`shardc.planning.host_speed.with_host_speed`). An older profile reads with 0 (not
# measured: it cannot be rescaled) and predicts as before. Later within version 9 (optional, a
# default): ``runtime_allocated_bytes``, the device memory the runtime holds once its kernels
# have run (cuBLAS workspaces), 0: not measured (:meth:`ClusterProfile.runtime_bytes`).
# Version 10 added the host fit's spread (``host_fit_spread``: per fitted host term, the lowest
# and highest value that the calibration's repeated rounds fitted, issue 19); it prices
# nothing. An older profile reads with none (not measured) and predicts as before.
PROFILE_VERSION = 10
READABLE_PROFILE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
# Host<->device bandwidth of pinned copies (bytes/s) where not measured: PCIe gen5 x16 measures
# about 50 GB/s each way at best; half of it is what large pinned copies sustain next to NCCL.
DEFAULT_HOST_LINK_BYTES_PER_S = 25e9
DEFAULT_HOST_COPY_LATENCY_S = 10e-6
HOST_LINK_FIELDS = ("host_to_device_bytes_per_s", "device_to_host_bytes_per_s")
# The host work that grows with the number of parameter tensors, outside what the per-kernel and
# per-call terms price (see ClusterProfile): seconds per parameter tensor, one field per phase.
PER_PARAM_FIELDS = ("region_entry_per_param_s", "forward_graph_per_param_s",
                    "backward_entry_per_param_s", "backward_graph_per_param_s",
                    "grad_handoff_per_param_s",
                    "optimizer_per_param_s", "zero_grad_per_param_s")
# The same phases' host seconds per step that do not grow with the parameter tensors (what the
# per-call and per-kernel terms leave at zero parameters: the loss, the optimizer's own Python,
# ...): one field per per-parameter field, in the same order.
FIXED_FIELDS = tuple(f.removesuffix("_per_param_s") + "_fixed_s" for f in PER_PARAM_FIELDS)
# FP8's host work in a compiled graph (version 6), seconds per ``torch._scaled_mm`` of the graph
# (an FP8 Linear: one in the forward, two in the backward); finite, may be negative (see
# ClusterProfile).
FP8_HOST_FIELDS = ("fp8_forward_per_scaled_mm_s", "fp8_backward_per_scaled_mm_s")
# Every term of seconds of the host's own work (Python, aten dispatch, launches): what the
# host-speed probe rescales (:func:`shardc.planning.host_speed.with_host_speed`). The host link
# and the host AdamW rates are not here: they are bound by the link and by host memory
# bandwidth, not by the interpreter's speed.
HOST_SECONDS_FIELDS = ("kernel_launch_s", "compiled_launch_s", "graph_call_s",
                       "collective_launch_s", *PER_PARAM_FIELDS, *FIXED_FIELDS,
                       *FP8_HOST_FIELDS)
PRESETS = ("h100", "h200")
# CPU offload's host step rate (version 5), a positive number.
HOST_FIELDS = ("host_adamw_params_per_s",)
# torch's fused CPU AdamW over fp32 masters, parameters per second: one H100 machine's 16
# cores stepped 5.12B parameters in about 1.05 s (docs/offload.md, the big model), i.e. about
# 28 bytes per parameter (reads of the parameter, gradient and both moments, writes of three)
# at ~136 GB/s of host memory bandwidth. An estimate for other hosts until calibrated.
DEFAULT_HOST_ADAMW_PARAMS_PER_S = 4.9e9


class ProfileError(ValueError):
    """A cluster profile that cannot be read (wrong format or version, missing fields)."""


@dataclass(frozen=True)
class MatmulPoint:
    """Achieved FLOP/s of ``(m, k) @ (k, n)`` in ``dtype`` (``2*m*n*k`` FLOPs)."""

    dtype: str
    m: int
    n: int
    k: int
    flops_per_s: float


@dataclass(frozen=True)
class AttentionPoint:
    """Achieved FLOP/s of the fused attention kernel (flash / memory-efficient) for one pass
    (``"forward"`` or ``"backward"``) at a sequence length and head dimension. FLOPs are counted
    as :func:`attention_flops` counts them (causal: half the square)."""

    dtype: str
    seq: int
    head_dim: int
    causal: bool
    pass_: str
    flops_per_s: float


@dataclass(frozen=True)
class CollectiveCurve:
    """Measured seconds of one collective kind over one group size, by buffer bytes (the
    gathered / unreduced buffer, as plans count ``buffer_bytes``)."""

    kind: str
    group_size: int
    level: str  # "intra" (within a node) | "inter"
    points: tuple[tuple[int, float], ...]  # (buffer bytes, seconds), the median of repeats


@dataclass(frozen=True)
class Link:
    """The ring model's constants for one level of the network (fitted or estimated)."""

    bus_bandwidth: float  # bytes/s per rank
    latency_s: float  # per ring step


@dataclass(frozen=True)
class HostLink:
    """The host link of a cluster profile (:attr:`ClusterProfile.host_link`): pinned copies
    between host memory and the device, each direction at its own rate (bytes/s) plus
    ``latency_s`` per copy. No defaults of its own: the profile's fields (and their format
    defaults, :data:`DEFAULT_HOST_LINK_BYTES_PER_S`, :data:`DEFAULT_HOST_COPY_LATENCY_S`) are
    the one source; :meth:`copy_seconds` is the one price of a host<->device copy."""

    device_to_host_bytes_per_s: float
    host_to_device_bytes_per_s: float
    latency_s: float

    def copy_seconds(self, nbytes: float, to_device: bool) -> float:
        """Seconds of one copy of ``nbytes`` (``to_device``: host->device, else
        device->host): the latency plus the bytes at that direction's rate; a copy of no bytes
        is not made (0.0)."""
        if nbytes <= 0:
            return 0.0
        rate = self.host_to_device_bytes_per_s if to_device else self.device_to_host_bytes_per_s
        return self.latency_s + nbytes / rate


@dataclass(frozen=True)
class ClusterProfile:
    """See the module docstring. ``memory`` holds ``(bytes moved, bytes/s)`` of memory-bound
    kernels; ``kernel_gpu_s`` is the fixed device time of one kernel (launch latency, tail),
    ``kernel_launch_s`` the host time to launch one eager op (the optimizer's foreach ops);
    ``compiled_launch_s`` the host time per kernel of a compiled training graph and
    ``graph_call_s`` the host time of calling one (guards, wrappers, autograd), both measured
    on a compiled chain of kernels (None / 0 where not measured: ``kernel_launch_s`` and no
    call cost); ``overlap_slowdown`` multiplies compute time while a collective runs;
    ``collective_launch_s`` is the host time per collective issued (calibrated over several
    ranks as what the per-parameter model sharded over them adds per collective to its host
    time over one rank; :func:`shardc.tools.host_cost.fit_collective_host_cost`).

    Host seconds per parameter tensor (version 3; zero in older profiles), each the part of a
    phase's host time that grows with the number of parameter tensors beyond what the terms
    above already price (calibration fits each as the slope of the phase's host time, less
    ``graph_call_s`` and ``compiled_launch_s`` per kernel of its graph, against the number of
    parameter tensors of a shardc-sharded model):

    - ``region_entry_per_param_s``: calling a compiled region's forward, per parameter tensor
      it takes: Dynamo's guards on each parameter (``TorchDynamo Cache Lookup``) and the
      wrappers' input handling (unwrapping each DTensor parameter, ``PythonSubclass``): the
      host time before the forward's first device work. Charged on the forward's host
      timeline before its first kernel launches.
    - ``forward_graph_per_param_s``: the rest of the compiled forward's host time that grows
      with its parameters, beyond ``compiled_launch_s`` per kernel: a block's kernels grow with
      its parameters, and Inductor's Python per kernel grows with the kernel's arguments and
      buffers, which the chain ``compiled_launch_s`` is fitted on hardly has. Charged spread
      over the forward's kernel launches (it hides where the device is the bottleneck).
    - ``backward_entry_per_param_s`` (version 4): ``backward()`` up to the compiled backward's
      first device work, per gradient (the autograd engine and the compiled backward's wrapper
      taking its inputs). Charged on the backward's host timeline before its first launch; the
      device waits for it unless the forward left work queued.
    - ``backward_graph_per_param_s`` (version 4): the backward's host time between its first
      and last launch beyond ``compiled_launch_s`` per kernel of the model: the launches of the
      kernels Inductor runs beyond the model's groups, per gradient. Charged spread over the
      backward's launches (it hides where the device is the bottleneck).
    - ``grad_handoff_per_param_s``: the end of a region's backward, per gradient it returns:
      wrapping each gradient as a DTensor, ``AccumulateGrad`` and the detach into ``.grad``
      (and whatever else of ``backward()``'s host time grows with the parameters: it is fitted
      as one term; since version 4 what runs before the backward's first launch is
      ``backward_entry_per_param_s``'s). Charged on the host after the backward's last launch
      (hidden under the device work still queued then, if any).
    - ``optimizer_per_param_s``: ``optimizer.step()`` for torch's ``foreach`` AdamW (the
      default, what the benchmarks run) over DTensor parameters, per parameter tensor: its
      Python, DTensor dispatch of each foreach op and the launches of its kernels. Its device
      time is :func:`shardc.planning.estimate.optimizer_step_seconds`'s.
    - ``zero_grad_per_param_s``: ``optimizer.zero_grad(set_to_none=True)``, per parameter
      tensor.

    Fixed host seconds per step of the same phases (version 4; zero in older profiles): the
    intercepts of the same fits, what each phase's host time holds at zero parameter tensors
    beyond ``graph_call_s`` and ``compiled_launch_s`` per kernel (the model's kernels: see
    :mod:`shardc.tools.host_cost`). They are charged once per step, where their phase is:

    - ``region_entry_fixed_s``, ``forward_graph_fixed_s``: the first region's forward (the one
      called first; the model's embedding, the loss and the wrappers' Python), before its
      first launch and spread over its launches;
    - ``backward_entry_fixed_s``, ``backward_graph_fixed_s``, ``grad_handoff_fixed_s``: the
      first region's backward (the step's last), before its first launch, spread over its
      launches and after its last;
    - ``optimizer_fixed_s``: ``optimizer.step()`` before its first kernel (its grouping of
      the parameters and state, the profiler and grad-mode wrappers), the device idle unless
      earlier work is still queued;
    - ``zero_grad_fixed_s``: with zero_grad.

    A fixed term may be negative (a phase whose call costs less than the compiled chain's
    ``graph_call_s``, e.g. the backward's); a phase's host time is never charged below zero.

    The host link (version 5): ``host_to_device_bytes_per_s`` and ``device_to_host_bytes_per_s``,
    the bandwidth of large copies between pinned host memory and the device in each direction,
    and ``host_copy_latency_s``, a copy's fixed time (:meth:`host_copy_seconds`): CPU offload's
    copies (:mod:`shardc.planning.copies`) and activation offload's
    (:mod:`shardc.planning.offload`) are priced at them. Calibration measures them on a GPU;
    older profiles, CPU profiles and presets not measured since read with the constants used
    before (25 GB/s each way, 10 us).

    FP8's host work (version 6; zero in older profiles): ``fp8_forward_per_scaled_mm_s`` and
    ``fp8_backward_per_scaled_mm_s``, host seconds per ``torch._scaled_mm`` of a compiled
    forward / backward (an FP8 ``nn.Linear``: one in the forward, its input and weight
    gradients two in the backward) beyond what the per-parameter terms and
    ``compiled_launch_s`` per kernel of the model already price: the Python of Inductor's
    extern ``_scaled_mm`` calls and of the amax, scale and cast kernels around each (more
    arguments and buffers per kernel than the bf16 block's). Charged spread over the graph's
    launches, like ``forward_graph_per_param_s`` (the graph's spread work never below zero).
    A term may be negative: an FP8 weight's quantize kernel takes the place of the bf16 cast
    whose launch the per-parameter terms already hold (calibrated on bf16), yet the model
    charges it as a launch; and FP8's simple kernels may launch faster than
    ``compiled_launch_s``. Calibration fits them on an FP8 variant of its tiny Llama where
    ``_scaled_mm`` runs (:func:`shardc.tools.host_cost.fit_fp8_host_cost`).

    ``host_adamw_params_per_s`` (version 5; older profiles read with the default): parameters
    (fp32 master elements) per second torch's fused CPU AdamW steps on this host
    (``torch.optim.AdamW(fused=True)`` on CPU tensors, all cores): the host step of CPU offload
    (:mod:`shardc.planning.step`). Default :data:`DEFAULT_HOST_ADAMW_PARAMS_PER_S` (one H100
    machine's host, measured in a training step); calibration times the kernel on host tensors
    (:func:`shardc.tools.calibrate.measure_host_adamw`).

    ``host_adamw_per_tensor_params_per_s`` (version 7; 0, and older profiles: not measured):
    the same for torch's per-tensor CPU AdamW (``torch.optim.AdamW(foreach=False)`` on CPU
    tensors, what an AdamW with ``foreach`` and ``fused`` unset runs on host tensors; CPU
    ``foreach=True`` loops over the same kernels): :meth:`host_adamw_rate`.

    ``device_adamw_foreach_scale`` and ``device_adamw_fused_scale`` (version 8; 0, and older
    profiles: not measured, taken as 1): torch's AdamW (``foreach=True`` / ``fused=True``)
    stepping device tensors, its measured time over the modelled one (the memory-bound passes
    of :func:`shardc.planning.estimate.optimizer_step_seconds` at this profile's bandwidth and
    kernel costs); the model multiplies its step by it (:meth:`device_optimizer_scale`).
    Calibration times a step of tensors about the size of one rank's shards
    (:func:`shardc.tools.calibrate.measure_device_adamw_scales`).

    ``host_probe_s`` (version 9; 0, and older profiles: not measured): seconds of the
    host-speed probe (:func:`shardc.tools.host_probe.measure_host_probe`: eager tiny-op
    launches and a fixed pure-Python loop), timed at calibration after the device's warm-up,
    the slowest rank's. It prices nothing itself: a run that times the probe again rescales the
    host terms (:data:`HOST_SECONDS_FIELDS`) by the ratio, for a host faster or slower than the
    calibrated one (:func:`shardc.planning.host_speed.with_host_speed`).

    ``runtime_allocated_bytes`` (within version 9, optional; 0: not measured): device bytes
    that stay allocated through the CUDA caching allocator once a matmul's forward and backward
    have run and every tensor of theirs is freed: the cuBLAS workspaces of the forward's thread
    and autograd's backward thread (:func:`shardc.tools.calibrate.measure_runtime_bytes`).
    ``torch.cuda.max_memory_allocated`` counts them; the peak model adds them to every phase of a
    CUDA target (:meth:`runtime_bytes`, the one source of that figure).

    ``host_fit_spread`` (version 10; empty, and older profiles: not measured): for each host
    term that calibration fits from timings of several models (:data:`PER_PARAM_FIELDS`,
    :data:`FIXED_FIELDS`, ``collective_launch_s`` over several ranks), ``(term, low, high)``:
    the range of the term fitted to all the repeated rounds' medians and to each round alone
    (:func:`shardc.tools.host_cost.fit_param_host_rounds`). It prices nothing; it says how far
    the calibration's own noise moves the term (:meth:`fit_spread`).

    :mod:`shardc.planning.step` places them on the step's host and device timelines."""

    name: str
    device: str
    source: str  # "measured" or the estimate's sources
    command: str
    date: str
    torch: str = ""
    device_memory_bytes: int = 0
    gpus: int = 1
    matmul: tuple[MatmulPoint, ...] = ()
    attention: tuple[AttentionPoint, ...] = ()
    memory: tuple[tuple[int, float], ...] = ()
    kernel_gpu_s: float = 2e-6
    kernel_launch_s: float = 6e-6
    compiled_launch_s: float | None = None
    graph_call_s: float = 0.0
    collective_launch_s: float = 15e-6
    collectives: tuple[CollectiveCurve, ...] = ()
    intra: Link = field(default_factory=lambda: Link(350e9, 4e-6))
    inter: Link = field(default_factory=lambda: Link(40e9, 10e-6))
    region_entry_per_param_s: float = 0.0
    forward_graph_per_param_s: float = 0.0
    backward_entry_per_param_s: float = 0.0
    backward_graph_per_param_s: float = 0.0
    grad_handoff_per_param_s: float = 0.0
    optimizer_per_param_s: float = 0.0
    zero_grad_per_param_s: float = 0.0
    region_entry_fixed_s: float = 0.0
    forward_graph_fixed_s: float = 0.0
    backward_entry_fixed_s: float = 0.0
    backward_graph_fixed_s: float = 0.0
    grad_handoff_fixed_s: float = 0.0
    optimizer_fixed_s: float = 0.0
    zero_grad_fixed_s: float = 0.0
    overlap_slowdown: float = 1.1
    host_to_device_bytes_per_s: float = DEFAULT_HOST_LINK_BYTES_PER_S
    device_to_host_bytes_per_s: float = DEFAULT_HOST_LINK_BYTES_PER_S
    host_copy_latency_s: float = DEFAULT_HOST_COPY_LATENCY_S
    # GPUs per node sharing the ``intra`` link; a group of more ranks spans nodes and runs at the
    # ``inter`` link (its ring crosses the network). Calibration on one node cannot see the target
    # cluster's nodes: override with ``{"profile": ..., "node_size": N}`` / ``--node-size``.
    node_size: int = 8
    host_adamw_params_per_s: float = DEFAULT_HOST_ADAMW_PARAMS_PER_S
    fp8_forward_per_scaled_mm_s: float = 0.0
    fp8_backward_per_scaled_mm_s: float = 0.0
    host_adamw_per_tensor_params_per_s: float = 0.0
    device_adamw_foreach_scale: float = 0.0
    device_adamw_fused_scale: float = 0.0
    host_probe_s: float = 0.0
    runtime_allocated_bytes: int = 0
    # (term, low, high) per fitted host term (version 10); a tuple, not a dict, so that the
    # frozen profile stays hashable. JSON: {"term": [low, high], ...}.
    host_fit_spread: tuple[tuple[str, float, float], ...] = ()
    notes: tuple[str, ...] = ()
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        for name in PER_PARAM_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ProfileError(f"shardc: cluster profile {self.name!r}: {name} is {value!r}; "
                                   "host seconds per parameter tensor must be a number >= 0 "
                                   "(0: not measured)")
        for name in FIXED_FIELDS + FP8_HOST_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ProfileError(f"shardc: cluster profile {self.name!r}: {name} is {value!r}; "
                                   "fixed host seconds per step (or per _scaled_mm) must be a "
                                   "finite number (0: not measured)")
        per_tensor = self.host_adamw_per_tensor_params_per_s
        if not isinstance(per_tensor, (int, float)) or not (math.isfinite(per_tensor)
                                                            and per_tensor >= 0):
            raise ProfileError(f"shardc: cluster profile {self.name!r}: "
                               f"host_adamw_per_tensor_params_per_s is {per_tensor!r}; a host "
                               "rate must be a finite number >= 0 (0: not measured)")
        for name in ("device_adamw_foreach_scale", "device_adamw_fused_scale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
                raise ProfileError(f"shardc: cluster profile {self.name!r}: {name} is {value!r}; "
                                   "a measured-over-modelled ratio must be a finite number >= 0 "
                                   "(0: not measured)")
        probe = self.host_probe_s
        if not isinstance(probe, (int, float)) or not (math.isfinite(probe) and probe >= 0):
            raise ProfileError(f"shardc: cluster profile {self.name!r}: host_probe_s is "
                               f"{probe!r}; the host probe's seconds must be a finite number "
                               ">= 0 (0: not measured)")
        runtime = self.runtime_allocated_bytes
        if isinstance(runtime, bool) or not isinstance(runtime, int) or runtime < 0:
            raise ProfileError(f"shardc: cluster profile {self.name!r}: runtime_allocated_bytes "
                               f"is {runtime!r}; it must be a whole number of bytes >= 0 (0: not "
                               "measured)")
        self._check_fit_spread()
        for name in HOST_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise ProfileError(f"shardc: cluster profile {self.name!r}: {name} is {value!r}; "
                                   "a host rate must be a finite number > 0 (leave it out for "
                                   "the default)")

        for name in HOST_LINK_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
                raise ProfileError(f"shardc: cluster profile {self.name!r}: {name} is {value!r}; "
                                   "host link bandwidth must be a finite number of bytes/s > 0")
        latency = self.host_copy_latency_s
        if not isinstance(latency, (int, float)) or not (latency >= 0 and math.isfinite(latency)):
            raise ProfileError(f"shardc: cluster profile {self.name!r}: host_copy_latency_s is "
                               f"{latency!r}; it must be a finite number of seconds >= 0")

    def _check_fit_spread(self) -> None:
        """``host_fit_spread`` holds ``(term, low, high)`` of distinct host-seconds terms with
        finite ``low <= high``; raises :class:`ProfileError` otherwise."""
        seen = set()
        for entry in self.host_fit_spread:
            ok = isinstance(entry, tuple) and len(entry) == 3 and entry[0] in HOST_SECONDS_FIELDS
            if ok:
                name, low, high = entry
                ok = name not in seen and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                    for v in (low, high)) and low <= high
                seen.add(name)
            if not ok:
                raise ProfileError(f"shardc: cluster profile {self.name!r}: host_fit_spread "
                                   f"entry {entry!r}; each must be (a host term named once, its "
                                   "low, its high) with finite low <= high")

    def fit_spread(self, name: str) -> tuple[float, float] | None:
        """The ``(low, high)`` that calibration's rounds fitted for the host term ``name``
        (version 10), or None where not measured."""
        return next(((low, high) for n, low, high in self.host_fit_spread if n == name), None)

    # ------------------------------------------------------------------ lookups

    @property
    def on_cpu(self) -> bool:
        """Whether the profile is a CPU's (calibration names it ``"CPU (<n> cores)"``), not a
        GPU's."""
        return self.device.upper().startswith("CPU")

    def runtime_bytes(self) -> int:
        """Device bytes the runtime holds through a CUDA step besides the graphs' tensors
        (cuBLAS workspaces): ``runtime_allocated_bytes`` where calibration measured it, else
        the estimate ``shardc.memory.cuda_blocks.DEFAULT_CUDA_RUNTIME_BYTES`` (torch's default
        32 MiB workspace per cuBLAS handle on sm90, two handles: the forward's thread and
        autograd's backward thread); a CPU's profile (``device`` "CPU ..."), which calibration
        measures as 0, has none."""
        from shardc.memory.cuda_blocks import DEFAULT_CUDA_RUNTIME_BYTES

        if self.runtime_allocated_bytes or self.on_cpu:
            return self.runtime_allocated_bytes
        return DEFAULT_CUDA_RUNTIME_BYTES

    def device_optimizer_scale(self, ran: str) -> float:
        """The measured over the modelled device step of implementation ``ran``
        (``shardc.planning.optimizer_kind.RAN``): 1 where not measured (the per-tensor loop is
        not)."""
        scale = {"foreach": self.device_adamw_foreach_scale,
                 "fused": self.device_adamw_fused_scale}.get(ran, 0.0)
        return scale if scale > 0 else 1.0

    @property
    def host_link(self) -> HostLink:
        """This profile's host link (its version-5 fields, or their defaults)."""
        return HostLink(self.device_to_host_bytes_per_s, self.host_to_device_bytes_per_s,
                        self.host_copy_latency_s)

    def host_copy_seconds(self, nbytes: float, to_device: bool) -> float:
        """Seconds of one copy of ``nbytes`` between pinned host memory and the device
        (``to_device``: host->device, else device->host): :meth:`HostLink.copy_seconds`."""
        return self.host_link.copy_seconds(nbytes, to_device)

    def graph_launch_s(self) -> float:
        """Host seconds per kernel of a compiled graph."""
        return self.kernel_launch_s if self.compiled_launch_s is None else self.compiled_launch_s

    def matmul_rate(self, m: int, n: int, k: int, dtype: str) -> float:
        """FLOP/s of an ``m x k @ k x n`` matmul in ``dtype``: the measured table of that dtype
        (float8 without a table: twice bfloat16; other dtypes without one: float32's, else an
        eighth of bfloat16's)."""
        table = self._matmul_table(dtype)
        scale = 1.0
        if not table:
            if dtype.startswith("float8"):
                table, scale = self._matmul_table("bfloat16"), 2.0
            else:
                table = self._matmul_table("float32")
                if not table:
                    table, scale = self._matmul_table("bfloat16"), 1 / 8
        if not table:
            raise ProfileError(f"shardc profile {self.name!r} has no matmul timings")
        return scale * interp_nearest_log(table, (m, n, k))

    def _matmul_table(self, dtype: str) -> list[tuple[tuple[float, ...], float]]:
        return [((p.m, p.n, p.k), p.flops_per_s) for p in self.matmul if p.dtype == dtype]

    def attention_rate(self, seq: int, head_dim: int, backward: bool, dtype: str) -> float:
        """FLOP/s of the fused attention kernel (forward or backward pass)."""
        pass_ = "backward" if backward else "forward"
        pts = [((p.seq, p.head_dim), p.flops_per_s) for p in self.attention
               if p.pass_ == pass_ and p.dtype == dtype]
        pts = pts or [((p.seq, p.head_dim), p.flops_per_s) for p in self.attention
                      if p.pass_ == pass_]
        if not pts:  # no attention timings: as fast as a large matmul, halved
            return 0.5 * self.matmul_rate(8192, 8192, 8192, "bfloat16")
        return interp_nearest_log(pts, (seq, head_dim))

    def memory_bandwidth(self, nbytes: float) -> float:
        """Bytes/s a memory-bound kernel moving ``nbytes`` (reads plus writes) reaches."""
        if not self.memory:
            raise ProfileError(f"shardc profile {self.name!r} has no memory bandwidth")
        return interp_log(self.memory, max(nbytes, 1.0))

    def collective_seconds(self, kind: str, buffer_bytes: int, group_size: int,
                           level: str = "intra") -> float:
        """Seconds of one collective over ``buffer_bytes`` (the full buffer) and ``group_size``
        ranks: the measured curve of that kind and size, else the ring model at this level's
        link (:meth:`ClusterSpec.collective_seconds`); a group larger than ``node_size`` spans
        nodes and runs at the ``inter`` link whatever ``level`` says; a one-rank group's is a
        device-to-device copy of the buffer."""
        if group_size <= 1:
            # shardc lowers a one-rank group's collectives too (docs/overhead.md: they show in
            # a world-1 profile): NCCL copies the send buffer into the receive buffer.
            if buffer_bytes <= 0 or not self.memory:
                return 0.0
            return 2.0 * buffer_bytes / self.memory_bandwidth(2.0 * buffer_bytes) \
                + self.kernel_gpu_s
        if group_size > self.node_size:
            level = "inter"
        for curve in self.collectives:
            if (curve.kind, curve.group_size, curve.level) == (str(kind), group_size, level):
                return max(interp_linear(curve.points, buffer_bytes), 0.0)
        return self.ring_spec().collective_seconds(str(kind), buffer_bytes, group_size, level)

    def ring_spec(self) -> ClusterSpec:
        """The analytical ring model at this profile's links (for unmeasured group sizes)."""
        return ClusterSpec(bus_bandwidth=self.intra.bus_bandwidth, latency_s=self.intra.latency_s,
                           inter_node_bandwidth=self.inter.bus_bandwidth,
                           inter_node_latency_s=self.inter.latency_s)

    def host_adamw_rate(self, ran: str = "fused") -> float:
        """Parameters per second of the host's AdamW in implementation ``ran``
        (``shardc.planning.optimizer_kind.RAN``): fused, the profile's
        ``host_adamw_params_per_s``; the others, ``host_adamw_per_tensor_params_per_s`` where
        measured, else the fused rate over ``DEFAULT_PER_TENSOR_HOST_SLOWDOWN``."""
        from shardc.planning.optimizer_kind import DEFAULT_PER_TENSOR_HOST_SLOWDOWN

        if ran == "fused":
            return self.host_adamw_params_per_s
        return self.host_adamw_per_tensor_params_per_s or (
            self.host_adamw_params_per_s / DEFAULT_PER_TENSOR_HOST_SLOWDOWN)

    def peak_matmul_flops(self, dtype: str = "bfloat16") -> float:
        table = self._matmul_table(dtype)
        return max((v for _, v in table), default=0.0)

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["format"] = PROFILE_FORMAT
        for p in data["attention"]:
            p["pass"] = p.pop("pass_")
        data["host_fit_spread"] = {n: [low, high] for n, low, high in self.host_fit_spread}
        return json.loads(json.dumps(data))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterProfile:
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ProfileError("shardc: not a cluster profile (its JSON has no "
                               f"\"format\": \"{PROFILE_FORMAT}\"); make one with "
                               "`python -m shardc calibrate --out FILE`")
        version = data.get("version")
        if version not in READABLE_PROFILE_VERSIONS:
            raise ProfileError(
                f"shardc: cluster profile {data.get('name')!r} has version {version!r}; this "
                f"shardc reads versions {', '.join(map(str, READABLE_PROFILE_VERSIONS))}. "
                "Measure it again with `python -m shardc calibrate` or upgrade shardc.")
        data = dict(data)
        data.pop("format")
        try:
            data["matmul"] = tuple(MatmulPoint(**p) for p in data.get("matmul", ()))
            data["attention"] = tuple(
                AttentionPoint(**{("pass_" if k == "pass" else k): v for k, v in p.items()})
                for p in data.get("attention", ()))
            data["memory"] = tuple((int(b), float(r)) for b, r in data.get("memory", ()))
            data["collectives"] = tuple(
                CollectiveCurve(c["kind"], c["group_size"], c.get("level", "intra"),
                                tuple((int(b), float(t)) for b, t in c["points"]))
                for c in data.get("collectives", ()))
            for level in ("intra", "inter"):
                if level in data:
                    data[level] = Link(**data[level])
            data["notes"] = tuple(data.get("notes", ()))
            spread = data.get("host_fit_spread", {})
            if not isinstance(spread, dict):
                raise TypeError(f"host_fit_spread is {spread!r}, not an object of "
                                "term: [low, high]")
            data["host_fit_spread"] = tuple((n, *lh) for n, lh in spread.items())
            return cls(**data)
        except (TypeError, KeyError) as exc:
            raise ProfileError(f"shardc: cluster profile {data.get('name')!r} is malformed: "
                               f"{exc}") from exc

    @classmethod
    def from_json(cls, text: str) -> ClusterProfile:
        return cls.from_dict(json.loads(text))


def preset_path(name: str):
    return resources.files("shardc.planning") / "profiles" / f"{name}.json"


def load_profile(name_or_path: str) -> ClusterProfile:
    """A preset by name (``h100``, ``h200``) or a profile JSON file by path."""
    if name_or_path in PRESETS:
        return ClusterProfile.from_json(preset_path(name_or_path).read_text())
    path = Path(name_or_path)
    if not path.exists():
        raise ProfileError(f"shardc: no cluster profile {name_or_path!r}: neither a preset "
                           f"({', '.join(PRESETS)}) nor a file")
    return ClusterProfile.from_json(path.read_text())


def preset_for_device(device_name: str) -> str:
    """The preset closest to a device by its name (``torch.cuda.get_device_name``)."""
    return "h200" if "H200" in device_name.upper() else "h100"


# Keys of the analytical ClusterSpec that ``ShardcOptions.cluster`` has always accepted.
_SPEC_KEYS = {f.name for f in dataclasses.fields(ClusterSpec)}


def resolve_profile(cluster: dict | None, device_name: str | None = None) -> ClusterProfile:
    """The profile ``ShardcOptions.cluster`` asks for.

    - ``None``: the preset for ``device_name`` (the compiling GPU), else ``h100``;
    - ``{"profile": name or path, ...}``: that profile; other keys override its scalar fields;
    - a full profile dict (``"format"`` set): that profile;
    - the ``ClusterSpec`` keys (``peak_flops``, ``mem_bandwidth``, ``bus_bandwidth``,
      ``latency_s``, ``inter_node_*``): the default preset with those rates replacing its
      matmul/attention tables (one flat rate), memory bandwidth and links.
    """
    if cluster and cluster.get("format") == PROFILE_FORMAT:
        return ClusterProfile.from_dict(cluster)
    cluster = dict(cluster or {})
    name = cluster.pop("profile", None) or preset_for_device(device_name or "")
    base = load_profile(name)
    spec_keys = {k: cluster.pop(k) for k in list(cluster) if k in _SPEC_KEYS}
    if spec_keys:
        base = _with_spec(base, ClusterSpec(**spec_keys), set(spec_keys))
    if cluster:
        known = {f.name for f in dataclasses.fields(ClusterProfile)}
        unknown = sorted(set(cluster) - known)
        if unknown:
            raise ProfileError(f"shardc: unknown cluster option(s) {unknown}; use 'profile', "
                               f"ClusterSpec fields {sorted(_SPEC_KEYS)} or profile fields")
        for level in ("intra", "inter"):
            if isinstance(cluster.get(level), dict):
                cluster[level] = Link(**cluster[level])
        base = dataclasses.replace(base, **cluster)
    return base


def _with_spec(base: ClusterProfile, spec: ClusterSpec, given: set[str]) -> ClusterProfile:
    changes: dict[str, Any] = {}
    if "peak_flops" in given:
        changes["matmul"] = (MatmulPoint("bfloat16", 8192, 8192, 8192, spec.peak_flops),)
        changes["attention"] = tuple(
            AttentionPoint("bfloat16", 4096, 128, True, p, spec.peak_flops)
            for p in ("forward", "backward"))
    if "mem_bandwidth" in given:
        changes["memory"] = ((1 << 30, spec.mem_bandwidth),)
    if given & {"bus_bandwidth", "latency_s"}:
        changes["intra"] = Link(spec.bus_bandwidth, spec.latency_s)
        changes["collectives"] = ()
    if given & {"inter_node_bandwidth", "inter_node_latency_s"}:
        changes["inter"] = Link(spec.inter_node_bandwidth, spec.inter_node_latency_s)
    return dataclasses.replace(base, name=f"{base.name}+overrides", **changes)
