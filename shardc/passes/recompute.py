"""Recompute whole blocks in the backward instead of saving their activations (the peak budget's
second lever, chosen by ``shardc.planning.recompute``).

A *block* is what the compile-once pass treats as one (``shardc.sharding.blocks``: a child of a
repeated container such as an ``nn.ModuleList``). In a region's joint graph it is either

* a **body call**: the ``invoke_subgraph`` node that runs the block's compiled forward body
  (shared by identical blocks) and the ``getitem`` nodes that take its outputs, which are the
  block's output and the activations its backward body reads; or
* an **inline block** (``compile_blocks_once=False``, or a block the compile-once pass sent
  inline): the forward nodes whose ``nn_module_stack`` names the block's module.

:func:`recompute_blocks` tags the chosen blocks' forward nodes ``MUST_RECOMPUTE`` with one
activation-checkpoint id per block, increasing with the block's position in the graph: the
mechanism of the user's activation checkpointing, so torch's min-cut partitioner saves each
recomputed block's inputs (the boundary between two recomputed blocks too: it saves a value
whose reader is recomputed in a region of a higher id) and recomputes the rest in the backward.
A body call is recomputed as a whole: the backward graph calls the same shared forward body
again, so the decision is per block even though the body is shared by every instance.

What is never recomputed (the block is not a candidate, with the reason): blocks whose forward
draws random numbers (recomputing them would draw other numbers: a body's random ops are read
from its partitioned graphs, an inline block's from the aten graph), blocks that run
collectives or shardc's other ops (a recomputed collective or host copy would run outside the
plan), and blocks the user's activation checkpointing already recomputes. shardc's own gathers
and what the reshard pass tags (views of gathered weights) keep their tags: they are recomputed
in the backward anyway, as the fixed policy does.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from shardc.ops.gather import GATHER_OP
from shardc.passes import recompute_part
from shardc.passes.aliased_saved_values import derived_saved_values
from shardc.passes.body import INVOKE_SUBGRAPH, gather_of
from shardc.passes.fx_utils import (
    OUTSIDE_CHECKPOINT_ID,
    call,
    has_tag,
    needed_by,
    op_overload,
    tensor_nbytes,
)
from shardc.passes.host_resident import compute_device_type, host_bytes
from shardc.planning.plan import split_part

__all__ = ["RECOMPUTE_BASE_ID", "Block", "checkpoint_inputs", "find_blocks", "forward_nodes",
           "recompute_blocks"]

# The activation-checkpoint ids of blocks shardc recomputes: above the user's regions' (small
# integers), below OUTSIDE_CHECKPOINT_ID (shardc's re-gathered weights, which a recomputed block
# reads: a recomputed value read by a region of a *higher* id would be saved instead).
RECOMPUTE_BASE_ID = 1 << 29


@dataclass(frozen=True)
class Block:
    """One block's forward in a joint graph: what recomputing it tags and what it saves."""

    name: str  # the block's module name, e.g. "layers.3"
    kind: str  # "body" (a compile-once body's call) or "inline"
    position: int  # its order among the graph's blocks (its checkpoint id's offset)
    nodes: tuple[fx.Node, ...]  # the forward nodes recomputing it tags, in graph order
    saved_bytes: int  # device bytes of its forward values that the backward reads (saved today)
    input_bytes: int  # bytes of the activations it reads from outside (saved if recomputed)
    outputs: tuple[fx.Node, ...] = ()  # its values that forward nodes outside it read
    excluded: str = ""  # why it is never recomputed ("" for a candidate)
    # Bytes of its saved values already on the host while the graph computes on a device
    # (shardc.passes.host_resident): not in saved_bytes, never offloaded; 0 on the CPU.
    host_saved_bytes: int = 0
    # Its saved values on the device that offload can copy (:func:`copyable`), in graph order
    # (the joint graph's: what a body call returns to the backward exactly, an inline block's
    # as the partitioner is likely to save them): what a part of it is made of
    # (``shardc.planning.offload.hidden_part``).
    saved_values: tuple[fx.Node, ...] = ()
    # The indices into saved_values of those a body call's backward can compute again cheaply
    # from the others (``shardc.passes.recompute_part.cheap_outputs``): what recomputing part
    # of it is made of; empty for inline blocks.
    recomputable: tuple[int, ...] = ()
    # A body call's outputs the backward reads (every saved one, copyable or not), by their
    # positions among the body's outputs: what a recomputed value's cone may stop at.
    read_positions: tuple[int, ...] = ()

    @property
    def freed_bytes(self) -> int:
        """What recomputing it removes from the saved activations (an estimate: its saved
        values, less its inputs, which become saved)."""
        return max(self.saved_bytes - self.input_bytes, 0)


