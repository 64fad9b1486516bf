"""Offload saved activations to host memory (the peak budget's third lever, chosen per block by
``shardc.planning.offload``; or forced by ``offload_activations``).

Runs on a region's partitioned graphs, before they are planned. For each chosen saved value
(an output of the forward graph that the backward graph reads), with the copy ops of CPU offload
(:mod:`shardc.ops.offload_copy`, the same ops, stream and simulated mode):

* **forward**: right after the value is computed, ``offload_copy_start(value, ..., "cpu")``
  starts its copy to (pinned, on CUDA) host memory on the copy stream; the forward returns the
  host copy in the value's place, so the device value is freed after its release (below), its
  last reader. Nothing waits
  on the CPU: the copies of a group (a block's saved values) are *released*
  (``offload_copy_release``: the compute stream waits for them, the graph may reuse their
  sources' memory from there on) one block later: the i-th value of a group right after the
  i-th value of the next group starts its copy (a window of about one block's values in
  flight, each copy overlapping about one block's forward); the last group's after the last
  forward reader of each value (held longer, they would be alive through the head and the loss,
  where the forward peaks). The CPU never blocks: it runs ahead launching kernels while the
  copies run, and the host copies are complete only on the copy stream: the copy back (below)
  waits for them on the copy stream, not the CPU. Waiting on the compute stream is what makes
  reusing a source safe: Inductor reuses a dead buffer for a later one of its size without the
  caching allocator. So the copies start without ``record_stream``, which would make the
  caching allocator hold a freed source until the CPU, running far ahead of the device, sees
  its copy complete: at the memory edge that held several checkpoints' blocks and made the
  allocator map new memory or free its cache and retry.
* **backward**: the host copy arrives as the saved value's placeholder; a device copy of it
  (``offload_copy_start(host, ..., device)``) is *prefetched*, issued one group ahead: the
  copies of a group (a block's saved values) start where the previous group's values are first
  read (the first group's at the start of the backward), and each is waited by the compute
  stream right before its first reader, which reads the device copy.

A value is offloadable when it is computed in the forward (not a graph input, nor by one of
shardc's ops or a collective), is a contiguous, non-empty tensor of static shape, is not
also one of the forward's own outputs (that would keep it on the device anyway) and is not
already on the host while the forward computes on a device (``shardc.passes.host_resident``:
a CPU tensor, or fused attention's RNG seed and offset, host scalars outside CUDA-graph
capture although their fake values name the device; copying them would be a host-to-host copy
made at once, and the backward would get them back on the device). The ops'
fake values make the forward's output and the backward's placeholder a host tensor for every
later pass (Inductor included). On a CPU mesh the "device" is the CPU:
every copy is a separate tensor (the simulated mode of CPU offload), so CPU tests run the copies,
CPU tensors included.

**A recomputed block's checkpoint** (recompute and offload combined, the peak budget's lever
after recomputing every block; ``block_groups``): a block both recomputed and offloaded saves
nothing of its own but its input, which the partitioner saved for its recomputation (the
previous block's boundary copy, or the embedding's output). That value is offloaded as
above, grouped under the block that reads it: its copy is released one block later in the
forward and prefetched one block ahead of that block's recomputation in the backward.

Every node this pass inserts carries ``node.meta[ACTIVATION_COPY]`` (``"d2h"``, ``"h2d"``,
``"wait"`` or ``"release"``), the backward's host placeholders ``"host"``, and
``node.meta[ACTIVATION_GROUP]`` (the group): the planner (``shardc.planning.graph_view``,
``shardc.planning.copies``) puts them on the copy lane, and the memory prediction counts the
host copies as host bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from shardc.ops.offload_copy import COPY_RELEASE_OP, COPY_START_OP, COPY_WAIT_OP
from shardc.passes.fx_utils import call, tensor_nbytes
from shardc.passes.host_resident import compute_device_type, on_host
from shardc.passes.recompute import Block, checkpoint_inputs, copyable
from shardc.planning.plan import is_part, split_part

__all__ = ["ACTIVATION_COPY", "ACTIVATION_GROUP", "OffloadedValue", "activation_role",
           "block_groups", "offload_saved", "offloadable_saved", "saved_on_host", "saved_values"]

ACTIVATION_COPY = "shardc_activation_copy"
ACTIVATION_GROUP = "shardc_activation_group"


@dataclass(frozen=True)
class OffloadedValue:
    """One saved value the pass offloaded: its name (the forward node's), group and bytes."""

    name: str
    group: str
    nbytes: int


def activation_role(node: fx.Node) -> str:
    """``"d2h"``, ``"h2d"``, ``"wait"``, ``"release"`` or ``"host"`` for the nodes this pass
    made or retyped; ``""`` for any other node."""
    return node.meta.get(ACTIVATION_COPY, "")


def saved_values(fw: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    """The forward graph's saved values (its outputs after the ``num_fwd_outputs`` user
    outputs), in order; symbolic sizes and other non-nodes left out."""
    out = fw.graph.output_node().args[0]
    return [a for a in out[num_fwd_outputs:] if isinstance(a, fx.Node)]


def offloadable_saved(fw: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    """The saved values the pass can offload (see the module docstring)."""
    user = {a for a in fw.graph.output_node().args[0][:num_fwd_outputs] if isinstance(a, fx.Node)}
    device = compute_device_type(fw.graph)
    return [n for n in saved_values(fw, num_fwd_outputs)
            if _offloadable(n, user) and not on_host(n, device)]


def saved_on_host(fw: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    """The saved values left where they are because they are already on the host while the
    forward computes on a device (``shardc.passes.host_resident``); none on the CPU. Before or
    after the pass: its host copies, which replace the offloaded values, are not among them."""
    device = compute_device_type(fw.graph)
    return [n for n in saved_values(fw, num_fwd_outputs)
            if not activation_role(n) and on_host(n, device)]


def _offloadable(node: fx.Node, user_outputs: set[fx.Node]) -> bool:
    return node not in user_outputs and not activation_role(node) and copyable(node)


def offload_saved(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int,
                  groups: Mapping[str, str], *, pin: bool | None = None) -> list[OffloadedValue]:
    """Offload the saved values named in ``groups`` (forward node name -> group, e.g. the block
    it belongs to); those not offloadable are left saved on the device. Changes ``fw`` and
    ``bw`` in place and returns what was offloaded, in the forward's order. ``pin``: allocate
    the host copies in pinned memory (default: where CUDA is available)."""
    pin = torch.cuda.is_available() if pin is None else pin
    chosen = [n for n in offloadable_saved(fw, num_fwd_outputs) if n.name in groups]
    if not chosen:
        return []
    placeholders = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    missing = [n.name for n in chosen if n.name not in placeholders]
    if missing:  # the partitioner names the backward's saved inputs after the forward's values
        raise ValueError(f"shardc: saved value(s) {missing} have no backward placeholder")
    done = []
    copies = []
    for node in chosen:
        group = groups[node.name]
        host = _start_d2h(fw.graph, node, group, pin)
        copies.append((node, host))
        _retype_placeholder(placeholders[node.name], host, node, group)
        done.append(OffloadedValue(node.name, group, tensor_nbytes(node.meta.get("val"))))
    _release(fw.graph, copies)
    _prefetch(bw, [placeholders[n.name] for n in chosen])
    fw.recompile()
    bw.recompile()
    return done


def _tag(node: fx.Node, role: str, group: str) -> fx.Node:
    node.meta[ACTIVATION_COPY] = role
    node.meta[ACTIVATION_GROUP] = group
    return node


def _start_d2h(graph: fx.Graph, node: fx.Node, group: str, pin: bool) -> fx.Node:
    """The host copy of ``node``, started right after it; it replaces ``node`` as a saved
    output of the forward."""
    val = node.meta["val"]
    with graph.inserting_after(node):
        # No record_stream: every copy gets a release that makes the compute stream wait
        # for it before the graph frees the value (_release).
        host = _tag(call(graph, COPY_START_OP, (node, node.name, "cpu", val.dtype, pin, False)),
                    "d2h", group)
    if not isinstance(host.meta.get("val"), torch.Tensor):  # a graph without fake values
        host.meta["val"] = val.to(torch.device("cpu"))
    output = graph.output_node()
    output.args = (tuple(host if a is node else a for a in output.args[0]),) \
        + tuple(output.args[1:])
    return host


def _release(graph: fx.Graph, copies: list[tuple[fx.Node, fx.Node]]) -> None:
    """One ``offload_copy_release(value, host, True)`` per started copy, where the compute
    stream waits for it: the i-th copy of a group right after the i-th copy of the next group
    starts (about a block's forward later; a window of one block's values in flight), the last
    group's after the last forward reader of each value. See the module docstring."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    by_group: dict[str, list[tuple[fx.Node, fx.Node]]] = {}
    for value, host in copies:
        by_group.setdefault(host.meta[ACTIVATION_GROUP], []).append((value, host))
    order = sorted(by_group, key=lambda g: min(index[h] for _, h in by_group[g]))
    for k, group in enumerate(order):
        copies_k = sorted(by_group[group], key=lambda c: index[c[1]])
        later = sorted((h for _, h in by_group[order[k + 1]]), key=index.__getitem__) \
            if k + 1 < len(order) else []
        for i, (value, host) in enumerate(copies_k):
            # The i-th copy of the next group (one block's forward later), or (the last
            # group) the last forward reader of the value: held any longer, it would be
            # alive where the forward peaks (the head and the loss after the last block).
            until = [later[min(i, len(later) - 1)]] if later else \
                [u for u in (host, *value.users) if u.op != "output"]
            with graph.inserting_after(max(until, key=index.__getitem__)):
                _tag(call(graph, COPY_RELEASE_OP, (value, host, True)), "release", group)


def _retype_placeholder(ph: fx.Node, host: fx.Node, node: fx.Node, group: str) -> None:
    """The backward's placeholder of an offloaded value now receives its host copy."""
    ph.meta["val"] = host.meta["val"]
    ph.meta.pop("tensor_meta", None)
    ph.meta["shardc_device"] = str(node.meta["val"].device)
    _tag(ph, "host", group)


def _first_reader(ph: fx.Node, index: dict[fx.Node, int]) -> fx.Node:
    return min(ph.users, key=index.__getitem__)


def _prefetch(bw: fx.GraphModule, hosts: list[fx.Node]) -> None:
    """For each host placeholder, a device copy issued one group ahead and waited right before
    its first reader (see the module docstring). Placeholders nothing reads stay as they are."""
    graph = bw.graph
    index = {n: i for i, n in enumerate(graph.nodes)}
    read = [ph for ph in hosts if ph.users]
    first = {ph: _first_reader(ph, index) for ph in read}
    by_group: dict[str, list[fx.Node]] = {}
    for ph in sorted(read, key=lambda p: index[first[p]]):
        by_group.setdefault(ph.meta[ACTIVATION_GROUP], []).append(ph)
    # Groups in the order the backward first reads them; each issued where the one before it
    # is first read, the first right after the placeholders.
    order = sorted(by_group, key=lambda g: index[first[by_group[g][0]]])
    start_anchor = next(n for n in graph.nodes if n.op != "placeholder")
    for k, group in enumerate(order):
        anchor = start_anchor if k == 0 else first[by_group[order[k - 1]][0]]
        for ph in by_group[group]:
            readers = list(ph.users)
            val = ph.meta["val"]
            with graph.inserting_before(anchor):
                dev = call(graph, COPY_START_OP, (ph, ph.name, ph.meta["shardc_device"],
                                                  val.dtype, False))
            _tag(dev, "h2d", group)
            with graph.inserting_before(first[ph]):
                _tag(call(graph, COPY_WAIT_OP, (dev,)), "wait", group)
            for reader in readers:
                reader.replace_input_with(ph, dev)


def block_groups(fw: fx.GraphModule, num_fwd_outputs: int, blocks: Sequence[Block],
                 names: Iterable[str], recomputed: Iterable[str] = ()) -> dict[str, str]:
    """Forward node name -> block name, for the offloadable saved values of the blocks named
    ``names`` (``"*"``: every block). ``blocks``: ``shardc.passes.recompute.find_blocks`` on
    the joint graph this forward was partitioned from (the partitioner keeps node names).

    A block named in both ``names`` and ``recomputed`` (recomputed in the backward, its
    checkpoint offloaded) saves no value of its own but its **checkpoint**: the activations it
    reads that no other block reads (``shardc.passes.recompute.checkpoint_inputs``, read on
    that joint graph after ``recompute_blocks``: its input hidden state, the previous block's
    boundary copy or the embedding's output), which the partitioner saved for its
    recomputation. Those are grouped under the block that reads them (the backward reads them
    first where it recomputes that block, so they are prefetched one block ahead of it like an
    offloaded block's values), ahead of any other group a value would have.

    A part's name (``shardc.planning.plan.part_name``) offloads only those saved values of its block
    (``Block.saved_values``), grouped under the block; none where the whole block is named
    too, or is recomputed (its values are not saved then)."""
    names = set(names)
    recomputed = set(recomputed)
    parts = dict(split_part(n) for n in names if is_part(n))
    names = {n for n in names if not is_part(n)}
    chosen = [b for b in blocks if "*" in names or b.name in names]
    members = {n.name: b.name for b in chosen for n in b.nodes}
    whole = {b.name for b in chosen}
    for b in blocks:
        if b.name in parts and b.name not in whole and b.name not in recomputed:
            values = b.saved_values
            members.update({values[i].name: b.name for i in parts[b.name] if i < len(values)})
    ckpt = [b for b in chosen if b.name in recomputed]
    if ckpt:
        inputs = checkpoint_inputs(blocks)
        members.update({n.name: b.name for b in ckpt for n in inputs[b.name]})
    return {n.name: members[n.name] for n in offloadable_saved(fw, num_fwd_outputs)
            if n.name in members}
