"""The whole training step: the compiled regions' graphs, then the host's per-parameter work
and the optimizer, on one host and one device timeline.

A plan predicts each compiled graph's time (:mod:`shardc.planning.schedule`; a region's forward
already waits for the host's per-parameter entry work, ``region_entry_per_param_s``, and its
launches carry ``forward_graph_per_param_s``). What follows the last backward runs outside the
compiled graphs:

1. the gradient hand-off of each region (``Predictions.grad_handoff_s``: the profile's
   ``grad_handoff_per_param_s`` per gradient), host work after the backward's last launch;
2. ``optimizer.step()``: its device time is :func:`shardc.planning.estimate.
   optimizer_step_seconds` (unchanged), split evenly over its foreach ops; before its first op
   the host does the optimizer's fixed work (``optimizer_fixed_s``: grouping the parameters
   and their state, the step's wrappers), and before each op its share of
   ``optimizer_per_param_s`` times the parameter tensors;
3. ``optimizer.zero_grad()``: ``zero_grad_per_param_s`` per parameter tensor and
   ``zero_grad_fixed_s`` of host work.

The graphs' fixed host work (profile version 4) is in the plans already: the first region's
forward carries ``region_entry_fixed_s`` and ``forward_graph_fixed_s``, its backward
``backward_entry_fixed_s`` (before its first launch, with ``backward_entry_per_param_s``; it
hides under the forward's queued device work) and its hand-off ``grad_handoff_fixed_s``
(:func:`shardc.planning.schedule.plan_region`).

Host work hides under device work only as far as the device still has work queued: at the end
of a backward that is ``Predictions.backward_queued_s`` (device time queued after the host's
last launch), afterwards whatever the optimizer's kernels leave queued. The step ends when both
are done: the measured step (CUDA events from before the forward to after ``zero_grad``) ends
at the later of the device's last kernel and the host's last call. With no per-parameter terms
(a version 1 or 2 profile) the step is the graphs' time plus the optimizer's device time, as
before.

Regions: the backward of the region compiled first (the lowest ``Plan.region``) runs last, so
its queued device time is what the optimizer's host work can hide under; another region's
hand-off can hide only under its own backward's queued time, and what it exceeds that by is
added to the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shardc.planning.estimate import optimizer_kernel_ops, optimizer_step_seconds
from shardc.planning.plan import Plan, Predictions
from shardc.planning.profile import ClusterProfile


@dataclass(frozen=True)
class OptimizerSpec:
    """What the step's optimizer works on: ``param_bytes`` of fp32 master shards in
    ``n_params`` parameter tensors (this rank), and its kind (``state_factor`` /
    ``temp_factor`` as :func:`shardc.planning.estimate.optimizer_kernel_ops` reads them; the
    plan's options ``optimizer_state_factor`` / ``optimizer_temp_factor``)."""

    param_bytes: float
    n_params: int
    state_factor: float = 2.0
    temp_factor: float = 1.0


@dataclass(frozen=True)
class StepPrediction:
    """The predicted step: ``graphs_s`` (the plans' forward and backward graphs, each
    region's ``step_time_s``), ``after_s`` (from the end of the last backward's device work to
    the end of the step: gradient hand-off, optimizer, zero_grad), ``step_s`` (their sum),
    ``optimizer_device_s`` (the optimizer's device time), and ``by_category`` for the part after
    the graphs: ``optimizer`` (device) and ``param_host`` (the device idle, waiting for the
    host's per-parameter work)."""

    graphs_s: float
    after_s: float
    optimizer_device_s: float
    by_category: dict[str, float] = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        return self.graphs_s + self.after_s


def after_backward_seconds(queued_s: float, handoff_s: float, optimizer_device_s: float,
                           optimizer_host_s: float, zero_grad_s: float, ops: int,
                           optimizer_prologue_s: float = 0.0) -> tuple[float, float]:
    """Seconds from the end of the last backward's device work to the end of the step, and how
    much of it the device idles waiting for the host.

    At that point the host is ``queued_s`` behind the device (device work still queued after
    its last launch); it hands the gradients off (``handoff_s``), then enters the optimizer
    (``optimizer_prologue_s`` before its first op) and runs its ``ops`` foreach ops, each after
    its share of ``optimizer_host_s`` and taking its share of ``optimizer_device_s`` on the
    device once both are there, then ``zero_grad_s``."""
    if ops < 1:
        raise ValueError(f"shardc step: the optimizer has {ops} ops; it needs at least one")
    host, t, idle = handoff_s - max(queued_s, 0.0) + max(optimizer_prologue_s, 0.0), 0.0, 0.0
    for _ in range(ops):
        host += optimizer_host_s / ops
        start = max(t, host)
        idle += start - t
        t = start + optimizer_device_s / ops
    host += zero_grad_s
    end = max(t, host)
    return end, idle + (end - t)


def _value(p: Predictions, key: str) -> float:
    v = getattr(p, key)
    return float(v) if v is not None else 0.0


def predict_step(plans: Sequence[Plan], profile: ClusterProfile, optimizer: OptimizerSpec
                 ) -> StepPrediction:
    """The step of the compiled regions ``plans`` (this rank's) with ``optimizer`` (see the
    module docstring)."""
    graphs_s = sum(_value(p.predicted, "step_time_s") for p in plans)
    last = min(plans, key=lambda p: p.region, default=None)
    excess = 0.0  # other regions' hand-off beyond their own backward's queued time
    for p in plans:
        if p is not last:
            excess += max(_value(p.predicted, "grad_handoff_s")
                          - _value(p.predicted, "backward_queued_s"), 0.0)
    queued = _value(last.predicted, "backward_queued_s") if last is not None else 0.0
    handoff = _value(last.predicted, "grad_handoff_s") if last is not None else 0.0
    device = optimizer_step_seconds(optimizer.param_bytes, optimizer.n_params, profile,
                                    state_factor=optimizer.state_factor,
                                    temp_factor=optimizer.temp_factor)
    _, ops = optimizer_kernel_ops(optimizer.state_factor, optimizer.temp_factor)
    zero_grad = profile.zero_grad_per_param_s * optimizer.n_params + profile.zero_grad_fixed_s
    after, idle = after_backward_seconds(
        queued, handoff, device, profile.optimizer_per_param_s * optimizer.n_params,
        max(zero_grad, 0.0), ops, optimizer_prologue_s=profile.optimizer_fixed_s)
    by_category = {"optimizer": device}
    if idle + excess > 0:
        by_category["param_host"] = idle + excess
    return StepPrediction(graphs_s=graphs_s, after_s=after + excess, optimizer_device_s=device,
                          by_category=by_category)
