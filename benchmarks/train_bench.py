"""Training-step benchmark: shardc against FSDP2, FSDP2 + compiled blocks, SimpleFSDP and a bound.

Launch with torchrun, one process per GPU::

    torchrun --nproc-per-node 2 benchmarks/train_bench.py --model 1b --out docs/bench
    torchrun --nproc-per-node 2 benchmarks/train_bench.py --device cpu --tiny   # gloo, CPU

One command runs every mode on the same model, data and settings and writes a markdown table and
a JSON file (with the exact command, GPU name, torch version and date) under ``--out``.

Modes:

``fsdp2``
    ``torch.distributed.fsdp.fully_shard`` per transformer block plus the root, eager,
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, fp32 master parameters.
``fsdp2-compile``
    The same with every block wrapped by ``torch.compile(block)`` before sharding (torchtitan's
    way): FSDP's hooks stay eager, the block's compute is compiled by Inductor.
``simplefsdp``
    Parameters are ``Shard(0)`` DTensors read through a parametrization that redistributes them
    to ``Replicate()`` (all-gather in bf16) and returns ``to_local(grad_placements=[Partial])`` so
    that the backward reduce-scatters (in fp32); gathered parameters are tagged for recompute in
    the joint graph (reshard after forward); the whole model is compiled by Inductor with its
    overlap scheduler and collective bucketing turned on
    (``torch._inductor.config.aten_distributed_optimizations``).
``shardc``
    ``shardc.shard(model, mesh, mp_policy=...)`` then ``torch.compile(model, backend="shardc")``
    with the default plan.
``bound``
    The same model compiled by Inductor with replicated parameters (fp32 master, bf16 compute
    through a cast in the parameter read, as shardc does) and no parameter communication at all
    (not even a gradient all-reduce): the step time perfect overlap would reach.

Measured per mode: median tokens/s per GPU over the timed steps (CUDA events), MFU
(``6 * params * tokens/s / peak``), peak memory allocated and reserved over the timed steps,
compile time (wall time of the first step), and exposed communication from a short
``torch.profiler`` trace (time in which NCCL kernels run and no other kernel does). For shardc
also the plan's predicted peak and exposed communication.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import gzip
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Noise in every distributed compile of torch 2.11 and in every profile; nothing to act on.
warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*")
warnings.filterwarnings("ignore", message=".*Profiler clears events.*")

# Runnable as a plain script from a checkout: make the repository importable.
_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import shardc  # noqa: E402

try:  # run as a script (benchmarks/ on sys.path) or imported as benchmarks.train_bench
    import bench_mesh  # noqa: E402
except ImportError:
    from benchmarks import bench_mesh  # noqa: E402
from shardc.models.llama import LlamaConfig, Transformer, llama_loss  # noqa: E402

MODES: tuple[str, ...] = ("fsdp2", "fsdp2-compile", "simplefsdp", "shardc", "bound")
# Diagnostic variants, run only when named in --modes.
EXTRA_MODES: tuple[str, ...] = ("shardc-keeporder", "shardc-pool")
SHARDED_BASELINES: tuple[str, ...] = ("fsdp2", "fsdp2-compile", "simplefsdp")
DEFAULT_BATCH: dict[str, int] = {"1b": 4, "wide": 2}
GIB = float(1 << 30)


# ----------------------------------------------------------------------------------------------
# Models and data


def model_config(name: str, seq: int, tiny: bool, n_layers: int | None = None) -> LlamaConfig:
    """The benchmark's model configurations (``tiny`` shrinks them for CPU and smoke runs;
    ``n_layers`` overrides the depth)."""
    if tiny:
        dim, layers, heads, vocab = {"1b": (256, 2, 4, 512), "wide": (384, 2, 6, 512)}[name]
    elif name == "1b":
        dim, layers, heads, vocab = 2048, 16, 16, 32000
    elif name == "wide":
        dim, layers, heads, vocab = 4096, 8, 32, 32000
    else:
        raise ValueError(f"unknown model {name!r}")
    return LlamaConfig(vocab_size=vocab, dim=dim, n_layers=n_layers or layers, n_heads=heads,
                       max_seq_len=seq)


def build_model(cfg: LlamaConfig, device: torch.device) -> Transformer:
    """The same initial weights on every rank and in every mode (seeded, built on ``device``)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg)
    model.init_weights(buffer_device=device)
    return model


def synthetic_batches(
    n: int, batch: int, seq: int, vocab: int, rank: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (tokens, targets) pairs of uniform random tokens; the same for every mode."""
    g = torch.Generator().manual_seed(1234 + rank)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((t[:, :-1].to(device), t[:, 1:].to(device)))
    return out


def _swap_param_reads(module: nn.Module, read: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Make every ``module.<param>`` attribute read return ``read(param)`` (class swap, in place).

    ``module.parameters()`` and the state dict still see the stored parameters (they go through
    ``_parameters``), so the optimizer steps the masters.
    """
    for sub in module.modules():
        names = [n for n, p in sub._parameters.items() if p is not None]
        if not names:
            continue
        props = {
            n: property(lambda self, n=n: read(self._parameters[n])) for n in names
        }
        cls = type(sub)
        sub.__class__ = type(f"Bench{cls.__name__}", (cls,), props)


# ----------------------------------------------------------------------------------------------
# Modes


@dataclass
class Setup:
    """What a mode hands the training loop."""

    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens, targets) -> loss
    params: list[nn.Parameter]
    keep: list[Any] = field(default_factory=list)  # objects to drop after the mode
    info: dict[str, Any] = field(default_factory=dict)
    after_first_step: Callable[[], dict[str, Any]] | None = None


def model_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return llama_loss(model(tokens), targets)


def compiled_loss(model: nn.Module, **compile_kwargs) -> Callable:
    """The model's forward and its loss compiled as one region (``--loss-in-graph``, the
    default) or the compiled model with the loss computed eagerly after it."""
    if LOSS_IN_GRAPH:
        return torch.compile(functools.partial(model_loss, model), **compile_kwargs)
    return functools.partial(model_loss, torch.compile(model, **compile_kwargs))


