"""shardc.passes.aliased_saved_values: where a body call's saved outputs are views of one body
value, the region saves the one laid out as that value and its backward views it into the
others, so Inductor gives their storage one name. Whole-model parity with the pass is every
parity test (shardc's Llama saves its attention output twice in every layer, checked below).
Within one graph, a body output read there and a view of it saved are read through one name
(``read_body_views_through_their_base``): Inductor wrote the first in place while the second
was still to be read."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from shardc.passes.aliased_saved_values import (
    read_body_views_through_their_base,
    save_one_view_per_storage,
    view_path,
)
from shardc.passes.body import body_calls
from shardc.passes.fx_utils import is_call

INVOKE = torch.ops.higher_order.invoke_subgraph
aten = torch.ops.aten


def _body(x: torch.Tensor, w: torch.Tensor):
    base = torch.mm(x, w)  # [4, 6]
    a = base.view(6, 4).t()  # a view of it in another layout
    b = base.detach().detach()  # the value itself, as SDPA's backward saves its output
    return base.sum(1), a, b


def _graphs(saved_order: tuple[int, int] = (1, 2)) -> tuple[fx.GraphModule, fx.GraphModule]:
    """A forward calling the body once (its output 0 returned, outputs 1 and 2 saved in
    ``saved_order``) and a backward reading both saved values."""
    body = make_fx(_body, tracing_mode="fake")(torch.randn(4, 5), torch.randn(5, 6))
    root = torch.nn.Module()
    root.body = body
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    call = g.call_function(INVOKE, (g.get_attr("body"), "body_id", x, w))
    items = {i: g.call_function(operator.getitem, (call, i)) for i in range(3)}
    g.output((items[0], *(items[i] for i in saved_order)))
    fw = fx.GraphModule(root, g)

    mode = FakeTensorMode()
    with mode:
        fakes = {1: torch.empty_strided((4, 6), (1, 4)), 2: torch.empty_strided((4, 6), (6, 1))}
    b = fx.Graph()
    phs = {}
    for i in saved_order:
        phs[i] = b.placeholder(f"saved_{i}")
        phs[i].meta["val"] = fakes[i]
    tangent = b.placeholder("tangents_1")
    # Reads both saved values, the transposed view through an op that sees its layout.
    mixed = b.call_function(aten.add.Tensor, (b.call_function(aten.mul.Tensor, (phs[1], 3.0)),
                                              phs[2]))
    contiguous = b.call_function(aten.clone.default, (phs[1],),
                                 {"memory_format": torch.contiguous_format})
    flat = b.call_function(aten.view.default, (contiguous, [24]))
    b.output((b.call_function(aten.mul.Tensor, (mixed, tangent)), flat))
    return fw, fx.GraphModule(torch.nn.Module(), b)


def _run(fw: fx.GraphModule, bw: fx.GraphModule, x, w, t):
    outs = fw(x, w)
    return outs[0], bw(*outs[1:], t)


def test_the_view_is_dropped_from_the_saved_values_and_derived_in_the_backward():
    for saved_order in ((1, 2), (2, 1)):
        fw, bw = _graphs(saved_order)
        x, w, t = torch.randn(4, 5), torch.randn(5, 6), torch.randn(4, 6)
        expected = _run(fw, bw, x, w, t)
        assert save_one_view_per_storage(fw, bw, num_fwd_outputs=1) == 1
        fw.graph.lint()
        bw.graph.lint()
        got = _run(fw, bw, x, w, t)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        # One saved value, the one laid out as the body's value; the backward views it.
        (kept,) = next(iter(fw.graph.find_nodes(op="output"))).args[0][1:]
        assert kept.args[1] == 2, saved_order
        (saved, _) = bw.graph.find_nodes(op="placeholder")
        assert saved.name == "saved_2"
        assert {u.target for u in saved.users} >= {aten.view.default}
        # The forward no longer reads the dropped output.
        call = next(body_calls(fw))
        assert sorted(u.args[1] for u in call.users) == [0, 2]


# What a traced ``Tensor.detach()`` is: ``aten.detach`` before torch 2.14, ``aten.alias`` on it.
_DETACH = (aten.detach.default, aten.alias.default)


def test_views_of_a_forward_value_saved_twice_are_saved_once():
    """Inline blocks: the forward's own graph saves two views of one of its values."""
    def forward(x, w):
        base = torch.mm(x, w)
        return base.sum(1), base.view(6, 4).t(), base.detach().detach()

    fw = make_fx(forward, tracing_mode="fake")(torch.randn(4, 5), torch.randn(5, 6))
    _, bw = _graphs((1, 2))
    x, w, t = torch.randn(4, 5), torch.randn(5, 6), torch.randn(4, 6)
    expected = _run(fw, bw, x, w, t)
    assert save_one_view_per_storage(fw, bw, num_fwd_outputs=1) == 1
    torch.testing.assert_close(_run(fw, bw, x, w, t), expected, rtol=0, atol=0)
    (kept,) = next(iter(fw.graph.find_nodes(op="output"))).args[0][1:]
    assert kept.target in _DETACH, kept.target