def forward_nodes(gm: fx.GraphModule, num_fwd_outputs: int) -> set[fx.Node]:
    """The joint graph's forward: every node the first ``num_fwd_outputs`` outputs need."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    return needed_by(out.args[0][:num_fwd_outputs])


def _module_path(path: str) -> str:
    """Dynamo's module path as a module name (``layers.0``): the sharded model's own path
    (``L['self']`` when the model itself is compiled, ``L['model']`` or ``G['model']`` when a
    compiled function calls it) left out, indices as attributes (``L['self'].layers[0]``)."""
    dotted = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path)
    return re.sub(r"^[LG]\.[A-Za-z_][A-Za-z0-9_]*\.?", "", dotted)


def _in_module(node: fx.Node, name: str) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any(_module_path(str(v[0])) == name for v in stack.values()
               if isinstance(v, tuple) and v)


def _draws_random(node: fx.Node) -> bool:
    """Whether an aten-level node draws random numbers. Fused attention is tagged
    nondeterministic-seeded for its dropout: it draws only with ``dropout_p`` > 0."""
    if "rng" in str(node.target):
        return True
    if not has_tag(node, torch.Tag.nondeterministic_seeded):
        return False
    op = op_overload(node)
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", 0.0)
            return p != 0.0
    return True


def _is_collective(node: fx.Node) -> bool:
    """A functional collective, or one of shardc's ops other than the gather (which keeps the
    reshard pass's tag)."""
    op = op_overload(node)
    return op is not None and (op.namespace in ("_c10d_functional", "c10d_functional")
                               or op.namespace == "shardc" and node.target is not GATHER_OP)


def _user_checkpointed(node: fx.Node) -> bool:
    policy = node.meta.get("recompute")
    return policy is not None and node.meta.get("ac_graph_id") != OUTSIDE_CHECKPOINT_ID


def _is_weight(node: fx.Node) -> bool:
    """A parameter (a graph input) or a gathered weight (or a view of one)."""
    return node.op == "placeholder" or gather_of(node) is not None


_NOT_COPIED = ("shardc", "_c10d_functional", "c10d_functional")  # op namespaces


def copyable(node: fx.Node) -> bool:
    """Whether activation offload (``shardc.passes.offload_saved``) can copy ``node``'s value:
    computed by an op that is neither one of shardc's own (a CPU offload device copy is lowered
    to a start/wait pair later) nor a collective (the plan may move its wait), into a
    non-empty, contiguous tensor of static shape (asking a symbolic one would add guards after
    the trace)."""
    val = node.meta.get("val")
    return (node.op == "call_function"
            and getattr(node.target, "namespace", "") not in _NOT_COPIED
            and isinstance(val, torch.Tensor) and val.device.type != "meta"
            and all(isinstance(d, int) for d in (*val.shape, *val.stride()))
            and val.numel() > 0 and val.is_contiguous())


def _bytes(nodes) -> int:
    return sum(tensor_nbytes(n.meta.get("val")) for n in nodes)


def _describe(gm: fx.GraphModule, name: str, kind: str, position: int, nodes: list[fx.Node],
              fwd: set[fx.Node], excluded: str, device_type: str) -> Block:
    inside = set(nodes)
    saved = [n for n in nodes if any(u not in fwd and u.op != "output" for u in n.users)]
    read = _positions(saved) if kind == "body" else ()
    # A view of another saved value is not saved after the partition but viewed in the
    # backward from the other (shardc.passes.aliased_saved_values): no bytes nor lever of its own.
    derived = derived_saved_values(gm, saved)
    saved = [n for n in saved if n not in derived]
    # Saved values already on the host (a device graph's CPU tensors, attention's RNG seed and
    # offset) take no device memory: neither lever frees any by them, and offload skips them.
    # A multi-output call (attention, a body call) counts as a whole: only some of its outputs.
    host = sum(host_bytes(n, device_type) for n in saved)
    inputs = {i for n in nodes for i in n.all_input_nodes if i not in inside and not _is_weight(i)}
    outputs = [n for n in nodes if any(u in fwd and u not in inside for u in n.users)]
    on_device = tuple(n for n in saved if copyable(n) and not host_bytes(n, device_type))
    return Block(name, kind, position, tuple(nodes), _bytes(saved) - host,
                 _bytes(sorted(inputs, key=lambda n: n.name)), tuple(outputs), excluded,
                 host_saved_bytes=host, saved_values=on_device,
                 recomputable=_recomputable(gm, nodes[0], read, on_device)
                 if read and not excluded else (),
                 read_positions=read)


