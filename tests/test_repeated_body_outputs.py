"""shardc.passes.repeated_body_outputs: a body output returned at two positions (a sunk body's
pair gradient) is read by the caller at its first position only, so Inductor gives its storage
one name. The whole-model check (a sunk body's recomputed part at parity under Inductor) is the
slow tests/test_recompute_part_ranks.py."""

from __future__ import annotations

import operator

import torch
from torch import fx

from shardc.passes.repeated_body_outputs import (
    read_repeated_outputs_once,
    repeated_output_positions,
)

INVOKE = torch.ops.higher_order.invoke_subgraph


def _body(a: torch.Tensor, b: torch.Tensor):
    s = torch.sin(a + b)
    return s, a * b, s


def _graph(read: list[int]) -> fx.GraphModule:
    """One call of the body, a getitem per entry of ``read`` (in that node order), and the
    outputs read combined with distinct weights."""
    root = torch.nn.Module()
    root.body = fx.symbolic_trace(_body)
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    call = g.call_function(INVOKE, (g.get_attr("body"), "body_id", x, y))
    out = None
    for weight, position in enumerate(read, start=1):
        item = g.call_function(operator.getitem, (call, position))
        term = g.call_function(operator.mul, (item, float(weight)))
        out = term if out is None else g.call_function(operator.add, (out, term))
    g.output(out)
    return fx.GraphModule(root, g)


def _read_positions(gm: fx.GraphModule) -> list[int]:
    call = next(iter(gm.graph.find_nodes(op="call_function", target=INVOKE)))
    return [u.args[1] for u in call.users]


def test_the_repeated_positions_are_found():
    assert repeated_output_positions(fx.symbolic_trace(_body)) == {2: 0}


def test_both_positions_read_become_one_getitem_with_the_same_results():
    for order in ([0, 1, 2], [2, 1, 0]):
        gm = _graph(order)
        a, b = torch.randn(3, 5), torch.randn(3, 5)
        expected = gm(a, b)
        assert read_repeated_outputs_once(gm) == 1
        gm.graph.lint()
        gm.recompile()
        torch.testing.assert_close(gm(a, b), expected, rtol=0, atol=0)
        assert sorted(_read_positions(gm)) == [0, 1], order


def test_only_the_later_position_read_reads_the_first():
    gm = _graph([1, 2])
    a, b = torch.randn(3, 5), torch.randn(3, 5)
    expected = gm(a, b)
    assert read_repeated_outputs_once(gm) == 1
    gm.recompile()
    torch.testing.assert_close(gm(a, b), expected, rtol=0, atol=0)
    assert sorted(_read_positions(gm)) == [0, 1]


def test_a_body_without_repeated_outputs_is_left_alone():
    def body(a, b):
        return a + b, a * b

    root = torch.nn.Module()
    root.body = fx.symbolic_trace(body)
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    call = g.call_function(INVOKE, (g.get_attr("body"), "body_id", x, y))
    g.output((g.call_function(operator.getitem, (call, 0)),
              g.call_function(operator.getitem, (call, 1))))
    gm = fx.GraphModule(root, g)
    before = str(gm.graph)
    assert read_repeated_outputs_once(gm) == 0
    assert str(gm.graph) == before
