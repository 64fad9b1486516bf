"""Repeat the periodic middle of a partitioned graph, to plan a deep model from a shallow trace.

The partitioned forward (or backward) graph of a model whose blocks ``<container>.0`` ...
``<container>.K-1`` are identical is, in graph order, a head (the placeholders, the embedding and
the first block), ``K - 2`` copies of one *period* (one interior block each) and a tail (the last
block, the head of the model, the output). A period starts at the first shardc node
(``gather_param`` / ``reduce_scatter_grad``) of its block; the forward visits blocks upwards,
the backward downwards.

:func:`find_periods` cuts a graph so and checks that consecutive periods are copies of each
other: the same ops with the same constant arguments and value shapes, parameter names one block
apart, and every node argument either inside the period at the same index, in the previous period
at the same index (the residual stream), the same shared node (e.g. the rotary tables), or a
graph input only that period reads (its parameter shards, its saved activations). With at least
three periods the step from one period to the previous is itself checked between two interior
periods. Anything else raises :class:`NotPeriodic`, and the caller traces the whole model instead.

A period may also own a *group* of nodes in the tail: nodes computed from that period's values
alone that only the graph's output reads (the partitioner puts some views the backward takes of
saved activations at the end of the forward, one group per block). The
groups of the periods must sit together in the tail, one after another in block order; they are
compared with their periods and repeated with them.

:func:`repeat_periods` then builds the graph of a model with more blocks: the head, the periods
(traced, then new copies of the last one, each reading the copy before it), the tail reading the
last copy; new graph inputs for the new copies; parameter names renumbered so every block keeps
its place (``<container>.i`` in the forward's ``i``-th period from the bottom, the backward's from
the top). Node values (fake tensors) are shared with the traced nodes they copy: planning reads
only their shapes and dtypes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from shardc.ops.gather import args_with_fqn, shardc_args
from shardc.passes.fx_utils import lazy_graph_module


class NotPeriodic(ValueError):
    """The graph is not a head, repeated identical periods and a tail (the reason says where)."""


def _fqn_block(node: fx.Node, container: str) -> tuple[int, str] | None:
    """(block index, name inside the block) of a shardc node's parameter under ``container``."""
    args = shardc_args(node)
    if args is None:
        return None
    m = re.fullmatch(rf"{re.escape(container)}\.(\d+)\.(.+)", args.fqn)
    return (int(m.group(1)), m.group(2)) if m else None


@dataclass
class Periods:
    """A graph cut into head (region 0), periods (regions 1..m) and tail (region m + 1)."""

    gm: fx.GraphModule
    container: str
    regions: list[list[fx.Node]]  # head, periods..., tail (the tail ends with the output node)
    blocks: list[int]  # the block each region starts with: head, periods..., tail
    region_of: dict[fx.Node, int] = field(default_factory=dict)
    index_of: dict[fx.Node, int] = field(default_factory=dict)
    # Graph inputs that the nodes of exactly one period read (the output node aside).
    owned: dict[fx.Node, int] = field(default_factory=dict)
    # Each period's group in the tail (see the module docstring), and the periods in the order
    # their groups appear there.
    groups: dict[int, list[fx.Node]] = field(default_factory=dict)
    group_order: list[int] = field(default_factory=list)

    def members(self, j: int) -> list[fx.Node]:
        """Period ``j``'s nodes: its slice of the graph, then its group in the tail."""
        return self.regions[j] + self.groups.get(j, [])

    @property
    def count(self) -> int:
        """How many periods (interior blocks) the graph holds."""
        return len(self.regions) - 2

    @property
    def step(self) -> int:
        """+1 when the graph visits blocks upwards (forward), -1 downwards (backward)."""
        return self.blocks[1] - self.blocks[0]


