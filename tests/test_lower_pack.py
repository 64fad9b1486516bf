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
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import shardc.ops.gather  # noqa: F401  (registers the shardc ops)
from shardc.compile.options import ShardcOptions
from shardc.memory import peak
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


def _one_rank_region(params: int):
    """World 1 (every collective elided): a forward whose block body reads a bucket of
    ``params`` gathered weights (bf16 compute), and a backward that gathers them again for the
    body's backward, which returns their bf16 gradients, reduced in fp32. Traced with fake
    tensors; the bodies are ``invoke_subgraph`` calls as Dynamo emits them."""
    gather, reduce = torch.ops.shardc.gather_param, torch.ops.shardc.reduce_scatter_grad
    group = dist.group.WORLD.group_name
    names = [f"layers.0.w{j}" for j in range(params)]
    shapes = [(64, 32) if j % 2 else (32, 64) for j in range(params)]  # uneven layouts

    def body(x, *weights):
        return (sum((x[:, :w.shape[1]] @ w.t()).sum() for w in weights) + x.sum(),)

    def body_bw(x, *weights):
        return tuple(w * (x.mean() + j) for j, w in enumerate(weights))

    fake = FakeTensorMode()
    with fake:
        x = torch.randn(8, 64, dtype=torch.bfloat16)
        ws = [torch.randn(s, dtype=torch.bfloat16) for s in shapes]
    body_gm, bw_gm = (make_fx(f, tracing_mode="fake")(x, *ws) for f in (body, body_bw))

    def gathered(shards):
        return [gather(s, name, s.shape[0], 1, group, torch.bfloat16, torch.float32, True)
                for name, s in zip(names, shards)]

    def forward(x, *shards):
        (h,) = torch.ops.higher_order.invoke_subgraph(body_gm, "body", x, *gathered(shards))
        return h

    def backward(x, *shards):
        grads = torch.ops.higher_order.invoke_subgraph(bw_gm, "body_bw", x, *gathered(shards))
        return [reduce(g, name, g.shape[0], 1, group, torch.float32, torch.float32)
                for name, g in zip(names, grads)]

    torch.manual_seed(0)
    shards = [torch.randn(s) for s in shapes]
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    fw = make_fx(forward, tracing_mode="fake")(x, *shards)
    bw = make_fx(backward, tracing_mode="fake")(x, *shards)
    return fw, bw, x, shards


def _lower_one_rank(params: int, one_op_casts: bool):
    with fake_world(1):
        fw, bw, x, shards = _one_rank_region(params)
        plan = plan_region(fw, bw, ShardcOptions(inductor=True))
        assert plan.collectives and all(c.elided for c in plan.collectives)
        for name, gm in (("forward", fw), ("backward", bw)):
            apply_plan(gm, plan, name, rank=0, fusing=True, one_op_casts=one_op_casts)
        outs = {"forward": fw(x, *shards), "backward": bw(x, *shards)}
    counts = {name: collections.Counter(str(n.target) for n in gm.graph.nodes
                                        if n.op == "call_function")
              for name, gm in (("forward", fw), ("backward", bw))}
    peaks = {name: peak.liveness_peak(gm, set(), fusion=True)[0]
             for name, gm in (("forward", fw), ("backward", bw))}
    return counts, outs, peaks, (fw, bw)


