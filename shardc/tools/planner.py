"""The capacity planner: plan one training step of a model for any world size, without GPUs.

:func:`plan_model` builds the model on the meta device, shards it over a fake process group of
the requested size (rank 0's view, ``shardc.tools.fake_world``) and compiles one training step
(the loss inside the compiled region, as training compiles it) with the shardc backend, which
plans the region exactly as a real run would; compilation stops once the plan is made
(``shardc.compile.pipeline.plan_only``). Attention is traced as the fused kernel a GPU runs
(``shardc.tools.attention``). A model with more blocks than a template traces is planned from
its first blocks, repeated (``shardc.tools.template``), unless ``template=False``.

With ``PlanSetup.inductor`` the step is planned as Inductor compiles it (its decompositions, and
the peak model's fusion-aware liveness), which is what the GPU runs; otherwise as the FX backend
(``inductor=False``) runs it. Either way the shards are CPU tensors that are allocated but never
written (untouched pages cost no memory; the kernel must allow overcommitting, Linux's default),
because neither works on the meta device: Inductor folds a meta graph away, and on meta tensors
the loss (``nll_loss``) has no autograd kernel, so the traced backward would hold zeros for every
gradient. :func:`capacity` turns a plan into the answers:
step time, tokens/s per GPU, MFU, exposed communication, and the peak against a device's memory.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardc import _torch
from shardc.models.llama import LlamaConfig
from shardc.planning.plan import Plan
from shardc.planning.profile import ClusterProfile, ProfileError, resolve_profile
from shardc.planning.step import OptimizerSpec, StepPrediction, predict_step
from shardc.tools.model_spec import ModelSpec, ModelSpecError, fit_seq, llama_model

GIB = 2**30


def fmt_bytes(n: float) -> str:
    """``31.2 GiB``, ``12.0 MiB``: GiB from 0.1 GiB up, else the largest unit below."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size * (0.1 if unit == "GiB" else 1):
            return f"{n / size:.{1 if unit != 'GiB' or abs(n) >= GIB else 2}f} {unit}"
    return f"{int(n)} B"
# Device memory as CUDA reports it (``torch.cuda.get_device_properties(0).total_memory``).
DEVICES_GIB = {"h100": 79.11, "h200": 139.81}
# ``--optimizer``: (optimizer_state_factor, optimizer_temp_factor, optimizer_impl, what it is).
# The state and temporaries go to the peak prediction, the kind to the step's optimizer term
# (shardc.planning.estimate.optimizer_kernel_ops); the implementation
# (shardc.planning.optimizer_kind) decides which temporaries the step holds and how fast the
# host steps: "auto" is torch's default (foreach and fused unset: foreach on the device, per
# tensor in a group holding host tensors).
OPTIMIZERS = {
    "adamw": (2.0, 1.0, "auto", "AdamW (foreach)"),
    "adamw-foreach": (2.0, 1.0, "foreach", "AdamW (foreach=True)"),
    "adamw-fused": (2.0, 0.0, "fused", "AdamW (fused)"),
    "adamw-per-tensor": (2.0, 1.0, "per_tensor", "AdamW (foreach=False)"),
    "sgd-momentum": (1.0, 1.0, "auto", "SGD with momentum (foreach)"),
    "sgd": (0.0, 1.0, "auto", "SGD (foreach)"),
}
OFFLOAD = ("none", "params", "optimizer")