def test_a_call_saving_one_view_or_views_without_the_value_itself_is_left_alone():
    fw, bw = _graphs((1, 2))
    out = next(iter(fw.graph.find_nodes(op="output")))
    # The forward's saved values pair up with the backward's: one of each less, still paired.
    out.args = ((out.args[0][0], out.args[0][1]),)
    saved_2 = bw.graph.find_nodes(op="placeholder")[1]
    saved_2.replace_all_uses_with(bw.graph.find_nodes(op="placeholder")[0])
    bw.graph.erase_node(saved_2)
    assert save_one_view_per_storage(fw, bw, num_fwd_outputs=1) == 0

    # Two saved views, neither laid out as the value: nothing to view the other from.
    def body(x, w):
        base = torch.mm(x, w)
        return base.sum(1), base.view(6, 4).t(), base.t()

    fw, bw = _graphs((1, 2))
    fw.body = make_fx(body, tracing_mode="fake")(torch.randn(4, 5), torch.randn(5, 6))
    assert save_one_view_per_storage(fw, bw, num_fwd_outputs=1) == 0

    # Symbolic sizes (dynamic shapes): left alone, without comparing (guarding) any size.
    fw, bw = _graphs((1, 2))
    fw.body = make_fx(_body, tracing_mode="symbolic")(torch.randn(4, 5), torch.randn(5, 6))
    shape_env = next(n.meta["val"] for n in fw.body.graph.find_nodes(op="placeholder")
                     ).fake_mode.shape_env
    guards = len(shape_env.guards)
    assert save_one_view_per_storage(fw, bw, num_fwd_outputs=1) == 0
    assert len(shape_env.guards) == guards


def test_view_path_walks_single_input_views_to_their_base():
    body = make_fx(_body, tracing_mode="fake")(torch.randn(4, 5), torch.randn(5, 6))
    a, b = next(iter(body.graph.find_nodes(op="output"))).args[0][1:]
    base_a, views_a = view_path(a)
    base_b, views_b = view_path(b)
    assert base_a is base_b and base_a.target == aten.mm.default
    assert [v.target for v in views_a] == [aten.view.default, aten.t.default]
    # torch 2.14's tracer records ``.detach().detach()`` as one ``alias``; earlier ones as two
    # ``detach`` nodes.
    assert views_b and all(v.target in _DETACH for v in views_b), views_b


