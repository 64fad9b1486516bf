"""``shardc.shard(..., pack_blocks=True)``: each repeated block's shards in one buffer, read and
gathered as one tensor (shardc.sharding.packed_blocks). Training parity over worlds 1-4 is in
tests/test_parity.py (``packed*`` scenarios); here the layout, what users see of the parameters,
and what keeps the buffer and the parameters one."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from dist_utils import one_rank_mesh
from torch import nn
from torch.distributed.tensor import DTensor

import shardc
from shardc.sharding.packed_blocks import LEAF_ATTR, PackedLayout


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(5, 13)
        self.gate = nn.Parameter(torch.randn(3))
        self.down = nn.Linear(13, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)) * self.gate.sum())


class Stack(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layout_unpacks_every_ranks_shards_into_the_full_weights(world):
    """Each rank's buffer holds its ``torch.chunk`` shard of every parameter, padded to the
    same rows on every rank; the ranks' buffers end to end unpack into the full weights (rows
    13, 5, 3 and 1: uneven or empty shards at every world above 1)."""
    block = Block()
    block.bias_row = nn.Parameter(torch.randn(1, 4))
    names = tuple(n for n, _ in block.named_parameters())
    layout = PackedLayout.of(block, names, world)
    buffers = torch.zeros(world, layout.numel)
    for rank in range(world):
        for e in layout.entries:
            shard = block.get_parameter(e.name).detach().chunk(world)
            if rank < len(shard):
                piece = shard[rank].reshape(-1)
                buffers[rank, e.offset:e.offset + piece.numel()] = piece
    assert all(e.offset * 4 % 64 == 0 for e in layout.entries), layout  # aligned views
    weights = layout.unpack(buffers.reshape(-1))
    assert len(weights) == len(names)
    for name, w in zip(names, weights):
        assert torch.equal(w, block.get_parameter(name).detach()), name


def _train(model, forward, steps: int = 2, weight_decay: float = 0.0,
           after_backward=None) -> list[float]:
    """``steps`` AdamW steps on fixed data; ``after_backward(model)`` runs before each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        loss = forward(torch.randn(4, 5, generator=g)).square().mean()
        loss.backward()
        if after_backward is not None:
            after_backward(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _stack_of(block: type, mesh, pack: bool) -> tuple[Stack, object]:
    """A Stack of three ``block``s (seeded), sharded on ``mesh`` with ``pack_blocks=pack``, and
    its compiled forward (FX graphs)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack()
    model.blocks = nn.ModuleList(block() for _ in range(3))
    shardc.shard(model, mesh, pack_blocks=pack)
    return model, torch.compile(model, backend=shardc.backend(inductor=False))


def _local(p: DTensor) -> torch.Tensor:
    return p.to_local()


def _buffer(block: nn.Module) -> torch.Tensor:
    return block.__dict__["_shardc_packed_state"].buffer


def _meta_packed_stack(mesh) -> tuple[Stack, Stack]:
    """A Stack's weights (the reference) and a Stack built on the meta device, sharded with
    packed blocks on ``mesh``."""
    torch.manual_seed(0)
    reference = Stack()
    with torch.device("meta"):
        model = Stack()
    shardc.shard(model, mesh, pack_blocks=True)
    return reference, model


def _load_shards(model: Stack, reference: Stack) -> None:
    with torch.no_grad():
        for p, ref in zip(model.parameters(), reference.parameters()):
            _local(p).copy_(ref)


def test_parameters_are_views_of_the_block_buffer_through_optimizer_state_dict_and_to_empty():
    torch._dynamo.reset()
    with one_rank_mesh() as mesh:
        reference, model = _meta_packed_stack(mesh)
        model.to_empty(device="cpu")  # new storage: the blocks pack it again
        _load_shards(model, reference)
        plain = Stack()
        plain.load_state_dict(reference.state_dict())
        shardc.shard(plain, mesh)
        for block in model.blocks:
            buffer = _buffer(block)
            for p in block.parameters():
                assert isinstance(p, DTensor)
                start = _local(p).data_ptr() - buffer.data_ptr()
                assert 0 <= start < buffer.numel() * buffer.element_size()
            assert block.__dict__[LEAF_ATTR] is not None
        assert list(model.state_dict()) == list(plain.state_dict())

        packed_losses = _train(model, torch.compile(model, backend=shardc.backend(
            inductor=False)))
        torch._dynamo.reset()
        plain_losses = _train(plain, torch.compile(plain, backend=shardc.backend(
            inductor=False)))
        assert packed_losses == plain_losses
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(_local(p), _local(q)), name
        # The optimizer stepped the parameters in place: in the buffer the next forward reads.
        block = model.blocks[0]
        offset = (_local(block.up.weight).data_ptr() - _buffer(block).data_ptr()) // 4
        assert torch.equal(_buffer(block)[offset:offset + 65].view(13, 5),
                           _local(block.up.weight))
        state = shardc.shard_state(model)
        assert state.packed.handed == 2 * len(model.blocks)
        notes = [n for r in state.regions for n in r.plan.notes if "packed" in n]
        assert notes, [r.plan.notes for r in state.regions]


def _packed_stack(mesh) -> tuple[Stack, object]:
    """A Stack sharded with packed blocks on ``mesh``, and its compiled forward (FX graphs)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = shardc.shard(Stack(), mesh, pack_blocks=True)
    return model, torch.compile(model, backend=shardc.backend(inductor=False))


def test_a_replaced_or_moved_parameter_is_never_read_stale():
    with one_rank_mesh() as mesh:
        model, forward = _packed_stack(mesh)
        forward(torch.randn(4, 5)).sum().backward()

        # Storage swapped behind shardc's back: the hand-off refuses the gradient.
        weight = model.blocks[1].down.weight
        torch.utils.swap_tensors(weight, nn.Parameter(DTensor.from_local(
            _local(weight).detach().clone(), weight.device_mesh, weight.placements)))
        with pytest.raises(RuntimeError, match=r"blocks\.1.*down\.weight.*new storage"):
            forward(torch.randn(4, 5)).sum().backward()

        # A parameter replaced by a plain one: the block reads one by one from then on, and
        # shardc's read refuses the replacement inside a forward.
        model.blocks[2].up.weight = nn.Parameter(torch.randn(13, 5))
        assert model.blocks[2].__dict__[LEAF_ATTR] is None
        with pytest.raises(Exception, match="replaced after sharding"):
            forward(torch.randn(4, 5))


def test_parameter_hooks_run_as_on_the_per_parameter_reads():
    """A ``register_hook`` hook that scales a packed parameter's gradient and a
    ``register_post_accumulate_grad_hook`` hook that reads and changes its ``.grad`` run once
    per backward from the hand-off, and leave every gradient bitwise what they leave with the
    per-parameter DTensor reads (where autograd runs them); with a ``.grad`` already there
    (no ``zero_grad``) the hooked gradient is added to it."""
    def run(pack: bool) -> tuple[list, dict]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        with one_rank_mesh() as mesh:
            model = shardc.shard(Stack(), mesh, pack_blocks=pack)
            forward = torch.compile(model, backend=shardc.backend(inductor=False))
            calls = []
            gate = model.blocks[0].gate
            gate.register_hook(lambda g: (calls.append(("pre", type(g).__name__)), g * 3)[1])
            up = model.blocks[1].up.weight

            def post(p):
                calls.append(("post", type(p.grad).__name__))
                p.grad.mul_(0.5)

            up.register_post_accumulate_grad_hook(post)
            for _ in range(2):  # the second backward accumulates into the .grad held
                forward(torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
                        ).square().sum().backward()
            if pack:
                assert shardc.shard_state(model).packed.handed == 2 * len(model.blocks)
            return calls, {n: _local(p.grad).clone() for n, p in model.named_parameters()}

    packed_calls, packed = run(True)
    assert sorted(packed_calls) == 2 * [("post", "DTensor")] + 2 * [("pre", "DTensor")]
    calls, reference = run(False)
    assert sorted(packed_calls) == sorted(calls)
    for name, grad in reference.items():
        assert torch.equal(packed[name], grad), name


def test_blocks_that_cannot_be_packed_say_why_once_and_quietly(caplog):
    """A group packing does not apply to (a frozen parameter here; mixed dtypes, FP8, TE, TP
    or offloaded parameters) and every group under CPU offload read their parameters one by
    one, recorded in ``BlockBodies.unpacked`` and said once per group on the ``shardc`` logger
    at info level (nothing at warning level), and train as before."""
    import logging

    torch._dynamo.reset()
    with one_rank_mesh() as mesh, caplog.at_level(logging.INFO, logger="shardc"):
        model = Stack()
        for block in model.blocks:
            block.gate.requires_grad_(False)
        shardc.shard(model, mesh, pack_blocks=True)
        (unpacked,) = shardc.shard_state(model).blocks.unpacked
        assert unpacked.module == "blocks.0" and "'gate' is frozen" in unpacked.reason
        assert all(model.blocks[i].__dict__.get(LEAF_ATTR) is None for i in range(3))
        # ... and train as the per-parameter reads do.
        forward = torch.compile(model, backend=shardc.backend(inductor=False))
        forward(torch.randn(4, 5)).sum().backward()
        assert model.blocks[0].up.weight.grad is not None
        offloaded = shardc.shard(Stack(), mesh, pack_blocks=True,
                                 offload=shardc.OffloadPolicy(simulate_on_cpu=True))
        (unpacked,) = shardc.shard_state(offloaded).blocks.unpacked
        assert "CPU offload" in unpacked.reason, unpacked
        assert all(offloaded.blocks[i].__dict__.get(LEAF_ATTR) is None for i in range(3))
        _train(offloaded, offloaded)
    said = [r for r in caplog.records if "read their parameters one by one" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO] * 2, [r.getMessage() for r in said]
    assert "'gate' is frozen" in said[0].getMessage() and "CPU offload" in said[1].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and r.name.startswith("shardc")], caplog.records


