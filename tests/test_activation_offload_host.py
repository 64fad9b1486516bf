"""Activation offload skips saved values already on the host (issue 22), on a CPU machine.

On a GPU, some saved values of a forward are host tensors: a checkpointed region's RNG state
(a CPU tensor, its fake value too) and fused attention's RNG seed and offset (host scalars
outside CUDA-graph capture, though their fake values name the device: torch's Note [Seed and
Offset]). Offloading them was a host-to-host copy made at once (the GPU test of the pending
copies found 2 per block fewer than the copies it counted). The graphs here are built by hand
with fake CUDA tensors (``FakeTensorMode`` needs no GPU): the pass, the blocks' byte counts the
planner prices, the peak prediction's host values, the plan's reasons and the forced-offload
note all leave those values out, and give the reason "already on the host". On a graph that
computes on the CPU every value is still offloaded (the CPU tests' copies run).
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from shardc.compile.pipeline import forced_checkpoint_note, forced_offload_note, left_on_host
from shardc.memory.host import activation_host_values, resident_host_values
from shardc.passes.body import INVOKE_SUBGRAPH
from shardc.passes.host_resident import compute_device_type, is_rng_output, on_host
from shardc.passes.offload_saved import (
    activation_role,
    block_groups,
    offload_saved,
    offloadable_saved,
    saved_on_host,
)
from shardc.passes.recompute import find_blocks
from shardc.planning import recompute as recompute_plan

_aten = torch.ops.aten
_STACK = {"layers_0": ("L['self'].layers[0]", torch.nn.Module)}
_BODY_STACK = {"layers_1": ("L['self'].layers[1]", torch.nn.Module)}
# Saved values: on the device, and already on the host (on a device graph).
_DEVICE = ("a", "out", "lse", "body_out")
_HOST = ("seed", "offset", "rng_state", "body_seed")


def _node(graph: fx.Graph, name: str, target, args: tuple, kwargs: dict | None = None, *,
          block: bool | dict = True) -> fx.Node:
    node = graph.call_function(target, args, kwargs)
    node.name = name
    if target is operator.getitem:
        val = args[0].meta["val"][args[1]]
    else:
        vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        val = target(*vals, **(kwargs or {}))
    node.meta["val"] = val
    if block:
        node.meta["nn_module_stack"] = dict(_STACK if block is True else block)
    return node


def _body(mode: FakeTensorMode, device: str) -> fx.GraphModule:
    """A compiled-once block body: attention, returning its output and its RNG seed."""
    g = fx.Graph()
    q = g.placeholder("q")
    with mode:
        q.meta["val"] = torch.empty(1, 1, 8, 16, device=device)
    att = _node(g, "att", _aten._scaled_dot_product_efficient_attention.default,
                (q, q, q, None, True), block=False)
    out = _node(g, "o", operator.getitem, (att, 0), block=False)
    seed = _node(g, "s", operator.getitem, (att, 2), block=False)
    g.output((out, seed))
    return fx.GraphModule(torch.nn.Module(), g)


def _forward(g: fx.Graph, root: torch.nn.Module, mode: FakeTensorMode, device: str
             ) -> tuple[fx.Node, dict[str, fx.Node]]:
    """The forward of two blocks into ``g``: layers.0 inline (attention, a host copy),
    layers.1 a compiled-once body's call (attention); its loss and its saved values by name."""
    x = g.placeholder("x")
    with mode:
        x.meta["val"] = torch.empty(1, 1, 8, 16, device=device)
        a = _node(g, "a", _aten.relu.default, (x,))
        att = _node(g, "att", _aten._scaled_dot_product_efficient_attention.default,
                    (a, a, a, None, True))
        saved = {"a": a}
        for i, name in enumerate(("out", "lse", "seed", "offset")):
            saved[name] = _node(g, name, operator.getitem, (att, i))
        # A host tensor as a checkpointed region's functionalized RNG state would be.
        saved["rng_state"] = _node(g, "rng_state", _aten._to_copy.default, (saved["lse"],),
                                   {"device": torch.device("cpu")})
        root.body0 = _body(mode, device)
        body = g.get_attr("body0")
        call = g.call_function(INVOKE_SUBGRAPH, (body, "body0", a))
        call.meta["nn_module_stack"] = dict(_BODY_STACK)
        call.meta["val"] = tuple(n.meta["val"] for n in root.body0.graph.output_node().args[0])
        saved["body_out"] = _node(g, "body_out", operator.getitem, (call, 0), block=_BODY_STACK)
        saved["body_seed"] = _node(g, "body_seed", operator.getitem, (call, 1),
                                   block=_BODY_STACK)
        loss = _node(g, "loss", _aten.sum.default, (saved["out"],), block=False)
        loss = _node(g, "loss2", _aten.add.Tensor, (loss, saved["body_out"]), block=False)
        # The forward reads the RNG state too (a functionalized random op would).
        state = _node(g, "state", _aten.sum.default, (saved["rng_state"],), block=False)
        loss = _node(g, "loss3", _aten.add.Tensor, (loss, state), block=False)
    return loss, saved


