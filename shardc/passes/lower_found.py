"""Lower the collectives found in the traced graph (tensor parallelism, FP8's amax all-reduce):
move each one's issue and wait nodes to the positions :func:`shardc.planning.found.place`
planned.

Positions are those of the plan (``p``: before compute op ``p``). Among the nodes shardc puts
before op ``p``, a found collective's issue goes first (it starts as early as possible) and its
wait last (it stalls compute as late as possible), unless a data dependency needs another order.
"""

from __future__ import annotations

from torch import fx

from shardc.planning.found import FoundCollective
from shardc.planning.graph_view import GraphView
from shardc.planning.plan import Collective


def _anchors(g: GraphView, gm: fx.GraphModule) -> list[fx.Node]:
    """Per position ``p``: the node to insert "before compute op p" in front of, once shardc's
    lowering has run. Lowering moves some compute ops later (views of a reduced gradient go
    behind its wait), so this is the first op at or after ``p`` still in its traced order (the
    output node at the end)."""
    output = gm.graph.find_nodes(op="output")[0]
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = [output] * (g.end + 1)
    later = index[output]  # the smallest index of the ops after the current one
    for q in range(g.end - 1, -1, -1):
        node = g.compute[q]
        if index[node] < later:  # in order (a moved op sits after later ones)
            later = index[node]
            out[q] = node
        else:
            out[q] = out[q + 1]
    return out


def _run_before(g: GraphView, anchor: fx.Node) -> list[fx.Node]:
    """The non-compute nodes right before ``anchor`` (shardc's collectives placed there, found
    collectives), in order."""
    run = []
    node = anchor.prev
    while node.op not in ("root", "placeholder", "get_attr") and node not in g.position:
        run.append(node)
        node = node.prev
    return run[::-1]


def lower(gm: fx.GraphModule, g: GraphView, records: list[Collective]) -> None:
    """Move each found collective's issue and wait nodes to its planned positions (call after
    shardc's collectives are inserted: an issue goes after whatever it reads among them, a wait
    before whatever reads it)."""
    if not records:
        return
    anchors = _anchors(g, gm)
    by_issue = {c.nodes[0]: c for c in records}
    after: dict[int, fx.Node] = {}  # per position: the last issue placed there
    for f in g.found:  # graph order: each group's collectives keep their order
        c = by_issue[f.node.name]
        _place_issue(g, f, anchors[c.issue_pos], after)
        for w in f.waits:
            _place_wait(g, w, anchors[c.wait_pos])


def _place_issue(g: GraphView, f: FoundCollective, anchor: fx.Node,
                 after: dict[fx.Node, fx.Node]) -> None:
    run = [n for n in _run_before(g, anchor) if n is not f.node and n not in f.items]
    inputs = set(f.node.all_input_nodes)
    marks = [i for i, n in enumerate(run) if n in inputs or n is after.get(anchor)]
    if marks:
        run[marks[-1]].append(f.node)
    else:
        (run[0] if run else anchor).prepend(f.node)
    node = f.node
    for item in f.items:
        node.append(item)
        node = item
    after[anchor] = node


def _place_wait(g: GraphView, wait: fx.Node, anchor: fx.Node) -> None:
    readers = set(wait.users)
    first = next((n for n in _run_before(g, anchor) if n in readers), anchor)
    first.prepend(wait)