@pytest.mark.parametrize("once", [True, False], ids=["bodies", "inline"])
def test_shardc_llama_saves_its_attention_output_once_per_block(once):
    """shardc's Llama (the benchmarks' model, tiny) compiled at world 1, its blocks compiled
    once (body calls) or inline: no two saved values are views of one value, and the backward
    takes the attention output's transpose from the one saved (the parity tests check the
    values)."""
    from torch.distributed import group
    from torch.distributed.device_mesh import DeviceMesh

    import shardc
    from shardc.compile.backend import capture_partitioned
    from shardc.models.llama import LlamaConfig, Transformer
    from shardc.tools.fake_world import fake_world

    torch._dynamo.reset()
    torch.manual_seed(0)
    try:
        with fake_world(1), capture_partitioned() as graphs:
            model = Transformer(LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4,
                                            max_seq_len=8))
            model.init_weights()
            shardc.shard(model, DeviceMesh.from_group(group.WORLD, "cpu"))
            forward = torch.compile(model, backend=shardc.backend(
                inductor=False, check_plan_consistency=False, compile_blocks_once=once))
            forward(torch.randint(0, 64, (2, 8))).float().mean().backward()
    finally:
        torch._dynamo.reset()
    (fw, bw), = graphs
    outputs = next(iter(fw.graph.find_nodes(op="output"))).args[0]
    calls = list(body_calls(fw))
    assert len(calls) == (3 if once else 0)
    for call in calls:
        body = getattr(fw, call.args[0].target)
        values = next(iter(body.graph.find_nodes(op="output"))).args[0]
        saved = [u.args[1] for u in call.users if u in outputs]
        bases = [view_path(values[p])[0] for p in saved]
        assert len(set(bases)) == len(bases), (call.name, saved)
    bases = [view_path(o)[0] for o in outputs if isinstance(o, fx.Node)
             and not is_call(view_path(o)[0], operator.getitem)]
    assert len(set(bases)) == len(bases)
    # The attention output's other view is taken in the backward, once per block.
    derived = [n for n in bw.graph.nodes if n.op == "call_function"
               and n.target == aten.transpose.int
               and n.args[0].op == "placeholder"]
    assert len(derived) == 3, [n.format_node() for n in derived]


def _value_and_view(x: torch.Tensor, w: torch.Tensor):
    base = x + w  # [4, 6]
    return base, base.view(24).view(2, 12), base.sum()


def _reads_one_saves_the_other() -> fx.GraphModule:
    """A forward reading its body call's output 0 and saving output 1, a view of it."""
    body = make_fx(_value_and_view, tracing_mode="fake")(torch.randn(4, 6), torch.randn(4, 6))
    root = torch.nn.Module()
    root.body = body
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    call = g.call_function(INVOKE, (g.get_attr("body"), "body_id", x, w))
    value = g.call_function(operator.getitem, (call, 0))
    view = g.call_function(operator.getitem, (call, 1))
    g.output((g.call_function(aten.mul.Tensor, (value, 2.0)), view))
    mode = FakeTensorMode()
    with mode:
        fakes = {"x": torch.empty(4, 6), "w": torch.empty(4, 6), "getitem": torch.empty(4, 6),
                 "getitem_1": torch.empty(2, 12)}
    for node in g.nodes:
        if node.name in fakes:
            node.meta["val"] = fakes[node.name]
    return fx.GraphModule(root, g)


def test_a_saved_view_of_an_output_the_graph_reads_is_read_through_that_output():
    gm = _reads_one_saves_the_other()
    x, w = torch.randn(4, 6), torch.randn(4, 6)
    expected = gm(x, w)
    assert read_body_views_through_their_base(gm) == 1
    (call,) = body_calls(gm)
    assert [u.args[1] for u in call.users] == [0]  # one name for the storage
    saved = next(iter(gm.graph.find_nodes(op="output"))).args[0][1]
    base, views = view_path(saved)
    assert base.args[1] == 0 and [v.target for v in views] == [aten.view.default] * 2
    for got, want in zip(gm(x, w), expected, strict=True):
        assert torch.equal(got, want)
    assert read_body_views_through_their_base(gm) == 0  # nothing left to do


def _view_of_input(x: torch.Tensor, w: torch.Tensor):
    return x.view(24), torch.mm(x, w)


