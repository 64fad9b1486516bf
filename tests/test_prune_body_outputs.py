"""shardc.passes.prune_body_outputs: a body call whose outputs are partly read runs a copy of the
body that computes only those (a recomputed block's forward body in the backward). The
whole-model checks are in tests/test_real_models.py (the recomputed bodies' matmuls, with
parity)."""

from __future__ import annotations

import operator

import torch
from torch import fx

from shardc.passes.prune_body_outputs import prune_unused_body_outputs, pruned_body_note

INVOKE = torch.ops.higher_order.invoke_subgraph


def _body(a: torch.Tensor, b: torch.Tensor):
    h = a @ b
    return torch.relu(h) + a, torch.sigmoid(h), a


def _graph(reads: list[tuple[int, ...]]) -> fx.GraphModule:
    """One call of the body per entry of ``reads`` (each output position read by a getitem),
    chained on the first read output, and the sum of every read output returned."""
    root = torch.nn.Module()
    root.body = fx.symbolic_trace(_body)
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    attr = g.get_attr("body")
    out = None
    for read in reads:
        call = g.call_function(INVOKE, (attr, "body_id", x, y))
        items = [g.call_function(operator.getitem, (call, i)) for i in read]
        x = items[0]
        for item in items:
            out = item if out is None else g.call_function(operator.add, (out, item))
    g.output(out)
    gm = fx.GraphModule(root, g)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    for call in gm.graph.find_nodes(op="call_function", target=INVOKE):
        call.meta["val"] = _body(a, b)
    return gm


def _calls(gm: fx.GraphModule) -> list[fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=INVOKE))


def _ops(body: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in body.graph.nodes if n.op in ("call_function", "call_method")]


def test_calls_reading_some_outputs_share_one_pruned_body_with_the_same_results():
    gm = _graph([(1,), (1,), (0, 1, 2)])
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    expected = gm(a, b)
    assert prune_unused_body_outputs(gm) == 2
    gm.recompile()
    torch.testing.assert_close(gm(a, b), expected, rtol=0, atol=0)
    first, second, whole = _calls(gm)
    # The two calls that read output 1 share one pruned body and identifier ...
    assert first.args[0] is second.args[0] and first.args[1] == second.args[1] != "body_id"
    pruned = getattr(gm, first.args[0].target)
    assert "relu" not in _ops(pruned) and "<built-in function add>" not in _ops(pruned)
    assert len(first.meta["val"]) == 1 and all(u.args[1] == 0 for u in first.users)
    # ... and the call that reads everything keeps the full body.
    assert whole.args[0].target == "body" and whole.args[1] == "body_id"


def test_calls_whose_unread_outputs_cost_nothing_are_left_alone():
    # Output 2 is an input passed through and output 0 is read: nothing to remove.
    gm = _graph([(0, 1)])
    before = gm.code
    assert prune_unused_body_outputs(gm) == 0
    gm.recompile()
    assert gm.code == before and _calls(gm)[0].args[0].target == "body"


def test_the_full_body_is_dropped_from_the_graph_when_no_call_reads_it():
    gm = _graph([(1,), (0, 1)])
    assert prune_unused_body_outputs(gm) == 1
    assert [n.target for n in gm.graph.find_nodes(op="get_attr")] == ["body", "body_pruned"]
    gm = _graph([(1,)])
    assert prune_unused_body_outputs(gm) == 1
    assert [n.target for n in gm.graph.find_nodes(op="get_attr")] == ["body_pruned"]


def test_the_plan_note_names_the_pruned_body_its_calls_and_what_it_keeps():
    gm = _graph([(1,), (1,), (0, 1, 2)])
    assert pruned_body_note(gm) is None
    prune_unused_body_outputs(gm)
    note = pruned_body_note(gm)
    # The full body: matmul, relu, add, sigmoid; the copy keeps the matmul and the sigmoid.
    assert "2 call(s) of body read 1 of its 3 outputs" in note, note
    assert "(2 of its 4 ops)" in note, note