def test_a_packed_name_stands_for_its_parameters_where_the_optimizer_is_placed():
    """The planner names a packed block's shards ``<block>.<packed>``; where its decisions
    reach the optimizer (offloaded or chunked steps), that name is the block's parameters."""
    from shardc.sharding.packed_blocks import PackedBlocks, expand

    torch._dynamo.reset()
    with one_rank_mesh() as mesh:
        model = Stack()
        shardc.shard(model, mesh, pack_blocks=True)
        packed = shardc.shard_state(model).packed
        assert isinstance(packed, PackedBlocks)
        names = expand(["head.weight", "blocks.1.<packed>"], packed)
        assert names == ["head.weight", "blocks.1.gate", "blocks.1.up.weight",
                         "blocks.1.up.bias", "blocks.1.down.weight"]
        assert set(names) <= set(dict(model.named_parameters()))


def _inductor_packed(rank: int, world: int) -> dict:
    from parity import sharded_run

    out = sharded_run(rank, world, "llama", "inductor", pack_blocks=True)
    out["donations"] = [n for plan in out.pop("plans") if plan is not None for n in plan.notes
                        if n.startswith("donated buffers")]
    return out


@pytest.mark.slow
def test_packed_blocks_train_at_parity_under_inductor_over_two_ranks():
    """The path GPUs take: Inductor compiles the unpack (a copy per weight above world 1) and
    its backward inside the shared body; uneven shards (rows 37, 45 and 24 over 2 ranks). Two
    packed blocks save too few values that are not donated to put before the donated ones: one
    is saved again, and the region keeps its donated buffers (``shardc.passes.body_donations``)."""
    from dist_utils import run_ranks
    from parity import STEPS, assert_parity, reference

    run = run_ranks(_inductor_packed, 2)[0]
    assert run["packed_handed"] == 2 * STEPS  # two blocks, every step
    (note,) = run["donations"]
    assert note.startswith("donated buffers kept") and "repeated before them" in note, note
    assert_parity(run, reference("llama"))


