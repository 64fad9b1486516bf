"""Saved values in the order AOTAutograd reads them: tensors, opaque objects, symbolic sizes.

AOTAutograd's runtime finds what the forward saves for the backward by position alone: after the
forward's own outputs come the saved tensors (those checked against in-place changes first), then
opaque objects (non-tensor values such as a ``DeviceMesh``), then symbolic sizes. The backward
graph takes them as inputs in the order symbolic sizes, tensors, opaque objects, then the
tangents.

Why shardc has to restore that order: every parameter of a sharded region is a DTensor, and
AOTAutograd flattens a DTensor input into its local tensor and its ``DeviceMesh`` (an opaque
object; so in torch 2.13, where this was found and is tested). The backward outputs each
parameter's gradient as a DTensor, so it needs the mesh: the partitioner saves the mesh input
for the backward, placing it after the saved tensors as it should. Then, when a checkpointed
region (``torch.utils.checkpoint``) recomputes an op tagged ``nondeterministic_seeded`` (dropout,
and every scaled-dot-product attention op, which is tagged so for its ``dropout_p`` even at 0),
the partitioner's ``functionalize_rng_ops`` saves
the op's RNG state tensor too, inserted just before the symbolic sizes: behind the mesh. The
runtime then counts the mesh as a tensor and fails (``expected all tensors_saved_with_vc_check
to be Tensors, got ... DeviceMesh``). Unsharded models have no opaque input, hence no failure.

:func:`order_saved_values` moves each saved value back into its group, keeping the order within
each group, in both graphs, so the forward's outputs and the backward's inputs still pair up.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import fx

log = logging.getLogger("shardc")

_TENSOR, _TENSOR_NO_VC_CHECK, _OPAQUE, _SYMBOLIC = range(4)


def _group(node: fx.Node) -> int:
    """Which of AOTAutograd's saved-value groups ``node`` belongs to (from its fake value; a node
    without one stays with the tensors, where AOTAutograd counts it too)."""
    if "val" not in node.meta:
        return _TENSOR
    val = node.meta["val"]
    if isinstance(val, torch.Tensor):
        return _TENSOR_NO_VC_CHECK if node.meta.get("saved_tensor_with_no_vc_check") else _TENSOR
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        return _SYMBOLIC
    return _OPAQUE


def _sorted_by_group(nodes: Sequence[fx.Node], order: Sequence[int]) -> list[fx.Node]:
    rank = {group: i for i, group in enumerate(order)}
    return sorted(nodes, key=lambda n: rank[_group(n)])  # stable: keeps the order within a group


# The backward's inputs after its saved values: tangents, then RNG seeds and offsets or (CUDA's
# graph-safe RNG) generator states, named so by AOTAutograd's partitioner.
_AFTER_SAVED = ("tangents", "bwd_seed", "bwd_base_offset", "bwd_rng_state")


def saved_inputs(bw: fx.GraphModule) -> list[fx.Node]:
    """The backward's inputs that are saved values: the placeholders before the tangents."""
    saved = []
    for ph in bw.graph.find_nodes(op="placeholder"):
        if ph.name.startswith(_AFTER_SAVED):
            break
        saved.append(ph)
    return saved


def order_saved_values(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> bool:
    """Put the forward's saved outputs in the order tensors, tensors without version-counter
    check, opaque objects, symbolic sizes, and the backward's saved inputs in the order symbolic
    sizes, tensors, opaque objects, as AOTAutograd's runtime reads them. Returns whether anything
    moved. Graphs whose saved outputs and inputs do not hold the same groups of values (not
    partitioned by AOTAutograd's conventions) are left as they are."""
    output = next(iter(fw.graph.find_nodes(op="output")))
    outs = tuple(output.args[0])
    saved_out = outs[num_fwd_outputs:]
    saved_in = saved_inputs(bw)
    if not all(isinstance(n, fx.Node) for n in saved_out):
        return False
    if sorted(map(_group, saved_out)) != sorted(map(_group, saved_in)):
        log.debug("shardc: saved values of the forward and backward differ; order left as is")
        return False
    new_out = _sorted_by_group(saved_out, (_TENSOR, _TENSOR_NO_VC_CHECK, _OPAQUE, _SYMBOLIC))
    new_in = _sorted_by_group(saved_in, (_SYMBOLIC, _TENSOR, _TENSOR_NO_VC_CHECK, _OPAQUE))
    if list(saved_out) == new_out and saved_in == new_in:
        return False
    order = [outs.index(n, num_fwd_outputs) for n in new_out]
    output.args = (outs[:num_fwd_outputs] + tuple(new_out),) + tuple(output.args[1:])
    descs = output.meta.get("desc")
    if isinstance(descs, (list, tuple)) and len(descs) == len(outs):
        output.meta["desc"] = list(descs[:num_fwd_outputs]) + [descs[i] for i in order]
    anchor = saved_in[-1].next if saved_in else None
    for node in new_in:
        anchor.prepend(node)
    fw.recompile()
    bw.recompile()
    return True
