"""Saved values that are already in host memory while their graph computes on a device.

Activation offload (``shardc.passes.offload_saved``) copies saved values to the host; the peak
budget prices that (``shardc.planning.offload``) by the bytes it frees on the device. A value
that already lives on the host frees nothing by being copied there: the copy is a pointless
host-to-host one, made at once (never pending on the copy stream), and the copy back would
hand the backward a device tensor where the forward made a host one. Two kinds, found on a
graph whose compute device is not the CPU (:func:`compute_device_type`):

* a value whose fake value is a CPU tensor (e.g. the RNG state a checkpointed region's
  functionalized random ops save: ``torch.cuda.get_rng_state()`` is a host tensor);
* the RNG seed and offset outputs of the fused attention ops (``philox_seed``,
  ``philox_offset``; flash's ``rng_state``, ``unused``): torch's meta kernels give them no
  device (Note [Seed and Offset] in ``torch/_meta_registrations.py``: it depends on whether a
  CUDA graph is being captured), so their fake values name the compute device, but outside
  CUDA-graph capture the kernels return host scalars (memory-efficient attention always does
  without dropout: the 2 per block the GPU test of pending copies missed). Whether flash's
  ``rng_state`` is on the host or the device was not checked on a GPU (torch's
  "BC breaking change to flash seed/offset" note); it is treated as host-resident either way.
  They are a few bytes each; left where they are, the backward gets the very tensors the
  forward made, wherever that is (the peak prediction counts them as host bytes).

On a graph that computes on the CPU nothing is "already on the host" in this sense: the CPU
tests offload every value (each copy a separate host tensor), so the copies run.

``compute_device_type`` and :func:`on_host` are the one definition every user shares: the pass
(what it offloads), the blocks' byte counts the planner prices (``shardc.passes.recompute``)
and the peak prediction's host values (``shardc.memory.host``).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from shardc.passes.body import INVOKE_SUBGRAPH
from shardc.passes.fx_utils import op_overload, subgraph_module, tensor_nbytes, tensors_in

__all__ = ["ALREADY_ON_HOST", "RNG_RETURNS", "compute_device_type", "host_bytes", "is_rng_output",
           "on_host"]

ALREADY_ON_HOST = "already on the host"

# Schema return names of a seeded op's RNG state (the fused attention ops').
RNG_RETURNS = frozenset({"philox_seed", "philox_offset", "rng_state", "unused"})


def compute_device_type(graph: fx.Graph) -> str:
    """The device type ``graph`` computes on: that of its first value (in graph order) on
    neither the CPU nor the meta device; else ``"cpu"`` if it has a CPU value (or no tensor
    value at all); else ``"meta"`` (a graph traced without a device). Meta values beside CPU
    ones (the budget planner's trials put the communication pool and its views on the meta
    device) leave a CPU graph a CPU one."""
    kinds: set[str] = set()
    for node in graph.nodes:
        for val in tensors_in(node.meta.get("val")):
            kind = val.device.type
            if kind not in ("cpu", "meta"):
                return kind
            kinds.add(kind)
    return "meta" if kinds == {"meta"} else "cpu"


def _body_output(call: fx.Node, idx: int) -> fx.Node | None:
    """The node a compiled-once block body's call (``invoke_subgraph``) returns at ``idx``."""
    body = subgraph_module(call)
    if body is None:
        return None
    outs = body.graph.output_node().args[0]
    inner = outs[idx] if isinstance(outs, (list, tuple)) and idx < len(outs) else None
    return inner if isinstance(inner, fx.Node) else None


def _rng_output(src: fx.Node, idx: int) -> bool:
    """Whether output ``idx`` of the multi-output call ``src`` is a seeded op's RNG seed or
    offset (:data:`RNG_RETURNS`), looking through compiled-once block bodies."""
    for _ in range(64):  # nesting depth of bodies; a bound, not a search
        if src.op != "call_function":
            return False
        if src.target is not INVOKE_SUBGRAPH:
            op = op_overload(src)
            if op is None or torch.Tag.nondeterministic_seeded not in op.tags:
                return False
            returns = op._schema.returns
            return idx < len(returns) and returns[idx].name in RNG_RETURNS
        inner = _body_output(src, idx)
        if inner is None or not _is_item(inner):
            return False
        src, idx = inner.args
    return False


def _is_item(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node) and isinstance(node.args[1], int))


def is_rng_output(node: fx.Node) -> bool:
    """Whether ``node`` takes a seeded op's RNG seed or offset output (:data:`RNG_RETURNS`)."""
    return _is_item(node) and _rng_output(*node.args)


def on_host(node: fx.Node, device_type: str) -> bool:
    """Whether ``node``'s value is already in host memory while its graph computes on
    ``device_type`` (:func:`compute_device_type`); always False on the CPU."""
    if device_type == "cpu":
        return False
    vals = tensors_in(node.meta.get("val"))
    if vals and all(v.device.type == "cpu" for v in vals):
        return True
    return is_rng_output(node)


def host_bytes(node: fx.Node, device_type: str) -> int:
    """Bytes of ``node``'s value already on the host while its graph computes on
    ``device_type``: all of it (:func:`on_host`), or of a multi-output call (a fused attention
    op, a block body's call) the outputs that are (CPU tensors, RNG seeds and offsets); 0 on
    the CPU."""
    if device_type == "cpu":
        return 0
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tensor_nbytes(val) if on_host(node, device_type) else 0
    if not isinstance(val, (list, tuple)):
        return 0
    return sum(tensor_nbytes(v) for i, v in enumerate(val) if isinstance(v, torch.Tensor)
               and (v.device.type == "cpu" or _rng_output(node, i)))