def test_plain_leaves_follow_the_shards_into_the_block_buffer():
    """With plain inputs (shard's default), a packed block's parameters keep plain leaves,
    which forwards read where the block is not read packed (eagerly): they alias the shards
    in the block's buffer, after ``shard`` and after ``to_empty`` repacks; an eager training
    run equals the DTensor reads' bit for bit."""
    from shardc.sharding.plain_inputs import leaf_for

    torch._dynamo.reset()
    with one_rank_mesh() as mesh:
        reference, model = _meta_packed_stack(mesh)

        def aliased() -> bool:
            return all(leaf_for(module, name).data_ptr() == _local(p).data_ptr()
                       for block in model.blocks for module in block.modules()
                       for name, p in module.named_parameters(recurse=False))

        assert aliased()
        model.to_empty(device="cpu")  # new storage, packed again: the leaves follow
        assert aliased()
        _load_shards(model, reference)
        twin = Stack()
        twin.load_state_dict(reference.state_dict())
        shardc.shard(twin, mesh, plain_inputs=False)
        assert _train(model, model) == _train(twin, twin)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(_local(p), _local(q)), name


def _saved_from_a_gather(fw, bw) -> list[str]:
    """The forward values the backward takes that a gather's output becomes through
    single-input ops alone (views, casts, copies): a gathered weight in another form."""
    from shardc.ops.gather import GATHER_OP
    from shardc.passes.fx_utils import is_call
    from shardc.passes.reshard import saved_for_backward

    found = []
    for node in saved_for_backward(fw, bw):
        walk = node
        while walk.op == "call_function" and len(walk.all_input_nodes) == 1:
            if is_call(walk, GATHER_OP):
                found.append(node.name)
                break
            walk = walk.all_input_nodes[0]
    return found


