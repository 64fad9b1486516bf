"""Calibration of the host's per-parameter work (``python -m shardc calibrate``).

Measures :data:`shardc.planning.profile.PER_PARAM_FIELDS`: a model of many tiny parameters
(tiny compute, so every phase is bound by the host) is sharded with ``shardc.shard`` (bf16
compute and fp32 reduction on a GPU, as the benchmarks run) over a one-rank mesh, compiled with
the shardc backend (Inductor on a GPU, blocks inline; the FX graphs on the CPU) and trained with
torch's default AdamW at three depths (:data:`GPU_PARAM_LAYERS`). On a GPU the model is shardc's
Llama at width 64 (1, 4 and 8 blocks: 12, 39 and 75 parameter tensors, the 1b benchmark's
blocks with the same kernels per block); on the CPU, whose profile serves tests, layers of a
norm weight and two ``Linear`` weights (1, 2 and 4: 3, 6 and 12 parameter tensors). Every
model is compiled first and then timed in :data:`HOST_ROUNDS` interleaved rounds
(:func:`time_rounds`), so that a drift of the host's speed hits every depth alike; the fit
takes each model's median over the rounds, and each term's spread is the range of the terms
fitted to each round alone (:func:`fit_param_host_rounds`; profile format 10).

A block's parameters and its kernels grow together, so the two cannot be told apart from the
depths alone: the chain that ``compiled_launch_s`` is fitted on prices each kernel, and the
per-parameter terms take what a real block's host work adds beyond that (its guards, DTensor
handling, and Inductor's Python per kernel, which grows with a kernel's arguments and buffers
where the chain's kernels have few). For models built of the measured block this is exact per
block; for others, an approximation. Each phase's host time is the wall clock around it without
synchronizing (the device, given kernels of a few microseconds, is never what the host waits
for); the step starts on an idle device, as a benchmark's synchronized step does:

- forward (the compiled call, loss included) less ``graph_call_s`` and ``compiled_launch_s``
  per kernel it launches, split at its first device work (on a GPU, measured from the device
  timestamps of a marker kernel and the forward's first kernel on an idle device): before it
  the region's entry work (``region_entry_per_param_s``), after it the rest
  (``forward_graph_per_param_s``); on the CPU all of it is the entry's;
- ``loss.backward()`` less the same for the backward graph, split the same way: before its
  first device work ``backward_entry_per_param_s``; the launches of the kernels the device ran
  beyond the model's (they happen between its first and last launch)
  ``backward_graph_per_param_s``; the rest the gradient hand-off (``grad_handoff_per_param_s``;
  on the CPU all of it);
- ``optimizer.step()`` (``optimizer_per_param_s``: foreach AdamW on a GPU, torch's default;
  on the CPU torch's default is the for-loop AdamW) and ``zero_grad(set_to_none=True)``
  (``zero_grad_per_param_s``), whole.

Over several ranks the same model is sharded over every rank at :func:`collective_design`'s
points: each depth with one bucket per block and one per parameter tensor, so that the host's
seconds per collective (``collective_launch_s``) is fitted from models that differ in their
collectives alone (:func:`collective_fit_parts`).

Each term is the slope of its phase's median against the number of parameter tensors
(:func:`shardc.planning.fit.fit_per_param`), and its intercept the phase's fixed host seconds
per step (:data:`shardc.planning.profile.FIXED_FIELDS`): what the per-kernel and per-call terms
already price is subtracted first, so nothing is counted twice. The launches subtracted are the
cost model's (the plans' ``forward_kernels``/``backward_kernels``), because the step model
charges ``compiled_launch_s`` per kernel it groups: where Inductor launches more kernels than
the model groups (on an H100, 165 and 313 against 101 and 184 for 8 tiny Llama blocks), their
host time lands in the per-parameter terms, per block, and a model of the same blocks is
charged what its host really does. The kernels ``torch.profiler`` counts (none on the CPU) are
kept for the notes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardc.planning.fit import (
    fit_least_squares,
    fit_line,
    fit_per_param,
    fit_through_origin,
    value_range,
)
from shardc.planning.profile import FIXED_FIELDS, FP8_HOST_FIELDS, PER_PARAM_FIELDS

# Depths of the measured model (:data:`MODEL`; 9 parameter tensors per Llama block: 12, 39
# and 75 tensors on a GPU). Three depths, the shallowest and the deepest far apart: a line
# through two close points trades its intercept against its slope (issue 19: two calibrations
# of one code fitted a hand-off of 9.1 and 46.0 us per tensor), and a middle point shows
# whether the host's work is a line at all. The benchmarks' 8 blocks are the deepest.
GPU_PARAM_LAYERS = (1, 4, 8)
CPU_PARAM_LAYERS = (1, 2, 4)
# Over several ranks (``collective_launch_s``): each depth with one bucket per block (what the
# benchmarks run) and one bucket per parameter tensor. At one depth the two differ only in the
# collectives the host issues, so the per-collective term is fitted from contrasts in which
# the per-parameter and fixed terms (and their errors) cancel; with depths alone the
# collectives grow with the parameters, and every error of the one-rank terms moved into it
# (531 against 182 us per collective on two calibrations of one code).
GPU_COLLECTIVE_LAYERS = (2, 6)
CPU_COLLECTIVE_LAYERS = (1, 2)
COLLECTIVE_BUCKETINGS = ("module", "param")
# Repeats: every model is timed in each of :data:`HOST_ROUNDS` rounds (interleaved, see
# :func:`time_rounds`), :data:`HOST_STEPS_PER_ROUND` steps a round; the fit takes each model's
# median over the rounds, and each term's spread is the range of the terms fitted to each
# round alone. Counts, not wall time, so the same command measures the same points. The host of
# a lent H100 machine runs the same steps up to 20-40% slower from one round of a few
# milliseconds to the next (2026-12-05, sixtieth session: two calibrations in one start fitted
# 112 and 50 us per FP8 forward ``_scaled_mm`` from 5 rounds of 2 steps); the rounds are cheap
# beside the compiles (a tiny model's step takes milliseconds), so there are many of them.
HOST_ROUNDS = 11
HOST_STEPS_PER_ROUND = 8
# Depths of its FP8 variant (7 FP8 Linears per block and the output head: 15 / 43 ``_scaled_mm``
# in the forward, twice that in the backward). Two depths, so that the fit is a slope: one depth
# (4 blocks until the twenty-eighth session) took whatever the bf16 terms leave at that size for
# work per ``_scaled_mm`` (118 us in the forward on an H200, where the 1b config's FP8 rows
# measured about 40 us: docs/cost_model.md, "FP8 back to back on one H200"). An FP8 region
# compiles about 2.5x slower than a bf16 one: the two cost ``calibrate`` about a minute.
GPU_FP8_LAYERS = (2, 6)
# The per-parameter fields priced in the forward (call to return) and in the backward.
FORWARD_FIELDS = ("region_entry_per_param_s", "forward_graph_per_param_s")
BACKWARD_FIELDS = ("backward_entry_per_param_s", "backward_graph_per_param_s",
                   "grad_handoff_per_param_s")


@dataclass(frozen=True)
class PhaseTimes:
    """One model's median host seconds per phase of a training step, and the kernels its
    forward and backward graphs launch."""

    params: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    zero_grad_s: float
    forward_kernels: int = 0
    backward_kernels: int = 0
    # Host seconds from the forward's call to its first device work (None: not measured, on
    # the CPU: the whole forward is then the entry's).
    forward_prelaunch_s: float | None = None
    # The kernels the cost model launches for the forward and backward graphs (the plans'
    # ``forward_kernels``/``backward_kernels``; None: not known, the counted ones are used).
    # The step model charges ``compiled_launch_s`` per kernel it groups, not per kernel the
    # device runs: the fit must take out the same launches, so that what the model's grouping
    # misses (Inductor launches more, smaller kernels) lands in the per-parameter terms.
    forward_model_kernels: int | None = None
    backward_model_kernels: int | None = None
    # Host seconds from ``optimizer.step()``'s call to its first device work (on a GPU; the
    # notes record it: where the optimizer's fixed host work sits).
    optimizer_prelaunch_s: float | None = None
    # Host seconds from ``backward()``'s call to the compiled backward's first device work
    # (None: not measured, on the CPU: the whole backward is then the hand-off's).
    backward_prelaunch_s: float | None = None
    # The ``torch._scaled_mm`` ops of the forward and backward graphs (an FP8 model's Linears;
    # 0 for a bf16 one).
    forward_scaled_mms: int = 0
    backward_scaled_mms: int = 0
    # The collectives the host issues in the forward and backward graphs (the plans' not
    # elided ones: none over a one-rank mesh).
    forward_collectives: int = 0
    backward_collectives: int = 0
    # The model's buckets: one per block and one for the rest ("module") or one per parameter
    # tensor ("param"; more collectives at the same parameters, :data:`COLLECTIVE_BUCKETINGS`).
    bucket_by: str = "module"


def unpriced_seconds(t: PhaseTimes, compiled_launch_s: float, graph_call_s: float
                     ) -> dict[str, float]:
    """Each phase's host seconds less what the profile's per-call and per-kernel terms price
    (the compiled graphs' calls and launches), keyed by the per-parameter field it fits. The
    forward and the backward split at their first device work: before it the call, the entry
    and one launch; after it the other launches and the rest (the forward's graph work, the
    backward's hand-off). The launches are the cost model's kernels where
    known (``forward_model_kernels``, ``backward_model_kernels``), else the counted ones."""
    fw_kernels = t.forward_kernels if t.forward_model_kernels is None \
        else t.forward_model_kernels
    bw_kernels = t.backward_kernels if t.backward_model_kernels is None \
        else t.backward_model_kernels
    forward = t.forward_s - graph_call_s - fw_kernels * compiled_launch_s
    if t.forward_prelaunch_s is None:
        entry, in_graph = forward, 0.0
    else:
        entry = t.forward_prelaunch_s - graph_call_s - min(fw_kernels, 1) * compiled_launch_s
        in_graph = forward - entry
    backward = t.backward_s - graph_call_s - bw_kernels * compiled_launch_s
    if t.backward_prelaunch_s is None:
        bw_entry = 0.0
    else:
        bw_entry = t.backward_prelaunch_s - graph_call_s - min(bw_kernels, 1) * compiled_launch_s
    # The launches of the kernels the device ran beyond the model's happen between the
    # backward's first and last launch (spread), not in the hand-off after it.
    bw_graph = (t.backward_kernels - bw_kernels) * compiled_launch_s
    return {
        "region_entry_per_param_s": entry,
        "forward_graph_per_param_s": in_graph,
        "backward_entry_per_param_s": bw_entry,
        "backward_graph_per_param_s": bw_graph,
        "grad_handoff_per_param_s": backward - bw_entry - bw_graph,
        "optimizer_per_param_s": t.optimizer_s,
        "zero_grad_per_param_s": t.zero_grad_s,
    }


def fit_param_host_cost(times: Sequence[PhaseTimes], compiled_launch_s: float,
                        graph_call_s: float) -> dict[str, float]:
    """Host seconds per parameter tensor of each phase (the profile's ``PER_PARAM_FIELDS``)
    and per step (``FIXED_FIELDS``) from models of two or more parameter counts: the slope and
    the intercept of what the other terms leave."""
    if len({t.params for t in times}) < 2:
        raise ValueError("calibrate: host seconds per parameter tensor need models of two or more "
                         f"parameter counts (got {[t.params for t in times]})")
    rows = [unpriced_seconds(t, compiled_launch_s, graph_call_s) for t in times]
    out: dict[str, float] = {}
    for name, fixed_name in zip(PER_PARAM_FIELDS, FIXED_FIELDS):
        out[fixed_name], out[name] = fit_per_param([t.params for t in times],
                                                   [r[name] for r in rows], name)
    return {name: out[name] for name in PER_PARAM_FIELDS + FIXED_FIELDS}


def residual_seconds(t: PhaseTimes, terms: dict[str, float], compiled_launch_s: float,
                     graph_call_s: float) -> tuple[float, float]:
    """The host seconds of a model's forward and backward (call to return) that nothing
    else prices (an FP8 model's, or one sharded over several ranks): the phase less
    ``graph_call_s``, ``compiled_launch_s`` per kernel of the cost model (an FP8 model's amax,
    scale and cast kernels included) and the per-parameter and fixed ``terms``
    (:func:`fit_param_host_cost`, fitted on the bf16 model over one rank) at its parameter
    count."""
    rows = unpriced_seconds(t, compiled_launch_s, graph_call_s)

    def left(fields: tuple[str, ...]) -> float:
        return sum(rows[f] - terms.get(f, 0.0) * t.params
                   - terms.get(f.removesuffix("_per_param_s") + "_fixed_s", 0.0) for f in fields)

    return left(FORWARD_FIELDS), left(BACKWARD_FIELDS)


def fit_fp8_host_cost(times: Sequence[PhaseTimes], terms: dict[str, float],
                      compiled_launch_s: float, graph_call_s: float,
                      bf16: Sequence[PhaseTimes] | None = None) -> dict[str, float]:
    """:data:`shardc.planning.profile.FP8_HOST_FIELDS` from FP8 models' phase times: per graph,
    what :func:`residual_seconds` leaves per ``_scaled_mm``: the slope against the
    ``_scaled_mm`` count over two or more depths (what does not grow with them drops out),
    through zero from one depth. Where that line's intercept is negative, the line through
    zero instead: a negative fixed part with a steeper slope fits the two depths and
    over-prices every larger model (:func:`shardc.planning.fit.fit_per_param` bounds the bf16
    terms for the same reason), and the step model has no FP8 fixed term to carry it (one
    H100, 2026-12-05: -0.96 ms and 142 us per ``_scaled_mm``, which priced the 1b FP8 step at
    batch 1 16% long; through zero 115 us). The slope may be negative: where the model
    charges FP8's kernels launches that the bf16 terms already hold (a weight's quantize in
    place of its cast) or that cost less than ``compiled_launch_s``.

    ``bf16``: the same models without FP8, timed in the same rounds (one per entry of
    ``times``, at its depth). Each FP8 model's residual is then taken less its bf16 twin's:
    what the bf16 terms misprice at that depth (their fit's error, a drift of the host
    between the fits) is in both and cancels, and the FP8 terms price FP8's own work alone
    (:func:`paired_residuals`)."""
    left = paired_residuals(times, terms, compiled_launch_s, graph_call_s, bf16)
    out = {}
    for i, (field, count_of) in enumerate(zip(FP8_HOST_FIELDS, ("forward_scaled_mms",
                                                                  "backward_scaled_mms"))):
        counts = [getattr(t, count_of) for t in times]
        if not counts or min(counts) <= 0:
            raise ValueError(f"calibrate: {field} needs FP8 models whose graphs run _scaled_mm "
                             f"(counted {counts})")
        out[field] = fp8_host_term(counts, [row[i] for row in left])
    return out


def paired_residuals(times: Sequence[PhaseTimes], terms: dict[str, float],
                     compiled_launch_s: float, graph_call_s: float,
                     bf16: Sequence[PhaseTimes] | None = None) -> list[tuple[float, float]]:
    """Each FP8 model's forward and backward host seconds that the bf16 ``terms`` and the
    launches do not price (:func:`residual_seconds`), less its bf16 twin's (``bf16[i]``, the
    same depth without FP8) where given."""
    left = [residual_seconds(t, terms, compiled_launch_s, graph_call_s) for t in times]
    if bf16 is None:
        return left
    if len(bf16) != len(times) or any(b.params != t.params or b.forward_scaled_mms
                                      for b, t in zip(bf16, times)):
        raise ValueError("calibrate: the FP8 host fit pairs each FP8 model with a bf16 model of "
                         f"its parameters and no _scaled_mm (FP8 {[t.params for t in times]}, "
                         f"bf16 {[(b.params, b.forward_scaled_mms) for b in bf16]})")
    twins = [residual_seconds(b, terms, compiled_launch_s, graph_call_s) for b in bf16]
    return [(f - bf, b - bb) for (f, b), (bf, bb) in zip(left, twins)]


def fp8_host_term(counts: Sequence[int], left: Sequence[float]) -> float:
    """One FP8 host term from what the bf16 terms leave of a graph (``left``, seconds) at its
    ``_scaled_mm`` counts, by :func:`fit_fp8_host_cost`'s rule: the slope over two or more
    counts where its line starts at or above zero, else (and from one count) the line through
    zero."""
    if len(set(counts)) > 1:
        fixed, slope = fit_line(counts, left)
        if fixed >= 0:
            return slope
    return fit_through_origin(counts, left)


def collective_fit_parts(times: Sequence[PhaseTimes], terms: dict[str, float],
                         compiled_launch_s: float, graph_call_s: float) -> dict[str, float]:
    """The least-squares parts of what :func:`residual_seconds` leaves of the forward and the
    backward together, over models sharded over several ranks: ``per_collective`` (seconds per
    issued collective), ``per_param`` and ``fixed`` (host seconds that grow with the parameter
    tensors or not at all beyond the one-rank ``terms``: an error of those terms, or the
    world's own per-parameter work). Unbounded.

    Where the points separate the collectives from the parameters (the same depth with
    other buckets, :data:`COLLECTIVE_BUCKETINGS`) all three are fitted; where the collectives
    grow with the parameters (depths alone) ``per_param`` cannot be told from
    ``per_collective`` and is 0: the slope against the collectives (``fixed`` its
    intercept), and from one collective count the line through zero."""
    counts = [t.forward_collectives + t.backward_collectives for t in times]
    if not counts or min(counts) <= 0:
        raise ValueError("calibrate: collective_launch_s needs models whose graphs issue "
                         f"collectives (counted {counts}): shard them over more than one rank")
    left = [sum(residual_seconds(t, terms, compiled_launch_s, graph_call_s)) for t in times]
    if len(set(counts)) == 1:
        return {"per_collective": sum(left) / sum(counts), "per_param": 0.0, "fixed": 0.0}
    try:
        per_collective, per_param, fixed = fit_least_squares(
            [(c, t.params, 1.0) for c, t in zip(counts, times)], left, "collective_launch_s")
    except ValueError:  # the collectives grow with the parameters: the old line
        fixed, per_collective = fit_line(counts, left)
        per_param = 0.0
    return {"per_collective": per_collective, "per_param": per_param, "fixed": fixed}


def fit_collective_host_cost(times: Sequence[PhaseTimes], terms: dict[str, float],
                             compiled_launch_s: float, graph_call_s: float) -> float:
    """``collective_launch_s`` from phase times of models sharded over several ranks: the host
    seconds per issued collective of what :func:`residual_seconds` leaves of the forward and
    the backward together, beyond the per-parameter and fixed ``terms`` fitted over one rank
    (where shardc elides every collective): :func:`collective_fit_parts`' ``per_collective``,
    never below zero. What grows with the parameters or not at all drops out. This is the
    world's host work per bucket beyond one rank's: the collective's own launch and the gather
    and reduction copies' Python that the kernel terms do not price."""
    parts = collective_fit_parts(times, terms, compiled_launch_s, graph_call_s)
    return max(parts["per_collective"], 0.0)


def fit_param_host_rounds(rounds: Sequence[Sequence[PhaseTimes]], compiled_launch_s: float,
                          graph_call_s: float
                          ) -> tuple[dict[str, float], dict[str, tuple[float, float]],
                                     list[dict[str, float]]]:
    """The per-parameter and fixed host terms (:func:`fit_param_host_cost`) from phase times
    in rounds (``[round][model]``, :func:`time_rounds`): fitted to each model's median over the
    rounds (:func:`median_times`); each term's spread ``(low, high)``, the range of it and the
    same term fitted to each round alone (:func:`shardc.planning.fit.value_range`: what one
    round's noise moves it by; deterministic, no resampling); and the terms of each round."""
    central = fit_param_host_cost(median_times(rounds), compiled_launch_s, graph_call_s)
    by_round = [fit_param_host_cost(r, compiled_launch_s, graph_call_s) for r in rounds]
    spread = {name: value_range(central[name], [t[name] for t in by_round])
              for name in central}
    return central, spread, by_round


def fit_collective_host_rounds(rounds: Sequence[Sequence[PhaseTimes]],
                               terms: dict[str, float], terms_by_round: Sequence[dict[str, float]],
                               compiled_launch_s: float, graph_call_s: float
                               ) -> tuple[float, tuple[float, float], dict[str, float]]:
    """``collective_launch_s`` (:func:`fit_collective_host_cost`) from phase times over several
    ranks in rounds (``[round][model]``), fitted to the medians over the rounds against the
    one-rank ``terms``; its spread, the range of it and its fits to each round alone against
    the one-rank terms of the round of the same index (``terms_by_round``, so that the one-rank
    fit's noise shows too; the central ``terms`` where there are fewer); and the central fit's
    parts (:func:`collective_fit_parts`, for the notes)."""
    medians = median_times(rounds)
    parts = collective_fit_parts(medians, terms, compiled_launch_s, graph_call_s)
    central = max(parts["per_collective"], 0.0)
    per_round = [fit_collective_host_cost(r, terms_by_round[i] if i < len(terms_by_round)
                                          else terms, compiled_launch_s, graph_call_s)
                 for i, r in enumerate(rounds)]
    return central, value_range(central, per_round), parts


def refit_nonnegative(terms: dict[str, float], counts: Sequence[int]) -> dict[str, float]:
    """The host terms of a profile fitted before the fit was bounded, fitted again with
    non-negative terms (:func:`shardc.planning.fit.fit_per_param`) without measuring again.

    ``terms``: the profile's ``PER_PARAM_FIELDS`` and ``FIXED_FIELDS``; ``counts``: the two
    parameter-tensor counts its calibration measured (its notes say them: 21 and 75 on a GPU).
    An unbounded least-squares line through two points goes through both exactly, so each
    phase's unpriced seconds at those counts are ``fixed + count * per_param``; they are
    refitted as a calibration would fit them now. Exact only for a two-count calibration whose
    slopes were all fitted as lines (the earlier fit replaced a negative slope with the
    phase's mean, whose points cannot be recovered): raises for other counts."""
    if len(set(counts)) != 2 or len(counts) != 2:
        raise ValueError("refit_nonnegative: the calibration's two parameter counts are needed "
                         f"(got {list(counts)}); with more, measure again")
    out = dict(terms)
    for name, fixed_name in zip(PER_PARAM_FIELDS, FIXED_FIELDS):
        fixed, per_param = terms.get(fixed_name, 0.0), terms.get(name, 0.0)
        points = [fixed + n * per_param for n in counts]
        out[fixed_name], out[name] = fit_per_param(list(counts), points, name)
    return out


class _Layer(nn.Module):
    """A tiny block with a transformer block's kinds of parameters: a norm weight (read by a
    pointwise op) and two matmul weights. Its weights are its own parameters, not ``nn.Linear``
    children: a stack of layers without children is no block stack for shardc
    (``blocks._is_block_stack``), so the layers compile inline, as they did when this model was
    calibrated with (the same ops as ``nn.Linear``'s)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(dim))
        self.up = nn.Parameter(nn.Linear(dim, dim, bias=False).weight.detach())
        self.down = nn.Parameter(nn.Linear(dim, dim, bias=False).weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.linear(torch.relu(F.linear(x * self.norm, self.up)), self.down)


def _one_rank_mesh(device: torch.device):
    """A mesh of this rank alone, and a function that undoes what making it set up (a world-1
    process group when none was initialized; under ``torchrun`` every rank makes every
    one-rank group, as ``new_group`` requires)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if dist.is_initialized():
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        return DeviceMesh.from_group(groups[dist.get_rank()], device.type), lambda: None
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    return init_device_mesh(device.type, (1,)), dist.destroy_process_group


def _device_work(fn: Callable[[], object], device: torch.device
                 ) -> tuple[object, int, float | None]:
    """``fn()``, the number of kernels (device operations) it launched and the host seconds
    from its call to its first one (0 and None on the CPU). The device is idle before (a
    synchronization) and a marker kernel is launched right before the call: on an idle device
    each kernel starts as soon as it is launched, so the gap between the marker's end and the
    first kernel's start (``torch.profiler``'s device timestamps) is the host's work before
    its first launch."""
    if device.type != "cuda":
        return fn(), 0, None
    from torch.profiler import ProfilerActivity, profile

    marker = torch.zeros(1, device=device)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        marker.add_(1)
        out = fn()
        torch.cuda.synchronize(device)
    ops = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                 key=lambda e: e.time_range.start)
    if len(ops) < 2:
        return out, max(len(ops) - 1, 0), None
    return out, len(ops) - 1, max(ops[1].time_range.start - ops[0].time_range.end, 0) / 1e6


def _layers_model(layers: int, device: torch.device, dtype: torch.dtype
                  ) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """``layers`` of :class:`_Layer` (3 parameter tensors each), and its loss on a fixed
    batch."""
    model = nn.Sequential(*[_Layer(16) for _ in range(layers)]).to(device)
    # (shardc casts the gathered parameters, not the inputs: the input in the compute dtype)
    x = torch.randn(8, 16, device=device, dtype=dtype)
    return model, lambda m: m(x).float().square().mean()


def _llama_model(layers: int, device: torch.device, dtype: torch.dtype
                 ) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """shardc's Llama (the benchmarks' blocks: 9 parameter tensors each, 3 more outside them) at
    a tiny width, and its cross-entropy loss on a fixed batch of 2 x 32 tokens."""
    from shardc.models.llama import LlamaConfig, Transformer, llama_loss

    cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=layers, n_heads=4, max_seq_len=32)
    with torch.device(device):
        model = Transformer(cfg)
    model.init_weights(buffer_device=device)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), device=device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return model, lambda m: llama_loss(m(inputs), targets)


