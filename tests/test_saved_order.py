"""shardc.passes.saved_order: the saved values of a partitioned pair of graphs in the order
AOTAutograd's runtime reads them (the end-to-end tests: tests/test_real_models.py, activation
checkpointing around SDPA and dropout)."""

from __future__ import annotations

import torch
from torch import fx

from shardc.passes.saved_order import order_saved_values


class _Mesh:
    """Stands for a DeviceMesh: an opaque (non-tensor, non-size) saved value."""


def _placeholder(graph: fx.Graph, name: str, val) -> fx.Node:
    node = graph.placeholder(name)
    node.meta["val"] = val
    return node


def _graphs(saved_names: list[str], bw_names: list[str]):
    """A forward returning ``y`` and then ``saved_names`` (as torch's RNG functionalization
    leaves them: the RNG state behind the opaque mesh), and a backward taking ``bw_names``
    and a tangent."""
    vals = {"x": torch.ones(2), "mesh": _Mesh(), "rng": torch.zeros(3, dtype=torch.uint8),
            "size": 5}
    fw = fx.Graph()
    nodes = {name: _placeholder(fw, name, val) for name, val in vals.items()}
    y = fw.call_function(torch.ops.aten.mul.Tensor, (nodes["x"], 2.0))
    fw.output((y, *(nodes[n] for n in saved_names)))
    bw = fx.Graph()
    inputs = [_placeholder(bw, name, vals[name]) for name in bw_names]
    tangent = _placeholder(bw, "tangents_1", torch.ones(2))
    x = next(n for n in inputs if n.name == "x")
    grad = bw.call_function(torch.ops.aten.mul.Tensor, (tangent, x))
    bw.output((grad,))
    return fx.GraphModule({}, fw), fx.GraphModule({}, bw)


def _fw_saved(fw: fx.GraphModule) -> list[str]:
    return [n.name for n in next(iter(fw.graph.find_nodes(op="output"))).args[0][1:]]


def _bw_inputs(bw: fx.GraphModule) -> list[str]:
    return [n.name for n in bw.graph.find_nodes(op="placeholder")]


def test_rng_state_behind_an_opaque_value_moves_ahead_of_it():
    fw, bw = _graphs(["x", "mesh", "rng", "size"], ["size", "x", "mesh", "rng"])
    assert order_saved_values(fw, bw, num_fwd_outputs=1)
    assert _fw_saved(fw) == ["x", "rng", "mesh", "size"]
    assert _bw_inputs(bw) == ["size", "x", "rng", "mesh", "tangents_1"]
    # The recompiled graphs run with the new signatures.
    x, rng = torch.ones(2), torch.zeros(3, dtype=torch.uint8)
    mesh = _Mesh()
    y, *saved = fw(x, mesh, rng, 5)
    assert saved[:2] == [x, rng] and saved[2] is mesh and saved[3] == 5
    (grad,) = bw(5, x, rng, mesh, torch.ones(2))
    assert torch.equal(grad, x)
    assert not order_saved_values(fw, bw, num_fwd_outputs=1), "already in order"


def test_graphs_in_order_or_not_pairing_up_are_left_alone():
    fw, bw = _graphs(["x", "rng", "mesh"], ["x", "rng", "mesh"])
    assert not order_saved_values(fw, bw, num_fwd_outputs=1)
    fw, bw = _graphs(["x", "mesh", "rng"], ["x", "mesh"])  # the backward lacks a saved value
    assert not order_saved_values(fw, bw, num_fwd_outputs=1)
    assert _fw_saved(fw) == ["x", "mesh", "rng"]
