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

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardc import _torch
from shardc.models.llama import LlamaConfig
from shardc.planning.plan import Plan
from shardc.planning.profile import ClusterProfile, ProfileError, resolve_profile
from shardc.tools.model_spec import ModelSpec, ModelSpecError, llama_model

GIB = 2**30


def fmt_bytes(n: float) -> str:
    """``31.2 GiB``, ``12.0 MiB``: GiB from 0.1 GiB up, else the largest unit below."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size * (0.1 if unit == "GiB" else 1):
            return f"{n / size:.{1 if unit != 'GiB' or abs(n) >= GIB else 2}f} {unit}"
    return f"{int(n)} B"
# Device memory as CUDA reports it (``torch.cuda.get_device_properties(0).total_memory``).
DEVICES_GIB = {"h100": 79.11, "h200": 139.81}


@dataclass(frozen=True)
class PlanSetup:
    """How the step is trained: ``precision`` ``"fp32"`` or ``"bf16"`` (bf16 parameters for
    compute, fp32 gradient reduction, fp32 master shards); ``checkpointing``: recompute every
    block's activations in the backward; ``fp8``: gather ``nn.Linear`` weights in FP8
    (``shardc.Float8Policy``); ``shard_size``: HSDP, sharding within groups of this many ranks
    and replicating across the world size / ``shard_size`` groups (``None``: FSDP over all);
    ``inductor``: plan as Inductor compiles (see the module docstring; the command line's
    default), else as the FX backend runs the graphs; ``tp``: tensor-parallel degree (FSDP over
    ``world / tp`` data-parallel ranks of a ``("dp", "tp")`` mesh; models whose spec can
    ``parallelize``: shardc's Llama)."""

    precision: str = "fp32"
    checkpointing: bool = False
    fp8: bool = False
    shard_size: int | None = None
    inductor: bool = False
    tp: int = 1

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16"):
            raise ModelSpecError(f"precision must be 'fp32' or 'bf16', got {self.precision!r}")
        if self.tp < 1:
            raise ModelSpecError(f"--tp {self.tp}: the tensor-parallel degree must be >= 1")

    def shard_kwargs(self) -> dict[str, Any]:
        import shardc

        kwargs: dict[str, Any] = {}
        if self.precision == "bf16":
            kwargs["mp_policy"] = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                              reduce_dtype=torch.float32)
        if self.fp8:
            kwargs["fp8"] = shardc.Float8Policy()
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


def trace_step(model: nn.Module, mesh, spec: ModelSpec, setup: PlanSetup, tokens: torch.Tensor,
               options: dict) -> None:
    """Shard ``model`` over ``mesh``, compile one step of ``spec.loss`` with the shardc backend
    and run it until the region is planned (nothing is compiled or run)."""
    import shardc
    from shardc.compile.pipeline import PlannedOnly, plan_only

    try:
        shardc.shard(model, mesh, **setup.shard_kwargs())
    except NotImplementedError as exc:
        raise ModelSpecError(f"cannot plan this setup: {exc}") from None
    _buffers_to(model, tokens.device.type)
    step = torch.compile(lambda t: spec.loss(model, t), backend=shardc.backend(**options))
    with plan_only():
        try:
            step(tokens)
        except Exception as exc:  # torch.compile wraps what the backend raises
            if not isinstance(_torch.backend_failure_cause(exc), PlannedOnly):
                raise
            return
    raise RuntimeError("shardc planner: the step compiled without a shardc region (no sharded "
                       "parameter read, or no backward)")


def plan_model(model: LlamaConfig | ModelSpec, world: int, batch: int, seq: int, options: dict,
               *, template: bool = True, setup: PlanSetup | None = None) -> tuple[Plan, float]:
    """Plan one training step of ``model`` at ``world`` ranks with ``batch`` sequences of
    ``seq`` tokens per rank; returns (plan, seconds).

    With ``template`` and more blocks than a template traces, the plan is made from a trace of
    the first blocks (``shardc.tools.template``); if the blocks or the traced graphs do not
    repeat, the whole model is traced (the plan's notes say why). ``seconds`` covers everything
    from building the model on the meta device to the finished plan.
    """
    from shardc.tools.attention import AttentionAsKernel
    from shardc.tools.explain import explain
    from shardc.tools.fake_world import fake_world
    from shardc.tools.template import TEMPLATE_BLOCKS, TemplateRefused, plan_from_template

    spec = model if isinstance(model, ModelSpec) else llama_model(model)
    setup = setup or PlanSetup()
    # Blocks inline: a plan with compiled-once bodies predicts the same peak and step
    # (tests/test_memory.py), and the template's extrapolation reads inline blocks' nodes.
    options = {"compile_blocks_once": False,
               **dict(inductor=setup.inductor, check_plan_consistency=False, **options)}
    if options.get("optimizer_offload", "auto") == "auto":
        # The plan is the GPU run's, made on the CPU: the peak budget may put the optimizer's
        # state on the host as it would there ("simulate": the lever on a CPU mesh too).
        options["optimizer_offload"] = "simulate"
    device = "cpu"  # see the module docstring: meta tensors lose the loss's gradient
    with fake_world(world), AttentionAsKernel():
        mesh = _mesh(world, setup, device)
        tokens = torch.zeros(batch, seq, dtype=torch.long, device=device)
        start = time.perf_counter()
        plan, refused = None, None
        built = _prepared(spec, setup, mesh)
        if template and _has_blocks(built, spec.container, TEMPLATE_BLOCKS):
            try:
                plan = plan_from_template(
                    built, mesh, None, options, container=spec.container,
                    trace=lambda m: trace_step(m, mesh, spec, setup, tokens, options))
            except TemplateRefused as exc:
                refused = str(exc)
                _torch.dynamo_reset()
            built = _prepared(spec, setup, mesh) if plan is None else built
        if plan is None:
            trace_step(built, mesh, spec, setup, tokens, options)
            plan = explain(built)
            if refused:
                plan.notes.append(f"traced whole, not from a template: {refused}")
        elapsed = time.perf_counter() - start
    _torch.dynamo_reset()
    return plan, elapsed


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


def capacity(plan: Plan, batch: int, seq: int, peak_flops: float,
             capacity_bytes: float | None) -> Capacity:
    """The answers for one plan; ``batch`` sequences of ``seq`` tokens per data-parallel rank
    (a tensor-parallel group shares them, so a GPU's share is ``1 / tp`` of them)."""
    p = plan.predicted
    forward_flops = sum(op.flops for op in plan.graphs.get("forward", ()))
    peak = plan.memory_by_category.get("peak", {})
    tp = max(1, plan.tp_size)
    world = plan.world_size * max(1, plan.replicate_size) * tp
    return Capacity(world=world, tokens_per_step=batch * seq / tp,
                    step_s=p.step_time_s or 0.0, exposed_comm_s=p.exposed_comm_s or 0.0,
                    model_flops=3.0 * forward_flops, peak_flops=peak_flops,
                    peak_bytes=p.peak_bytes or 0.0, capacity_bytes=capacity_bytes,
                    peak_terms={k: float(v) for k, v in peak.get("bytes", {}).items()})


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