def test_one_rank_casts_are_one_op_per_bucket_with_the_same_bits_and_peak():
    """World 1 under Inductor (``one_op_local_casts``, the default): a bucket's gathers, cast
    to the compute dtype for the one body call that reads them, and its gradients, cast to the
    reduce dtype as they come out of one body call, are one ``shardc::cast_into`` each instead
    of a cast per parameter, whatever the bucket holds; right before the reading call. The
    lowered graphs compute the same bits as the per-parameter casts, and the memory model
    predicts the same peak for both."""
    cast = "prims.convert_element_type.default"
    two, six = _lower_one_rank(2, True), _lower_one_rank(6, True)
    for counts, _, _, (fw, bw) in (two, six):
        assert counts["forward"]["shardc.cast_into.default"] == 1 and counts["forward"][cast] == 0
        # the weights gathered again for the body's backward, and the gradients
        assert counts["backward"]["shardc.cast_into.default"] == 2, counts["backward"]
        assert counts["backward"][cast] == 0
        for gm in (fw, bw):
            (body,) = gm.graph.find_nodes(op="call_function",
                                          target=torch.ops.higher_order.invoke_subgraph)
            (into, *_) = [n for n in gm.graph.nodes if str(n.target) == "shardc.cast_into.default"]
            if gm is fw or into.next is body:
                assert into.next is body and list(body.args[3:]) == list(into.args[1])
    for params, one in ((2, two), (6, six)):
        counts, outs, peaks, _ = _lower_one_rank(params, False)
        assert counts["forward"]["shardc.cast_into.default"] == 0
        assert counts["forward"][cast] == params and counts["backward"][cast] == 2 * params
        assert torch.equal(one[1]["forward"], outs["forward"])
        assert len(one[1]["backward"]) == params
        for a, b in zip(one[1]["backward"], outs["backward"]):
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
        assert one[2] == peaks, (one[2], peaks)


def test_pool_pack_and_unpack_into_take_one_kernel_only_where_it_is_the_same_layout():
    """``pool_pack`` packs with one ``torch._chunk_cat`` where the rows per rank are the
    tensors' even split and they share a dtype, ``unpack_into`` with one
    ``torch.split_with_sizes_copy`` where the outputs cover the buffer's columns in order;
    otherwise they copy tensor by tensor. Both give the layout the docstrings define (checked
    against slices here) in every case: even and uneven rows, a transposed gradient, a 1-D
    weight, mixed dtypes, padding rows wider than the split."""
    torch.manual_seed(0)
    for world in (1, 2, 3, 4):
        grads = [torch.randn(10, 3).bfloat16(), torch.randn(7, 5).t().bfloat16(),
                 torch.randn(9).bfloat16()]
        for mixed, wide in ((False, 0), (True, 0), (False, 1)):
            tensors = [g.float() if mixed and i == 1 else g for i, g in enumerate(grads)]
            rows = [-(-t.shape[0] // world) + wide for t in tensors]
            row_numel = [t[0].numel() for t in tensors]
            n = sum(r * k for r, k in zip(rows, row_numel))
            table = torch.full((world, n), float("nan"))
            pool_pack(table, tensors, rows, world, True, 2)
            off = 0
            for t, r, k in zip(tensors, rows, row_numel):
                padded = torch.zeros(r * world, *t.shape[1:])
                padded[:t.shape[0]] = t.float()
                want = padded.view(world, r * k) / 2
                assert torch.equal(table[:, off:off + r * k], want), (world, mixed, wide)
                off += r * k
            shards = [t[:r] for t, r in zip(tensors, rows)]  # rank 0's shard (all rows)
            send = torch.full((n,), float("nan"), dtype=torch.bfloat16)
            pool_pack(send, shards, rows, world, False)
            off = 0
            for s, r, k in zip(shards, rows, row_numel):
                want = torch.zeros(r * k, dtype=torch.bfloat16)
                want[:s.numel()] = s.reshape(-1)
                assert torch.equal(send[off:off + r * k], want), (world, mixed, wide)
                off += r * k
    cols, world = [4, 10, 6], 3
    table = torch.arange(world * 22, dtype=torch.float32).view(world, -1)
    for offsets in ([0, 4, 14], [2, 6, 16]):  # in order to the last column; not
        outs = [torch.empty(world * c) for c in cols]
        unpack_into(table.view(-1), world, offsets, outs)
        for out, off, c in zip(outs, offsets, cols):
            assert torch.equal(out, table[:, off:off + c].reshape(-1))
