"""shardc.passes.body_sizes on a small Dynamo-like graph: a size a body returns is computed
again by the caller where it is arithmetic on the body's inputs' sizes, and stays read from the
body where the body computes it from an intermediate tensor. The whole-model check (an inline
block reading a shared body's token count under Inductor) is in tests/test_blocks.py."""

from __future__ import annotations

import operator

import torch
from torch import fx

from shardc.passes.body_sizes import recompute_returned_sizes

INVOKE = torch.ops.higher_order.invoke_subgraph


def _body() -> fx.GraphModule:
    """``(x @ w, 2 * x.size(0), (x @ w).size(1))``, with Dynamo's example values."""
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    g = fx.Graph()
    px, pw = g.placeholder("x"), g.placeholder("w")
    px.meta["example_value"], pw.meta["example_value"] = x, w
    h = g.call_function(torch.matmul, (px, pw))
    h.meta["example_value"] = x @ w
    rows = g.call_method("size", (px, 0))
    rows.meta["example_value"] = 4
    twice = g.call_function(operator.mul, (2, rows))
    twice.meta["example_value"] = 8
    cols = g.call_method("size", (h, 1))
    cols.meta["example_value"] = 5
    g.output((h, twice, cols))
    return fx.GraphModule(torch.nn.Module(), g)


def _root() -> fx.GraphModule:
    root = torch.nn.Module()
    root.body = _body()
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    call = g.call_function(INVOKE, (g.get_attr("body"), "body_id", x, w))
    items = [g.call_function(operator.getitem, (call, i)) for i in range(3)]
    for item, value in zip(items, (torch.randn(4, 5), 8, 5)):
        item.meta["example_value"] = value
    g.output(tuple(items))
    return fx.GraphModule(root, g)


def test_a_size_of_the_inputs_is_computed_by_the_caller_and_one_of_an_intermediate_is_not():
    gm = _root()
    assert recompute_returned_sizes(gm) == 1
    out = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    # Output 1 is now the caller's own 2 * x.size(0), computed before the body call ...
    assert out[1].target is operator.mul
    size = out[1].args[1]
    assert size.op == "call_method" and size.target == "size"
    assert size.args[0].op == "placeholder" and size.args[0].name == "x"
    call = next(iter(gm.graph.find_nodes(op="call_function", target=INVOKE)))
    order = list(gm.graph.nodes)
    assert order.index(out[1]) < order.index(call)
    # ... while output 2, the matmul's size, stays read from the body.
    assert out[2].target is operator.getitem and out[2].args == (call, 2)
    assert out[0].target is operator.getitem and out[0].args == (call, 0)
    # No copy left behind from the size that could not be copied.
    assert len(gm.graph.find_nodes(op="call_method", target="size")) == 1



def test_a_symbolic_size_of_an_intermediate_is_built_from_the_callers_size_symbols():
    """llama4_text on torch 2.11: the inline layer's ``full_like(router_logits)`` reads the
    token count (``2*s27``) that the shared body computed from an intermediate's size. The
    caller computes it from its own placeholder of the symbol instead; a size over a symbol the
    caller does not have stays read from the body, and leaves no node behind."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    n, m = env.create_unbacked_symint(), env.create_unbacked_symint()
    body = _body()  # (x @ w, 2 * x.size(0), (x @ w).size(1)): outputs 1 and 2 read from it
    root = torch.nn.Module()
    root.body = body
    g = fx.Graph()
    x, w, pn = g.placeholder("x"), g.placeholder("w"), g.placeholder("n")
    pn.meta["example_value"] = n
    call = g.call_function(INVOKE, (g.get_attr("body"), "body_id", x, w))
    items = [g.call_function(operator.getitem, (call, i)) for i in range(3)]
    # Dynamo's values (symbolic this time): output 2, an intermediate's size, is 2*n + 1 over
    # the caller's symbol n; output 1 stays the copy of the body's arithmetic on x.size(0).
    for item, value in zip(items, (torch.randn(4, 5), 8, 2 * n + 1)):
        item.meta["example_value"] = value
    g.output(tuple(items))
    gm = fx.GraphModule(root, g)
    assert recompute_returned_sizes(gm) == 2
    result = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    built = result[2]
    assert built.target is operator.add and 1 in built.args
    twice = next(a for a in built.args if isinstance(a, fx.Node))
    assert twice.target is operator.mul and set(twice.args) == {2, pn}
    assert str(built.meta["example_value"]) == str(2 * n + 1)
    order = list(gm.graph.nodes)
    assert order.index(built) < order.index(call)
    assert result[1].target is operator.mul  # the copy, as in the test above

    # Over a symbol the caller has no placeholder for (m): left read from the body.
    g2 = fx.Graph()
    x, w, pn = g2.placeholder("x"), g2.placeholder("w"), g2.placeholder("n")
    pn.meta["example_value"] = n
    call = g2.call_function(INVOKE, (g2.get_attr("body"), "body_id", x, w))
    items = [g2.call_function(operator.getitem, (call, i)) for i in range(3)]
    for item, value in zip(items, (torch.randn(4, 5), 8, m * n)):
        item.meta["example_value"] = value
    g2.output((items[0], items[2]))
    gm2 = fx.GraphModule(root, g2)
    before = len(gm2.graph.nodes)
    assert recompute_returned_sizes(gm2) == 0
    assert len(gm2.graph.nodes) == before
    result = next(iter(gm2.graph.find_nodes(op="output"))).args[0]
    assert result[1].target is operator.getitem and result[1].args == (call, 2)
