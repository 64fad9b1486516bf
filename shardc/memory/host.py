"""CPU offload's share of the memory prediction: what lives on the host, what the device holds.

With offload the parameter shards (graph inputs feeding ``offload_to_device``), their
gradients (``offload_to_host`` results) and the optimizer state live in host memory: the
device peak (:func:`shardc.memory.peak.predict_peak`) leaves them out, and ``host_bytes``
counts them. The device copies the forward and backward make are ordinary values of the graphs
and stay in the device peak; ``device_copy_bytes`` is the most of them live at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from shardc.ops.offload_copy import is_grad_d2h_start, is_to_device, is_to_host
from shardc.passes.fx_utils import view_chain_root
from shardc.passes.host_resident import compute_device_type, on_host
from shardc.passes.offload_saved import activation_role
from shardc.planning.plan import CollectiveKind, Plan


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return int(val.numel()) * val.element_size() if isinstance(val, torch.Tensor) else 0


@dataclass
class HostState:
    """A region's offloaded values, found before lowering."""

    params: set[fx.Node]  # forward placeholders holding host shards
    bw_params: set[fx.Node]
    param_bytes: int
    grad_bytes: int

    def host_bytes(self, optimizer_state_factor: float) -> int:
        return int(self.param_bytes * (1 + optimizer_state_factor) + self.grad_bytes)


def _host_placeholders(gm: fx.GraphModule | None) -> set[fx.Node]:
    if gm is None:
        return set()
    roots = (view_chain_root(n.args[0]) for n in gm.graph.nodes if is_to_device(n))
    return {r for r in roots if r is not None}


def find_host_state(fw: fx.GraphModule, bw: fx.GraphModule | None) -> HostState:
    params = _host_placeholders(fw)
    grads = sum(_nbytes(n) for n in bw.graph.nodes if is_to_host(n)) if bw is not None else 0
    return HostState(params, _host_placeholders(bw), sum(_nbytes(p) for p in params), grads)


def host_values(gm: fx.GraphModule | None) -> set[fx.Node]:
    """Nodes of a lowered graph whose values are host tensors made by CPU offload's gradient
    copies: the starts the lowering marked as a gradient's device->host copy
    (:func:`~shardc.ops.offload_copy.is_grad_d2h_start`). Marked, not found by the copy's
    target: on a CPU mesh simulating offload (the capacity planner's, the CPU tests') the
    parameters' host->device copies target ``"cpu"`` too and are device memory, as on a GPU.
    (Taken for host values, a resharded backward's copies of its parameters were left out of
    the CPU plan's peak: on the wide config at world 1, 2.34e9 B less than the GPU's compile
    predicted.) Activation offload's host copies are :func:`activation_host_values`."""
    if gm is None:
        return set()
    return {n for n in gm.graph.nodes if is_grad_d2h_start(n)}


def activation_host_values(fw: fx.GraphModule, bw: fx.GraphModule | None) -> set[fx.Node]:
    """Activation offload (``shardc.passes.offload_saved``): the forward's host copies of saved
    values and the backward's placeholders receiving them; host memory, not device."""
    out = {n for n in fw.graph.nodes if activation_role(n) == "d2h"}
    if bw is not None:
        out |= {n for n in bw.graph.find_nodes(op="placeholder") if activation_role(n) == "host"}
    return out


def resident_host_values(fw: fx.GraphModule, bw: fx.GraphModule | None) -> set[fx.Node]:
    """Saved values already in host memory while the graphs compute on a device
    (``shardc.passes.host_resident``: CPU tensors, fused attention's RNG seed and offset),
    which activation offload leaves where they are: the forward's outputs that are, and the
    backward's placeholders that receive them (named alike); none on the CPU. Activation
    offload's own host copies are :func:`activation_host_values`; other host values (CPU
    offload's) are counted where they were before."""
    device = compute_device_type(fw.graph)
    if device == "cpu":
        return set()
    outs = fw.graph.output_node().args[0]
    out = {n for n in (outs if isinstance(outs, (list, tuple)) else (outs,))
           if isinstance(n, fx.Node) and not activation_role(n) and on_host(n, device)}
    if bw is not None:
        names = {n.name for n in out}
        out |= {n for n in bw.graph.find_nodes(op="placeholder")
                if n.name in names and not activation_role(n)}
    return out


def activation_host_bytes(fw: fx.GraphModule) -> int:
    """Host bytes of the saved values the forward offloads (alive from the forward to the
    backward's prefetch of them)."""
    return sum(_nbytes(n) for n in fw.graph.nodes if activation_role(n) == "d2h")


def optimizer_host_bytes(param_bytes: float, optimizer_state_factor: float) -> int:
    """Optimizer-only offload: host bytes of the masters (``param_bytes``: the device shards'
    bytes), their gradients (as many) and the optimizer state; the device keeps only the
    shards and gradients (:mod:`shardc.runtime.offload_optimizer`)."""
    return int(param_bytes * (2 + optimizer_state_factor))


def device_copy_bytes(plan: Plan) -> int:
    """The most bytes of host->device copies alive at once, over the region's graphs."""
    best = 0
    for graph in {c.graph for c in plan.copies}:
        live: dict[int, int] = {}
        for c in plan.copies:
            if c.graph == graph and c.kind == CollectiveKind.H2D_COPY and c.buffer_lifetime:
                for q in range(*c.buffer_lifetime):
                    live[q] = live.get(q, 0) + c.buffer_bytes
        best = max(best, max(live.values(), default=0))
    return best