def _graphs(device: str) -> tuple[fx.GraphModule, fx.GraphModule, fx.GraphModule]:
    """The joint graph (for the blocks) and a partitioned forward and backward of one block."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    graphs = []
    for joint in (True, False):
        root = torch.nn.Module()
        g = fx.Graph()
        loss, saved = _forward(g, root, mode, device)
        if joint:  # the backward's readers of the saved values, in the same graph
            reads = [_node(g, f"read_{n}", _aten.mul.Tensor, (v, 2), block=False)
                     for n, v in saved.items()]
            g.output((loss, *reads))
        else:
            g.output((loss, *saved.values()))
        graphs.append(fx.GraphModule(root, g))
    bw = fx.Graph()
    acc = []
    for node in graphs[1].graph.output_node().args[0][1:]:
        ph = bw.placeholder(node.name)
        ph.meta["val"] = node.meta["val"]
        with mode:
            acc.append(_node(bw, f"grad_{node.name}", _aten.mul.Tensor, (ph, 2), block=False))
    bw.output(tuple(acc))
    return graphs[0], graphs[1], fx.GraphModule(torch.nn.Module(), bw)


def _blocks(joint: fx.GraphModule):
    return find_blocks(joint, 1, ["layers.1"], ["layers.0"])


def test_a_device_forward_offloads_only_its_device_values():
    joint, fw, bw = _graphs("cuda")
    assert compute_device_type(fw.graph) == "cuda"
    saved = {n.name: n for n in fw.graph.output_node().args[0][1:]}
    # The RNG seed and offset name the device in their fake values, yet they live on the host.
    assert saved["seed"].meta["val"].device.type == "cuda" and is_rng_output(saved["seed"])
    assert is_rng_output(saved["body_seed"])  # through the compiled-once body's output
    assert not is_rng_output(saved["out"]) and not is_rng_output(saved["body_out"])
    assert {n.name for n in offloadable_saved(fw, 1)} == set(_DEVICE)
    assert [n.name for n in saved_on_host(fw, 1)] == [n for n in saved if n in _HOST]

    blocks = _blocks(joint)
    on_cpu = _blocks(_graphs("cpu")[0])  # the same bytes, all saved
    assert [b.kind for b in blocks] == ["inline", "body"]
    nbytes = {n: saved[n].meta["val"].nbytes for n in saved}
    # The planner prices offload (and recompute) by the device bytes only: the attention
    # call's seed and offset (the call is saved whole), the host tensor and the body call's
    # seed are not among them (counted twice, as saved_bytes counts every saved node: the call,
    # whose outputs the backward reads, and its getitem).
    host = [nbytes["seed"] + nbytes["offset"] + nbytes["rng_state"], 2 * nbytes["body_seed"]]
    assert [b.host_saved_bytes for b in blocks] == host and all(host)
    assert [b.saved_bytes for b in blocks] == [c.saved_bytes - h for c, h in zip(on_cpu, host)]
    assert [c.host_saved_bytes for c in on_cpu] == [0, 0]

    groups = block_groups(fw, 1, blocks, {"*"})
    assert set(groups) == set(_DEVICE)
    done = offload_saved(fw, bw, 1, groups, pin=False)
    left = left_on_host(fw, 1, blocks, {"*"})  # after the pass, as the pipeline asks
    assert sorted(v.name for v in done) == sorted(_DEVICE)
    d2h = [n for n in fw.graph.nodes if activation_role(n) == "d2h"]
    assert len(d2h) == len(_DEVICE)
    assert all(n.args[0].meta["val"].device.type == "cuda" and not on_host(n.args[0], "cuda")
               for n in d2h)
    # The host values stay saved as they are: their backward placeholders receive them.
    outs = fw.graph.output_node().args[0]
    assert all(saved[n] in outs for n in _HOST)
    phs = {p.name: p for p in bw.graph.find_nodes(op="placeholder")}
    assert {n for n, p in phs.items() if activation_role(p) == "host"} == set(_DEVICE)
    assert all(p.users and next(iter(p.users)).args[0] is p for n, p in phs.items()
               if n in _HOST)
    # Peak prediction: the host values are host memory, not the device's.
    resident = resident_host_values(fw, bw)
    assert {n.name for n in resident if n.graph is fw.graph} >= set(_HOST)
    assert {n.name for n in resident if n.op == "placeholder"} == set(_HOST)
    assert not resident & activation_host_values(fw, bw)
    # The forced-offload note names them (every block: every saved value already on the host;
    # named blocks: their members, which the inline block's seed and offset are not, being no
    # forward node of the joint graph).
    assert sorted(left) == sorted(_HOST)
    assert sorted(left_on_host(fw, 1, blocks, {"layers.0", "layers.1"})) == [
        "body_seed", "rng_state"]
    note = forced_offload_note(done, blocks, {"*"}, left)
    assert f"{len(_DEVICE)} saved value(s)" in note and "already on the host" in note


def test_a_cpu_forward_still_offloads_every_value():
    joint, fw, bw = _graphs("cpu")
    assert compute_device_type(fw.graph) == "cpu"
    names = [n.name for n in fw.graph.output_node().args[0][1:]]
    assert [n.name for n in offloadable_saved(fw, 1)] == names
    assert saved_on_host(fw, 1) == [] and not resident_host_values(fw, bw)
    blocks = _blocks(joint)
    assert [b.host_saved_bytes for b in blocks] == [0, 0]
    assert left_on_host(fw, 1, blocks, {"*"}) == []
    # Every saved value that is a member of a block (seed and offset are not: see above).
    members = [n for n in names if n not in ("seed", "offset")]
    done = offload_saved(fw, bw, 1, block_groups(fw, 1, blocks, {"*"}), pin=False)
    assert [v.name for v in done] == members
    assert "already on the host" not in forced_offload_note(done, blocks, {"*"}, [])


def test_the_plan_says_why_host_values_are_not_offloaded():
    joint, _, _ = _graphs("cuda")
    block = _blocks(joint)[0]
    cand = recompute_plan.RecomputeCandidate(
        block.name, block.kind, block.position, 1e-4, block.saved_bytes, offload=True,
        forward_s=1e-3, copy_s=1e-3, offload_s=1e-4)
    (decision,) = recompute_plan.decisions([block], [cand], [block.name], needed=True, peak=1)
    assert decision.offloaded and decision.bytes == block.saved_bytes
    assert f"{block.host_saved_bytes} B" in decision.reason
    assert "already on the host" in decision.reason


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_on_host_is_never_true_on_the_cpu(device):
    joint, fw, _ = _graphs(device)
    seed = next(n for n in fw.graph.nodes if n.name == "seed")
    assert on_host(seed, "cpu") is False
    assert on_host(seed, "cuda") is True  # an RNG output, whatever its fake device


def test_a_meta_pool_beside_cpu_values_is_a_cpu_graph():
    """The budget planner's trials put the communication pool (a graph input) on the meta
    device: a CPU graph stays one, a graph of meta values alone computes on "meta"."""
    g = fx.Graph()
    for name, device in (("x", "cpu"), ("pool", "meta"), ("y", "cpu")):
        g.placeholder(name).meta["val"] = torch.empty(2, device=device)
    assert compute_device_type(g) == "cpu"
    meta = fx.Graph()
    meta.placeholder("x").meta["val"] = torch.empty(2, device="meta")
    assert compute_device_type(meta) == "meta"
    assert compute_device_type(_graphs("cuda")[1].graph) == "cuda"


def test_forced_notes_name_what_matched_no_block():
    """Both forced-offload notes say which named blocks are not in the region and when it has
    none at all, so a misspelt name is not silently ignored."""
    for note in (forced_offload_note([], [], {"layers.9", "*"}),
                 forced_checkpoint_note([], [], {"layers.9"}, set())):
        assert "named but not blocks of this region: ['layers.9']" in note
        assert "this region has no blocks" in note