# Set from --loss-in-graph in main(); every whole-model compiled mode follows it.
LOSS_IN_GRAPH = True


def setup_fsdp2(model: Transformer, mesh, compile_blocks: bool) -> Setup:
    """FSDP2: ``fully_shard`` per block and the root; blocks optionally ``torch.compile``d."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(list(model.layers)):
        if compile_blocks:
            block = torch.compile(block)
            model.layers.register_module(str(i), block)
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    info = {"mp_policy": "param_dtype=bf16, reduce_dtype=fp32",
            "compile": "torch.compile(block) per block, Inductor" if compile_blocks else "eager"}
    info["loss"] = "eager, after the model"
    return Setup(functools.partial(model_loss, model), list(model.parameters()), [model], info)


def _recompute_gathers_pass(gm: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
    """Joint-graph pass: tag each parameter all-gather (and the casts and views around it) as
    must-recompute, so the partitioner regathers in the backward instead of saving the gathered
    parameter (reshard after forward, like FSDP2 and shardc)."""
    from torch.utils.checkpoint import CheckpointPolicy

    c10d = torch.ops._c10d_functional
    gather, wait = c10d.all_gather_into_tensor.default, c10d.wait_tensor.default

    def tag(node: torch.fx.Node) -> None:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = 1 << 20  # its own region: never a boundary with user AC

    def from_input(node: torch.fx.Node) -> list[torch.fx.Node] | None:
        chain = []
        while node.op != "placeholder":
            if node.op != "call_function" or len(node.all_input_nodes) != 1:
                return None
            chain.append(node)
            node = node.all_input_nodes[0]
        return chain

    tagged = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target != gather:
            continue
        chain = from_input(node.all_input_nodes[0])
        if chain is None:
            continue
        for n in [*chain, node]:
            tag(n)
        frontier = [u for u in node.users if u.target == wait]
        while frontier:
            n = frontier.pop()
            tag(n)
            if len(n.users) == 1:
                user = next(iter(n.users))
                target = getattr(user, "target", None)
                if isinstance(target, torch._ops.OpOverload) and target.is_view:
                    frontier.append(user)
        tagged += 1
    gm.recompile()
    _SIMPLEFSDP_STATS["tagged_gathers"] = _SIMPLEFSDP_STATS.get("tagged_gathers", 0) + tagged
    return gm


_SIMPLEFSDP_STATS: dict[str, int] = {}

SIMPLEFSDP_INDUCTOR_CONFIG: dict[str, Any] = {
    # Inductor's own overlap scheduler with overlap-preserving bucketing of the all-gathers and
    # reduce-scatters (the recommended torch 2.11 path; it supersedes the older
    # reorder_for_compute_comm_overlap passes and bucket_*_fx flags, which stay off here).
    "aten_distributed_optimizations.enable_overlap_scheduling": True,
    "aten_distributed_optimizations.collective_bucketing": True,
    "aten_distributed_optimizations.insert_overlap_deps": True,
    "reorder_for_compute_comm_overlap": False,
    # As torchtitan's SimpleFSDP sets them with this scheduler.
    "reorder_for_peak_memory": False,
    "allow_buffer_reuse": False,
}


def simplefsdp_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]):
    """Inductor with the overlap/bucketing config and the reshard-after-forward joint pass,
    patched only while this graph compiles (other modes see the default config)."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    patches = dict(SIMPLEFSDP_INDUCTOR_CONFIG)
    if not torch.cuda.is_available():
        # The overlap scheduler's cost model reads the GPU's bandwidth (through Triton): on CPU
        # (functional runs only) the graph is compiled without it.
        patches["aten_distributed_optimizations.enable_overlap_scheduling"] = False
    with functorch_config.patch(joint_custom_pass=_recompute_gathers_pass):
        return compile_fx(gm, example_inputs, config_patches=patches)