def _positions(saved: list[fx.Node]) -> tuple[int, ...]:
    """The output positions of a body call's saved ``getitem`` nodes."""
    return tuple(g.args[1] for g in saved if g.target is operator.getitem)


def _recomputable(gm: fx.GraphModule, call_node: fx.Node, read: tuple[int, ...],
                  on_device: tuple[fx.Node, ...]) -> tuple[int, ...]:
    """The indices into ``on_device`` (getitems of the body call ``call_node``) of the outputs
    its body computes cheaply from the others the backward reads (at positions ``read``;
    ``recompute_part.cheap_outputs``)."""
    body = getattr(gm, call_node.args[0].target)
    cheap = recompute_part.cheap_outputs(body, read)
    return tuple(i for i, g in enumerate(on_device) if g.args[1] in cheap)


def _body_blocks(gm: fx.GraphModule, fwd: set[fx.Node], names: Sequence[str],
                 order: dict[fx.Node, int]) -> list[tuple]:
    calls = [n for n in gm.graph.nodes if n.op == "call_function"
             and n.target is INVOKE_SUBGRAPH and n in fwd]
    if len(calls) != len(names):  # not the calls the compile-once pass described: none
        return []
    out = []
    for node, name in zip(calls, names):
        nodes = [node, *sorted(node.users, key=order.__getitem__)]
        body = getattr(gm, node.args[0].target)
        inner = [n for m in body.modules() if isinstance(m, fx.GraphModule)
                 for n in m.graph.nodes if n.op == "call_function"]
        out.append((node, name, "body", nodes, _why_not(nodes + inner)))
    return out


def _why_not(nodes: list[fx.Node]) -> str:
    if any(_user_checkpointed(n) for n in nodes):
        return "activation checkpointing already recomputes it"
    if any(_draws_random(n) for n in nodes):
        return "it draws random numbers, which a recomputation would draw again differently"
    if any(_is_collective(n) for n in nodes):
        return ("it runs collectives or shardc's own ops (host copies, gradient stashes), which "
                "a recomputation would run again outside the plan")
    return ""


def _inline_blocks(gm: fx.GraphModule, fwd: set[fx.Node], names: Sequence[str]) -> list[tuple]:
    out = []
    for name in names:
        nodes = [n for n in gm.graph.nodes if n in fwd and n.op == "call_function"
                 and _in_module(n, name)]
        # shardc's gathers and the views the reshard pass tagged stay as they are.
        mine = [n for n in nodes if n.target is not GATHER_OP and not (
            n.meta.get("recompute") is not None
            and n.meta.get("ac_graph_id") == OUTSIDE_CHECKPOINT_ID)]
        if mine:
            out.append((mine[0], name, "inline", mine, _why_not(mine)))
    return out


def find_blocks(gm: fx.GraphModule, num_fwd_outputs: int, body_blocks: Sequence[str],
                inline_blocks: Sequence[str]) -> list[Block]:
    """The blocks of the joint graph ``gm`` in graph order: ``body_blocks`` names the forward
    body calls in order (``RegionRecord.body_calls``; none if their number differs),
    ``inline_blocks`` the blocks traced inline. The same graph gives the same blocks, names and
    positions on every copy of it (the budget planner's trials)."""
    fwd = forward_nodes(gm, num_fwd_outputs)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found = _body_blocks(gm, fwd, body_blocks, order) + _inline_blocks(gm, fwd, inline_blocks)
    found.sort(key=lambda t: order[t[0]])
    device_type = compute_device_type(gm.graph)
    return [_describe(gm, name, kind, i, nodes, fwd, why, device_type)
            for i, (_, name, kind, nodes, why) in enumerate(found)]