# The measured model: "llama" (tiny Llama blocks, what the benchmarks train; on a GPU) or
# "layers" (:class:`_Layer`, faster to compile; on the CPU, whose profile serves tests).
MODELS = {"llama": _llama_model, "layers": _layers_model}
GPU_MODEL, CPU_MODEL = "llama", "layers"


_CODE_IDS = itertools.count()


def _own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own (the same body, a numbered name). Dynamo keeps its
    compiled frames per code object, at most ``recompile_limit`` (8) of them: the calibration
    models are different models behind one loss function, so without this they would share
    one cache, a call would check the guards of the entries tried before its own (host time
    that is no model's), and the ninth model would run eagerly (Dynamo only warns)."""
    code = fn.__code__
    code = code.replace(co_name=f"{code.co_name}_{next(_CODE_IDS)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                              fn.__closure__)


@dataclass
class CompiledModel:
    """A calibration model, sharded, compiled and warmed up (:func:`compile_model`), with what
    its plans say; :func:`time_rounds` times its steps."""

    layers: int
    bucket_by: str
    params: int
    step_fn: Callable[[], torch.Tensor]  # the compiled forward (loss included)
    optimizer: torch.optim.Optimizer
    model_kernels: tuple[int | None, int | None]
    scaled_mms: tuple[int, int]
    collectives: tuple[int, int]


def compile_model(layers: int, device: torch.device, mesh, *, mixed: bool | None = None,
                  model_kind: str | None = None, fp8: bool = False,
                  bucket_by: str = "module") -> CompiledModel:
    """A ``layers``-deep model (``model_kind``, default :data:`GPU_MODEL` or
    :data:`CPU_MODEL`) sharded over ``mesh``, compiled with the shardc backend (blocks
    inline, buckets ``bucket_by``: one per block, or one per parameter tensor) and trained
    three untimed steps (the first compiles). ``mixed`` (default: on a GPU): bf16 compute and
    fp32 reduction, as the benchmarks train. ``fp8``: its ``nn.Linear`` weights gathered in
    FP8 (``shardc.Float8Policy()``; on a GPU with ``torch._scaled_mm`` they compute on it)."""
    import shardc

    gpu = device.type == "cuda"
    mixed = gpu if mixed is None else mixed
    kind = model_kind or (GPU_MODEL if gpu else CPU_MODEL)
    if kind not in MODELS:
        raise ValueError(f"calibrate: unknown model {kind!r} for the host cost; use one of "
                         f"{sorted(MODELS)}")
    torch.manual_seed(0)
    model, loss_of = MODELS[kind](layers, device, torch.bfloat16 if mixed else torch.float32)
    mp = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed else None
    shardc.shard(model, mesh, mp_policy=mp, fp8=shardc.Float8Policy() if fp8 else None,
                 allow_partial_mesh=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = torch.compile(functools.partial(_own_code(loss_of), model),
                            backend=shardc.backend(inductor=gpu, compile_blocks_once=False,
                                                   bucket_by=bucket_by))
    for _ in range(3):
        loss_fn().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if gpu:
        torch.cuda.synchronize(device)
    plans = shardc.explain_all(model)
    return CompiledModel(layers, bucket_by, sum(1 for _ in model.parameters()), loss_fn, opt,
                         model_kernels(plans), scaled_mm_calls(plans), collective_calls(plans))


def _profiled_step(m: CompiledModel, device: torch.device
                   ) -> tuple[int, int, float | None, float | None, float | None]:
    """One step under ``torch.profiler`` (:func:`_device_work`): the forward's and the
    backward's kernels, and the host seconds before the first device work of the forward, the
    backward and the optimizer (None on the CPU)."""
    loss, fw_kernels, before = _device_work(m.step_fn, device)
    # The seed gradient made up front: ``backward()`` would launch its fill first, and the gap
    # to the compiled backward's first kernel is what is measured.
    seed = torch.ones_like(loss)
    _, bw_kernels, bw_before = _device_work(functools.partial(loss.backward, seed), device)
    _, _, opt_before = _device_work(m.optimizer.step, device)
    m.optimizer.zero_grad(set_to_none=True)
    return fw_kernels, bw_kernels, before, bw_before, opt_before


def _timed_steps(m: CompiledModel, device: torch.device, steps: int) -> list[float]:
    """The median host seconds of the forward, ``backward()``, ``step()`` and ``zero_grad()``
    over ``steps`` steps, each started on an idle device (as a synchronized benchmark step
    is), timed without synchronizing inside the step, after one untimed step (the first after
    :func:`_profiled_step` pays whatever the profiler's teardown left to the host)."""
    gpu = device.type == "cuda"
    phases: list[list[float]] = [[], [], [], []]
    for i in range(steps + 1):  # the first untimed: it follows the profiler's teardown
        if gpu:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = m.step_fn()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        m.optimizer.step()
        t3 = time.perf_counter()
        m.optimizer.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        for phase, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            if i:
                phase.append(seconds)
    if gpu:
        torch.cuda.synchronize(device)
    return [statistics.median(p) for p in phases]


def round_order(count: int, round_index: int) -> list[int]:
    """The order of ``count`` timed items in round ``round_index``: every other round reversed,
    so that no item always follows the same one."""
    order = list(range(count))
    return order[::-1] if round_index % 2 else order


def time_rounds(models: Sequence[CompiledModel], device: torch.device, rounds: int,
                steps: int) -> list[list[PhaseTimes]]:
    """Each model's :class:`PhaseTimes` per round: ``[round][model]``. The models are
    interleaved, so that a drift of the host's speed (another process, the clock, the
    allocator) hits every model alike instead of the ones measured last: in each round every
    model runs one profiled step (it also brings its caches back after the other models ran)
    and then ``steps`` timed ones after an untimed one (:func:`_timed_steps`); every other
    round goes through the models in reverse, so no model always follows the same one."""
    if rounds < 1 or steps < 1:
        raise ValueError(f"calibrate: host timings need rounds >= 1 and steps >= 1 (got {rounds}, "
                         f"{steps})")
    out: list[list[PhaseTimes]] = []
    for r in range(rounds):
        order = round_order(len(models), r)
        row: list[PhaseTimes | None] = [None] * len(models)
        for i in order:
            m = models[i]
            fw_kernels, bw_kernels, before, bw_before, opt_before = _profiled_step(m, device)
            if device.type == "cuda" and not (fw_kernels and bw_kernels and before is not None):
                raise RuntimeError(
                    f"calibrate: torch.profiler saw {fw_kernels} forward and {bw_kernels} "
                    "backward CUDA kernels of the compiled model; without them the compiled "
                    "graphs' launches cannot be told from the host's per-parameter work. Check "
                    "that the profiler records CUDA activity here (CUPTI), or calibrate with "
                    "another torch build.")
            row[i] = PhaseTimes(m.params, *_timed_steps(m, device, steps), fw_kernels,
                                bw_kernels, before, *m.model_kernels, opt_before, bw_before,
                                *m.scaled_mms, *m.collectives, bucket_by=m.bucket_by)
        out.append([t for t in row if t is not None])
    return out


def median_times(rounds: Sequence[Sequence[PhaseTimes]]) -> list[PhaseTimes]:
    """Per model, the median over ``rounds`` (``[round][model]``, :func:`time_rounds`) of each
    of its measured seconds (None where a round did not measure it); the counts are each
    model's own (the same in every round, from its plans), the kernels counted the first
    round's."""
    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    seconds = ("forward_s", "backward_s", "optimizer_s", "zero_grad_s", "forward_prelaunch_s",
               "optimizer_prelaunch_s", "backward_prelaunch_s")
    return [dataclasses.replace(per_round[0], **{f: median([getattr(t, f) for t in per_round])
                                                 for f in seconds})
            for per_round in zip(*rounds)]


def collective_calls(plans) -> tuple[int, int]:
    """The collectives the host issues in the forward and backward graphs of ``plans`` (not
    elided: a one-rank group's are lowered to none)."""
    return tuple(sum(1 for p in plans for c in p.collectives
                     if c.graph == graph and not c.elided)
                 for graph in ("forward", "backward"))


def scaled_mm_calls(plans) -> tuple[int, int]:
    """The ``torch._scaled_mm`` ops of the forward and backward graphs of ``plans``."""
    return tuple(sum(1 for p in plans for op in p.graphs.get(graph, ())
                     if "_scaled_mm" in op.target) for graph in ("forward", "backward"))


def model_kernels(plans) -> tuple[int | None, int | None]:
    """The kernels the cost model launches for the forward and the backward graphs of
    ``plans`` (every region; None where a plan does not say, e.g. one made before the count
    was recorded)."""
    out = []
    for graph in ("forward", "backward"):
        counts = [getattr(p.predicted, f"{graph}_kernels") for p in plans]
        out.append(None if not counts or any(c is None for c in counts)
                   else int(sum(counts)))
    return out[0], out[1]


@dataclass(frozen=True)
class HostFit:
    """The per-parameter and fixed host terms fitted over one rank
    (:func:`measure_param_host_cost`): the terms, each term's spread ``(low, high)``
    (:func:`fit_param_host_rounds`), the phase times fitted (each model's median over the
    rounds), and each round's terms (what the collective fit's spread subtracts per round)."""

    terms: dict[str, float]
    spread: dict[str, tuple[float, float]]
    times: list[PhaseTimes]
    terms_by_round: list[dict[str, float]]


@dataclass(frozen=True)
class CollectiveFit:
    """``collective_launch_s`` fitted over several ranks (:func:`measure_collective_host_cost`),
    its spread, the least-squares parts it came from (:func:`collective_fit_parts`) and the
    phase times fitted (each model's median over the rounds)."""

    launch_s: float
    spread: tuple[float, float]
    parts: dict[str, float]
    times: list[PhaseTimes]


def _timed_models(device: torch.device, mesh, points: Sequence[tuple[int, str]], rounds: int,
                  steps: int, **model: object) -> list[list[PhaseTimes]]:
    """Every ``(layers, bucket_by)`` point compiled first (:func:`compile_model`), then timed
    interleaved (:func:`time_rounds`): ``[round][point]``."""
    models = [compile_model(n, device, mesh, bucket_by=b, **model) for n, b in points]
    return time_rounds(models, device, rounds, steps)


def measure_param_host_cost(device: torch.device, compiled_launch_s: float, graph_call_s: float,
                            *, layers: Sequence[int] | None = None, rounds: int = HOST_ROUNDS,
                            steps: int = HOST_STEPS_PER_ROUND) -> HostFit:
    """The per-parameter and fixed host terms on this device (see the module docstring) over a
    one-rank mesh, at ``layers`` (default :data:`GPU_PARAM_LAYERS` or
    :data:`CPU_PARAM_LAYERS`), ``rounds`` interleaved rounds of ``steps`` timed steps each."""
    layers = tuple(layers or (GPU_PARAM_LAYERS if device.type == "cuda" else CPU_PARAM_LAYERS))
    mesh, undo = _one_rank_mesh(device)
    try:
        timed = _timed_models(device, mesh, [(n, "module") for n in layers], rounds, steps)
    finally:
        undo()
    terms, spread, by_round = fit_param_host_rounds(timed, compiled_launch_s, graph_call_s)
    return HostFit(terms, spread, median_times(timed), by_round)


def _world_mesh(device: torch.device):
    """A mesh of every rank of the initialized default process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def collective_design(layers: Sequence[int], bucketings: Sequence[str] = COLLECTIVE_BUCKETINGS
                      ) -> list[tuple[int, str]]:
    """The ``(layers, bucket_by)`` points the host's seconds per collective are measured at:
    every depth with every bucketing (:data:`COLLECTIVE_BUCKETINGS`), so that at each depth the
    collectives vary at a fixed parameter count."""
    return [(n, b) for n in layers for b in bucketings]


def measure_collective_host_cost(device: torch.device, one_rank: HostFit,
                                 compiled_launch_s: float, graph_call_s: float, *,
                                 layers: Sequence[int] | None = None,
                                 bucketings: Sequence[str] = COLLECTIVE_BUCKETINGS,
                                 rounds: int = HOST_ROUNDS, steps: int = HOST_STEPS_PER_ROUND
                                 ) -> CollectiveFit:
    """``collective_launch_s`` on this device and process group
    (:func:`fit_collective_host_rounds`): the model of the per-parameter fit, sharded over every
    rank of the default process group (which must hold more than one), at
    :func:`collective_design`'s points (default depths :data:`GPU_COLLECTIVE_LAYERS` or
    :data:`CPU_COLLECTIVE_LAYERS`), against the one-rank fit ``one_rank``. Every rank must
    call it (with the same arguments)."""
    layers = tuple(layers or (GPU_COLLECTIVE_LAYERS if device.type == "cuda"
                              else CPU_COLLECTIVE_LAYERS))
    timed = _timed_models(device, _world_mesh(device), collective_design(layers, bucketings),
                          rounds, steps)
    launch, spread, parts = fit_collective_host_rounds(timed, one_rank.terms,
                                                       one_rank.terms_by_round,
                                                       compiled_launch_s, graph_call_s)
    return CollectiveFit(launch, spread, parts, median_times(timed))


def measure_fp8_host_cost(device: torch.device, terms: dict[str, float],
                          compiled_launch_s: float, graph_call_s: float, *,
                          layers: Sequence[int] = GPU_FP8_LAYERS, rounds: int = HOST_ROUNDS,
                          steps: int = HOST_STEPS_PER_ROUND
                          ) -> tuple[dict[str, float], list[PhaseTimes],
                                                   list[PhaseTimes]]:
    """FP8's host terms on this GPU (:func:`fit_fp8_host_cost`): the tiny Llama of
    :func:`measure_param_host_cost` with FP8 Linears at ``layers``, each paired with the same
    model without FP8, all timed in the same interleaved rounds, against the bf16 ``terms``
    fitted there. Returns the terms and the FP8 and bf16 models' phase times (medians over the
    rounds). Call it only where ``torch._scaled_mm`` runs (Hopper and later); it raises
    otherwise."""
    mesh, undo = _one_rank_mesh(device)
    try:
        models = [compile_model(n, device, mesh, fp8=fp8) for fp8 in (True, False)
                  for n in layers]
        times = median_times(time_rounds(models, device, rounds, steps))
    finally:
        undo()
    fp8_times, bf16_times = times[:len(layers)], times[len(layers):]
    return (fit_fp8_host_cost(fp8_times, terms, compiled_launch_s, graph_call_s, bf16_times),
            fp8_times, bf16_times)
