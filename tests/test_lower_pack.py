"""Pool-less lowering (Inductor's default) fills a bucket's send buffer with one
``shardc::pool_pack`` into an ``empty`` buffer of the graph, not a cast, pad and view per
parameter and a ``cat``: the send side's node count does not grow with the bucket's parameters
(issue 18, compile once per repeated block), and the buffer holds the same bits as before.
One process, graphs traced with fake tensors; the op runs eagerly on small tensors."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import shardc.ops.gather  # noqa: F401  (registers the shardc ops)
from shardc.compile.options import ShardcOptions
from shardc.ops.pool import pool_pack, unpack_into
from shardc.passes.lower import apply_plan
from shardc.planning.plan import CollectiveKind
from shardc.planning.schedule import plan_region
from shardc.tools.fake_world import fake_world

_SEND_SIDE = ("prims.convert_element_type.default", "aten.cat.default",
              "aten.constant_pad_nd.default", "aten.div.Tensor", "shardc.pool_pack.default",
              "aten.empty.memory_format")


def _region(params: int, world: int, group: str, dim0: int = 64):
    """A forward gathering ``params`` weights of one block (bf16 compute) and a backward
    reducing their gradients (fp32 reduce), traced with fake tensors."""
    gather, reduce = torch.ops.shardc.gather_param, torch.ops.shardc.reduce_scatter_grad
    names = [f"layers.0.w{j}" for j in range(params)]

    def gathered(shards):
        return [gather(s, name, dim0, world, group, torch.bfloat16, torch.float32, True)
                for name, s in zip(names, shards)]

    def forward(x, *shards):
        h = x
        for w in gathered(shards):
            h = torch.relu(h @ w.float().t()[:, :64])
        return h.sum()

    def backward(x, *shards_and_grads):  # the weights gathered again (resharded), as torch's
        shards, grads = shards_and_grads[:params], shards_and_grads[params:]
        return [reduce(g * w, name, dim0, world, group, torch.float32, torch.float32)
                for name, w, g in zip(names, gathered(shards), grads)]

    rows = -(-dim0 // world)
    shards = [torch.randn(rows, 64) for _ in names]
    grads = [torch.randn(dim0, 64, dtype=torch.bfloat16) for _ in names]
    fw = make_fx(forward, tracing_mode="fake")(torch.randn(8, 64), *shards)
    bw = make_fx(backward, tracing_mode="fake")(torch.randn(8, 64), *shards, *grads)
    return fw, bw


def _lowered(params: int, world: int, dim0: int = 64, one_op: bool = True
             ) -> dict[str, collections.Counter]:
    """The lowered graphs' call counts by op, planned at rank 0 of a fake world, with
    ``ShardcOptions.one_op_bucket_copies`` (``one_op``) as given."""
    with fake_world(world):
        return _lower(params, world, dist.group.WORLD.group_name, dim0, one_op)


def _lower(params: int, world: int, group: str, dim0: int, one_op: bool
           ) -> dict[str, collections.Counter]:
    fw, bw = _region(params, world, group, dim0)
    plan = plan_region(fw, bw, ShardcOptions(inductor=True))
    assert plan.pool_offsets == {}  # Inductor's default: no pool
    kinds = collections.Counter(c.kind for c in plan.collectives)
    assert kinds == {CollectiveKind.ALL_GATHER: 2, CollectiveKind.REDUCE_SCATTER: 1}, kinds
    assert all(len(c.params) == params for c in plan.collectives)  # one bucket
    counts = {}
    for name, gm in (("forward", fw), ("backward", bw)):
        apply_plan(gm, plan, name, rank=0, one_op=one_op)
        counts[name] = collections.Counter(str(n.target) for n in gm.graph.nodes
                                           if n.op == "call_function")
    return counts


def _send_side(counts: collections.Counter) -> dict[str, int]:
    return {op: counts[op] for op in _SEND_SIDE if counts[op]}


def test_send_buffers_are_packed_by_one_op_whatever_the_bucket_holds():
    two, six = _lowered(2, 2), _lowered(6, 2)
    # Forward: one all-gather, its send buffer one empty + one pack; the backward's all-gather
    # (resharded, gathered again) and reduce-scatter the same.
    assert _send_side(two["forward"]) == {"shardc.pool_pack.default": 1,
                                         "aten.empty.memory_format": 1}
    assert _send_side(two["backward"]) == {"shardc.pool_pack.default": 2,
                                          "aten.empty.memory_format": 2}
    for graph in ("forward", "backward"):
        assert _send_side(six[graph]) == _send_side(two[graph])  # not per parameter


def test_without_the_option_send_buffers_stay_per_parameter():
    """``one_op_bucket_copies`` is off by default: each send buffer is a cast per parameter
    and a ``cat``, as before (its step time on GPUs is not measured yet)."""
    for params in (2, 6):
        counts = _lowered(params, 2, one_op=False)
        assert counts["forward"]["shardc.pool_pack.default"] == 0
        assert counts["forward"]["aten.cat.default"] == 1
        assert counts["forward"]["prims.convert_element_type.default"] >= params
    assert not ShardcOptions().one_op_bucket_copies


def test_a_divisor_that_is_no_power_of_two_keeps_the_per_tensor_reduce():
    """World 3: the gradient's 1/3 stays Inductor's own arithmetic (on GPUs a multiplication by
    the reciprocal, which an exact division would not reproduce); the all-gather, a cast only,
    is packed, with uneven rows (64 = 22 + 22 + 20) padded by the op."""
    counts = _lowered(3, 3)
    assert _send_side(counts["forward"]) == {"shardc.pool_pack.default": 1,
                                             "aten.empty.memory_format": 1}
    back = _send_side(counts["backward"])
    assert back["shardc.pool_pack.default"] == 1 and back["aten.cat.default"] == 1
    assert back["aten.div.Tensor"] == 3 and back["prims.convert_element_type.default"] == 3


def _old_gather_send(shards, rows, dtype):
    pieces = [F.pad(s.to(dtype), [0, 0] * (s.dim() - 1) + [0, r - s.shape[0]]).reshape(-1)
              for s, r in zip(shards, rows)]
    return torch.cat(pieces)


def _old_reduce_send(grads, rows, world, dtype, divisor):
    pieces = []
    for g, r in zip(grads, rows):
        x = g.to(dtype) / divisor
        x = F.pad(x, [0, 0] * (x.dim() - 1) + [0, r * world - x.shape[0]]).contiguous()
        pieces.append(x.view(world, -1))
    return torch.cat(pieces, 1)


@pytest.mark.parametrize("world", [2, 4])
def test_the_packed_send_buffers_hold_the_bits_of_the_per_tensor_ones(world):
    torch.manual_seed(0)
    # uneven rows (padding), a 1-D norm weight, a non-contiguous (transposed) gradient
    dims = [(7, 3), (8, 5), (6,), (4, 4)]
    rows = [-(-d[0] // world) for d in dims]
    shards = [torch.randn(min(r, d[0]), *d[1:]) * 100 for r, d in zip(rows, dims)]
    out = torch.empty(sum(r * torch.Size(d[1:]).numel() for r, d in zip(rows, dims)),
                      dtype=torch.bfloat16)
    pool_pack(out, shards, rows, world, False)
    assert torch.equal(out, _old_gather_send(shards, rows, torch.bfloat16))
    grads = [torch.randn(*d, dtype=torch.bfloat16) for d in dims]
    grads[3] = torch.randn(4, 4, dtype=torch.bfloat16).t()
    assert not grads[3].is_contiguous()
    table = torch.empty(world, out.numel(), dtype=torch.float32)
    pool_pack(table, grads, rows, world, True, world)
    assert torch.equal(table, _old_reduce_send(grads, rows, world, torch.float32, world))


def _body_region(params: int, group: str):
    """A forward whose gathered weights (one bucket) are read only by one block-body call
    (``invoke_subgraph``), traced with fake tensors, as Inductor's default gets it."""
    gather = torch.ops.shardc.gather_param
    names = [f"layers.0.w{j}" for j in range(params)]

    def body(x, *weights):
        h = x
        for w in weights:
            h = torch.relu(h @ w.float().t())
        return (h,)

    body_gm = make_fx(body, tracing_mode="fake")(torch.randn(8, 64),
                                                 *(torch.randn(64, 64) for _ in names))

    def forward(x, *shards):
        weights = [gather(s, name, 64, 2, group, torch.bfloat16, torch.float32, True)
                   for name, s in zip(names, shards)]
        (h,) = torch.ops.higher_order.invoke_subgraph(body_gm, "body", x, *weights)
        return h.sum()

    return make_fx(forward, tracing_mode="fake")(torch.randn(8, 64),
                                                 *(torch.randn(32, 64) for _ in names))


