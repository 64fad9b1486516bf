"""shardc.passes.body_share: equal block bodies that Dynamo traced as separate subgraphs (torch
2.11 under dynamic shapes) are called as one; bodies that differ in an operation, a constant or
an input's strides keep their own."""

from __future__ import annotations

import operator

import torch
from torch import fx

from shardc.passes.body_share import INVOKE_SUBGRAPH, graph_form, share_equal_bodies


def _body(scale: float, example: torch.Tensor) -> fx.GraphModule:
    """``tanh((x @ w)[:, :4]) * scale`` as a Dynamo-style subgraph (placeholders carry example
    values; the slice is a constant argument that cannot be hashed)."""
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    x.meta["example_value"], w.meta["example_value"] = example, torch.randn(4, 4)
    product = graph.call_function(torch.mm, (x, w))
    sliced = graph.call_function(operator.getitem, (product, (slice(None), slice(0, 4))))
    out = graph.call_function(torch.mul, (graph.call_function(torch.tanh, (sliced,)), scale))
    graph.output((out,))
    return fx.GraphModule(torch.nn.Module(), graph)


def _region(bodies: list[fx.GraphModule]) -> tuple[fx.GraphModule, list[fx.Node]]:
    """A root graph calling each body once, in order, on the previous call's output."""
    root = torch.nn.Module()
    graph = fx.Graph()
    h = graph.placeholder("h")
    calls = []
    for i, body in enumerate(bodies):
        root.add_module(f"subgraph_{i}", body)
        w = graph.placeholder(f"w{i}")
        call = graph.call_function(INVOKE_SUBGRAPH,
                                   (graph.get_attr(f"subgraph_{i}"), f"subgraph_{i}", h, w))
        h = graph.call_function(lambda out: out[0], (call,))
        calls.append(call)
    graph.output(h)
    return fx.GraphModule(root, graph), calls


def test_equal_bodies_are_called_as_one_and_results_are_unchanged():
    contiguous = torch.randn(3, 4)
    strided = torch.randn(4, 3).t()  # same sizes, other strides
    bodies = [_body(0.5, contiguous), _body(0.5, contiguous), _body(2.0, contiguous),
              _body(0.5, contiguous), _body(0.5, strided)]
    assert graph_form(bodies[0]) == graph_form(bodies[1]) == graph_form(bodies[3])
    assert graph_form(bodies[0]) != graph_form(bodies[2])  # another constant
    assert graph_form(bodies[0]) != graph_form(bodies[4])  # another input stride
    gm, calls = _region(bodies)
    inputs = [torch.randn(3, 4)] + [torch.randn(4, 4) for _ in bodies]
    expected = gm(*inputs)

    assert share_equal_bodies(calls) == 2
    assert [c.args[1] for c in calls] == ["subgraph_0", "subgraph_0", "subgraph_2",
                                          "subgraph_0", "subgraph_4"]
    kept = {name for name, _ in gm.named_children()}
    assert kept == {"subgraph_0", "subgraph_2", "subgraph_4"}
    torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)
    assert share_equal_bodies(calls) == 0  # nothing left to share


def _run(sub: fx.GraphModule, *args: torch.Tensor):
    return sub(*args)


def _with_region(policy) -> fx.GraphModule:
    """A body holding a nested region subgraph (as a checkpointed block's body does), whose
    selective checkpointing policy Dynamo records on the subgraph, not in its nodes."""
    region = _body(1.0, torch.randn(3, 4))
    if policy is not None:
        region.meta["_checkpoint_context_fn"] = policy
    root = torch.nn.Module()
    root.add_module("region", region)
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    x.meta["example_value"], w.meta["example_value"] = torch.randn(3, 4), torch.randn(4, 4)
    graph.output((graph.call_function(_run, (graph.get_attr("region"), x, w)),))
    return fx.GraphModule(root, graph)


def test_nested_regions_with_other_checkpoint_policies_are_not_equal():
    def keep_matmuls(ctx, op, *args, **kwargs):
        return None

    def keep_nothing(ctx, op, *args, **kwargs):
        return None

    assert graph_form(_with_region(keep_matmuls)) == graph_form(_with_region(keep_matmuls))
    assert graph_form(_with_region(None)) == graph_form(_with_region(None))
    assert graph_form(_with_region(keep_matmuls)) != graph_form(_with_region(keep_nothing))
    assert graph_form(_with_region(keep_matmuls)) != graph_form(_with_region(None))
