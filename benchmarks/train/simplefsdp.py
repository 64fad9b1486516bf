"""The SimpleFSDP baseline, written from DTensor's public API.

Parameters are ``Shard(0)`` DTensors read through a class swap that redistributes them to
``Replicate()`` (all-gather in bf16) and returns ``to_local(grad_placements=[Partial])`` so that
the backward reduce-scatters (in fp32); a joint-graph pass tags the gathers for recompute (reshard
after forward); the whole model is compiled by Inductor with its overlap scheduler and collective
bucketing on, patched only while this mode's graphs compile.

Contract: :func:`setup_simplefsdp` returns a :class:`setup.Setup`; its ``after_first_step``
reports how many gathers the joint pass tagged (counted since the process started).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardc.models.llama import Transformer
from train.setup import Setup, compiled_loss, swap_param_reads


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


def setup_simplefsdp(model: Transformer, mesh, loss_in_graph: bool) -> Setup:
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
    swap_param_reads(model, gather)
    compiled = compiled_loss(model, loss_in_graph, backend=simplefsdp_backend)
    config = dict(SIMPLEFSDP_INDUCTOR_CONFIG)
    if not torch.cuda.is_available():
        config["aten_distributed_optimizations.enable_overlap_scheduling"] = False
    info = {"inductor_config": {k: str(v) for k, v in config.items()},
            "grad_reduce_op": reduce_op, "reshard_after_forward": "joint-graph recompute tags"}

    def stats() -> dict[str, Any]:
        return {"tagged_gathers": _SIMPLEFSDP_STATS.get("tagged_gathers", 0)}

    return Setup(compiled, params, [model, compiled], info, stats)