def test_inline_blocks_regather_the_unpacked_weights_in_the_backward():
    """``compile_blocks_once=False`` (and the planner, which traces inline) puts the packed
    bodies' unpack in the region's own graph: above world 1 it copies each weight out of the
    gathered buffer, and those copies are recomputed from a new gather in the backward like
    the gather itself (reshard_after_forward), never saved from the forward (they were: every
    block's full weights held from the forward to the backward)."""
    from torch.distributed import group
    from torch.distributed.device_mesh import DeviceMesh

    from shardc.compile.backend import capture_partitioned
    from shardc.ops.gather import GATHER_OP
    from shardc.ops.gather_args import GatherArgs
    from shardc.passes.fx_utils import is_call
    from shardc.tools.fake_world import fake_world

    torch._dynamo.reset()
    torch.manual_seed(0)
    try:
        with fake_world(2), capture_partitioned() as graphs:
            model = shardc.shard(Stack(), DeviceMesh.from_group(group.WORLD, "cpu"),
                                 pack_blocks=True)
            forward = torch.compile(model, backend=shardc.backend(
                inductor=False, compile_blocks_once=False, check_plan_consistency=False))
            forward(torch.randn(4, 5)).sum().backward()
    finally:
        torch._dynamo.reset()
    (fw, bw), = graphs
    regathered = [n for n in bw.graph.nodes if is_call(n, GATHER_OP)
                  and GatherArgs.of(n).fqn.endswith(".<packed>")]
    assert len(regathered) == len(model.blocks), regathered
    assert _saved_from_a_gather(fw, bw) == []