def find_periods(gm: fx.GraphModule, container: str, n_blocks: int) -> Periods:
    """Cut ``gm`` (the partitioned graph of a model with ``n_blocks`` blocks under
    ``container``) into head, periods and tail, and check the periods repeat; raises
    :class:`NotPeriodic` with the reason otherwise."""
    nodes = list(gm.graph.nodes)
    first: dict[int, int] = {}
    for i, node in enumerate(nodes):
        found = _fqn_block(node, container)
        if found is not None:
            first.setdefault(found[0], i)
    if sorted(first) != list(range(n_blocks)):
        raise NotPeriodic(f"blocks with shardc nodes: {sorted(first)}, expected 0..{n_blocks - 1}")
    order = sorted(first, key=first.__getitem__)
    if order not in (list(range(n_blocks)), list(range(n_blocks))[::-1]):
        raise NotPeriodic(f"blocks are not visited in order: {order}")
    if n_blocks < 4:
        raise NotPeriodic(f"{n_blocks} blocks give fewer than two periods to compare")
    cuts = [0] + [first[b] for b in order[1:]] + [len(nodes)]
    regions = [nodes[a:b] for a, b in zip(cuts, cuts[1:])]
    p = Periods(gm, container, regions, order)
    for r, region in enumerate(regions):
        for i, node in enumerate(region):
            p.region_of[node], p.index_of[node] = r, i
            if node.op == "placeholder" and r != 0:
                raise NotPeriodic(f"graph input {node.name} comes after the first period starts")
    _find_owned_inputs(p)
    _find_tail_groups(p)
    for j in range(1, p.count):
        _check_outputs(p, j, _check_next_period(p, j))
    return p


def _find_owned_inputs(p: Periods) -> None:
    for node in p.regions[0]:
        if node.op != "placeholder":
            continue
        readers = {p.region_of[u] for u in node.users if u.op != "output"}
        if len(readers) == 1 and 1 <= next(iter(readers)) <= p.count:
            p.owned[node] = readers.pop()


def _group_of(p: Periods, node: fx.Node) -> int | None:
    """The period whose group ``node`` (a tail node) is: read only by the output, and computed
    from the values of that one period (and shared nodes of the head) only."""
    if any(u.op != "output" for u in node.users):
        return None
    owners = set()
    for a in node.all_input_nodes:
        r = p.region_of[a]
        if a in p.owned:
            owners.add(p.owned[a])
        elif r != 0:
            owners.add(r)
    if len(owners) != 1:
        return None
    j = owners.pop()
    return j if 1 <= j <= p.count else None


def _find_tail_groups(p: Periods) -> None:
    """Find the periods' groups in the tail; they join their periods (``region_of``/``index_of``
    as if they followed the period's slice)."""
    tail = p.regions[-1][:-1]
    run = [(i, j) for i, j in ((i, _group_of(p, n)) for i, n in enumerate(tail)) if j]
    if {j for _, j in run} <= {p.count}:
        return  # only the last period's values: the tail reads them as it reads its carry
    if [i for i, _ in run] != list(range(run[0][0], run[-1][0] + 1)):
        raise NotPeriodic("the periods' groups in the tail are interleaved with other nodes")
    for i, j in run:
        if p.group_order[-1:] != [j]:
            if j in p.groups:
                raise NotPeriodic(f"period {j}'s group in the tail is split")
            p.group_order.append(j)
            p.groups[j] = []
        node = tail[i]
        p.region_of[node], p.index_of[node] = j, len(p.regions[j]) + len(p.groups[j])
        p.groups[j].append(node)
    ascending = list(range(1, p.count + 1))
    if p.group_order not in (ascending, ascending[::-1]):
        raise NotPeriodic(f"the periods' groups in the tail are in order {p.group_order}")


def _value_signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype,
                value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_value_signature(v) for v in value)
    return value if isinstance(value, (int, float, bool, str, type(None))) else type(value)