def test_an_output_viewing_an_operand_is_read_as_that_view_of_the_operand():
    """A body returning a view of its input (a recomputed block's pruned forward does): the
    caller reads the view of its own operand, so the operand's buffer has one name."""
    body = make_fx(_view_of_input, tracing_mode="fake")(torch.randn(4, 6), torch.randn(6, 2))
    root = torch.nn.Module()
    root.body = body
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    doubled = g.call_function(aten.mul.Tensor, (x, 2.0))
    call = g.call_function(INVOKE, (g.get_attr("body"), "body_id", doubled, w))
    view = g.call_function(operator.getitem, (call, 0))
    product = g.call_function(operator.getitem, (call, 1))
    g.output((view, product))
    mode = FakeTensorMode()
    with mode:
        fakes = {"x": torch.empty(4, 6), "w": torch.empty(6, 2), "mul_tensor": torch.empty(4, 6),
                 "getitem": torch.empty(24), "getitem_1": torch.empty(4, 2)}
    for node in g.nodes:
        if node.name in fakes:
            node.meta["val"] = fakes[node.name]
    gm = fx.GraphModule(root, g)
    args = torch.randn(4, 6), torch.randn(6, 2)
    expected = gm(*args)
    assert read_body_views_through_their_base(gm) == 1
    read = next(iter(gm.graph.find_nodes(op="output"))).args[0][0]
    base, views = view_path(read)
    assert base is doubled and [v.target for v in views] == [aten.view.default]
    for got, want in zip(gm(*args), expected, strict=True):
        assert torch.equal(got, want)


def _value_and_flat_view(x: torch.Tensor, w: torch.Tensor):
    base = x + w  # [n, 6]
    return base, base.view(base.shape[0] * 6), base.sum()


def test_a_saved_view_with_a_symbolic_size_is_read_through_that_output():
    """Under dynamic shapes the view reads a size node of the body (``view(base, [6*s0])``);
    the caller replays it with the size computed from its own symbol placeholder. Without
    that (torch 2.11, a dynamic-shape recompile) Inductor computed the outer graph's sum in
    place in output 0's buffer while output 1, a view of it, was still saved for the
    backward: the last sunk block's weight gradient came out wrong."""
    body = make_fx(_value_and_flat_view, tracing_mode="symbolic")(
        torch.randn(4, 6), torch.randn(4, 6))
    x_val = body.graph.find_nodes(op="placeholder")[0].meta["val"]
    mode, rows = x_val.fake_mode, x_val.shape[0]
    root = torch.nn.Module()
    root.body = body
    g = fx.Graph()
    n, x, w = g.placeholder("n"), g.placeholder("x"), g.placeholder("w")
    call = g.call_function(INVOKE, (g.get_attr("body"), "body_id", x, w))
    value = g.call_function(operator.getitem, (call, 0))
    view = g.call_function(operator.getitem, (call, 1))
    g.output((g.call_function(aten.mul.Tensor, (value, 2.0)), view))
    with mode:
        x_fake, value_fake = torch.empty(rows, 6), torch.empty(rows, 6)
        view_fake = torch.empty(rows * 6)
    n.meta["val"] = rows
    x.meta["val"], w.meta["val"] = x_fake, torch.empty_like(x_fake)
    value.meta["val"], view.meta["val"] = value_fake, view_fake
    gm = fx.GraphModule(root, g)
    args = 5, torch.randn(5, 6), torch.randn(5, 6)
    expected = gm(*args)
    assert read_body_views_through_their_base(gm) == 1
    (call,) = body_calls(gm)
    assert [u.args[1] for u in call.users] == [0]  # one name for the storage
    saved = next(iter(gm.graph.find_nodes(op="output"))).args[0][1]
    base, views = view_path(saved, symbolic=True)
    assert base.args[1] == 0 and [v.target for v in views] == [aten.view.default]
    (size,) = [a for a in views[0].all_input_nodes if a is not base]
    assert size.target is operator.mul and set(size.args) == {n, 6}
    for got, want in zip(gm(*args), expected, strict=True):
        assert torch.equal(got, want)