def setup_simplefsdp(model: Transformer, mesh) -> Setup:
    """SimpleFSDP written from DTensor's public API: Shard(0) parameters, gathered by
    ``redistribute`` in a parametrization, whole model compiled."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    for sub in model.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = nn.Parameter(
                    distribute_tensor(p.detach(), mesh, [Shard(0)]), requires_grad=p.requires_grad
                )
    # Gradients are averaged over ranks like FSDP2 and shardc do; gloo has no AVG reduction.
    reduce_op = "avg" if dist.get_backend() == "nccl" else "sum"
    placements, grad_placements = [Replicate()], [Partial(reduce_op)]

    def gather(p: torch.Tensor) -> torch.Tensor:
        if not isinstance(p, DTensor):
            return p
        full = p.redistribute(placements=placements, forward_dtype=torch.bfloat16,
                              backward_dtype=torch.float32)
        return full.to_local(grad_placements=grad_placements)

    params = list(model.parameters())
    _swap_param_reads(model, gather)
    compiled = compiled_loss(model, backend=simplefsdp_backend)
    config = dict(SIMPLEFSDP_INDUCTOR_CONFIG)
    if not torch.cuda.is_available():
        config["aten_distributed_optimizations.enable_overlap_scheduling"] = False
    info = {"inductor_config": {k: str(v) for k, v in config.items()},
            "grad_reduce_op": reduce_op, "reshard_after_forward": "joint-graph recompute tags"}

    def stats() -> dict[str, Any]:
        return {"tagged_gathers": _SIMPLEFSDP_STATS.get("tagged_gathers", 0)}

    return Setup(compiled, params, [model, compiled], info, stats)


def _shardc_backend_name() -> str:
    """``"shardc"``, registering it if the package is importable but not installed (no entry
    point, e.g. ``PYTHONPATH=$PWD`` on a fresh machine)."""
    from torch._dynamo.backends.registry import list_backends, register_backend

    if "shardc" not in list_backends(exclude_tags=()):
        register_backend(compiler_fn=shardc.shardc_backend, name="shardc")
    return "shardc"


def setup_shardc(model: Transformer, mesh, **options: Any) -> Setup:
    """shardc: shard in place, compile with the shardc backend and its default plan (or these
    backend options)."""
    mp = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shardc.shard(model, mesh, mp_policy=mp)
    backend = shardc.backend(**options) if options else _shardc_backend_name()
    compiled = compiled_loss(model, backend=backend)

    def plan_summary() -> dict[str, Any]:
        plans = shardc.explain_all(model)
        regions = []
        for plan in plans:
            pred = dict(plan.predicted)
            regions.append({
                "region": plan.region,
                "buckets": len(plan.buckets),
                "collectives": len(plan.collectives),
                "predicted": pred,
                "hash": plan.hash(),
            })
        out: dict[str, Any] = {"regions": regions, "n_regions": len(plans)}
        if plans and all("peak_bytes" in p.predicted for p in plans):
            out["predicted_peak_bytes"] = max(p.predicted["peak_bytes"] for p in plans)
            out["predicted_peak_kind"] = "peak_bytes (whole step)"
        elif plans:
            out["predicted_peak_bytes"] = max(
                p.predicted.get("peak_comm_buffer_bytes", 0) for p in plans
            )
            out["predicted_peak_kind"] = "peak_comm_buffer_bytes (communication buffers only)"
        for key in ("exposed_comm_s", "step_time_s", "comm_time_s"):
            if plans:
                out[f"predicted_{key}"] = sum(p.predicted.get(key, 0.0) for p in plans)
        out["_plans"] = plans  # not serialized: dumped separately by rank 0
        return out

    return Setup(compiled, list(model.parameters()), [model, compiled],
                 {"options": "default (ShardcOptions())"}, plan_summary)


def setup_bound(model: Transformer) -> Setup:
    """Replicated fp32 parameters read as bf16, compiled by Inductor; no communication."""
    params = list(model.parameters())
    _swap_param_reads(model, lambda p: p.to(torch.bfloat16))
    compiled = compiled_loss(model)
    return Setup(compiled, params, [model, compiled],
                 {"compute": "fp32 master, bf16 cast in the parameter read, Inductor",
                  "communication": "none (no gradient all-reduce)"})


def mode_context(mode: str) -> contextlib.AbstractContextManager:
    """Config a mode runs under (compiles happen lazily, in the first forward and backward).

    ``shardc-keeporder``: shardc with Inductor's ``reorder_for_peak_memory`` off. With it on (the
    default), Inductor's scheduler moves each of shardc's all-gathers (and reduce-scatters) right
    next to its wait, undoing the plan's prefetch; this variant measures the plan as planned.
    """
    if mode == "shardc-keeporder":
        return torch._inductor.config.patch(reorder_for_peak_memory=False)
    return contextlib.nullcontext()


def setup_mode(mode: str, cfg: LlamaConfig, device: torch.device, mesh) -> Setup:
    model = build_model(cfg, device)
    if mode == "bound":
        return setup_bound(model)
    if mode == "simplefsdp" and mesh.ndim != 1:
        raise NotImplementedError("simplefsdp mode: 1-D meshes only (no --mesh / --tp)")
    model = bench_mesh.parallelize_llama(model, mesh)  # --tp: tensor-parallel blocks first
    if mode == "fsdp2":
        return setup_fsdp2(model, bench_mesh.dp_mesh(mesh), compile_blocks=False)
    if mode == "fsdp2-compile":
        return setup_fsdp2(model, bench_mesh.dp_mesh(mesh), compile_blocks=True)
    if mode == "simplefsdp":
        return setup_simplefsdp(model, mesh)
    if mode == "shardc-pool":
        setup = setup_shardc(model, mesh, comm_pool=True)
        setup.info["options"] = "comm_pool=True (static communication pool under Inductor)"
        return setup
    if mode in ("shardc", "shardc-keeporder"):
        setup = setup_shardc(model, mesh)
        if mode == "shardc-keeporder":
            setup.info["inductor_config"] = {"reorder_for_peak_memory": "False"}
        return setup
    raise ValueError(f"unknown mode {mode!r}")


# ----------------------------------------------------------------------------------------------
# Measurement helpers


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of half-open intervals ``(start, end)``."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def measure(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length of disjoint intervals."""
    return sum(end - start for start, end in intervals)


