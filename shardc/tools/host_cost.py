"""Calibration of the host's per-parameter work (``python -m shardc calibrate``).

Measures :data:`shardc.planning.profile.PER_PARAM_FIELDS`: a model of many tiny parameters
(tiny compute, so every phase is bound by the host) is sharded with ``shardc.shard`` (bf16
compute and fp32 reduction on a GPU, as the benchmarks run) over a one-rank mesh, compiled with
the shardc backend (Inductor on a GPU, blocks inline; the FX graphs on the CPU) and trained with
torch's default AdamW at two depths. On a GPU the model is shardc's Llama at width 64 (2 and 8
blocks: 21 and 75 parameter tensors, the 1b benchmark's blocks with the same kernels per
block); on the CPU, whose profile serves tests, layers of a norm weight and two ``Linear``
weights (1 and 2: 3 and 6 parameter tensors).

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

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardc.planning.fit import fit_line, fit_per_param
from shardc.planning.profile import FIXED_FIELDS, FP8_HOST_FIELDS, PER_PARAM_FIELDS

# Depths of the measured model (:data:`MODEL`; 9 parameter tensors per Llama block).
GPU_PARAM_LAYERS = (2, 8)
CPU_PARAM_LAYERS = (1, 2)
# Depths of its FP8 variant (7 FP8 Linears per block and the output head; an FP8 region compiles
# about 2.5x slower than a bf16 one, so one depth keeps ``calibrate`` within ~30 s longer):
# 4 blocks, 29 ``_scaled_mm`` in the forward and 58 in the backward.
GPU_FP8_LAYERS = (4,)
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
                      compiled_launch_s: float, graph_call_s: float) -> dict[str, float]:
    """:data:`shardc.planning.profile.FP8_HOST_FIELDS` from FP8 models' phase times: per graph,
    what :func:`residual_seconds` leaves per ``_scaled_mm``: the slope against the
    ``_scaled_mm`` count over two or more depths (what does not grow with them drops out),
    through zero from one depth. It may be negative: where the model charges FP8's kernels
    launches that the bf16 terms already hold (a weight's quantize in place of its cast) or
    that cost less than ``compiled_launch_s``."""
    out = {}
    for i, (field, count_of) in enumerate(zip(FP8_HOST_FIELDS, ("forward_scaled_mms",
                                                                  "backward_scaled_mms"))):
        counts = [getattr(t, count_of) for t in times]
        if not counts or min(counts) <= 0:
            raise ValueError(f"calibrate: {field} needs FP8 models whose graphs run _scaled_mm "
                             f"(counted {counts})")
        left = [residual_seconds(t, terms, compiled_launch_s, graph_call_s)[i]
                for t in times]
        if len(set(counts)) > 1:
            _, out[field] = fit_line(counts, left)
        else:
            out[field] = sum(left) / sum(counts)
    return out


def fit_collective_host_cost(times: Sequence[PhaseTimes], terms: dict[str, float],
                             compiled_launch_s: float, graph_call_s: float) -> float:
    """``collective_launch_s`` from phase times of models sharded over several ranks: the host
    seconds per issued collective of what :func:`residual_seconds` leaves of the forward and
    the backward together, beyond the per-parameter and fixed ``terms`` fitted over one rank
    (where shardc elides every collective). The slope against the collectives issued over two
    or more depths (what does not grow with them drops out), through zero from one depth;
    never below zero. This is the world's host work per bucket beyond one rank's: the
    collective's own launch and the gather and reduction copies' Python that the kernel
    terms do not price."""
    counts = [t.forward_collectives + t.backward_collectives for t in times]
    if not counts or min(counts) <= 0:
        raise ValueError("calibrate: collective_launch_s needs models whose graphs issue "
                         f"collectives (counted {counts}): shard them over more than one rank")
    left = [sum(residual_seconds(t, terms, compiled_launch_s, graph_call_s)) for t in times]
    if len(set(counts)) > 1:
        _, per_collective = fit_line(counts, left)
    else:
        per_collective = sum(left) / sum(counts)
    return max(per_collective, 0.0)


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
    pointwise op) and two matmul weights."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(dim))
        self.up = nn.Linear(dim, dim, bias=False)
        self.down = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x * self.norm)))


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


def time_phases(layers: int, device: torch.device, mesh, steps: int,
                mixed: bool | None = None, model_kind: str | None = None,
                fp8: bool = False) -> PhaseTimes:
    """Median host seconds of each phase of ``steps`` training steps of a ``layers``-deep
    model (``model_kind``, default :data:`GPU_MODEL` or :data:`CPU_MODEL`), after three
    untimed ones (the first compiles) and, on a GPU, five profiled ones (kernels per graph,
    the forward's host time before its first launch). ``mixed`` (default: on a GPU): bf16
    compute and fp32 reduction, as the benchmarks train. Blocks compile inline, as
    ``benchmarks/predict_step.py`` measures by default. ``fp8``: its ``nn.Linear`` weights
    gathered in FP8 (``shardc.Float8Policy()``; on a GPU with ``torch._scaled_mm`` they compute
    on it)."""
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
    loss_fn = torch.compile(functools.partial(loss_of, model),
                            backend=shardc.backend(inductor=gpu, compile_blocks_once=False))

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(device)

    for _ in range(3):
        loss_fn().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    prelaunch, bw_prelaunch, opt_prelaunch = [], [], []
    for _ in range(5 if gpu else 1):  # host time before the first launch (forward, optimizer)
        loss, fw_kernels, before = _device_work(loss_fn, device)
        # The seed gradient made up front: ``backward()`` would launch its fill first, and the
        # gap to the compiled backward's first kernel is what is measured.
        seed = torch.ones_like(loss)
        _, bw_kernels, bw_before = _device_work(functools.partial(loss.backward, seed), device)
        _, _, opt_before = _device_work(opt.step, device)
        opt.zero_grad(set_to_none=True)
        if before is not None:
            prelaunch.append(before)
        if opt_before is not None:
            opt_prelaunch.append(opt_before)
        if bw_before is not None:
            bw_prelaunch.append(bw_before)
    if gpu and not (fw_kernels and bw_kernels and prelaunch):
        raise RuntimeError(
            f"calibrate: torch.profiler saw {fw_kernels} forward and {bw_kernels} backward CUDA "
            "kernels of the compiled model; without them the compiled graphs' launches cannot be "
            "told from the host's per-parameter work. Check that the profiler records CUDA "
            "activity here (CUPTI), or calibrate with another torch build.")
    phases: list[list[float]] = [[], [], [], []]
    for _ in range(steps):
        sync()  # each step starts on an idle device, as a synchronized benchmark step does
        t0 = time.perf_counter()
        loss = loss_fn()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        for phase, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phase.append(seconds)
    sync()
    n = sum(1 for _ in model.parameters())
    plans = shardc.explain_all(model)
    model_fw, model_bw = model_kernels(plans)
    fw_mms, bw_mms = scaled_mm_calls(plans)
    fw_colls, bw_colls = collective_calls(plans)
    return PhaseTimes(n, *(statistics.median(p) for p in phases), fw_kernels, bw_kernels,
                      statistics.median(prelaunch) if prelaunch else None,
                      model_fw, model_bw,
                      statistics.median(opt_prelaunch) if opt_prelaunch else None,
                      statistics.median(bw_prelaunch) if bw_prelaunch else None,
                      fw_mms, bw_mms, fw_colls, bw_colls)


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


def measure_param_host_cost(device: torch.device, compiled_launch_s: float, graph_call_s: float,
                            *, layers: Sequence[int] | None = None, steps: int = 20
                            ) -> tuple[dict[str, float], list[PhaseTimes]]:
    """The per-parameter host terms on this device (see the module docstring), and the phase
    times they were fitted to."""
    layers = tuple(layers or (GPU_PARAM_LAYERS if device.type == "cuda" else CPU_PARAM_LAYERS))
    mesh, undo = _one_rank_mesh(device)
    try:
        times = [time_phases(n, device, mesh, steps) for n in layers]
    finally:
        undo()
    return fit_param_host_cost(times, compiled_launch_s, graph_call_s), times


def _world_mesh(device: torch.device):
    """A mesh of every rank of the initialized default process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def measure_collective_host_cost(device: torch.device, terms: dict[str, float],
                                 compiled_launch_s: float, graph_call_s: float, *,
                                 layers: Sequence[int] | None = None, steps: int = 20
                                 ) -> tuple[float, list[PhaseTimes]]:
    """``collective_launch_s`` on this device and process group (:func:`fit_collective_host_cost`):
    the model of the per-parameter fit, sharded over every rank of the default process group
    (which must hold more than one), at the same depths; and the phase times it was fitted
    to. Every rank must call it."""
    layers = tuple(layers or (GPU_PARAM_LAYERS if device.type == "cuda" else CPU_PARAM_LAYERS))
    mesh = _world_mesh(device)
    times = [time_phases(n, device, mesh, steps) for n in layers]
    return fit_collective_host_cost(times, terms, compiled_launch_s, graph_call_s), times


def measure_fp8_host_cost(device: torch.device, terms: dict[str, float],
                          compiled_launch_s: float, graph_call_s: float, *,
                          layers: Sequence[int] = GPU_FP8_LAYERS, steps: int = 10
                          ) -> tuple[dict[str, float], list[PhaseTimes]]:
    """FP8's host terms on this GPU (:func:`fit_fp8_host_cost`): the tiny Llama of
    :func:`measure_param_host_cost` with FP8 Linears, against the bf16 ``terms`` fitted there.
    Call it only where ``torch._scaled_mm`` runs (Hopper and later); it raises otherwise."""
    mesh, undo = _one_rank_mesh(device)
    try:
        times = [time_phases(n, device, mesh, steps, fp8=True) for n in layers]
    finally:
        undo()
    return fit_fp8_host_cost(times, terms, compiled_launch_s, graph_call_s), times
