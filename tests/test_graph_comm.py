"""Collectives found in the traced graph (tensor parallelism): recognized, planned on their
group's lane, moved as far as their data allows, lowered in a valid order (one process, graphs
traced with fake tensors: nothing runs)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import shardc.ops.gather  # noqa: F401  (registers shardc::gather_param)
from shardc.compile.options import ShardcOptions
from shardc.passes.lower import apply_plan
from shardc.planning.schedule import plan_region
from shardc.runtime.comm_errors import describe
from shardc.runtime.plan_check import _describe

funcol = torch.ops._c10d_functional
GROUPS = {"dp": ("shard", 2), "tpg": ("tp", 2)}


def _tp_forward(x, w_shard, z):
    w = torch.ops.shardc.gather_param(w_shard, "w", 8, 2, "dp", None, None, True)
    y = x @ w.t()
    q = torch.relu(z) * 2  # independent of y: overlaps the all-reduce once its wait moves
    h = funcol.wait_tensor(funcol.all_reduce(y, "sum", "tpg"))
    s = q.sum()
    g = funcol.wait_tensor(funcol.all_gather_into_tensor(z, 2, "tpg"))  # reads an input
    wg = funcol.wait_tensor(funcol.all_gather_into_tensor(w, 2, "tpg"))  # a gathered param
    return h + s, g, wg.sum()


def _trace(fn, *shapes):
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))


def _plan(gm, **options):
    return plan_region(gm, None, ShardcOptions(inductor=False, **options), groups=GROUPS)


def _order(gm) -> dict[str, int]:
    return {n.name: i for i, n in enumerate(gm.graph.nodes)}


def test_found_collectives_are_planned_moved_and_lowered_in_order():
    gm = _trace(_tp_forward, (4, 8), (4, 8), (4, 8))
    plan = _plan(gm)
    ops = [op.name for op in plan.graphs["forward"]]
    found = {c.id: c for c in plan.collectives if c.origin == "graph"}
    assert sorted(found) == ["forward.all_gather.tp.1", "forward.all_gather.tp.2",
                             "forward.all_reduce.tp.0"]
    assert not any(name.startswith(("all_reduce", "all_gather", "wait_tensor")) for name in ops)
    ar, ag, agw = (found[f"forward.{k}.tp.{i}"] for k, i in
                   (("all_reduce", 0), ("all_gather", 1), ("all_gather", 2)))
    for c in (ar, ag, agw):
        assert (c.group, c.stream, c.group_size, c.bucket, c.params) == ("tp", "tp", 2, -1, [])
        assert c.buffer_lifetime is None and c.dtype == "float32"
    # bytes: 4x8 float32 in; the all-gathers receive twice that
    assert (ar.bytes, ar.buffer_bytes) == (128, 128) and (ag.bytes, ag.buffer_bytes) == (128, 256)
    assert ar.tensors == ["mm: float32[4, 8]", "wait_tensor: float32[4, 8]"]
    assert ar.nodes == ["all_reduce", "wait_tensor"]
    # the all-reduce: issued right after its matmul, waited before the add that reads it
    assert ar.issue_pos == ops.index("mm") + 1 and ar.wait_pos == ops.index("add")
    assert ar.overlaps == ops[ar.issue_pos:ar.wait_pos] and "relu" in ar.overlaps
    assert "as soon as its input exists" in ar.reason and "first reader" in ar.reason
    # the all-gather of an input could go at 0, but not before the all-reduce of its group
    assert ag.issue_pos == ar.issue_pos and ag.wait_pos == len(ops)
    # the all-gather of a gathered parameter is issued where traced (shardc places that gather),
    # but still waited before its first reader
    assert "issued where traced (it reads a tensor shardc gathers)" in agw.reason
    assert agw.issue_pos == ops.index("add") and agw.wait_pos == ops.index("sum_2")
    # its lane is its own: it starts when issued (after the op before its issue, no later
    # than the op after it), though the shard lane is busy until later
    fw_ops = plan.graphs["forward"]
    assert fw_ops[ar.issue_pos - 1].predicted_end_s <= ar.predicted_start_s
    assert ar.predicted_start_s <= fw_ops[ar.issue_pos].predicted_start_s
    assert plan.predicted["exposed_comm_s"] == pytest.approx(
        sum(c.exposed_s for c in plan.collectives))
    apply_plan(gm, plan, "forward", rank=0)  # lints the graph
    order = _order(gm)
    assert order["mm"] < order["all_reduce"] < order["all_gather_into_tensor"] < order["relu"]
    assert order["sum_1"] < order["all_gather_into_tensor_1"] < order["wait_tensor"]
    assert order["wait_tensor"] == order["add"] - 1 and order["wait_tensor_2"] == order["sum_2"] - 1
    gathered = [n for n in gm.graph.nodes if n.target is funcol.wait_tensor.default
                and n.args[0].args[-1] == "dp"]
    assert order[gathered[0].name] < order["all_gather_into_tensor_1"]


def test_kept_where_traced_when_asked_or_when_written_in_place():
    gm = _trace(_tp_forward, (4, 8), (4, 8), (4, 8))
    traced = _plan(gm, move_found_collectives=False)
    ops = [op.name for op in traced.graphs["forward"]]
    ar = next(c for c in traced.collectives if c.id == "forward.all_reduce.tp.0")
    assert ar.issue_pos == ar.wait_pos == ops.index("sum_1")
    assert "issued where traced (move_found_collectives=False)" in ar.reason
    # The hash covers the found collectives' kinds and order (not their activation bytes).
    moved = _plan(gm)
    assert traced.hash() == moved.hash()
    assert "kept where traced (move_found_collectives=False)" in traced.notes[0]
    found = moved.collectives[-1]
    found.kind = "all_to_all"
    assert moved.hash() != traced.hash()
    # Errors name a found collective by its group and nodes (it has no bucket).
    assert "all_to_all forward.all_gather.tp.2 (float32) in forward, found in the traced graph" \
        == _describe(found.signature())
    message = describe(found.id, moved, RuntimeError("timed out"))
    assert f"all_to_all of the traced graph over the tp group ({', '.join(found.nodes)})" in message

    def in_place(x, y):
        a = x * 2
        funcol.wait_tensor(funcol.all_reduce_(a, "sum", "tpg"))
        return a + y.relu()

    def with_param(x, y, w_shard):
        w = torch.ops.shardc.gather_param(w_shard, "w", 8, 2, "dp", None, None, True)
        return in_place(x, y) + w.sum()

    gm = _trace(with_param, (4, 8), (4, 8), (4, 8))
    (c,) = [c for c in _plan(gm).collectives if c.origin == "graph"]
    assert "it writes its input in place" in c.reason and c.issue_pos == c.wait_pos