class _PeriodMatch:
    """Checks that period ``j + 1`` is period ``j`` one block further."""

    def __init__(self, p: Periods, j: int) -> None:
        self.p, self.j = p, j
        self.inputs: dict[fx.Node, fx.Node] = {}  # period j's owned inputs -> period j + 1's
        self.matched: set[fx.Node] = set()  # period j + 1's inputs already matched

    def fail(self, x: fx.Node, why: str):
        raise NotPeriodic(f"period {self.j + 1} differs from period {self.j} at {x.name}: {why}")

    def same_ref(self, x: fx.Node, a: fx.Node, b: fx.Node) -> None:
        """``a`` (read by a node of period j) and ``b`` (by its counterpart) correspond."""
        p, j = self.p, self.j
        if a in p.owned or b in p.owned:
            if p.owned.get(a) != j or p.owned.get(b) != j + 1:
                self.fail(x, f"reads inputs {a.name} / {b.name} not owned by its period")
            if a not in self.inputs:
                if b in self.matched:
                    self.fail(x, f"input {b.name} stands for two inputs of period {j}")
                self.inputs[a] = b
                self.matched.add(b)
            if self.inputs[a] is not b or \
                    _value_signature(a.meta.get("val")) != _value_signature(b.meta.get("val")):
                self.fail(x, f"inputs {a.name} / {b.name} do not correspond")
            return
        ra, rb = p.region_of[a], p.region_of[b]
        if a is b and ra == 0:
            return  # a shared node of the head
        if (ra, rb) in ((j, j + 1), (j - 1, j)) and ra >= 1 and p.index_of[a] == p.index_of[b]:
            return  # inside the period, or in the previous one (at the same place)
        if j == 1 and ra == 0 and rb == 1 and \
                _value_signature(a.meta.get("val")) == _value_signature(b.meta.get("val")):
            return  # the first period's previous "period" is the head; checked from j = 2 on
        self.fail(x, f"reads {a.name} (region {ra}) where the other reads {b.name} (region {rb})")

    def same_args(self, x: fx.Node, a: Any, b: Any) -> None:
        if isinstance(a, fx.Node) and isinstance(b, fx.Node):
            self.same_ref(x, a, b)
        elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and \
                type(a) is type(b) and len(a) == len(b):
            for u, v in zip(a, b):
                self.same_args(x, u, v)
        elif isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
            for k in a:
                self.same_args(x, a[k], b[k])
        elif isinstance(a, fx.Node) or isinstance(b, fx.Node) or a != b:
            self.fail(x, f"argument {a!r} vs {b!r}")

    def same_node(self, x: fx.Node, y: fx.Node) -> None:
        if (x.op, x.target) != (y.op, y.target):
            self.fail(x, f"{x.op} {x.target} vs {y.op} {y.target}")
        if _value_signature(x.meta.get("val")) != _value_signature(y.meta.get("val")):
            self.fail(x, "values of different shapes")
        bx, by = _fqn_block(x, self.p.container), _fqn_block(y, self.p.container)
        if (bx is None) != (by is None) or (bx and (bx[1] != by[1] or
                                                    by[0] - bx[0] != self.p.step)):
            self.fail(x, f"parameter {shardc_args(x).fqn if bx else None} vs "
                      f"{shardc_args(y).fqn if by else None}")
        args_x, args_y = x.args, y.args
        if bx is not None:  # the names were compared above, block numbers apart
            args_x, args_y = args_with_fqn(x, ""), args_with_fqn(y, "")
        self.same_args(x, args_x, args_y)
        self.same_args(x, x.kwargs, y.kwargs)


def _check_next_period(p: Periods, j: int) -> _PeriodMatch:
    one, two = p.members(j), p.members(j + 1)
    if len(one) != len(two):
        raise NotPeriodic(f"periods {j} and {j + 1} have {len(one)} and {len(two)} nodes")
    match = _PeriodMatch(p, j)
    for x, y in zip(one, two):
        match.same_node(x, y)
    return match


def _output_entries(p: Periods) -> tuple[list[Any], list[int | None]]:
    """The output node's flat entries and, for each, the period it belongs to (or None)."""
    output = p.regions[-1][-1]
    entries = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else None
    if output.op != "output" or entries is None:
        raise NotPeriodic("the graph does not end with an output of a flat tuple")
    owners = []
    for e in entries:
        owner = None
        if isinstance(e, fx.Node):
            owner = p.owned.get(e, p.region_of[e])
            owner = owner if 1 <= owner <= p.count else None
        owners.append(owner)
    return entries, owners


def _check_outputs(p: Periods, j: int, match: _PeriodMatch) -> None:
    """Period ``j``'s outputs (saved activations, gradients) match period ``j + 1``'s."""
    entries, owners = _output_entries(p)
    one = [e for e, o in zip(entries, owners) if o == j]
    two = [e for e, o in zip(entries, owners) if o == j + 1]

    def same(a: fx.Node, b: fx.Node) -> bool:
        if a in p.owned:
            return match.inputs.get(a) is b
        return b not in p.owned and p.index_of[a] == p.index_of[b]

    if len(one) != len(two) or not all(same(a, b) for a, b in zip(one, two)):
        raise NotPeriodic(f"outputs of periods {j} and {j + 1} do not correspond")