def intersection_measure(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]
                         ) -> float:
    """Length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def is_comm_kernel(name: str) -> bool:
    return "nccl" in name.lower()


def kernel_breakdown(events: Iterable[dict[str, Any]], steps: int) -> dict[str, float]:
    """Per-step GPU time split from Chrome-trace kernel events (``ts``/``dur`` in us).

    ``exposed_comm_ms``: union of NCCL kernel intervals minus its intersection with the union of
    all other kernels; ``comm_ms``: the NCCL union; ``compute_ms``: the non-NCCL union;
    ``idle_ms``: time in the profiled window with no kernel running.
    """
    comm, compute = [], []
    lo, hi = math.inf, -math.inf
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") != "kernel":
            continue
        start, end = float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0))
        lo, hi = min(lo, start), max(hi, end)
        (comm if is_comm_kernel(str(ev.get("name", ""))) else compute).append((start, end))
    if not comm and not compute:
        return {}
    comm_u, compute_u = merge_intervals(comm), merge_intervals(compute)
    overlap = intersection_measure(comm_u, compute_u)
    busy = measure(merge_intervals(comm + compute))
    per = 1e-3 / max(steps, 1)  # us -> ms per step
    return {
        "exposed_comm_ms": (measure(comm_u) - overlap) * per,
        "comm_ms": measure(comm_u) * per,
        "overlapped_comm_ms": overlap * per,
        "compute_ms": measure(compute_u) * per,
        "idle_ms": ((hi - lo) - busy) * per,
        "window_ms": (hi - lo) * per,
        "n_comm_kernels": len(comm) / max(steps, 1),
        "n_compute_kernels": len(compute) / max(steps, 1),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gather_objects(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------------------------
# One mode


@dataclass
class RunSettings:
    """Global settings shared by every mode of one run."""

    model: str
    cfg: LlamaConfig
    batch: int
    seq: int
    steps: int
    warmup: int
    profile_steps: int
    lr: float
    peak_flops: float
    device: torch.device
    memory_snapshot: bool = False


def train_step(setup: Setup, opt: torch.optim.Optimizer, tokens: torch.Tensor,
               targets: torch.Tensor) -> torch.Tensor:
    loss = setup.loss(tokens, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def run_mode(mode: str, s: RunSettings, mesh, rank: int, log: Callable[[str], None]
             ) -> dict[str, Any]:
    """Build, warm up, time and profile one mode on this rank; returns this rank's metrics."""
    device = s.device
    res: dict[str, Any] = {}
    t0 = time.perf_counter()
    data = synthetic_batches(s.warmup + s.steps + s.profile_steps + 1, s.batch, s.seq,
                             s.cfg.vocab_size, bench_mesh.data_rank(mesh, rank), device)
    setup = setup_mode(mode, s.cfg, device, mesh)
    opt = torch.optim.AdamW(setup.params, lr=s.lr)
    res["setup_s"] = time.perf_counter() - t0
    res.update(setup.info)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    it = iter(data)

    # Warm-up: the first step compiles (compiled modes) and initializes lazily (all modes).
    warm_times, losses = [], []
    for i in range(s.warmup):
        tokens, targets = next(it)
        sync(device)
        t = time.perf_counter()
        loss = train_step(setup, opt, tokens, targets)
        sync(device)
        warm_times.append(time.perf_counter() - t)
        losses.append(float(loss))
        if i == 0:
            log(f"    {mode}: first step {warm_times[0]:.1f}s, loss {losses[0]:.4f}")
            if setup.after_first_step is not None:
                res.update(setup.after_first_step())
    res["warmup_step_s"] = warm_times
    res["compile_s"] = warm_times[0] if warm_times else None

    # Timed steps.
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_ms = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(s.steps)]
        for start, end in events:
            tokens, targets = next(it)
            start.record()
            loss = train_step(setup, opt, tokens, targets)
            end.record()
            losses.append(loss)
        torch.cuda.synchronize(device)
        step_ms = [a.elapsed_time(b) for a, b in events]
        res["peak_alloc_bytes"] = torch.cuda.max_memory_allocated(device)
        res["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    else:
        for _ in range(s.steps):
            tokens, targets = next(it)
            t = time.perf_counter()
            loss = train_step(setup, opt, tokens, targets)
            step_ms.append((time.perf_counter() - t) * 1e3)
            losses.append(loss)
    losses = [float(x) for x in losses]
    res["step_ms"] = step_ms
    res["losses"] = losses

    if s.memory_snapshot and device.type == "cuda" and mode.startswith("shardc"):
        from memory_peak import record_and_summarize

        tokens, targets = next(it)
        res["memory_at_peak"] = record_and_summarize(
            device.index or 0, functools.partial(train_step, setup, opt, tokens, targets))

    # A short profile: kernel intervals of a few steps.
    if s.profile_steps > 0:
        res.update(profile_steps(setup, opt, it, s))
    res["total_s"] = time.perf_counter() - t0
    del setup, opt, data, it, loss
    return res


def profile_steps(setup: Setup, opt: torch.optim.Optimizer, it, s: RunSettings
                  ) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if s.device.type == "cuda" else [ProfilerActivity.CPU]
    sync(s.device)
    with profile(activities=activities) as prof:
        for _ in range(s.profile_steps):
            tokens, targets = next(it)
            train_step(setup, opt, tokens, targets)
        sync(s.device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return {"profile": kernel_breakdown(events, s.profile_steps)}


def free_memory(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def aggregate(mode: str, per_rank: list[dict[str, Any]], s: RunSettings) -> dict[str, Any]:
    """Combine the ranks' metrics: step time and memory take the worst rank, profile the mean."""
    errors = [r["error"] for r in per_rank if r.get("error")]
    out: dict[str, Any] = {"mode": mode}
    if errors:
        out["status"] = "error"
        out["error"] = errors[0]
        out["traceback"] = next(r.get("traceback") for r in per_rank if r.get("error"))
        out["ranks_failed"] = [i for i, r in enumerate(per_rank) if r.get("error")]
        return out
    r0 = per_rank[0]
    tokens = s.batch * s.seq
    medians = [statistics.median(r["step_ms"]) for r in per_rank]
    step_ms = max(medians)
    tps = tokens / (step_ms / 1e3)
    out.update({
        "status": "ok",
        "step_ms_median": step_ms,
        "step_ms_min": min(min(r["step_ms"]) for r in per_rank),
        "step_ms_max": max(max(r["step_ms"]) for r in per_rank),
        "step_ms_rank_medians": medians,
        "timed_steps": len(r0["step_ms"]),
        "tokens_per_s_per_gpu": tps,
        "mfu": 6 * s.cfg.num_params() * tps / s.peak_flops,
        "compile_s": max(r["compile_s"] for r in per_rank) if r0.get("compile_s") else None,
        "warmup_step_s": r0["warmup_step_s"],
        "setup_s": max(r["setup_s"] for r in per_rank),
        "total_s": max(r["total_s"] for r in per_rank),
        "loss_first": statistics.fmean(r["losses"][0] for r in per_rank),
        "loss_last": statistics.fmean(r["losses"][-1] for r in per_rank),
    })
    if "peak_alloc_bytes" in r0:
        out["peak_alloc_bytes"] = max(r["peak_alloc_bytes"] for r in per_rank)
        out["peak_reserved_bytes"] = max(r["peak_reserved_bytes"] for r in per_rank)
        out["peak_alloc_bytes_per_rank"] = [r["peak_alloc_bytes"] for r in per_rank]
    profiles = [r.get("profile") or {} for r in per_rank]
    if all(profiles):
        out["profile"] = {k: statistics.fmean(p[k] for p in profiles) for k in profiles[0]}
        out["profile_per_rank"] = profiles
    for key in ("mp_policy", "compile", "inductor_config", "grad_reduce_op",
                "reshard_after_forward", "tagged_gathers", "options", "compute", "communication",
                "loss", "memory_at_peak"):
        if key in r0:
            out[key] = r0[key]
    if mode.startswith("shardc"):
        for key, value in r0.items():
            if key.startswith("predicted") or key in ("regions", "n_regions"):
                out[key] = value
    return out


# ----------------------------------------------------------------------------------------------
# Reporting


def _gib(x: float | None) -> str:
    return "–" if x is None else f"{x / GIB:.2f}"


def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def evaluate_goals(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's three goals, each with met / not met and the numbers."""
    goals = []
    sc, bound = results.get("shardc", {}), results.get("bound", {})
    ok = lambda r: r.get("status") == "ok"  # noqa: E731

    g: dict[str, Any] = {"goal": "shardc tokens/s >= 0.95 x bound"}
    if ok(sc) and ok(bound):
        ratio = sc["tokens_per_s_per_gpu"] / bound["tokens_per_s_per_gpu"]
        g.update(met=ratio >= 0.95, value=ratio,
                 detail=f"{sc['tokens_per_s_per_gpu']:,.0f} / {bound['tokens_per_s_per_gpu']:,.0f}"
                        f" = {ratio:.3f}x bound")
        if ratio < 0.95:
            need = 0.95 * bound["tokens_per_s_per_gpu"]
            gap_ms = sc["step_ms_median"] - bound["step_ms_median"]
            g["detail"] += (f"; missed by {0.95 - ratio:.3f} (needs {need:,.0f} tokens/s, i.e. "
                            f"{sc['step_ms_median'] - bound['step_ms_median'] / 0.95:.1f} ms/step "
                            f"less; shardc is {gap_ms:.1f} ms/step slower than bound)")
    else:
        g.update(met=None, detail="not evaluated (shardc or bound did not run)")
    goals.append(g)

    g = {"goal": "shardc peak alloc <= lowest of fsdp2 / fsdp2-compile / simplefsdp"}
    base = {m: results[m]["peak_alloc_bytes"] for m in SHARDED_BASELINES
            if ok(results.get(m, {})) and "peak_alloc_bytes" in results[m]}
    if ok(sc) and "peak_alloc_bytes" in sc and base:
        best = min(base, key=base.get)
        diff = sc["peak_alloc_bytes"] - base[best]
        amount = f"{diff / GIB:+.2f} GiB" if abs(diff) >= 0.1 * GIB else \
            f"{diff / (1 << 20):+.1f} MiB"
        g.update(met=diff <= 0, value=sc["peak_alloc_bytes"] / base[best],
                 detail=f"shardc {_gib(sc['peak_alloc_bytes'])} GiB vs {best} "
                        f"{_gib(base[best])} GiB ({amount}, {100 * diff / base[best]:+.3f}%)")
    else:
        g.update(met=None, detail="not evaluated (no peak memory for shardc or the baselines)")
    goals.append(g)

    g = {"goal": "shardc predicted peak within 5% of measured"}
    pred, kind = sc.get("predicted_peak_bytes"), sc.get("predicted_peak_kind", "")
    if ok(sc) and pred is not None and "peak_alloc_bytes" in sc:
        meas = sc["peak_alloc_bytes"]
        err = (pred - meas) / meas
        if kind.startswith("peak_bytes"):
            g.update(met=abs(err) <= 0.05, value=err,
                     detail=f"predicted {_gib(pred)} GiB vs measured {_gib(meas)} GiB "
                            f"({100 * err:+.1f}%)")
        else:
            g.update(met=False, value=err,
                     detail=f"the plan has no whole-step peak (no `peak_bytes`); its "
                            f"`peak_comm_buffer_bytes` = {_gib(pred)} GiB covers only the "
                            f"communication buffers, against {_gib(meas)} GiB measured "
                            f"({100 * err:+.1f}%)")
    else:
        g.update(met=None, detail="not evaluated (no prediction or no measured peak)")
    goals.append(g)
    return goals


def diagnose(results: dict[str, dict[str, Any]]) -> list[str]:
    """Sentences on where shardc's time and memory go, from the plan and the profile."""
    sc, bound = results.get("shardc", {}), results.get("bound", {})
    lines: list[str] = []
    prof, bprof = sc.get("profile") or {}, bound.get("profile") or {}
    if sc.get("status") == "ok" and bound.get("status") == "ok":
        gap = sc["step_ms_median"] - bound["step_ms_median"]
        lines.append(f"shardc step {sc['step_ms_median']:.1f} ms vs bound "
                     f"{bound['step_ms_median']:.1f} ms: {gap:+.1f} ms/step.")
    if sc.get("status") == "ok" and prof:
        lines.append(
            f"Profiler (mean over ranks, per step): NCCL kernels {prof['comm_ms']:.1f} ms, of "
            f"which {prof['exposed_comm_ms']:.1f} ms exposed (no other kernel running) and "
            f"{prof['overlapped_comm_ms']:.1f} ms overlapped; non-NCCL kernels "
            f"{prof['compute_ms']:.1f} ms; GPU idle {prof['idle_ms']:.1f} ms.")
        if bprof:
            lines.append(
                f"Bound for comparison: kernels {bprof['compute_ms']:.1f} ms, idle "
                f"{bprof['idle_ms']:.1f} ms per step; shardc's non-NCCL kernels take "
                f"{prof['compute_ms'] - bprof['compute_ms']:+.1f} ms more (copies into and out "
                f"of communication buffers, compute slowed by concurrent NCCL kernels) and its "
                f"idle time {prof['idle_ms'] - bprof['idle_ms']:+.1f} ms more.")
    if "predicted_exposed_comm_s" in sc:
        lines.append(
            f"Plan prediction: step {1e3 * sc.get('predicted_step_time_s', 0):.1f} ms, "
            f"communication {1e3 * sc.get('predicted_comm_time_s', 0):.1f} ms of which "
            f"{1e3 * sc['predicted_exposed_comm_s']:.1f} ms exposed "
            f"({sc.get('n_regions', '?')} compiled region(s)).")
    keep = results.get("shardc-keeporder", {})
    if keep.get("status") == "ok":
        kprof = keep.get("profile") or {}
        text = (f"shardc-keeporder (Inductor's reorder_for_peak_memory off, so the plan's issue "
                f"positions survive): step {keep['step_ms_median']:.1f} ms, "
                f"{keep['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU")
        if bound.get("status") == "ok":
            text += (f" = {keep['tokens_per_s_per_gpu'] / bound['tokens_per_s_per_gpu']:.3f}x "
                     "bound")
        if kprof:
            text += (f"; NCCL {kprof['comm_ms']:.1f} ms/step, {kprof['exposed_comm_ms']:.1f} ms "
                     "exposed")
        if "peak_alloc_bytes" in keep:
            text += f"; peak {_gib(keep['peak_alloc_bytes'])} GiB allocated"
        lines.append(text + ".")
    pool = results.get("shardc-pool", {})
    if pool.get("status") == "ok" and sc.get("status") == "ok":
        text = (f"shardc-pool (static communication pool under Inductor, comm_pool=True): "
                f"{pool['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU "
                f"({pool['tokens_per_s_per_gpu'] / sc['tokens_per_s_per_gpu']:.3f}x shardc)")
        if "peak_alloc_bytes" in pool and "peak_alloc_bytes" in sc:
            text += (f", peak {_gib(pool['peak_alloc_bytes'])} GiB allocated vs shardc's "
                     f"{_gib(sc['peak_alloc_bytes'])} GiB")
        lines.append(text + ".")
    if sc.get("status") == "ok" and "peak_alloc_bytes" in sc:
        text = f"Memory: shardc peak {_gib(sc['peak_alloc_bytes'])} GiB allocated"
        if bound.get("peak_alloc_bytes"):
            text += f" vs bound (replicated) {_gib(bound['peak_alloc_bytes'])} GiB"
        regions = sc.get("regions") or []
        parts = {k: v for k, v in (regions[0]["predicted"] if regions else {}).items()
                 if k.endswith("_bytes")}
        if parts:
            text += "; the plan's memory terms (region 0, GiB): " + ", ".join(
                f"{k} {v / GIB:.2f}" for k, v in parts.items())
        lines.append(text + ".")
    snap = sc.get("memory_at_peak")
    if snap:
        lines.append(
            f"Memory history of one shardc step (rank 0): peak {_gib(snap['peak_live_bytes'])} "
            "GiB allocated during the step on top of "
            f"{_gib(snap['allocated_before_recording_bytes_lower_bound'])} GiB allocated before "
            f"it, reached at {snap['peak_at']} ({snap['peak_phase']}); live at the peak by "
            "phase: " + ", ".join(f"{k} {_gib(v)} GiB" for k, v in snap["by_phase_bytes"].items())
            + "; largest sites: " + "; ".join(
                f"{t['site']} {_gib(t['bytes'])} GiB x{t['count']} `{t['source'][:70]}`"
                for t in snap["top"][:8]) + ".")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        "# Training-step benchmark: shardc vs FSDP2, SimpleFSDP and the bound",
        "",
        f"- command: `{meta['command']}`",
        f"- date (UTC): {meta['date']}",
        f"- GPU: {meta['gpu']} x {meta['world_size']} ({meta['device']}; mesh "
        f"{meta.get('mesh', 'FSDP')}); torch "
        f"{meta['torch']}; NCCL {meta.get('nccl', '–')}; Python {meta['python']}",
        f"- MFU peak: {meta['peak_flops'] / 1e12:.0f} TFLOP/s dense bf16 per GPU; MFU = 6 x "
        "params x tokens/s / peak (embedding and output included, attention FLOPs not)",
        f"- timed steps: {meta['steps']} (median), warm-up {meta['warmup']}, profiled "
        f"{meta['profile_steps']}; AdamW (torch default foreach), lr {meta['lr']}",
        "- numerics in every mode: fp32 master parameters, bf16 compute, gradients reduced in "
        "fp32; loss (cross entropy in fp32) "
        + ("compiled with the model in shardc, bound and simplefsdp (eager after the model in "
           "fsdp2 and fsdp2-compile)" if meta.get("loss_in_graph", False)
           else "outside the compiled region"),
        "",
    ]
    for name, model in report["models"].items():
        s = model["settings"]
        lines += [
            f"## Model `{name}`: {s['params'] / 1e9:.2f}B params, {s['n_layers']} layers, dim "
            f"{s['dim']}, {s['n_heads']} heads, ffn {s['ffn']}, vocab {s['vocab']}; batch "
            f"{s['batch']} x {s['seq']} tokens per GPU",
            "",
        ]
        if model.get("note"):
            lines += [model["note"], ""]
        lines += [
            "| mode | tokens/s/GPU | x bound | MFU | peak alloc GiB | peak reserved GiB | "
            "exposed comm ms/step | comm ms/step | step ms | compile s | loss first → last |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        res = model["results"]
        bound = res.get("bound", {})
        for mode in [m for m in (*MODES, *EXTRA_MODES) if m in model["modes"]]:
            r = res.get(mode, {"status": "not run"})
            if r.get("status") != "ok":
                why = r.get("error") or r.get("reason") or r.get("status")
                why = str(why).replace("|", "\\|").replace("\n", " ")[:160]
                lines.append(f"| {mode} | {r.get('status')}: {why} | | | | | | | | | |")
                continue
            ratio = (r["tokens_per_s_per_gpu"] / bound["tokens_per_s_per_gpu"]
                     if bound.get("status") == "ok" else None)
            prof = r.get("profile") or {}
            lines.append(
                f"| {mode} | {r['tokens_per_s_per_gpu']:,.0f} | {_fmt(ratio, '.3f')} | "
                f"{100 * r['mfu']:.1f}% | {_gib(r.get('peak_alloc_bytes'))} | "
                f"{_gib(r.get('peak_reserved_bytes'))} | {_fmt(prof.get('exposed_comm_ms'), '.1f')}"
                f" | {_fmt(prof.get('comm_ms'), '.1f')} | {r['step_ms_median']:.1f} | "
                f"{_fmt(r.get('compile_s'), '.1f')} | {r['loss_first']:.3f} → "
                f"{r['loss_last']:.3f} |")
        sc = res.get("shardc", {})
        if sc.get("status") == "ok" and sc.get("predicted_peak_bytes") is not None:
            lines += ["", f"shardc plan: predicted peak {_gib(sc['predicted_peak_bytes'])} GiB "
                      f"({sc.get('predicted_peak_kind')}) next to measured peak allocated "
                      f"{_gib(sc.get('peak_alloc_bytes'))} GiB; predicted exposed communication "
                      f"{1e3 * sc.get('predicted_exposed_comm_s', 0):.1f} ms/step."]
        lines += ["", "### Goals", "", "| goal | result | numbers |", "| --- | --- | --- |"]
        for g in model["goals"]:
            mark = {True: "met", False: "**not met**", None: "not evaluated"}[g["met"]]
            lines.append(f"| {g['goal']} | {mark} | {g['detail']} |")
        diag = model.get("diagnosis") or []
        if diag:
            lines += ["", "### Where shardc's time and memory go", ""]
            lines += [f"- {d}" for d in diag]
        lines.append("")
    lines += [
        "## How the numbers are taken",
        "",
        "- tokens/s/GPU: per-GPU tokens per step over the median step time (CUDA events around "
        "forward, backward, optimizer step and zero_grad; the slowest rank's median).",
        "- peak memory: `torch.cuda.max_memory_allocated/reserved` over the timed steps "
        "(`reset_peak_memory_stats` before them), the larger of the ranks.",
        "- compile s: wall time of the first step (compilation plus lazy initialization). Modes "
        "run one after the other in one process each rank (order: "
        f"{', '.join(meta.get('mode_order', []))}); Inductor's kernel caches are not cleared "
        "between modes, so a later mode may reuse kernels an earlier one compiled.",
        "- exposed comm: from a `torch.profiler` trace of the profiled steps, the union of NCCL "
        "kernel intervals minus its intersection with the union of all other kernels, per step, "
        "mean over ranks; comm ms/step is the NCCL union.",
        "- bound: replicated parameters, Inductor, no communication at all (no gradient "
        "all-reduce): the step time perfect overlap would reach.",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Driver


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("1b", "wide", "both"), default="1b")
    p.add_argument("--modes", nargs="+", choices=(*MODES, *EXTRA_MODES), default=list(MODES),
                   help="modes to run, in this order (shardc-pool: shardc with comm_pool=True; "
                        "shardc-keeporder: diagnostic, shardc with "
                        "Inductor's reorder_for_peak_memory off)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compile)")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps (0: none)")
    p.add_argument("--wide-steps", type=int, default=None,
                   help="timed steps for the wide model (default: --steps)")
    p.add_argument("--batch", type=int, default=None,
                   help="sequences per GPU (default: 4 for 1b, 2 for wide)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense bf16 peak per GPU for MFU (H100/H200 SXM: 989)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--mesh", default=None, metavar="RxS",
                   help="HSDP: a (replicate, shard) mesh of R x S ranks (R*S = world size)")
    p.add_argument("--tp", type=int, default=1,
                   help="FSDP+TP: tensor-parallel degree; shardc/FSDP2 shard over world/tp")
    p.add_argument("--tiny", action="store_true", help="tiny models (CPU / smoke tests)")
    p.add_argument("--n-layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--out", default="docs/bench", help="directory for the markdown and JSON")
    p.add_argument("--name", default=None,
                   help="file stem of the results (default train_bench, train_bench_tiny)")
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="skip modes that would not finish this many seconds after the start "
                        "(0: no deadline)")
    p.add_argument("--mode-estimate-s", type=float, default=90.0,
                   help="time a mode is assumed to take when no earlier run of it is known")
    p.add_argument("--dump-plan", action=argparse.BooleanOptionalAction, default=True,
                   help="write shardc's plan(s) as gzipped JSON next to the results")
    p.add_argument("--loss-in-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the loss with the model in the whole-model compiled modes "
                        "(shardc, bound, simplefsdp); fsdp2 modes always compute it eagerly")
    p.add_argument("--memory-snapshot", action="store_true",
                   help="record one extra step of the shardc modes with the CUDA memory history "
                        "and report what is live at its peak")
    p.add_argument("--timeout-s", type=float, default=900.0, help="process-group timeout")
    p.add_argument("--render", metavar="JSON", default=None,
                   help="only re-render the markdown of an earlier run's JSON (next to it)")
    return p.parse_args(argv)


def launch_command(argv: Sequence[str]) -> str:
    world = os.environ.get("WORLD_SIZE")
    prefix = f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', world)} " if world \
        else "python "
    return prefix + shlex.join(argv)


def shardc_source_hash() -> str:
    """sha256 over shardc's ``*.py`` files (identifies the code measured without git)."""
    from shardc.compile.backend import source_hash as _source_hash

    return _source_hash()


def git_describe() -> str | None:
    """``HEAD`` commit (plus ``-dirty`` if shardc/ has local changes), if git is there."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_REPO, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "shardc"], cwd=_REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # not built with NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def init_distributed(device_type: str, timeout_s: float) -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ:  # a single process: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def rerender(path: Path) -> Path:
    """Recompute goals and diagnosis of a results JSON and rewrite its markdown beside it."""
    report = json.loads(path.read_text())
    for model in report["models"].values():
        model["goals"] = evaluate_goals(model["results"])
        model["diagnosis"] = diagnose(model["results"])
    out = path.with_suffix(".md")
    out.write_text(render_markdown(report))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.render:
        print(f"wrote {rerender(Path(args.render))}")
        return
    start = time.perf_counter()
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rank, world, device = init_distributed(device_type, args.timeout_s)
    global LOSS_IN_GRAPH
    LOSS_IN_GRAPH = args.loss_in_graph
    mesh = bench_mesh.build_mesh(device_type, world, args.mesh, args.tp)
    if device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    seq = args.seq or (128 if args.tiny else 2048)
    name = args.name or ("train_bench_tiny" if args.tiny else "train_bench")
    out_dir = Path(args.out)
    models = ["1b", "wide"] if args.model == "both" else [args.model]
    command = launch_command(sys.argv if argv is None else ["benchmarks/train_bench.py", *argv])

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)

    meta = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(device) if device_type == "cuda" else platform.processor()
        or "cpu",
        "device": device_type,
        "world_size": world,
        "mesh": bench_mesh.describe(mesh),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": _nccl_version() if device_type == "cuda" else None,
        "python": platform.python_version(),
        "shardc_source_sha256": shardc_source_hash(),
        "git": git_describe(),
        "host_cpus": os.cpu_count(),
        "steps": args.steps,
        "warmup": args.warmup,
        "profile_steps": args.profile_steps,
        "lr": args.lr,
        "loss_in_graph": args.loss_in_graph,
        "mode_order": list(args.modes),
        "peak_flops": args.peak_tflops * 1e12,
        "env": {k: os.environ[k] for k in sorted(os.environ)
                if k.startswith(("NCCL_", "TORCH_NCCL", "TORCHINDUCTOR_", "TORCH_SYMM"))},
    }
    report: dict[str, Any] = {"meta": meta, "models": {}}
    log(f"{command}\n  {meta['gpu']} x {world}, torch {meta['torch']}")
    durations: dict[str, float] = {}

    def write() -> None:
        if rank != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{name}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        (out_dir / f"{name}.md").write_text(render_markdown(report))

    for model_name in models:
        cfg = model_config(model_name, seq, args.tiny, args.n_layers)
        batch = args.batch or DEFAULT_BATCH[model_name]
        steps = args.wide_steps if (model_name == "wide" and args.wide_steps) else args.steps
        settings = RunSettings(model_name, cfg, batch, seq, steps, args.warmup,
                               args.profile_steps, args.lr, args.peak_tflops * 1e12, device,
                               args.memory_snapshot)
        entry: dict[str, Any] = {
            "settings": {"params": cfg.num_params(), "n_layers": cfg.n_layers, "dim": cfg.dim,
                         "n_heads": cfg.n_heads, "ffn": cfg.hidden_dim, "vocab": cfg.vocab_size,
                         "batch": batch, "seq": seq, "steps": steps,
                         "tokens_per_step_per_gpu": batch * seq},
            "modes": list(args.modes), "results": {}, "goals": [], "diagnosis": [],
        }
        if steps != args.steps:
            entry["note"] = (f"This model ran {steps} timed steps (not {args.steps}) to fit the "
                             "device time.")
        report["models"][model_name] = entry
        log(f"model {model_name}: {cfg.num_params() / 1e9:.3f}B params, batch {batch} x {seq}")
        for mode in args.modes:
            # Rank 0 decides whether the mode fits before the deadline; every rank follows.
            estimate = durations.get(mode, args.mode_estimate_s)
            elapsed = time.perf_counter() - start
            decision = [bool(args.deadline_s) and elapsed + estimate > args.deadline_s]
            dist.broadcast_object_list(decision, src=0)
            if decision[0]:
                entry["results"][mode] = {
                    "mode": mode, "status": "skipped",
                    "reason": f"deadline: {elapsed:.0f}s elapsed + ~{estimate:.0f}s estimated > "
                              f"{args.deadline_s:.0f}s"}
                log(f"  {mode}: skipped ({entry['results'][mode]['reason']})")
                write()
                continue
            log(f"  {mode}: start")
            t_mode = time.perf_counter()
            try:
                with mode_context(mode):
                    res = run_mode(mode, settings, mesh, rank, log)
            except Exception as exc:  # record and go on with the next mode
                res = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}",
                       "traceback": traceback.format_exc()[-6000:]}
                print(f"[rank {rank}] {mode} failed:\n{res['traceback']}", file=sys.stderr,
                      flush=True)
            plans = res.pop("_plans", None)
            free_memory(device)
            per_rank = gather_objects(res)
            agg = aggregate(mode, per_rank, settings)
            durations[mode] = time.perf_counter() - t_mode
            agg["mode_wall_s"] = durations[mode]
            entry["results"][mode] = agg
            if rank == 0 and plans and args.dump_plan:
                out_dir.mkdir(parents=True, exist_ok=True)
                path = out_dir / f"{name}_{model_name}_{mode}_plan.json.gz"
                with gzip.open(path, "wt") as f:
                    json.dump([p.to_dict() for p in plans], f)
                agg["plan_file"] = path.name
            del plans
            if agg["status"] == "ok":
                prof = agg.get("profile") or {}
                log(f"  {mode}: {agg['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, step "
                    f"{agg['step_ms_median']:.1f} ms, peak "
                    f"{_gib(agg.get('peak_alloc_bytes'))}/{_gib(agg.get('peak_reserved_bytes'))}"
                    f" GiB, exposed comm {_fmt(prof.get('exposed_comm_ms'), '.1f')} ms, compile "
                    f"{_fmt(agg.get('compile_s'), '.1f')} s, loss {agg['loss_first']:.3f} -> "
                    f"{agg['loss_last']:.3f} ({durations[mode]:.0f}s)")
            else:
                log(f"  {mode}: {agg['status']}: {agg.get('error')}")
            entry["goals"] = evaluate_goals(entry["results"])
            entry["diagnosis"] = diagnose(entry["results"])
            write()
    if rank == 0:
        print(render_markdown(report), flush=True)
        log(f"wrote {out_dir / (name + '.md')} and {out_dir / (name + '.json')}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