def checkpoint_inputs(blocks: Sequence[Block]) -> dict[str, list[fx.Node]]:
    """Per block: its **checkpoint**, the activations it reads from outside that no other block
    reads (not weights: parameters and gathered weights), in graph order. What a recomputed
    block still saves (the partitioner saves a recomputed region's inputs): its input hidden
    state, made by the block before it (its boundary copy, :func:`recompute_blocks`) or by the
    embedding. Values several blocks read (a rotary table, a mask) belong to none: small, and
    read first by the block read last in the backward. Read from the blocks' nodes as the graph
    is now: after :func:`recompute_blocks`, the boundary copies; before, the outputs they
    copy (the same bytes)."""
    readers: dict[fx.Node, set[str]] = {}
    for block in blocks:
        inside = set(block.nodes)
        for node in block.nodes:
            for i in node.all_input_nodes:
                if i not in inside and not _is_weight(i) and i.op != "get_attr":
                    readers.setdefault(i, set()).add(block.name)
    out: dict[str, list[fx.Node]] = {b.name: [] for b in blocks}
    for node, names in readers.items():
        if len(names) == 1:
            out[next(iter(names))].append(node)
    order = {n: i for i, n in enumerate(blocks[0].nodes[0].graph.nodes)} if blocks else {}
    return {name: sorted(nodes, key=order.__getitem__) for name, nodes in out.items()}


def checkpoint_bytes(blocks: Sequence[Block], device_type: str = "cpu") -> dict[str, int]:
    """Per block: the device bytes of its checkpoint (:func:`checkpoint_inputs`), what
    offloading a recomputed block's checkpoint frees (values already on the host left out)."""
    return {name: sum(tensor_nbytes(n.meta.get("val")) - host_bytes(n, device_type)
                      for n in nodes)
            for name, nodes in checkpoint_inputs(blocks).items()}


def recompute_blocks(gm: fx.GraphModule, blocks: Sequence[Block], names: set[str]) -> int:
    """Tag the forward nodes of the blocks named ``names`` (``blocks`` from
    :func:`find_blocks` on this graph) for recomputation in the backward; returns how many
    blocks. A part's name (``shardc.planning.plan.part_name``: indices into the block's
    ``recomputable`` saved values) recomputes only those values
    (``shardc.passes.recompute_part``), where the block is not named whole. Refuses an
    excluded block or a value that is not recomputable (a planner bug, never the user's)."""
    count = 0
    parts = {}
    for name in names:
        block, indices = split_part(name)
        if indices is not None and block not in names:
            parts[block] = indices
    for block in blocks:
        if block.name in parts:
            _recompute_part(gm, block, parts[block.name])
            count += 1
            continue
        if block.name not in names:
            continue
        if block.excluded:
            raise ValueError(f"shardc: block {block.name} cannot be recomputed: "
                             f"{block.excluded}")
        for node in block.nodes:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = RECOMPUTE_BASE_ID + block.position
        for out in block.outputs:
            _save_boundary(gm.graph, out, set(block.nodes))
        count += 1
    return count


def _recompute_part(gm: fx.GraphModule, block: Block, indices: Sequence[int]) -> None:
    if block.excluded or not set(indices) <= set(block.recomputable):
        raise ValueError(f"shardc: saved values {sorted(indices)} of block {block.name} cannot "
                         f"be recomputed alone: {block.excluded or 'not cheap to recompute'}")
    recompute_part.recompute_values(gm, block.nodes[0],
                                    [block.saved_values[i].args[1] for i in indices],
                                    block.read_positions, RECOMPUTE_BASE_ID + block.position)


def _save_boundary(graph: fx.Graph, out: fx.Node, inside: set[fx.Node]) -> fx.Node:
    """Save a recomputed block's output for its readers outside the block (the next block,
    the backward of later ones), so that recomputing one block never recomputes the blocks
    before it. torch's partitioner saves a recomputed region's output only when a region of a
    higher id reads it, and never a ``getitem`` of a recomputed multi-output op (a body
    call's): a copy marked must-save is the boundary instead (a fusing compiler removes the
    copy after the partition)."""
    with graph.inserting_after(out):
        boundary = call(graph, torch.ops.aten.clone.default, (out,))
    boundary.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    for key in ("nn_module_stack", "partitioner_tag", "seq_nr"):
        if key in out.meta:
            boundary.meta[key] = out.meta[key]
    out.replace_all_uses_with(boundary, delete_user_cb=lambda u: u is not boundary
                              and u not in inside)
    return boundary