def _lowered_body(params: int, fusing: bool) -> collections.Counter:
    with fake_world(2):
        fw = _body_region(params, dist.group.WORLD.group_name)
        plan = plan_region(fw, None, ShardcOptions(inductor=True))
        apply_plan(fw, plan, "forward", rank=0, fusing=fusing, one_op=True)
    nodes = list(fw.graph.nodes)
    call = next(n for n in nodes if n.target is torch.ops.higher_order.invoke_subgraph)
    unpacks = [n for n in nodes if str(n.target) == "shardc.unpack_into.default"]
    if fusing:  # right before the body call, its outputs the call's weights
        assert len(unpacks) == 1 and unpacks[0].next is call
        assert list(call.args[3:]) == list(unpacks[0].args[3])
    return collections.Counter(str(n.target) for n in nodes if n.op == "call_function")


def test_a_bucket_one_body_call_reads_is_copied_out_by_one_op_before_it():
    """Under Inductor the gathered copies of a bucket read by one body call are one
    ``shardc::unpack_into`` right before the call, into an ``empty`` per parameter (buffers
    Inductor allocates, as it did the clones): no copy node per parameter. FX keeps a clone
    per parameter at the wait."""
    two, six = _lowered_body(2, True), _lowered_body(6, True)
    for counts, params in ((two, 2), (six, 6)):
        assert counts["aten.clone.default"] == 0 and counts["aten.slice.Tensor"] == 0
        assert counts["shardc.unpack_into.default"] == 1
        assert counts["aten.empty.memory_format"] == params + 1  # + the send buffer
    fx_run = _lowered_body(6, False)
    assert fx_run["shardc.unpack_into.default"] == 0 and fx_run["aten.clone.default"] == 6


def test_unpack_into_copies_each_ranks_columns():
    world, cols = 3, [4, 10, 6]
    table = torch.arange(world * sum(cols), dtype=torch.float32).view(world, -1)
    outs = [torch.empty(world * c) for c in cols]
    unpack_into(table.view(-1), world, [0, 4, 14], outs)
    for out, off, c in zip(outs, [0, 4, 14], cols):
        assert torch.equal(out, table[:, off:off + c].reshape(-1))
