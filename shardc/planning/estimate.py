"""Estimators: how long one kernel, one collective, one optimizer step takes on a profile.

Estimators price single things from a :class:`shardc.planning.profile.ClusterProfile`; the
scheduler (:mod:`shardc.planning.schedule`) places them on the compute stream and the process
groups' lanes and simulates the step. (Inductor keeps its estimators and schedulers apart the
same way.)

- matmul: ``2*m*n*k / rate(m, n, k, dtype)``, at least its bytes over the memory bandwidth;
- attention (one fused kernel, forward or backward): its FLOPs (:func:`attention_flops`) over
  the profile's attention rate for its sequence length and head dimension;
- a fused group of pointwise ops and reductions, or any other memory-bound kernel: the bytes it
  reads and writes (:mod:`shardc.planning.kernels`) over the bandwidth a kernel of that size
  reaches;
- every kernel takes at least ``kernel_gpu_s`` on the device and ``kernel_launch_s`` of host
  time to launch (the scheduler keeps a host timeline, so CPU-bound stretches show);
- a collective: the profile's curve for its kind and group size, else the ring model; the
  copies that pack its send buffer and unpack what it received are memory-bound kernels.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from shardc.ops.gather import GATHER_OP
from shardc.ops.gather_args import GatherArgs, ReduceArgs
from shardc.passes.fx_utils import is_call, size_hint, tensor_nbytes
from shardc.planning import optimizer_kind
from shardc.planning.cost_model import FusedLossDims, node_flops_and_bytes
from shardc.planning.kernels import ATTENTION, FUSABLE, MATMUL, Kernel, base_name
from shardc.planning.profile import ClusterProfile


def _val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _shape(t: torch.Tensor) -> list[int]:
    return [size_hint(s) for s in t.shape]


def memory_seconds(nbytes: float, profile: ClusterProfile) -> float:
    """Device time of a memory-bound kernel moving ``nbytes`` (reads plus writes)."""
    if nbytes <= 0:
        return 0.0
    return nbytes / profile.memory_bandwidth(nbytes)


def matmul_seconds(node: fx.Node, profile: ClusterProfile) -> float:
    name = base_name(node)
    args = [a for a in node.args if isinstance(a, fx.Node)]
    flops, nbytes = node_flops_and_bytes(node)
    a = b = None
    if name in ("mm", "bmm", "_scaled_mm") and len(args) >= 2:
        a, b = _val(args[0]), _val(args[1])
    elif name in ("addmm", "baddbmm") and len(args) >= 3:
        a, b = _val(args[1]), _val(args[2])
    if a is not None and b is not None and a.dim() >= 2 and b.dim() >= 2:
        sa, sb = _shape(a), _shape(b)
        batch = math.prod(sa[:-2])
        m, k, n = batch * sa[-2], sa[-1], sb[-1]
        flops = 2.0 * m * n * k
        rate = profile.matmul_rate(m, n, k, _dtype(a))
    else:  # convolutions, grouped matmuls: at the rate of a large matmul
        out = _val(node)
        out = out if out is not None else (_val(args[0]) if args else None)
        rate = profile.matmul_rate(8192, 8192, 8192, _dtype(out) if out is not None
                                   else "bfloat16")
    if flops <= 0:
        return memory_seconds(nbytes, profile)
    return max(flops / rate, memory_seconds(nbytes, profile))


def fused_loss_seconds(node: fx.Node, profile: ClusterProfile) -> float:
    """The fused cross-entropy (``shardc.ops.fused_ce``): its matmuls at the rate of one
    chunk's ``[chunk, D] x [D, V]``, then its other kernels (the log-softmax, the softmax, the
    scaling, the cast, the weight gradient's accumulation: separate eager kernels, one after
    the other) at the memory bandwidth: the two add, they do not overlap."""
    flops, nbytes = node_flops_and_bytes(node)
    h, w = _val(node.args[0]), _val(node.args[1])
    if h is None or w is None:
        return memory_seconds(nbytes, profile)
    d = FusedLossDims.of(node, h, w)
    rate = profile.matmul_rate(d.chunk, d.vocab, d.hidden, _dtype(h))
    return flops / rate + memory_seconds(d.elementwise_bytes(), profile)


def _is_causal(node: fx.Node) -> bool:
    """The ``is_causal`` argument of an attention op, by its schema (``True`` if unknown:
    decoder training). Read from the op's schema directly: ``fx.Node.normalized_arguments``
    took about 6 ms a call in a profiled 32-layer compile (torch 2.11), once per attention
    call of every block."""
    if "is_causal" in node.kwargs:
        return bool(node.kwargs["is_causal"])
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    for i, arg in enumerate(schema.arguments):
        if arg.name == "is_causal":
            if i < len(node.args):
                return bool(node.args[i])
            return bool(arg.default_value) if arg.has_default_value() else True
    return True


def attention_flops(q_shape: list[int], kv_len: int, causal: bool, backward: bool) -> float:
    """FLOPs of one attention pass as flash attention counts them: ``4*B*H*Sq*Skv*D`` forward
    (two matmuls), half of it when causal (masked blocks are skipped), 2.5x for the backward."""
    flops = 4.0 * math.prod(q_shape[:-1]) * kv_len * q_shape[-1]
    if causal:
        flops *= 0.5
    return flops * (2.5 if backward else 1.0)


def attention_seconds(node: fx.Node, profile: ClusterProfile) -> float:
    backward = "backward" in base_name(node)
    tensors = [_val(a) for a in node.args if isinstance(a, fx.Node)]
    tensors = [t for t in tensors if t is not None]
    q, k = (tensors[1], tensors[2]) if backward and len(tensors) >= 3 else (
        (tensors[0], tensors[1]) if len(tensors) >= 2 else (None, None))
    if q is None or q.dim() < 3:
        flops, nbytes = node_flops_and_bytes(node)
        return max(flops / profile.attention_rate(2048, 128, backward, "bfloat16"),
                   memory_seconds(nbytes, profile))
    qs = _shape(q)
    seq, kv_len = qs[-2], _shape(k)[-2]
    flops = attention_flops(qs, kv_len, _is_causal(node), backward)
    rate = profile.attention_rate(max(seq, kv_len), qs[-1], backward, _dtype(q))
    return flops / rate


KERNEL_CATEGORIES = ("matmul", "attention_forward", "attention_backward", "fused", "other")


def kernel_category(kernel: Kernel) -> str:
    """What a kernel's time is reported under (``Predictions.time_by_category_s``; the
    benchmarks sort measured GPU kernels into the same names): one of
    :data:`KERNEL_CATEGORIES`."""
    if kernel.kind == MATMUL:
        return "matmul"
    if kernel.kind == ATTENTION:
        return ("attention_backward" if "backward" in base_name(kernel.nodes[0])
                else "attention_forward")
    return "fused" if kernel.kind == FUSABLE else "other"


def kernel_seconds(kernel: Kernel, profile: ClusterProfile) -> float:
    """Device time of one kernel (at least ``kernel_gpu_s``)."""
    node = kernel.nodes[0]
    if kernel.kind == MATMUL:
        t = matmul_seconds(node, profile)
    elif kernel.kind == ATTENTION:
        t = attention_seconds(node, profile)
    elif kernel.kind == FUSABLE:
        t = memory_seconds(kernel.bytes, profile)
    elif base_name(node) == "fused_linear_cross_entropy":
        t = fused_loss_seconds(node, profile)
    else:  # an op Inductor does not fuse: roofline on its own numbers
        flops, nbytes = node_flops_and_bytes(node)
        t = max(flops / profile.peak_matmul_flops() if flops else 0.0,
                memory_seconds(nbytes, profile))
    return max(t, profile.kernel_gpu_s)


def collective_copy_bytes(kind: str, graph_bytes: tuple[float, float], world: int
                          ) -> tuple[float, float]:
    """Bytes the copy kernels around one of shardc's collectives move: (packing the send buffer,
    unpacking the received one). ``graph_bytes``: (bytes of the inputs as the graph holds them,
    bytes of the collective's full buffer). An all-gather packs (casts) the shards and copies
    each parameter out of the gathered buffer (a view when there is one rank); a reduce-scatter
    packs the gradients (cast to the reduction dtype) and its outputs are views."""
    inputs, buffer = graph_bytes
    if kind == "all_gather":
        return inputs + buffer / max(world, 1), (2.0 * buffer if world > 1 else 0.0)
    if kind == "reduce_scatter":
        return inputs + buffer, 0.0
    return 0.0, 0.0


def optimizer_kernel_ops(state_factor: float = 2.0, temp_factor: float = 1.0
                         ) -> tuple[float, int]:
    """(parameter-sized reads and writes, foreach ops) of one optimizer step: Adam/AdamW
    (``state_factor`` 2) in torch's ``foreach`` implementation (``temp_factor`` 1): about ten
    passes over the shards (lerp and mul/addcmul of the moments, sqrt, div, add of eps, addcdiv
    into the parameters, weight decay), each reading and writing whole lists: about 20; the fused
    one (``temp_factor`` 0) one pass (7). SGD with momentum (``state_factor`` 1): 5 in 3 ops;
    plain SGD: 3 in one."""
    if state_factor >= 2:
        return (20.0, 10) if temp_factor > 0 else (7.0, 1)
    if state_factor >= 1:
        return 5.0, 3
    return 3.0, 1


def optimizer_step_seconds(param_bytes: float, n_params: int, profile: ClusterProfile, *,
                           state_factor: float = 2.0, temp_factor: float = 1.0,
                           ran: str | None = None) -> float:
    """Device time of the optimizer's step over this rank's parameter shards (``param_bytes``
    of fp32 master weights in ``n_params`` tensors), outside the compiled graphs: the passes of
    :func:`optimizer_kernel_ops` over the shards at the memory bandwidth; each foreach op
    launches a kernel per chunk of tensors (``n_params``/16 here, about what torch's chunking
    gives), at least ``kernel_gpu_s`` and ``kernel_launch_s`` each. The host's per-parameter
    work around it (``ClusterProfile.optimizer_per_param_s``) is placed by
    :mod:`shardc.planning.step`. ``ran`` (``shardc.planning.optimizer_kind``; default: fused
    where ``temp_factor`` is 0, else foreach): ``"per_tensor"`` makes the foreach passes as a
    kernel per tensor each. The whole is multiplied by the profile's measured-over-modelled
    ratio for ``ran`` (``ClusterProfile.device_optimizer_scale``; 1 where not measured)."""
    ran = ran or optimizer_kind.ran("auto", temp_factor)
    passes, ops = optimizer_kernel_ops(state_factor, 0.0 if ran == "fused" else
                                       max(temp_factor, 1.0))
    kernels = ops * (max(n_params, 1) if ran == "per_tensor" else max(1, math.ceil(n_params / 16)))
    moved = passes * param_bytes
    # Scaled by what calibration measured against this model (profile version 8; 1 before).
    return profile.device_optimizer_scale(ran) * (
        memory_seconds(moved, profile) + kernels * max(profile.kernel_gpu_s,
                                                       profile.kernel_launch_s))


def elided_cast_bytes(node: fx.Node) -> int:
    """Bytes the cast that replaces an elided gather or reduction of one parameter moves
    (``shardc.passes.lower.elide``: the shard cast to the gathered dtype; the gradient cast to
    the reduce dtype and then to the shard's, one fused kernel): what it reads plus what it
    writes; 0 where no dtype changes (nothing to compute)."""
    if is_call(node, GATHER_OP):
        src, dst = GatherArgs.of(node).shard.meta.get("val"), node.meta.get("val")
        steps = [] if src is None or dst is None else [src.dtype, dst.dtype]
    else:
        args = ReduceArgs.of(node)
        src = args.grad.meta.get("val") if isinstance(args.grad, fx.Node) else None
        dst = src
        steps = [] if src is None else [src.dtype, args.reduce_dtype or src.dtype,
                                        args.out_dtype]
    if not steps or all(d == steps[0] for d in steps):
        return 0
    numel = math.prod(size_hint(s) for s in dst.shape)
    # ``dtype.itemsize``, not a scalar's ``element_size()``: planning runs under the compile's
    # fake mode, where making a tensor dispatches through it (about 2 ms a parameter).
    return numel * (steps[0].itemsize + steps[-1].itemsize)


def host_optimizer_seconds(param_bytes: float, profile: ClusterProfile, *,
                           state_factor: float = 2.0, temp_factor: float = 0.0,
                           ran: str | None = None) -> float:
    """Host time of an offloaded optimizer step over ``param_bytes`` of fp32 masters (CPU
    offload: the optimizer steps on the host) in implementation ``ran``
    (``shardc.planning.optimizer_kind``; default: fused where ``temp_factor`` is 0, else
    foreach). AdamW at the profile's rate for it (``ClusterProfile.host_adamw_rate``: fused,
    else the per-tensor CPU kernels, which CPU ``foreach`` runs too); another kind is taken as
    memory-bound on the host too, scaled by its reads and writes against AdamW's in the same
    implementation (:func:`optimizer_kernel_ops`: SGD's 5 or 3). The Python per parameter
    tensor is :mod:`shardc.planning.step`'s."""
    if param_bytes <= 0:
        return 0.0
    ran = ran or optimizer_kind.ran("auto", temp_factor)
    fused = ran == "fused"
    passes, _ = optimizer_kernel_ops(state_factor, 0.0 if fused else 1.0)
    adamw, _ = optimizer_kernel_ops(2.0, 0.0 if fused else 1.0)
    return (param_bytes / 4.0) / profile.host_adamw_rate(ran) * passes / adamw


def elided_cast_seconds(gm: fx.GraphModule, profile: ClusterProfile) -> dict[str, float]:
    """Per parameter whose gather casts (compute dtype != the shard's), the predicted device
    time of that cast: what a gather over a one-rank group costs once elided
    (``shardc.passes.lower.elide``), so what keeping it gathered saves in the backward
    (``shardc.planning.budget.candidates``). A function of global shapes and dtypes only: the
    same on every rank."""
    out: dict[str, float] = {}
    for node in gm.graph.nodes:
        if not is_call(node, GATHER_OP):
            continue
        moved = elided_cast_bytes(node)
        if moved:
            fqn = GatherArgs.of(node).fqn
            out[fqn] = out.get(fqn, 0.0) + memory_seconds(moved, profile) + profile.kernel_gpu_s
    return out


def graph_input_bytes(nodes: list[fx.Node]) -> float:
    return float(sum(tensor_nbytes(n.meta.get("val")) for n in nodes))
