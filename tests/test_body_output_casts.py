"""shardc.passes.body_output_casts: an output of a block body that the graph only casts (a
one-rank group's gradient to the reduce dtype) is cast inside the body, through the body's
``cat``, so Inductor writes the cast where the body wrote its result. The whole-model checks
are tests/test_parity.py (``packed_bf16`` and ``bf16`` at world 1, bit for bit each other and
within tolerance of the unsharded reference) and the plan note below."""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from shardc.passes.body_output_casts import (
    ONE_RANK_GRAD_CAST,
    body_output_casts_note,
    cast_body_outputs_inside,
)

INVOKE = torch.ops.higher_order.invoke_subgraph
CAST = torch.ops.prims.convert_element_type.default
CAT = torch.ops.aten.cat.default


def _body(a: torch.Tensor, b: torch.Tensor):
    """A packed block's backward in miniature: a "weight gradient" and a second one written
    into one flat buffer (with a gap), and another output."""
    h = a @ b
    flat = torch.cat([h.reshape(1, -1), torch.zeros(1, 3, dtype=a.dtype),
                      (h * 2).sum(0).reshape(1, -1)], 1).view(-1)
    return flat, torch.sigmoid(h)


def _graph(casts: list[tuple[int, ...]], extra_read: bool = False, one_rank: bool = True
           ) -> fx.GraphModule:
    """One call of the body per entry of ``casts`` (the output positions the graph casts to
    float32 and reads only so; the others are read as they are), each call's outputs summed
    into the graph's result. ``extra_read``: the first call's output 0 is also read uncast.
    ``one_rank``: the casts are a one-rank group's gradient casts (lowering's meta)."""
    root = torch.nn.Module()
    a, b = torch.randn(4, 4, dtype=torch.bfloat16), torch.randn(4, 4, dtype=torch.bfloat16)
    root.body = make_fx(_body, tracing_mode="fake")(a, b)
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    attr = g.get_attr("body")
    total = []
    for k, cast in enumerate(casts):
        call = g.call_function(INVOKE, (attr, "body_id", x, y))
        for i in (0, 1):
            item = g.call_function(operator.getitem, (call, i))
            value = g.call_function(CAST, (item, torch.float32)) if i in cast else item
            total.append(g.call_function(torch.ops.aten.sum.default, (value,)))
            if extra_read and k == 0 and i == 0:
                total.append(g.call_function(torch.ops.aten.sum.default, (item,)))
    out = total[0]
    for t in total[1:]:
        out = g.call_function(operator.add, (out, t))
    g.output(out)
    gm = fx.GraphModule(root, g)
    # Fake values as the partitioned graphs carry them (the pass computes new ones from them).
    fake = [n.meta["val"] for n in root.body.graph.find_nodes(op="placeholder")]
    for ph, val in zip(g.find_nodes(op="placeholder"), fake):
        ph.meta["val"] = val
    with fake[0].fake_mode:
        vals = _body(*fake)
    for node in g.nodes:
        if node.target is INVOKE:
            node.meta["val"] = vals
        elif node.target is operator.getitem:
            node.meta["val"] = vals[node.args[1]]
        elif node.target is CAST:
            node.meta["val"] = node.args[0].meta["val"].to(torch.float32)
            node.meta[ONE_RANK_GRAD_CAST] = one_rank
    return gm


def _calls(gm: fx.GraphModule) -> list[fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=INVOKE))


def _inputs():
    return torch.randn(4, 4, dtype=torch.bfloat16), torch.randn(4, 4, dtype=torch.bfloat16)


def test_calls_that_only_cast_an_output_share_one_body_that_casts_it_through_its_cat():
    gm = _graph([(0,), (0,), (0,)])
    a, b = _inputs()
    expected = gm(a, b)
    assert cast_body_outputs_inside(gm) == 3
    gm.recompile()
    torch.testing.assert_close(gm(a, b), expected, rtol=0, atol=0)
    assert not gm.graph.find_nodes(op="call_function", target=CAST)  # no cast outside
    calls = _calls(gm)
    assert len({c.args[0].target for c in calls}) == 1 and calls[0].args[1] != "body_id"
    assert [n.target for n in gm.graph.find_nodes(op="get_attr")] == ["body_cast"]
    assert calls[0].meta["val"][0].dtype == torch.float32
    variant = getattr(gm, calls[0].args[0].target)
    # The cast is taken of each of the cat's inputs, not of the cat.
    (cat,) = variant.graph.find_nodes(op="call_function", target=CAT)
    assert all(p.target is CAST and p.args[1] == torch.float32 for p in cat.args[0])
    assert cat.meta["val"].dtype == torch.float32


def test_a_cast_not_every_call_makes_stays_outside():
    # Every call casts output 0; only the first casts output 1 too: one copy of the body
    # (output 0 cast), the first call's cast of output 1 left where it was.
    gm = _graph([(0, 1), (0,)])
    a, b = _inputs()
    expected = gm(a, b)
    assert cast_body_outputs_inside(gm) == 2
    gm.recompile()
    torch.testing.assert_close(gm(a, b), expected, rtol=0, atol=0)
    (cast,) = gm.graph.find_nodes(op="call_function", target=CAST)
    assert cast.args[0].args[1] == 1
    assert len({c.args[0].target for c in _calls(gm)}) == 1


def test_an_output_read_uncast_too_keeps_its_body():
    gm = _graph([(0,), (0,)], extra_read=True)
    before = gm.code
    assert cast_body_outputs_inside(gm) == 0
    gm.recompile()
    assert gm.code == before and all(c.args[0].target == "body" for c in _calls(gm))


def test_casts_other_than_a_one_rank_gradient_stay_outside():
    # (Above one rank the FX path casts a gradient before packing it: left where it is.)
    gm = _graph([(0,), (0,)], one_rank=False)
    before = gm.code
    assert cast_body_outputs_inside(gm) == 0
    gm.recompile()
    assert gm.code == before


def test_the_plan_note_names_the_body_its_calls_and_the_casts():
    gm = _graph([(0,), (0,)])
    assert body_output_casts_note(gm) is None
    cast_body_outputs_inside(gm)
    note = body_output_casts_note(gm)
    assert "2 call(s) of body cast output 0 to float32 inside the body" in note, note