@dataclass(frozen=True)
class PlanSetup:
    """How the step is trained: ``precision`` ``"fp32"`` or ``"bf16"`` (bf16 parameters for
    compute, fp32 gradient reduction, fp32 master shards); ``checkpointing``: recompute every
    block's activations in the backward; ``fp8``: gather ``nn.Linear`` weights in FP8
    (``fp8_embedding``: ``nn.Embedding`` weights too, as ``benchmarks/predict_step.py``'s
    ``:fp8`` runs do); FP8 Linears are traced on ``torch._scaled_mm`` as on a GPU
    (``shardc.sharding.fp8.scaled_mm_as_on_gpu``)
    (``shardc.Float8Policy``); ``shard_size``: HSDP, sharding within groups of this many ranks
    and replicating across the world size / ``shard_size`` groups (``None``: FSDP over all);
    ``inductor``: plan as Inductor compiles (see the module docstring; the command line's
    default), else as the FX backend runs the graphs; ``tp``: tensor-parallel degree (FSDP over
    ``world / tp`` data-parallel ranks of a ``("dp", "tp")`` mesh; models whose spec can
    ``parallelize``: shardc's Llama); ``offload``: CPU offload (``"params"``:
    ``OffloadPolicy()``, ``"optimizer"``: optimizer-only), ``step_in_backward``: its host step
    overlapped with the backward; ``optimizer``: a key of :data:`OPTIMIZERS` (None: foreach
    AdamW, fused with offload); ``reshard_after_forward``: ``shardc.shard``'s (False: the
    backward reuses the forward's gathered parameters); ``pack_blocks``: ``shardc.shard``'s
    (on by default, as there: each repeated block's shards in one buffer, one gather per
    block); where ``shard`` packed a block (not under offload, FP8 or TP, nor for a block it
    cannot pack: :mod:`shardc.sharding.packed_blocks`), the step is planned with the blocks
    compiled once, as they run, and traced whole (no template); False plans each parameter's
    own reads."""

    precision: str = "fp32"
    checkpointing: bool = False
    fp8: bool = False
    fp8_embedding: bool = False
    shard_size: int | None = None
    inductor: bool = False
    tp: int = 1
    offload: str = "none"
    step_in_backward: bool = False
    optimizer: str | None = None
    reshard_after_forward: bool = True
    pack_blocks: bool = True

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16"):
            raise ModelSpecError(f"precision must be 'fp32' or 'bf16', got {self.precision!r}")
        if self.tp < 1:
            raise ModelSpecError(f"--tp {self.tp}: the tensor-parallel degree must be >= 1")
        if self.offload not in OFFLOAD:
            raise ModelSpecError(f"--offload {self.offload!r}: use one of {', '.join(OFFLOAD)}")
        if self.step_in_backward and self.offload != "params":
            raise ModelSpecError("--step-in-backward overlaps CPU offload's host step with the "
                                 "backward: it needs --offload params (OffloadPolicy())")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ModelSpecError(f"--optimizer {self.optimizer!r}: use one of "
                                 f"{', '.join(OPTIMIZERS)}")

    @property
    def optimizer_name(self) -> str:
        """The optimizer planned for: ``--optimizer``, else foreach AdamW on the device and
        fused AdamW on the host (CPU offload: torch's CPU kernel, as docs/offload.md runs it)."""
        if self.optimizer is not None:
            return self.optimizer
        return "adamw" if self.offload == "none" else "adamw-fused"

    def optimizer_options(self) -> dict[str, Any]:
        """The backend options the optimizer's kind sets (its state, temporaries and
        implementation)."""
        state, temp, impl, _ = OPTIMIZERS[self.optimizer_name]
        return {"optimizer_state_factor": state, "optimizer_temp_factor": temp,
                "optimizer_impl": impl}

    def shard_kwargs(self) -> dict[str, Any]:
        import shardc

        kwargs: dict[str, Any] = {}
        if not self.reshard_after_forward:
            kwargs["reshard_after_forward"] = False
        kwargs["pack_blocks"] = self.pack_blocks
        if self.precision == "bf16":
            kwargs["mp_policy"] = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                              reduce_dtype=torch.float32)
        if self.fp8:
            kwargs["fp8"] = shardc.Float8Policy(
                modules=(nn.Linear, nn.Embedding) if self.fp8_embedding else (nn.Linear,))
        if self.offload != "none":
            # The planning machine's CPU mesh: offload's copies as on a GPU (simulate_on_cpu);
            # nothing is pinned and the host check would weigh the planned model against
            # this machine.
            kwargs["offload"] = shardc.OffloadPolicy(
                params=self.offload == "params", optimizer=True, pin_memory=False,
                simulate_on_cpu=True, check_host_memory=False,
                optimizer_state_factor=self.optimizer_options()["optimizer_state_factor"])
        return kwargs


