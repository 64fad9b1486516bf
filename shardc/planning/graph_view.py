"""A partitioned graph as the planners see it: compute positions and shardc's nodes.

Positions index the graph's compute schedule (its ops, shardc's gather/reduce nodes and the
found collectives' bookkeeping nodes excluded): "position ``p``" means "before compute op
``p``". The planners (:mod:`shardc.planning.schedule`, :mod:`shardc.planning.found`) decide
positions on this view; the lowering (:mod:`shardc.passes.lower`) maps them back to nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx

from shardc.ops.gather import GATHER_OP, REDUCE_SCATTER_OP
from shardc.ops.gather_args import GatherArgs, ReduceArgs
from shardc.ops.offload_copy import copy_fqn, is_to_device, is_to_host
from shardc.passes.fx_utils import gather_derived, is_call, view_chain_root
from shardc.passes.offload_saved import activation_role
from shardc.planning.found import FoundCollective, find


@dataclass
class GraphView:
    """A partitioned graph as planning sees it: its compute order (positions), shardc's gather
    and reduce nodes keyed by parameter name, and the collectives found in it
    (:mod:`shardc.planning.found`), whose nodes are not compute ops."""

    name: str
    compute: list[fx.Node]
    position: dict[fx.Node, int]
    gathers: dict[str, fx.Node] = field(default_factory=dict)
    reduces: dict[str, fx.Node] = field(default_factory=dict)
    found: list[FoundCollective] = field(default_factory=list)
    # Planned positions of the found collectives' nodes (set by ``found.place``).
    placed: dict[fx.Node, int] = field(default_factory=dict)
    # CPU offload: each parameter's host->device copy (what its gather sends) and the
    # device->host copy of its gradient; not compute ops (the plan places them on its copy lane).
    to_device: dict[str, fx.Node] = field(default_factory=dict)
    to_host: dict[str, fx.Node] = field(default_factory=dict)
    # Activation offload (shardc.passes.offload_saved): its copy starts and waits, in graph
    # order; not compute ops either (the plan places them on the copy lane).
    activation_copies: list[fx.Node] = field(default_factory=list)

    @property
    def end(self) -> int:
        return len(self.compute)

    def pos(self, node: fx.Node) -> int:
        """Position of ``node`` (placeholders count as 0, the output as the end)."""
        if node.op == "placeholder":
            return 0
        if node.op == "output":
            return self.end
        if node in self.position:
            return self.position[node]
        if node in self.placed:
            return self.placed[node]
        # A shardc node: it sits before the next compute op.
        for later in _nodes_after(node):
            if later in self.position:
                return self.position[later]
        return self.end

    def first_use(self, fqn: str) -> int:
        return min((self.pos(u) for u in self.gathers[fqn].users), default=self.end)

    def last_use(self, fqn: str) -> int:
        derived = gather_derived(self.gathers[fqn])
        users = [u for d in derived for u in d.users if u not in derived]
        uses = [self.pos(u) for u in users] + [self.pos(d) for d in derived[1:]]
        return max(uses, default=self.first_use(fqn))


def ready_pos(g: GraphView, node: fx.Node) -> int:
    """Earliest position at which ``node``'s value exists: after its compute op, or where a
    bookkeeping node (a found collective's wait) is placed."""
    if node.op == "placeholder":
        return 0
    return g.pos(node) + 1 if node in g.position else g.pos(node)


def available_pos(g: GraphView, node: fx.Node) -> int:
    """Earliest position a collective reading ``node`` can be issued at (views are re-taken)."""
    if is_to_device(node):  # the copy moves with the collective: its source's availability
        return available_pos(g, node.all_input_nodes[0])
    if view_chain_root(node) is not None:
        return 0
    return g.pos(node) + 1


def _nodes_after(node: fx.Node):
    n = node.next
    while n.op != "root":
        yield n
        n = n.next


def analyze(gm: fx.GraphModule, name: str) -> GraphView:
    """The view of ``gm`` (the region's ``name`` graph: "forward" or "backward")."""
    found = find(gm)
    bookkeeping = {n for f in found for n in f.nodes}
    compute, gathers, reduces, to_device, to_host, activations = [], {}, {}, {}, {}, []
    for node in gm.graph.nodes:
        if node.op == "call_function" and activation_role(node):
            activations.append(node)
        elif is_to_device(node):
            to_device[copy_fqn(node)] = node
        elif is_to_host(node):
            # A tied weight's second copy carries the zeros left where reductions merged
            # (shardc.passes.dedupe): it stays a plain op; the planned one reads the reduction.
            if copy_fqn(node) not in to_host or is_call(node.args[0], REDUCE_SCATTER_OP):
                to_host[copy_fqn(node)] = node
        elif is_call(node, GATHER_OP):
            gathers[GatherArgs.of(node).fqn] = node
        elif is_call(node, REDUCE_SCATTER_OP):
            reduces[ReduceArgs.of(node).fqn] = node
        elif node.op not in ("placeholder", "output") and node not in bookkeeping:
            compute.append(node)
    return GraphView(name, compute, {n: i for i, n in enumerate(compute)}, gathers, reduces,
                     found, to_device=to_device, to_host=to_host,
                     activation_copies=activations)
