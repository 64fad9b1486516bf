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

CPU offload (``OptimizerSpec.offload``): the optimizer steps on the host, over the fp32 masters,
at the profile's ``host_adamw_params_per_s`` (:func:`shardc.planning.estimate.
host_optimizer_seconds`), after its Python (``optimizer_fixed_s`` and ``optimizer_per_param_s``
per tensor, as on the device); the device has nothing to run meanwhile.

- ``"params"`` (``OffloadPolicy()``): the masters, gradients and state live on the host; the
  copies of shards to the device and of gradients back are in the graphs already (the plan's
  ``copies`` on the copy lane, at the host link's rate each way), so the host step follows the
  hand-off. With ``overlap`` (``shardc.step_in_backward``) one host worker steps each bucket
  once its gradients' device->host copy ends (``Plan.copies``' predicted ends, in the
  backward of the region whose backward runs last), bucket after bucket, while the device runs
  the rest of the backward; what is left after the backward's end (and every parameter of the
  other regions) is stepped by ``optimizer.step()``. The model gives the host step the whole
  host: the copies and the backward's own host traffic do not slow it (on one H100 machine they
  did, with the worker stepping DTensor stand-ins; on one H200 with plain stand-ins the backward
  took 131-135 ms beside the worker against 126 ms without it: ``docs/offload.md``).
- ``"optimizer"`` (``OffloadPolicy(params=False, optimizer=True)``): ``optimizer.step()``
  copies each device shard and its gradient to the host, steps, and copies the shards back,
  on the link, none of it overlapped; the copies are priced by
  :func:`shardc.planning.optimizer_offload.copy_seconds`, as the budget planner's decision to
  offload prices them (the gradients as many bytes as the fp32 shards).

Where a plan's peak budget put the optimizer's state and step on the host (the budget's last
lever, ``MemoryBudget.optimizer``) and ``optimizer.offload`` is ``"none"``, the step is priced as
that decision runs: every parameter's (:func:`budget_host_share` 1) as ``"optimizer"``; only
some parameters' (a partial choice) as a mixed step: their share of the bytes and tensors
steps on the host with optimizer-only offload's copies, the rest on the device, one after the
other inside ``optimizer.step()`` (the hooks copy to the host first, torch steps the group,
the hooks copy back).

Where a plan's peak budget chose the optimizer step in chunks (``MemoryBudget.
optimizer_chunks``), the device step is priced as one call plus the chunks' extra calls
(``OptimizerChunksDecision.predicted_ms``, summed over the regions that chose it).

Regions: the backward of the region compiled first (the lowest ``Plan.region``) runs last, so
its queued device time is what the optimizer's host work can hide under; another region's
hand-off can hide only under its own backward's queued time, and what it exceeds that by is
added to the step.

CUDA graphs (``predict_step(..., cudagraphs=True)``, ``mode="reduce-overhead"``): the graphs
replay, so their device time is the plan's less the waits for the host, and the whole backward
is queued when the host returns from it.

Back to back (``StepPrediction.steady_s``): in training the host does not wait for the device
between steps, so it starts a step while the device still runs the previous one's queued work
(the optimizer's kernels). Over many steps the step then takes the longer of the host's work
(``host_s``: every host second of the step, as the timeline above places it) and the device's
(``device_s``: the step less the device's waits for the host; its waits for collectives stay): the
device catches up with a host that is behind, and a device that is behind keeps the host's lead.
That is what a loop that never synchronizes measures (``benchmarks/predict_step.py``'s measured
step); ``step_s`` is the same step from an idle device (a loop that synchronizes every step, e.g.
with ``loss.item()``). It applies where nothing in the step waits for the device on the host:
not to a step whose optimizer runs on the host (CPU offload, optimizer-only offload, the peak
budget's host share), whose host waits for the gradients' copies, nor under CUDA graphs (not
modelled there); for those ``steady_s`` is ``step_s``.

Exposed communication (:func:`step_exposed_comm`): what communication adds to the step, the
counterpart of the benchmarks' measured "waited for" figure: each plan's exposed communication
(its stalls for collectives less what its later host waits absorb, :mod:`shardc.planning.
schedule`), less what the host work after the last backward absorbs of the last region's;
under CUDA graphs, whose replays have no host waits, each plan's stalls (``comm_stall_s``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from shardc.planning import optimizer_kind, optimizer_offload
from shardc.planning.estimate import (
    host_optimizer_seconds,
    optimizer_kernel_ops,
    optimizer_step_seconds,
)
from shardc.planning.plan import CollectiveKind, Plan, Predictions
from shardc.planning.profile import ClusterProfile

OFFLOAD_MODES = ("none", "params", "optimizer")


@dataclass(frozen=True)
class OptimizerSpec:
    """What the step's optimizer works on: ``param_bytes`` of fp32 master shards in
    ``n_params`` parameter tensors (this rank), and its kind (``state_factor`` /
    ``temp_factor`` as :func:`shardc.planning.estimate.optimizer_kernel_ops` reads them; the
    plan's options ``optimizer_state_factor`` / ``optimizer_temp_factor``); ``name`` says which
    (for reports). ``offload``: where it steps (:data:`OFFLOAD_MODES`: ``"none"`` on the device,
    ``"params"`` CPU offload of the parameters and optimizer, ``"optimizer"`` optimizer-only
    offload; see the module docstring); ``overlap``: ``shardc.step_in_backward`` (with
    ``"params"`` only). ``impl``: the ``torch.optim`` implementation
    (``shardc.planning.optimizer_kind``; the option ``optimizer_impl``): ``"auto"`` steps host
    masters, and a group mixing them with device shards, per tensor (:meth:`ran`)."""

    param_bytes: float
    n_params: int
    state_factor: float = 2.0
    temp_factor: float = 1.0
    name: str = "AdamW (foreach)"
    offload: str = "none"
    overlap: bool = False
    impl: str = "auto"
    # The peak budget's step in chunks (``MemoryBudget.optimizer_chunks``): the seconds its
    # extra calls add to the device step (``shardc.planning.optimizer_chunks.price``).
    chunk_s: float = 0.0

    def ran(self, *, host_in_group: bool) -> str:
        """The implementation that steps a group with (``host_in_group``) or without host
        tensors."""
        return optimizer_kind.ran(self.impl, self.temp_factor, host_in_group=host_in_group)

    def __post_init__(self) -> None:
        optimizer_kind.check(self.impl)
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"shardc step: offload must be one of {OFFLOAD_MODES}, got "
                             f"{self.offload!r}")
        if self.overlap and self.offload != "params":
            raise ValueError("shardc step: overlap (shardc.step_in_backward) needs the "
                             "parameters offloaded (offload='params', OffloadPolicy())")


@dataclass(frozen=True)
class Phase:
    """One phase of the step on the device's timeline: ``seconds`` from its start to its end,
    of which the device idles ``host_wait_s`` waiting for the host (launches, Python, a host
    step) and ``comm_wait_s`` waiting for a collective; ``runs_on``: where its work is
    (``"device"``, or ``"host"`` for an offloaded optimizer step)."""

    name: str
    seconds: float
    host_wait_s: float = 0.0
    comm_wait_s: float = 0.0
    runs_on: str = "device"

    @property
    def bound(self) -> str:
        """``"host"`` where the device waits for the host at least half the phase,
        ``"communication"`` where it waits for collectives at least half, ``"hidden"`` for a
        phase of no time (its host work hid under device work queued before it), else
        ``"device"``."""
        if self.seconds <= 0:
            return "hidden"
        if self.host_wait_s >= 0.5 * self.seconds:
            return "host"
        if self.comm_wait_s >= 0.5 * self.seconds:
            return "communication"
        return "device"


@dataclass(frozen=True)
class StepPrediction:
    """The predicted step: ``graphs_s`` (the plans' forward and backward graphs, each
    region's ``step_time_s``), ``after_s`` (from the end of the last backward's device work to
    the end of the step: gradient hand-off, optimizer, zero_grad), ``step_s`` (their sum),
    ``optimizer_device_s`` (the optimizer's device time; 0 when it steps on the host),
    ``exposed_comm_s`` (what communication adds to the step: :func:`step_exposed_comm`),
    ``optimizer_host_s`` (an offloaded step's host compute, overlapped or not), and
    ``by_category`` for the part after the graphs: ``optimizer`` (device), ``host_optimizer``
    (the device idle while the host steps), ``offload_copies`` (optimizer-only offload's
    copies) and ``param_host`` (the device idle, waiting for the host's per-parameter work).
    ``phases``: forward, backward, optimizer (with the hand-off before it), zero_grad; their
    seconds add up to ``step_s``. ``optimizer``: the optimizer's name and where it steps."""

    graphs_s: float
    after_s: float
    optimizer_device_s: float
    by_category: dict[str, float] = field(default_factory=dict)
    phases: tuple[Phase, ...] = ()
    optimizer: str = ""
    optimizer_host_s: float = 0.0
    exposed_comm_s: float = 0.0
    # The host's work in the step (seconds from its start; 0: not modelled) and the step back to
    # back (0: ``step_s``): see the module docstring.
    host_s: float = 0.0
    back_to_back_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.graphs_s + self.after_s

    @property
    def device_s(self) -> float:
        """The step less the device's waits for the host."""
        return self.step_s - sum(p.host_wait_s for p in self.phases)

    @property
    def steady_s(self) -> float:
        """The step back to back (the host running ahead), else ``step_s``."""
        return self.back_to_back_s or self.step_s

    def to_dict(self) -> dict:
        """JSON-ready: the totals and each phase with its bound."""
        return {"step_s": self.step_s, "steady_s": self.steady_s, "host_s": self.host_s,
                "device_s": self.device_s, "graphs_s": self.graphs_s, "after_s": self.after_s,
                "optimizer": self.optimizer, "optimizer_device_s": self.optimizer_device_s,
                "optimizer_host_s": self.optimizer_host_s, "exposed_comm_s": self.exposed_comm_s,
                "by_category": dict(self.by_category),
                "phases": [{"name": p.name, "seconds": p.seconds, "host_wait_s": p.host_wait_s,
                            "comm_wait_s": p.comm_wait_s, "runs_on": p.runs_on,
                            "bound": p.bound} for p in self.phases]}


def _host_start(queued_s: float, handoff_s: float, optimizer_prologue_s: float) -> float:
    """Where the host enters the optimizer's first op, from the end of the last backward's
    device work (see :func:`after_backward_seconds`)."""
    return handoff_s - max(queued_s, 0.0) + max(optimizer_prologue_s, 0.0)


class AfterBackward(NamedTuple):
    """What follows the last backward's device work, in seconds from its end
    (:func:`after_backward_timeline`)."""

    optimizer_end_s: float  # the optimizer's last kernel ends
    optimizer_idle_s: float  # the device's idle time until then
    end_s: float  # the step ends: the later of the device's last kernel and the host's last call
    idle_s: float  # the device's idle time in all
    host_end_s: float  # the host returns from zero_grad


def after_backward_timeline(queued_s: float, handoff_s: float, optimizer_device_s: float,
                            optimizer_host_s: float, zero_grad_s: float, ops: int,
                            optimizer_prologue_s: float = 0.0) -> AfterBackward:
    """:func:`after_backward_seconds`, split where the optimizer ends, with the host's end."""
    if ops < 1:
        raise ValueError(f"shardc step: the optimizer has {ops} ops; it needs at least one")
    host, t, idle = _host_start(queued_s, handoff_s, optimizer_prologue_s), 0.0, 0.0
    for _ in range(ops):
        host += optimizer_host_s / ops
        start = max(t, host)
        idle += start - t
        t = start + optimizer_device_s / ops
    host += zero_grad_s
    end = max(t, host)
    return AfterBackward(t, idle, end, idle + (end - t), host)


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
    timeline = after_backward_timeline(queued_s, handoff_s, optimizer_device_s,
                                       optimizer_host_s, zero_grad_s, ops, optimizer_prologue_s)
    return timeline.end_s, timeline.idle_s


def _value(p: Predictions, key: str) -> float:
    v = getattr(p, key)
    return float(v) if v is not None else 0.0


def _host_wait(plan: Plan, graph: str) -> float:
    """The device's idle time in ``plan``'s ``graph`` waiting for the host (its launches and
    per-parameter work, :class:`shardc.planning.schedule._Timeline`)."""
    cats = plan.predicted.time_by_category_s or {}
    return cats.get(f"{graph}/launch_bound", 0.0) + cats.get(f"{graph}/param_host", 0.0)


def _replayed_s(plan: Plan, graph: str) -> float:
    """``plan``'s ``graph`` replayed as a CUDA graph: its device time without the waits for the
    host, whose launches and per-parameter work a replay does not do."""
    return max(_value(plan.predicted, f"{graph}_time_s") - _host_wait(plan, graph), 0.0)


def _graph_phase(plans: Sequence[Plan], graph: str, cudagraphs: bool = False,
                 replay_call_s: float = 0.0) -> Phase:
    seconds = host = comm = 0.0
    for p in plans:
        cats = p.predicted.time_by_category_s or {}
        comm += cats.get(f"{graph}/exposed_comm", 0.0)
        if cudagraphs:
            seconds += _replayed_s(p, graph)
        else:
            seconds += _value(p.predicted, f"{graph}_time_s")
            host += _host_wait(p, graph)
    # Under CUDA graphs the device waits only for the first replay's call.
    return Phase(graph, seconds + replay_call_s, host + replay_call_s, comm)


def _bucket_grads(plan: Plan) -> list[tuple[float, float, int]]:
    """The backward's device->host gradient copies of ``plan``: (predicted end from the
    backward's start, parameter elements, parameter tensors), by end."""
    out = []
    for c in plan.copies:
        if c.kind == CollectiveKind.D2H_COPY and c.graph == "backward" and c.origin == "shardc":
            itemsize = 2 if c.dtype in ("bfloat16", "float16") else 8 if c.dtype == "float64" \
                else 4
            out.append((c.predicted_end_s, c.buffer_bytes / itemsize, len(c.params)))
    return sorted(out)


def overlapped_host_step(plan: Plan, spec: OptimizerSpec, profile: ClusterProfile
                         ) -> tuple[float, float, int]:
    """``shardc.step_in_backward`` on the region whose backward runs last: one worker steps
    each bucket from its gradients' arrival on the host, one after the other. Returns (how far
    the worker runs past the backward's device end, the elements it stepped, the tensors)."""
    worker, elements, tensors = 0.0, 0.0, 0
    for end, n, k in _bucket_grads(plan):
        worker = max(worker, end) + host_optimizer_seconds(
            n * 4, profile, state_factor=spec.state_factor, temp_factor=spec.temp_factor,
            ran=spec.ran(host_in_group=True)) \
            + profile.optimizer_per_param_s * k
        elements, tensors = elements + n, tensors + k
    return max(worker - _value(plan.predicted, "backward_time_s"), 0.0), elements, tensors


def _host_step(last: Plan | None, spec: OptimizerSpec, profile: ClusterProfile
               ) -> tuple[float, float, float, float]:
    """An offloaded optimizer step: (how far the overlapped worker runs past the backward's
    device end, 0 without overlap; the host seconds of ``optimizer.step()``, of them the
    copies'; the host compute in all, overlapped or not)."""
    ran = spec.ran(host_in_group=True)
    compute = host_optimizer_seconds(spec.param_bytes, profile, state_factor=spec.state_factor,
                                     temp_factor=spec.temp_factor, ran=ran)
    python = profile.optimizer_fixed_s + profile.optimizer_per_param_s * spec.n_params
    copies = 0.0
    if spec.offload == "optimizer":  # shards and gradients (as many bytes) there, shards back
        copies = sum(optimizer_offload.copy_seconds(spec.param_bytes, spec.param_bytes, profile))
    if not spec.overlap or last is None:
        return 0.0, max(python, 0.0) + compute + copies, copies, compute
    # Overlapped: the worker's buckets, then optimizer.step() on what it did not step.
    behind, elements, tensors = overlapped_host_step(last, spec, profile)
    rest_bytes = max(spec.param_bytes - 4 * elements, 0.0)
    rest = host_optimizer_seconds(rest_bytes, profile, state_factor=spec.state_factor,
                                  temp_factor=spec.temp_factor, ran=ran) \
        + profile.optimizer_per_param_s * max(spec.n_params - tensors, 0)
    return behind, max(profile.optimizer_fixed_s, 0.0) + rest, 0.0, compute


def budget_host_share(plans: Sequence[Plan]) -> float:
    """The share of this rank's parameter shard bytes whose optimizer state and step the plans'
    peak budget put on the host: 0 where none did, 1 where one put every parameter's there,
    else the largest region's share (``Predictions.optimizer_host_param_bytes`` over its
    ``param_bytes``; later regions plan with an earlier region's choice, so the largest holds
    it)."""
    share = 0.0
    for p in plans:
        decision = p.budget.optimizer if p.budget is not None else None
        if decision is None or not decision.on_host:
            continue
        if not decision.partial:
            return 1.0
        shards = _value(p.predicted, "param_bytes")
        host = _value(p.predicted, "optimizer_host_param_bytes")
        share = max(share, min(host / shards, 1.0) if shards > 0 else 0.0)
    return share


def _mixed_step(queued: float, handoff: float, zero_grad: float, optimizer: OptimizerSpec,
                share: float, profile: ClusterProfile
                ) -> tuple[AfterBackward, float, float, float, float]:
    """A step whose optimizer steps ``share`` of the shards on the host (the peak budget's
    partial choice) and the rest on the device: (its timeline, the device part's seconds, the
    host step's seconds with its copies, of them the copies', of them the host compute's)."""
    host_n = min(max(round(optimizer.n_params * share), 1), optimizer.n_params)
    host = replace(optimizer, param_bytes=optimizer.param_bytes * share, n_params=host_n,
                   offload="optimizer")
    _, host_s, copies, compute = _host_step(None, host, profile)
    device_n = optimizer.n_params - host_n
    # One group over both: ``"auto"`` steps the device part per tensor too.
    device = optimizer_step_seconds(optimizer.param_bytes - host.param_bytes, device_n, profile,
                                    state_factor=optimizer.state_factor,
                                    temp_factor=optimizer.temp_factor,
                                    ran=optimizer.ran(host_in_group=True)) if device_n else 0.0
    # The host's copies and step come first (the pre-step hook), then the device part's
    # kernels; its per-parameter host work adds to the host's.
    timeline = after_backward_timeline(queued, handoff, device,
                                       host_s + profile.optimizer_per_param_s * device_n,
                                       zero_grad, 1)
    return timeline, device, host_s, copies, compute


def _graph_comm(plan: Plan, cudagraphs: bool) -> float:
    """What communication adds to ``plan``'s graphs: its exposed communication (the stalls
    for collectives less what later host waits absorb); replayed as CUDA graphs, which have
    no host waits to absorb them, its stalls (plans without ``comm_stall_s``: the former)."""
    stall = plan.predicted.comm_stall_s
    if cudagraphs and stall is not None:
        return stall
    return _value(plan.predicted, "exposed_comm_s")


def step_exposed_comm(plans: Sequence[Plan], cudagraphs: bool, queued: float, after: float,
                      after_of: Callable[[float], float]) -> float:
    """What communication adds to the step: the step less the same step with no stall for a
    collective (the measured counterpart: the NCCL time the compute stream waited for).

    Each plan's graphs add :func:`_graph_comm`. The region whose backward runs last ends that
    much later on the device with the host where it was, so its backward leaves that much more
    device work queued (``queued``) for the hand-off and the optimizer's host work to hide
    under: without the stalls only ``queued - delay`` (below zero: the host arrives that much
    after the device's end, and all that follows waits for it), and the part after the graphs
    (``after``; ``after_of(queued)`` recomputes it) may grow back by what the stalls had
    hidden. Never below zero."""
    if not plans:
        return 0.0
    last = min(plans, key=lambda p: p.region)
    graphs = sum(_graph_comm(p, cudagraphs) for p in plans)
    shadow = queued - _graph_comm(last, cudagraphs)
    shadow_after = max(-shadow, 0.0) + after_of(max(shadow, 0.0))
    return max(graphs - max(shadow_after - after, 0.0), 0.0)


def _after_graphs(queued: float, handoff: float, zero_grad: float, optimizer: OptimizerSpec,
                  share: float, profile: ClusterProfile, last: Plan | None
                  ) -> tuple[AfterBackward, float, dict[str, float], float, float]:
    """What follows the last backward's device work, from its end (see the module docstring),
    with ``queued`` seconds of device work left when the host returns from it: (its timeline,
    the optimizer's device seconds, seconds by category, the host step's compute, the idle
    waiting for the host's other work)."""
    on_host = optimizer.offload != "none"
    by_category: dict[str, float] = {}
    host_compute = 0.0
    if 0.0 < share < 1.0:
        timeline, device, host_s, copies, host_compute = _mixed_step(
            queued, handoff, zero_grad, optimizer, share, profile)
        idle = timeline.idle_s
        by_category["optimizer"] = device
        stepping = min(host_s - copies, idle)
        by_category["host_optimizer"] = stepping
        by_category["offload_copies"] = min(copies, idle - stepping)
        other_idle = idle - stepping - by_category["offload_copies"]
    elif on_host:
        device = 0.0
        behind, host_s, copies, host_compute = _host_step(last, optimizer, profile)
        # The worker runs beside the main thread's hand-off; optimizer.step() waits for both.
        handoff = max(queued, handoff, queued + behind)
        timeline = after_backward_timeline(queued, handoff, 0.0, host_s, zero_grad, 1)
        idle = timeline.idle_s
        stepping = min(host_s - copies + behind, idle)
        by_category["host_optimizer"] = stepping
        if copies:
            by_category["offload_copies"] = min(copies, idle - stepping)
        other_idle = idle - stepping - by_category.get("offload_copies", 0.0)
    else:
        ran = optimizer.ran(host_in_group=False)
        device = optimizer_step_seconds(optimizer.param_bytes, optimizer.n_params, profile,
                                        state_factor=optimizer.state_factor,
                                        temp_factor=optimizer.temp_factor, ran=ran) \
            + optimizer.chunk_s
        _, ops = optimizer_kernel_ops(optimizer.state_factor, 0.0 if ran == "fused" else
                                      max(optimizer.temp_factor, 1.0))
        if ran == "per_tensor":  # the same ops, one kernel per tensor each
            ops *= max(optimizer.n_params, 1)
        timeline = after_backward_timeline(
            queued, handoff, device, profile.optimizer_per_param_s * optimizer.n_params,
            zero_grad, ops, optimizer_prologue_s=profile.optimizer_fixed_s)
        by_category["optimizer"] = device
        other_idle = timeline.idle_s
    return timeline, device, by_category, host_compute, other_idle


def predict_step(plans: Sequence[Plan], profile: ClusterProfile, optimizer: OptimizerSpec,
                 *, cudagraphs: bool = False) -> StepPrediction:
    """The step of the compiled regions ``plans`` (this rank's) with ``optimizer`` (see the
    module docstring).

    ``cudagraphs``: the compiled regions replay as CUDA graphs (``torch.compile(...,
    mode="reduce-overhead")``): a graph's device time is the plan's without the device's waits
    for the host (a replay launches no kernel one by one and does no per-parameter work), the
    step's first replay call (``graph_call_s``) is waited for once, and the host returns from
    a backward replay at once, so the backward's whole device time is queued under the
    hand-off and the optimizer's host work. The optimizer and zero_grad run eagerly, as
    before."""
    share = budget_host_share(plans) if optimizer.offload == "none" else 0.0
    if share >= 1.0:  # the budget put every parameter's state and step on the host
        optimizer = replace(optimizer, offload="optimizer", overlap=False)
    chunks = [p.budget.optimizer_chunks for p in plans
              if p.budget is not None and p.budget.optimizer_chunked]
    if chunks and optimizer.offload == "none" and share == 0.0:
        optimizer = replace(optimizer, chunk_s=sum(c.predicted_ms for c in chunks) * 1e-3)

    def queued_of(p: Plan) -> float:
        return _replayed_s(p, "backward") if cudagraphs else _value(p.predicted,
                                                                     "backward_queued_s")

    replay_call_s = max(profile.graph_call_s, 0.0) if cudagraphs and plans else 0.0
    if cudagraphs:
        graphs_s = replay_call_s + sum(_replayed_s(p, "forward") + _replayed_s(p, "backward")
                                       for p in plans)
    else:
        graphs_s = sum(_value(p.predicted, "step_time_s") for p in plans)
    last = min(plans, key=lambda p: p.region, default=None)
    excess = 0.0  # other regions' hand-off beyond their own backward's queued time
    for p in plans:
        if p is not last:
            excess += max(_value(p.predicted, "grad_handoff_s") - queued_of(p), 0.0)
    queued = queued_of(last) if last is not None else 0.0
    handoff = _value(last.predicted, "grad_handoff_s") if last is not None else 0.0
    zero_grad = max(profile.zero_grad_per_param_s * optimizer.n_params
                    + profile.zero_grad_fixed_s, 0.0)
    on_host = optimizer.offload != "none"
    after_args = (handoff, zero_grad, optimizer, share, profile, last)
    timeline, device, by_category, host_compute, other_idle = _after_graphs(queued, *after_args)
    opt_end, opt_idle, after, idle = (timeline.optimizer_end_s, timeline.optimizer_idle_s,
                                      timeline.end_s, timeline.idle_s)
    exposed = step_exposed_comm(plans, cudagraphs, queued, after,
                                lambda q: _after_graphs(q, *after_args)[0].end_s)
    if other_idle + excess > 1e-15:
        by_category["param_host"] = other_idle + excess
    where = "host, CPU offload" + (" overlapped with the backward (step_in_backward)"
                                   if optimizer.overlap else "") if on_host else "device"
    if optimizer.offload == "optimizer":
        where = "host, optimizer-only offload"
    if 0.0 < share < 1.0:
        where = (f"host for {share:.0%} of the shards (the peak budget's choice), the device "
                 "for the rest")
    # Which implementation the prediction assumes, where torch's default picks it (unset
    # foreach/fused) or it runs per tensor: the host's kernels are several times slower.
    ran = optimizer.ran(host_in_group=on_host or share > 0.0)
    if ran == "per_tensor" or optimizer.impl == "auto" and (on_host or share > 0.0):
        where += f"; torch.optim runs it {optimizer_kind.describe(ran)}"
    phases = (_graph_phase(plans, "forward", cudagraphs, replay_call_s),
              _graph_phase(plans, "backward", cudagraphs),
              Phase("optimizer", opt_end + excess, opt_idle + excess,
                    runs_on="host" if on_host or share > 0.0 else "device"),
              Phase("zero_grad", after - opt_end, idle - opt_idle, runs_on="host"))
    step = StepPrediction(graphs_s=graphs_s, after_s=after + excess, optimizer_device_s=device,
                          by_category=by_category, phases=phases,
                          optimizer=f"{optimizer.name} on the {where}",
                          optimizer_host_s=host_compute, exposed_comm_s=exposed)
    if on_host or share > 0.0 or cudagraphs:
        return step
    # The host's last call: the graphs' (with the other regions' hand-off beyond their queued
    # time), then the timeline's optimizer host work and zero_grad.
    host = graphs_s + excess + timeline.host_end_s
    host = min(max(host, 0.0), step.step_s)
    return replace(step, host_s=host, back_to_back_s=max(host, step.device_s))