def _mesh(world: int, setup: PlanSetup, device: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if setup.tp > 1:
        if setup.shard_size is not None:
            raise ModelSpecError("--tp with --shard-size: HSDP + TP (a 3-D mesh) is not "
                                 "supported; plan FSDP + TP or HSDP")
        if world % setup.tp:
            raise ModelSpecError(f"--tp {setup.tp} must divide the world size {world}")
        return init_device_mesh(device, (world // setup.tp, setup.tp),
                                mesh_dim_names=("dp", "tp"))
    if setup.shard_size is None or setup.shard_size == world:
        return DeviceMesh.from_group(dist.group.WORLD, device)
    if setup.shard_size < 1 or world % setup.shard_size:
        raise ModelSpecError(f"--shard-size {setup.shard_size} must divide the world size "
                             f"{world} (HSDP: replicate world/shard x shard)")
    return init_device_mesh(device, (world // setup.shard_size, setup.shard_size),
                            mesh_dim_names=("replicate", "shard"))


def _buffers_to(model: nn.Module, device: str) -> None:
    """Give the buffers the tracing device (uninitialized: planning reads no value)."""
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.device.type != device:
                setattr(module, name, torch.empty_like(buf, device=device))


def _prepared(spec: ModelSpec, setup: PlanSetup, mesh) -> nn.Module:
    model = spec.build()
    if setup.tp > 1:
        if spec.parallelize is None:
            raise ModelSpecError(f"--tp: {spec.name} has no tensor-parallel plan here; the "
                                 "planner parallelizes shardc's Llama (llama-* presets)")
        spec.parallelize(model, mesh["tp"])
    if setup.checkpointing:
        if spec.checkpoint_blocks is None:
            raise ModelSpecError(f"{spec.name}: no blocks to checkpoint")
        spec.checkpoint_blocks(model)
    return model


def shard_for_plan(model: nn.Module, mesh, setup: PlanSetup) -> tuple[str, ...]:
    """Shard ``model`` over ``mesh`` as ``setup`` trains it (``setup.shard_kwargs()``); returns
    the blocks ``shardc.shard`` packed (:func:`shardc.sharding.packed_blocks.packed_block_names`,
    empty where it packed none). A setup ``shard`` refuses raises :class:`ModelSpecError`."""
    import shardc
    from shardc.sharding.packed_blocks import packed_block_names

    try:
        shardc.shard(model, mesh, **setup.shard_kwargs())
    except NotImplementedError as exc:
        raise ModelSpecError(f"cannot plan this setup: {exc}") from None
    return packed_block_names(model)


def trace_step(model: nn.Module, mesh, spec: ModelSpec, setup: PlanSetup, tokens: torch.Tensor,
               targets: torch.Tensor, options: dict, *, sharded: bool = False) -> None:
    """Shard ``model`` over ``mesh`` (:func:`shard_for_plan`; ``sharded``: the caller did,
    with this ``setup``), compile one step of ``spec.loss`` on ``(tokens, targets)`` with the
    shardc backend and run it until the region is planned (nothing is compiled or run). Pass two
    tensors, as training does: one tensor passed as both is one graph input where training has
    two, and the plan misses the targets' bytes (32 KiB at the peak at batch 2 x 2048:
    docs/memory_budget.md, gap22)."""
    import shardc
    from shardc.compile.pipeline import PlannedOnly, plan_only

    if not sharded:
        shard_for_plan(model, mesh, setup)
    _buffers_to(model, tokens.device.type)
    step = torch.compile(lambda t, y: spec.loss(model, t, y), backend=shardc.backend(**options))
    with plan_only():
        try:
            step(tokens, targets)
        except Exception as exc:  # torch.compile wraps what the backend raises
            if not isinstance(_torch.backend_failure_cause(exc), PlannedOnly):
                raise
            return
    raise RuntimeError("shardc planner: the step compiled without a shardc region (no sharded "
                       "parameter read, or no backward)")


@dataclass(frozen=True)
class PlannedModel:
    """:func:`plan_model_step`'s answer: the plan, the seconds planning took, and what the
    step's optimizer works on (this rank's shards of the trained parameters)."""

    plan: Plan
    seconds: float
    optimizer: OptimizerSpec


def shard_bytes(module: nn.Module) -> tuple[float, int]:
    """(local shard bytes, tensors) of the trained parameters of a sharded ``module``."""
    from torch.distributed.tensor import DTensor

    params = [p for p in module.parameters() if p.requires_grad]
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    return float(sum(t.numel() * t.element_size() for t in local)), len(params)


def optimizer_spec(model: nn.Module, setup: PlanSetup,
                   repeated: tuple[str, int] | None = None) -> OptimizerSpec:
    """What the optimizer steps on rank 0 of the planned ``model`` (sharded): the local shard
    bytes (the masters' dtype) and the number of trained parameter tensors, with
    ``setup``'s optimizer and offload. ``repeated``: ``(container, blocks)`` when ``model`` was
    planned from a template (``model.<container>`` keeps only the traced blocks): the missing
    blocks count as its last one (the template's blocks are identical)."""
    nbytes, tensors = shard_bytes(model)
    if repeated is not None:
        layers = model.get_submodule(repeated[0])
        missing = repeated[1] - len(layers)
        if missing > 0:
            block_bytes, block_tensors = shard_bytes(layers[-1])
            nbytes, tensors = nbytes + missing * block_bytes, tensors + missing * block_tensors
    state, temp, impl, name = OPTIMIZERS[setup.optimizer_name]
    return OptimizerSpec(nbytes, tensors, state_factor=state, temp_factor=temp, name=name,
                         offload=setup.offload, overlap=setup.step_in_backward, impl=impl)


@contextmanager
def _fresh_dynamo() -> Iterator[None]:
    """Trace on a reset dynamo and leave none of its state behind, also where planning raises
    (a plan refused under a budget). The planner compiles the same step code for every plan
    (:func:`trace_step`'s lambda): dynamo's state from an earlier compile of it at other shapes
    makes it mark the sizes that changed dynamic (automatic dynamic shapes), and the traced
    graphs get SymInt inputs, which shift the plan's memory-timeline positions (its hash is
    unchanged)."""
    _torch.dynamo_reset()
    try:
        yield
    finally:
        _torch.dynamo_reset()


def plan_model(model: LlamaConfig | ModelSpec, world: int, batch: int, seq: int, options: dict,
               *, template: bool = True, setup: PlanSetup | None = None) -> tuple[Plan, float]:
    """Plan one training step of ``model`` at ``world`` ranks with ``batch`` sequences of
    ``seq`` tokens per rank; returns (plan, seconds) (:func:`plan_model_step`)."""
    planned = plan_model_step(model, world, batch, seq, options, template=template, setup=setup)
    return planned.plan, planned.seconds


def plan_model_step(model: LlamaConfig | ModelSpec, world: int, batch: int, seq: int,
                    options: dict, *, template: bool = True, setup: PlanSetup | None = None
                    ) -> PlannedModel:
    """Plan one training step of ``model`` at ``world`` ranks with ``batch`` sequences of
    ``seq`` tokens per rank; returns the plan, the seconds and the optimizer's work.

    With ``template`` and more blocks than a template traces, the plan is made from a trace of
    the first blocks (``shardc.tools.template``); if the blocks or the traced graphs do not
    repeat, the whole model is traced (the plan's notes say why). ``seconds`` covers everything
    from building the model on the meta device to the finished plan.
    """
    from shardc.sharding.fp8 import scaled_mm_as_on_gpu
    from shardc.tools.attention import AttentionAsKernel
    from shardc.tools.explain import explain
    from shardc.tools.fake_world import fake_world
    from shardc.tools.template import TEMPLATE_BLOCKS, TemplateRefused, plan_from_template

    spec = model if isinstance(model, ModelSpec) else llama_model(model)
    spec, seq_note = fit_seq(spec, seq)  # a config too short for ``seq``: raised, or refused
    setup = setup or PlanSetup()
    # Blocks inline: the template's extrapolation reads inline blocks' nodes, and without
    # recompute a plan with compiled-once bodies predicts the same peak and step within 1-2%
    # (tests/test_memory.py). Under a peak budget, blocks compiled once, as the GPU run
    # compiles them by default: a recomputed body is recomputed as it is there (an inline
    # block's recomputation is placed by torch's partitioner, and peaks far higher:
    # docs/capacity.md).
    budgeted = bool(options.get("peak_memory_budget_bytes"))
    options = {**setup.optimizer_options(),
               **dict(inductor=setup.inductor, check_plan_consistency=False, **options)}
    if options.get("optimizer_offload", "auto") == "auto":
        # The plan is the GPU run's, made on the CPU: the peak budget may put the optimizer's
        # state on the host as it would there ("simulate": the lever on a CPU mesh too).
        options["optimizer_offload"] = "simulate"
    device = "cpu"  # see the module docstring: meta tensors lose the loss's gradient
    # Traced as a GPU computes the step: fused attention, FP8 Linears on _scaled_mm.
    with _fresh_dynamo(), fake_world(world), AttentionAsKernel(), scaled_mm_as_on_gpu():
        mesh = _mesh(world, setup, device)
        # The inputs and the targets are two tensors, as a data loader gives them (trace_step).
        tokens = torch.zeros(batch, seq, dtype=torch.long, device=device)
        targets = torch.zeros(batch, seq, dtype=torch.long, device=device)
        start = time.perf_counter()
        plan, refused = None, None
        built = _prepared(spec, setup, mesh)
        # Whether the blocks are packed is what shard did with this model, not what the setup
        # asked for: a block shard cannot pack (frozen or differently typed parameters, FP8,
        # TP, offload: packed_blocks.eligible_reason) reads its parameters one by one.
        packed = bool(shard_for_plan(built, mesh, setup))
        # Packed blocks are read through their compiled-once bodies, and the template's
        # extrapolation reads inline blocks (see above): traced whole. An explicit option wins.
        options = {"compile_blocks_once": budgeted or packed, **options}
        repeated = None  # planned from a template: (container, the model's blocks)
        if template and not packed and _has_blocks(built, spec.container, TEMPLATE_BLOCKS):
            # The template traces the first blocks of a model of its own, unsharded; the whole
            # model, sharded above, is traced if it refuses.
            trimmed = _prepared(spec, setup, mesh)
            repeated = (spec.container, len(trimmed.get_submodule(spec.container)))
            try:
                plan = plan_from_template(
                    trimmed, mesh, None, options, container=spec.container,
                    trace=lambda m: trace_step(m, mesh, spec, setup, tokens, targets, options))
                built = trimmed
            except TemplateRefused as exc:
                refused, repeated = str(exc), None
                _torch.dynamo_reset()
        if plan is None:
            trace_step(built, mesh, spec, setup, tokens, targets, options, sharded=True)
            plan = explain(built)
            if refused:
                plan.notes.append(f"traced whole, not from a template: {refused}")
        if seq_note:
            plan.notes.append(seq_note)
        elapsed = time.perf_counter() - start
        spec_of_step = dataclasses.replace(
            optimizer_spec(built, setup, repeated),
            state_factor=options["optimizer_state_factor"],
            temp_factor=options["optimizer_temp_factor"],
            impl=options.get("optimizer_impl", "auto"))
    return PlannedModel(plan, elapsed, spec_of_step)


def _has_blocks(model: nn.Module, container: str | None, more_than: int) -> bool:
    """Whether ``model.<container>`` is an ``nn.ModuleList`` of more than ``more_than`` blocks."""
    if not container:
        return False
    try:
        layers = model.get_submodule(container)
    except AttributeError:
        return False
    return isinstance(layers, nn.ModuleList) and len(layers) > more_than


# -------------------------------------------------------------------------------- answers


@dataclass
class Capacity:
    """What the plan predicts for one step, per rank."""

    world: int
    tokens_per_step: float  # per GPU
    step_s: float
    exposed_comm_s: float
    model_flops: float  # forward + backward FLOPs of the model (no recomputation), per rank
    peak_flops: float
    peak_bytes: float
    capacity_bytes: float | None
    peak_terms: dict[str, float]
    # The whole step (shardc.planning.step): None for a plan's graphs alone (``step_s``).
    step: StepPrediction | None = None
    graphs_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s else 0.0

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_s * self.peak_flops) if self.step_s else 0.0

    def largest_terms(self, n: int = 4) -> list[tuple[str, float]]:
        terms = sorted(self.peak_terms.items(), key=lambda kv: -kv[1])
        return [(name, b) for name, b in terms[:n] if b > 0]

    def verdict(self) -> str:
        peak, cap = fmt_bytes(self.peak_bytes), self.capacity_bytes
        if cap is None:
            return f"peak {peak} (device memory unknown: give --device)"
        if self.peak_bytes <= cap:
            return f"fits: {peak} of {fmt_bytes(cap)}"
        terms = ", ".join(f"{name} {fmt_bytes(b)}" for name, b in self.largest_terms())
        return (f"does not fit by {fmt_bytes(self.peak_bytes - cap)} (peak {peak} of "
                f"{fmt_bytes(cap)}); largest terms: {terms}")


def device_capacity(device: str | None) -> float | None:
    """Bytes of device memory for ``--device``: ``h100``, ``h200`` or a number of GiB."""
    if device is None:
        return None
    if device.lower() in DEVICES_GIB:
        return DEVICES_GIB[device.lower()] * GIB
    try:
        gib = float(device)
    except ValueError:
        raise ModelSpecError(f"--device {device!r}: use {', '.join(DEVICES_GIB)} or a number of "
                             "GiB (e.g. --device 80)") from None
    if gib <= 0:
        raise ModelSpecError(f"--device {device!r}: the memory must be positive")
    return gib * GIB


def _forward_part(op) -> float:
    """An op's forward FLOPs: all of them, but a third of the fused cross-entropy's, which
    computes the logits' gradients in the forward too (``shardc.ops.fused_ce``)."""
    return op.flops / 3.0 if "fused_linear_cross_entropy" in op.target else op.flops


def capacity(plan: Plan, batch: int, seq: int, peak_flops: float,
             capacity_bytes: float | None, step: StepPrediction | None = None) -> Capacity:
    """The answers for one plan; ``batch`` sequences of ``seq`` tokens per data-parallel rank
    (a tensor-parallel group shares them, so a GPU's share is ``1 / tp`` of them). With
    ``step`` (:func:`whole_step`) the step time is the whole step's (forward, backward,
    optimizer, zero_grad) back to back (``StepPrediction.steady_s``), else the plan's graphs
    alone; so is the exposed communication
    (``StepPrediction.exposed_comm_s``, else the plan's ``exposed_comm_s``)."""
    p = plan.predicted
    forward_flops = sum(_forward_part(op) for op in plan.graphs.get("forward", ()))
    peak = plan.memory_by_category.get("peak", {})
    tp = max(1, plan.tp_size)
    world = plan.world_size * max(1, plan.replicate_size) * tp
    graphs_s = p.step_time_s or 0.0
    return Capacity(world=world, tokens_per_step=batch * seq / tp,
                    # Training's step: back to back (the host running ahead).
                    step_s=step.steady_s if step is not None else graphs_s,
                    # The step's (what communication adds to it) where the step is known.
                    exposed_comm_s=step.exposed_comm_s if step is not None
                    else p.exposed_comm_s or 0.0,
                    model_flops=3.0 * forward_flops, peak_flops=peak_flops,
                    peak_bytes=p.peak_bytes or 0.0, capacity_bytes=capacity_bytes,
                    peak_terms={k: float(v) for k, v in peak.get("bytes", {}).items()},
                    step=step, graphs_s=graphs_s)


def whole_step(planned: PlannedModel, profile: ClusterProfile, cudagraphs: bool = False
               ) -> StepPrediction:
    """The whole step of a planned model: its graphs, then the optimizer and zero_grad
    (:func:`shardc.planning.step.predict_step`, as ``benchmarks/predict_step.py`` predicts the
    measured step); ``cudagraphs``: its graphs replayed as CUDA graphs."""
    return predict_step([planned.plan], profile, planned.optimizer, cudagraphs=cudagraphs)


def capacity_dict(cap: Capacity) -> dict[str, Any]:
    """The answers as JSON-ready data (``--json``)."""
    out: dict[str, Any] = {
        "world": cap.world, "step_s": cap.step_s, "graphs_s": cap.graphs_s,
        "tokens_per_s_per_gpu": cap.tokens_per_s, "mfu": cap.mfu,
        "exposed_comm_s": cap.exposed_comm_s, "peak_bytes": cap.peak_bytes,
        "capacity_bytes": cap.capacity_bytes,
        "fits": None if cap.capacity_bytes is None else cap.peak_bytes <= cap.capacity_bytes,
        "peak_terms": dict(cap.peak_terms)}
    if cap.step is not None:
        out["step"] = cap.step.to_dict()
    return out


def step_lines(step: StepPrediction) -> list[str]:
    """The whole step, phase by phase, with what bounds each."""
    lines = [f"step phases (optimizer: {step.optimizer}):"]
    for ph in step.phases:
        waits = []
        if ph.host_wait_s >= 5e-5:
            waits.append(f"device waits {ph.host_wait_s * 1e3:.1f} ms for the host")
        if ph.comm_wait_s >= 5e-5:
            waits.append(f"{ph.comm_wait_s * 1e3:.1f} ms for communication")
        where = "" if ph.runs_on == "device" else ", runs on the host"
        bound = "hidden under queued device work" if ph.bound == "hidden" else \
            f"{ph.bound}-bound"
        lines.append(f"  {ph.name:<10} {ph.seconds * 1e3:9.1f} ms  {bound}{where}"
                     + (f" ({'; '.join(waits)})" if waits else ""))
    if step.optimizer_host_s:
        lines.append(f"  host optimizer compute {step.optimizer_host_s * 1e3:.1f} ms "
                     "(overlapped with the backward where it can be)" if "overlapped"
                     in step.optimizer else
                     f"  host optimizer compute {step.optimizer_host_s * 1e3:.1f} ms")
    return lines


# ------------------------------------------------------------------------ cluster profile


def cluster_option(profile: str | None, rates: dict[str, float]) -> dict | None:
    """``ShardcOptions.cluster`` for ``--profile`` (a preset name or a profile file written by
    ``python -m shardc calibrate``) and the rates given on the command line (``ClusterSpec``
    fields, which replace the profile's tables by one flat rate each)."""
    if profile is None:
        return dict(rates) if rates else None
    return {"profile": profile, **rates}


def cluster_profile(cluster: dict | None) -> ClusterProfile:
    """The cluster profile the plan's cost model uses for ``cluster`` (the backend resolves it
    the same way; without a GPU and without ``--profile``: the ``h100`` preset)."""
    try:
        return resolve_profile(cluster)
    except (ProfileError, TypeError) as exc:
        raise ModelSpecError(f"--profile/rates: {exc}") from None


def peak_flops_of(profile: ClusterProfile, precision: str) -> float:
    """The dense matmul rate MFU is measured against: the profile's rate for a large (8192^3)
    matmul in the compute dtype (bf16, or fp32 for ``precision="fp32"``)."""
    return profile.matmul_rate(8192, 8192, 8192, "bfloat16" if precision == "bf16"
                               else "float32")


def profile_text(profile: ClusterProfile) -> str:
    """One line naming the profile and whether it was measured."""
    how = "measured" if profile.source == "measured" else "estimated, not measured"
    return f"cluster profile: {profile.name} ({profile.device}, {how}, {profile.date})"


def peak_terms_text(plan: Plan, limit: int = 6) -> list[str]:
    """Lines naming what is live at the predicted peak (by category, then the largest values)."""
    peak = plan.memory_by_category.get("peak")
    if not peak:
        return []
    where = peak["graph"] + (f" position {peak['position']}" if peak["graph"] != "optimizer step"
                             else "")
    cats = sorted(peak["bytes"].items(), key=lambda kv: -kv[1])
    lines = [f"peak at the {where}: " + ", ".join(
        f"{c} {fmt_bytes(b)}" for c, b in cats if b > 0)]
    if peak.get("largest"):
        lines.append("  largest values there: " + ", ".join(
            f"{name} ({cat}) {fmt_bytes(b)}" for name, cat, b in peak["largest"][:limit]))
    return lines