class RowBlock(Block):
    """A Block with a one-row parameter: its shard is empty on every rank but the first."""

    def __init__(self) -> None:
        super().__init__()
        self.row = nn.Parameter(torch.randn(1, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.row.sum()


def test_an_empty_shard_in_a_packed_block_takes_its_gradient():
    """On a rank whose shard of a block's parameter is empty (one row over two ranks: rank 1
    holds none), the hand-off gives that parameter its empty gradient. It refused it as
    "got new storage": an empty tensor's data_ptr() is 0, never the buffer's address."""
    from torch.distributed import group
    from torch.distributed.device_mesh import DeviceMesh

    from shardc.tools.fake_world import fake_world

    torch._dynamo.reset()
    torch.manual_seed(0)
    try:
        with fake_world(2, rank=1):
            model = Stack()
            model.blocks = nn.ModuleList(RowBlock() for _ in range(3))
            shardc.shard(model, DeviceMesh.from_group(group.WORLD, "cpu"), pack_blocks=True)
            assert shardc.shard_state(model).packed.blocks
            assert _local(model.blocks[0].row).numel() == 0
            forward = torch.compile(model, backend=shardc.backend(
                inductor=False, check_plan_consistency=False))
            forward(torch.randn(4, 5)).sum().backward()
            assert shardc.shard_state(model).packed.handed == len(model.blocks)
            for name, p in model.named_parameters():
                assert p.grad is not None and p.grad.shape == p.shape, name
                assert _local(p.grad).shape == _local(p).shape, name
    finally:
        torch._dynamo.reset()


def test_blocks_are_packed_by_default_where_the_reads_are_plain():
    """``pack_blocks`` defaults to ``plain_inputs`` (s70): ``shard(model)`` packs the repeated
    blocks, ``plain_inputs=False`` keeps each parameter's DTensor read (and so its own read),
    ``pack_blocks=False`` asks for the per-parameter reads; anything but a bool or None is
    refused by name."""
    from torch.distributed import group
    from torch.distributed.device_mesh import DeviceMesh

    from shardc.tools.fake_world import fake_world

    with fake_world(2):
        mesh = DeviceMesh.from_group(group.WORLD, "cpu")
        packed = {}
        for name, kwargs in (("default", {}), ("dtensor_reads", {"plain_inputs": False}),
                             ("unpacked", {"pack_blocks": False})):
            state = shardc.shard_state(shardc.shard(Stack(), mesh, **kwargs))
            packed[name] = sorted(state.packed.blocks) if state.packed is not None else []
        assert packed["default"] == [f"blocks.{i}" for i in range(len(Stack().blocks))], packed
        assert packed["dtensor_reads"] == packed["unpacked"] == [], packed
        with pytest.raises(TypeError, match="pack_blocks must be True, False or None"):
            shardc.shard(Stack(), mesh, pack_blocks="yes")


def test_async_checkpoints_stage_packed_parameters(tmp_path):
    """``dcp.async_save`` stages a packed model's state (torch's stager took a DTensor over a
    view inside the block buffer, whose wrapper had the view's storage offset and so a nonzero
    ``data_ptr()``, for a tensor with storage, and raised "invalid python storage"), through
    ``get_state_dict`` and through shardc's ``CheckpointManager``; what it wrote is what the
    parameters held when it returned."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from shardc.checkpoint import CheckpointManager, ModelState, OptimizerState

    with one_rank_mesh() as mesh:
        model, forward = _packed_stack(mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loss = forward(torch.randn(4, 5)).square().mean()
        loss.backward()
        opt.step()
        saved = {n: _local(p).clone() for n, p in model.named_parameters()}
        assert _buffer(model.blocks[1]) is not None

        msd, osd = get_state_dict(model, opt)
        direct = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "d"))
        manager = CheckpointManager(tmp_path / "m")
        managed = manager.async_save(1, {"model": ModelState(model),
                                         "optim": OptimizerState(model, opt)})
        with torch.no_grad():  # changed in the buffer once staged: not in the checkpoints
            for p in model.parameters():
                p.add_(1.0)
        direct.result()
        managed.result()

        for load in (lambda s: dcp.load(s, checkpoint_id=str(tmp_path / "d")), manager.load):
            fresh = shardc.shard(Stack(), mesh, pack_blocks=True)
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
            load({"model": ModelState(fresh), "optim": OptimizerState(fresh, fresh_opt)})
            for name, p in fresh.named_parameters():
                assert torch.equal(_local(p), saved[name]), name


class UnusedBlock(Block):
    """A Block with a parameter its training forward leaves out (read only in eval mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.eval_scale = nn.Parameter(torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if self.training else y * self.eval_scale


def test_a_weight_a_call_leaves_out_keeps_a_none_gradient():
    """A packed block's one gradient covers every parameter of the block, so a parameter the
    forward does not use got zeros where autograd leaves ``.grad`` None, and AdamW stepped it
    (weight decay; Adam's momentum on a parameter used only in some steps): silently other
    values than the per-parameter reads'. Such a call reads the block's parameters one by one:
    the same gradients (None) and parameters, bit for bit."""
    def run(pack: bool) -> tuple[list, dict, dict]:
        grads = {}

        def record(model) -> None:
            grads.update({n: p.grad is None for n, p in model.named_parameters()})

        with one_rank_mesh() as mesh:
            model, forward = _stack_of(UnusedBlock, mesh, pack)
            losses = _train(model, forward, weight_decay=0.1, after_backward=record)
            return losses, grads, {n: _local(p).clone() for n, p in model.named_parameters()}

    losses, grads, params = run(True)
    ref_losses, ref_grads, ref_params = run(False)
    assert [n for n, none in grads.items() if none] == [
        f"blocks.{i}.eval_scale" for i in range(3)], grads
    assert grads == ref_grads and losses == ref_losses
    for name, p in ref_params.items():
        assert torch.equal(params[name], p), name


class Stage(nn.Module):
    """Blocks in a stage, stages in a list: groups inside groups."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class Stages(Stack):
    def __init__(self, container: bool) -> None:
        super().__init__(blocks=0)
        self.blocks = nn.ModuleList(
            nn.ModuleList(Block() for _ in range(2)) if container else Stage() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.blocks:
            for block in (stage if isinstance(stage, nn.ModuleList) else [stage]):
                x = block(x)
        return self.head(x)


@pytest.mark.parametrize(("container", "meta"), [(False, False), (False, True), (True, True)])
def test_nested_groups_pack_each_parameter_once(container, meta):
    """Stages of blocks (``container=False``: each stage a module with a forward, compiled once
    itself) or a ``ModuleList`` of ``ModuleList``s (``True``: never called) make groups inside
    groups; both were packed, the inner after the outer, so one of the two packed reads read a
    stale copy (refused at the hand-off: the stages at once, the lists after ``to_empty``).
    Now the outer group is packed where it is called, the inner ones where it is not, and
    training (``meta``: from a meta-device model, after ``to_empty``) equals the per-parameter
    reads' bit for bit."""
    def run(pack: bool) -> tuple[list, dict, list]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        reference = Stages(container)
        with one_rank_mesh() as mesh:
            with torch.device("meta" if meta else "cpu"):
                model = Stages(container)
            shardc.shard(model, mesh, pack_blocks=pack)
            if meta:
                model.to_empty(device="cpu")
            with torch.no_grad():
                for p, ref in zip(model.parameters(), reference.parameters()):
                    _local(p).copy_(ref)
            losses = _train(model, torch.compile(model, backend=shardc.backend(
                inductor=False)))
            state = shardc.shard_state(model)
            packed = sorted(state.packed.blocks) if state.packed is not None else []
            return losses, {n: _local(p).clone() for n, p in model.named_parameters()}, packed

    losses, params, packed = run(True)
    assert packed == ([f"blocks.{i}.{j}" for i in range(2) for j in range(2)] if container
                      else ["blocks.0", "blocks.1"]), packed
    ref_losses, ref_params, _ = run(False)
    assert losses == ref_losses
    for name, p in ref_params.items():
        assert torch.equal(params[name], p), name


class ReentrantBlock(Block):
    """A Block under reentrant activation checkpointing: the weights are in the closure the
    checkpoint's custom ``autograd.Function`` recomputes, not in the graph its output shows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(super().forward, x, use_reentrant=True)


def test_reentrant_checkpointed_blocks_stay_packed():
    """The check for weights a call's gradient leaves out cannot see through a custom
    ``autograd.Function``, so it leaves such calls packed (it had read every weight of these
    blocks one by one); training equals the per-parameter reads' bit for bit."""
    def run(pack: bool) -> tuple[list, dict, int]:
        with one_rank_mesh() as mesh:
            model, forward = _stack_of(ReentrantBlock, mesh, pack)
            losses = _train(model, forward)
            state = shardc.shard_state(model)
            handed = state.packed.handed if state.packed is not None else 0
            return losses, {n: _local(p).clone() for n, p in model.named_parameters()}, handed

    losses, params, handed = run(True)
    assert handed == 2 * 3  # two steps, three blocks, every one read packed
    ref_losses, ref_params, _ = run(False)
    assert losses == ref_losses
    for name, p in ref_params.items():
        assert torch.equal(params[name], p), name


def test_a_deepcopy_of_a_packed_parameter_is_refused_by_name():
    """``copy.deepcopy`` of a packed model (``torch.optim.swa_utils.AveragedModel``, an EMA
    teacher) failed deep in torch with "Attempted to call copy_() on an invalid python storage":
    a packed parameter's DTensor wrapper carries its view's storage offset (a nonzero
    ``data_ptr()`` without storage of its own), so torch's ``Tensor.__deepcopy__`` copies a
    storage it does not have. A copy would not be packed either (its parameters' own storages
    beside a copy of the buffer its forwards read). Refused, naming the parameter and what to
    do; a copy of the ``state_dict`` works. (Since s75 a copy of the model is refused by
    its sharded modules first, packed or not:
    ``test_a_deepcopy_of_a_sharded_model_is_refused_by_module``.)"""
    import copy

    with one_rank_mesh() as mesh:
        model, forward = _packed_stack(mesh)
        forward(torch.randn(4, 5)).sum().backward()
        name, param = next(iter(model.named_parameters()))
        assert name.startswith("blocks.0.")
        with pytest.raises(RuntimeError, match=rf"deepcopy.*'{name}'.*pack_blocks"):
            copy.deepcopy(param)
        with pytest.raises(RuntimeError, match=r"deepcopy of the sharded module 'blocks\.0"):
            copy.deepcopy(model)
        saved = copy.deepcopy(model.state_dict())
        for name, p in model.named_parameters():
            assert torch.equal(_local(saved[name]), _local(p)), name


@pytest.mark.parametrize("plain_inputs", [True, False])
def test_a_deepcopy_of_a_sharded_model_is_refused_by_module(plain_inputs):
    """s74's probe: a ``copy.deepcopy`` of a model sharded with ``pack_blocks=False`` kept the
    original's records (its class, the plain leaves' owners as weak references to the
    original's modules; the leaves copied without their hand-off hooks), so training the copy
    left every ``.grad`` None, silently. Every sharded module now refuses ``copy.deepcopy``,
    naming itself; the original still trains (shardc's own skeleton copies of its blocks are
    not refused), and a copy of its ``state_dict`` works."""
    import copy

    torch._dynamo.reset()
    torch.manual_seed(0)
    with one_rank_mesh() as mesh:
        model = shardc.shard(Stack(), mesh, pack_blocks=False, plain_inputs=plain_inputs)
        with pytest.raises(RuntimeError, match=r"deepcopy of the sharded module 'blocks\.0"
                                               r"[a-z.]*'.*before shardc\.shard"):
            copy.deepcopy(model)
        with pytest.raises(RuntimeError, match=r"deepcopy.*AveragedModel"):
            torch.optim.swa_utils.AveragedModel(model)
        forward = torch.compile(model, backend=shardc.backend(inductor=False))
        forward(torch.randn(4, 5)).sum().backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, f"no gradient reached {missing}"
        saved = copy.deepcopy(model.state_dict())
        for name, p in model.named_parameters():
            assert torch.equal(_local(saved[name]), _local(p)), name