class _Builder:
    """Emits the repeated graph (see :func:`repeat_periods`)."""

    def __init__(self, p: Periods, n_blocks: int) -> None:
        self.p, self.graph = p, fx.Graph()
        self.extra = n_blocks - (p.count + 2)
        self.base = p.blocks[0] if p.step == 1 else p.blocks[0] + self.extra
        self.head: dict[fx.Node, fx.Node] = {}
        self.periods: list[list[fx.Node]] = [[]]  # new region r' -> its nodes (0: unused)
        self.inputs: dict[tuple[fx.Node, int], fx.Node] = {}  # (owned input, new period)
        self.tail: dict[fx.Node, fx.Node] = {}

    def new_block(self, region: int, new_region: int, block: int) -> int:
        return self.base + new_region * self.p.step + (block - self.p.blocks[region])

    def ref(self, a: fx.Node, shift: int, tail: bool) -> fx.Node:
        p = self.p
        if a in p.owned:
            return self.inputs[(a, p.owned[a] + shift)]
        r = p.region_of[a]
        if r == 0:
            return self.head[a]
        if r == len(p.regions) - 1:
            if not tail:
                raise NotPeriodic(f"a period reads {a.name} of the tail")
            return self.tail[a]
        return self.periods[r + shift][p.index_of[a]]

    def copy(self, node: fx.Node, region: int, new_region: int, tail: bool = False) -> fx.Node:
        shift = new_region - region
        new = self.graph.node_copy(node, lambda a: self.ref(a, shift, tail))
        found = _fqn_block(node, self.p.container)
        if found is not None:
            block = self.new_block(region, new_region, found[0])
            new.args = args_with_fqn(new, f"{self.p.container}.{block}.{found[1]}")
        return new

    def inputs_for(self, template: fx.Node, owner: int) -> None:
        """The graph input ``template`` (owned by ``owner``) for every new period it stands for:
        itself for the traced periods, a new input for each added copy of the last period."""
        count = self.p.count
        if owner != count:
            self.inputs[(template, owner)] = self.head[template]
            return
        self.inputs[(template, count)] = self.head[template]
        for j in range(count + 1, count + self.extra + 1):
            new = self.graph.placeholder(f"{template.target}_rep{j}")
            new.meta = dict(template.meta)
            self.inputs[(template, j)] = new

    def build(self) -> fx.Graph:
        p, count = self.p, self.p.count
        head = p.regions[0]
        for node in head:
            if node.op == "placeholder":
                self.head[node] = self.graph.node_copy(node)
                if node in p.owned:
                    self.inputs_for(node, p.owned[node])
        for node in head:
            if node.op != "placeholder":
                self.head[node] = self.copy(node, 0, 0)
        for r in range(1, count + self.extra + 1):
            self.periods.append([])
            self.copy_period(p.regions[min(r, count)], r)
        last = len(p.regions) - 1
        for node in p.regions[last][:-1]:
            if p.region_of[node] != last:  # a period's group: all groups go together
                if node is p.groups[p.group_order[0]][0]:
                    self.copy_groups()
                continue
            self.tail[node] = self.copy(node, last, last + self.extra, tail=True)
        self.graph.output(self.outputs())
        return self.graph

    def copy_period(self, template: list[fx.Node], r: int) -> None:
        """Append to new period ``r`` the copies of ``template`` (nodes of one traced period)."""
        region = self.p.region_of[template[0]]
        for node in template:
            self.periods[r].append(self.copy(node, region, r))

    def copy_groups(self) -> None:
        """Every new period's group in the tail, in the block order the traced groups have."""
        p, count = self.p, self.p.count
        descending = p.group_order[0] > p.group_order[-1]
        for r in sorted(range(1, count + self.extra + 1), reverse=descending):
            self.copy_period(p.groups[min(r, count)], r)

    def outputs(self) -> tuple:
        p, count = self.p, self.p.count
        entries, owners = _output_entries(p)
        last = max((i for i, o in enumerate(owners) if o == count), default=None)
        out = []
        for i, (e, owner) in enumerate(zip(entries, owners)):
            if not isinstance(e, fx.Node):
                out.append(e)
            elif owner is None:  # the head's or the tail's
                out.append(self.ref(e, self.extra, tail=True))
            else:
                out.append(self.ref(e, 0, tail=False))
            if i == last:
                mine = [x for x, o in zip(entries, owners) if o == count]
                for shift in range(1, self.extra + 1):
                    out.extend(self.ref(x, shift, tail=False) for x in mine)
        return tuple(out)


def repeat_periods(p: Periods, n_blocks: int) -> fx.GraphModule:
    """The graph of the same model with ``n_blocks`` blocks (at least the traced number):
    ``p``'s periods followed by copies of its last period (see the module docstring)."""
    if n_blocks < p.count + 2:
        raise ValueError(f"repeat_periods: {n_blocks} blocks is fewer than the traced "
                         f"{p.count + 2}")
    graph = _Builder(p, n_blocks).build()
    return lazy_graph_module(p.gm, graph)
