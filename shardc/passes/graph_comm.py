"""Collectives already in the traced graph when shardc plans it.

DTensor issues the collectives of tensor parallelism itself (``_c10d_functional`` ops on the tp
process group, each followed by a ``wait_tensor``), and shardc's FP8 pass adds one amax all-reduce
over the shard group before planning. shardc neither creates nor buckets these, but it plans them
like its own collectives:

- :func:`find` recognizes them by op (a table of functional collective ops, not node names) and
  names their process group's role on the mesh (``tp``, ``shard``, ``replicate``; ``other`` for a
  group shardc was not told about);
- :func:`place` gives each one a plan record (kind, group, tensors, bytes, issue and wait positions,
  reason). An asynchronous functional collective is issued as soon as its inputs exist, but never
  before an earlier collective of its group (each group keeps its traced order, so its ranks issue
  the same sequence) nor across an op that writes in place; it is waited right before the first op
  that reads its result. This moves when the bytes travel, never which bytes or what the ops
  compute: results are bitwise the same. Collectives that write their input in place, run
  synchronously (DTensor's ``shard_dim_alltoall``) or read a shardc-gathered tensor keep their
  traced issue position;
- :func:`lower` moves the issue and wait nodes to those positions in the graph.

Positions are those of the plan (``p``: before compute op ``p``). Among the nodes shardc puts before
op ``p``, a found collective's issue goes first (it starts as early as possible) and its wait last
(it stalls compute as late as possible), unless a data dependency needs another order.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass, field

import torch
from torch import fx

from shardc.passes.fx_utils import size_hint
from shardc.plan import Collective

funcol = torch.ops._c10d_functional

# Metadata a pass may put on a collective it adds before planning: a phrase saying where it came
# from, for the plan's reason (e.g. shardc's FP8 amax all-reduce).
ORIGIN_META = "shardc_origin"

# Functional collectives by op packet name (the names of torch's ``_c10d_functional`` ops) -> kind.
_FUNCOL_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}

# Lane (communication stream) of each group role: a process group runs its collectives on its own
# stream, so collectives of different groups overlap each other. "comm" is the shard group's lane
# (the name plans have always used).
SHARD_LANE = "comm"


def lane(role: str, group_name: str = "") -> str:
    """The simulated stream of collectives over the group with this role."""
    if role == "shard":
        return SHARD_LANE
    if role in ("replicate", "tp"):
        return role
    return f"group {group_name}"


def _op_table() -> dict[object, str]:
    """Op packet -> kind, for the functional collectives this torch has (the table above), plus
    DTensor's synchronous ``shard_dim_alltoall``."""
    importlib.import_module("torch.distributed.tensor")  # registers the _dtensor ops
    table = {}
    for name, kind in _FUNCOL_KINDS.items():
        packet = getattr(funcol, name, None)
        if packet is not None:
            table[packet] = kind
    dtensor = getattr(torch.ops, "_dtensor", None)
    alltoall = getattr(dtensor, "shard_dim_alltoall", None) if dtensor is not None else None
    if alltoall is not None:
        table[alltoall] = "all_to_all"
    return table


_TABLE: dict[object, str] | None = None


def collective_kind(node: fx.Node) -> str | None:
    """The kind of collective ``node`` runs, if it is one (``wait_tensor`` is not)."""
    global _TABLE
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if _TABLE is None:
        _TABLE = _op_table()
    return _TABLE.get(target.overloadpacket)


def _is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is funcol.wait_tensor.default


def _is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem"


def _argument(node: fx.Node, name: str):
    """The argument ``name`` of an op node, by the op's schema (positional or keyword)."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name)
    return None


def writes_in_place(node: fx.Node) -> bool:
    """Whether ``node`` is an op that writes an argument (``add_``, ``copy_``, ``*_out``)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return any(a.alias_info is not None and a.alias_info.is_write
               for a in target._schema.arguments)


@dataclass
class FoundCollective:
    """One collective of the traced graph and its bookkeeping nodes."""

    node: fx.Node  # the collective: issues it
    kind: str
    group_name: str
    group_size: int | None  # from the op's arguments where it has one
    waits: list[fx.Node] = field(default_factory=list)  # none: it runs synchronously
    items: list[fx.Node] = field(default_factory=list)  # getitems of a coalesced collective

    @property
    def nodes(self) -> list[fx.Node]:
        """The collective's nodes: none of them is a compute op of the schedule."""
        return [self.node, *self.items, *self.waits]


def find(gm: fx.GraphModule) -> list[FoundCollective]:
    """The collectives of ``gm``, in graph order (shardc's own are added later, by lowering)."""
    found = []
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        size = _argument(node, "group_size")
        f = FoundCollective(node, kind, str(_argument(node, "group_name")),
                            int(size) if isinstance(size, int) else None)
        for user in node.users:
            if _is_wait(user):
                f.waits.append(user)
            elif _is_getitem(user):
                f.items.append(user)
                f.waits += [w for w in user.users if _is_wait(w)]
        found.append(f)
    return found


# ------------------------------------------------------------------------------------ planning


def _tensors(value) -> list[torch.Tensor]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, torch.Tensor)]


def _nbytes(tensors: list[torch.Tensor]) -> int:
    total = 0
    for t in tensors:  # size hints: planning adds no guard
        numel = 1
        for s in t.shape:
            numel *= size_hint(s)
        total += numel * t.element_size()
    return total


def _describe_tensor(node: fx.Node) -> str:
    parts = []
    for t in _tensors(node.meta.get("val")):
        shape = ", ".join(str(s) for s in t.shape)
        parts.append(f"{str(t.dtype).removeprefix('torch.')}[{shape}]")
    return f"{node.name}: {', '.join(parts) or '?'}"


def _inputs(f: FoundCollective) -> list[fx.Node]:
    """The tensors it sends (not the sizes an all-to-all reads from other nodes)."""
    return [a for a in f.node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _outputs(f: FoundCollective) -> list[fx.Node]:
    return f.waits or [f.node]


def _byte_counts(f: FoundCollective) -> tuple[int, int]:
    """(bytes, buffer_bytes) as the plan defines them for shardc's collectives: an all-gather
    sends ``bytes`` and fills ``buffer_bytes``; a reduce-scatter or all-to-all sends
    ``buffer_bytes`` and receives ``bytes``; an all-reduce or broadcast moves one buffer."""
    sent = _nbytes([t for a in _inputs(f) for t in _tensors(a.meta.get("val"))])
    got = _nbytes([t for o in _outputs(f) for t in _tensors(o.meta.get("val"))])
    if f.kind == "all_gather":
        return sent, got
    if f.kind in ("reduce_scatter", "all_to_all"):
        return got, sent
    return sent, sent


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')
_SHARDC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module_of(node: fx.Node) -> str:
    """``w2 (Linear)``: the innermost module the op was traced in (a backward op: the module of
    the forward op it differentiates), from Dynamo's metadata; "" if none is recorded."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    path, cls = list(stack.values())[-1][:2]
    path = re.sub(r"^L\['self'\]\.?", "", str(path))
    path = re.sub(r"\[['\"]?(\w+)['\"]?\]", r".\1", path).strip(".")
    name = getattr(cls, "__name__", str(cls)).removeprefix("Shardc")
    return f"{path or 'the model'} ({name})"


def _source_of(node: fx.Node) -> str:
    """Where the op was traced: the user's line, and DTensor's tensor-parallel hook if it ran
    there (e.g. ``_prepare_output_fn`` of a ``ColwiseParallel``/``RowwiseParallel`` style)."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return ""
    libraries = (os.path.dirname(torch.__file__), _SHARDC_DIR)
    hooks = [fn for path, _, fn in frames
             if path.startswith(os.path.join(libraries[0], "distributed", "tensor", "parallel"))]
    user = [(path, line, fn) for path, line, fn in frames if not path.startswith(libraries)]
    where = ""
    if user:
        path, line, fn = user[-1]
        where = f"{os.path.basename(path)}:{line} in {fn}"
    if hooks:
        where += f"{', ' if where else ''}tensor-parallel style hook {hooks[-1]}"
    return where


def origin(node: fx.Node, role: str, graph: str) -> str:
    """Where a found collective came from, in words, for its plan record's reason."""
    if ORIGIN_META in node.meta:
        return str(node.meta[ORIGIN_META])
    who = "DTensor (tensor parallelism)" if role == "tp" else "the traced program"
    details = [d for d in (_module_of(node), _source_of(node)) if d]
    side = "backward of " if graph == "backward" and node.meta.get("autograd_backward") else ""
    return f"issued by {who}" + (f" in {side}{'; '.join(details)}" if details else "")


def _ready(g, node: fx.Node) -> int | None:
    """Position from which ``node``'s value exists, or None when it is a node shardc places
    itself later (a gathered parameter): then the reader stays where it was traced."""
    if node.op in ("placeholder", "get_attr"):
        return 0
    if node in g.position:
        return g.position[node] + 1
    return g.placed.get(node)


def _issue_reason(issue: int, traced: int, kept: str) -> str:
    if kept:
        return f"issued where traced ({kept})"
    if issue < traced:
        return (f"issued at op {issue}, as soon as its input exists ({traced - issue} op(s) "
                "earlier than traced)")
    return "issued where traced: its input is made by the op just before"


def _wait_reason(issue: int, wait: int, first: int, fixed: str) -> str:
    if fixed:
        return f"waited where traced (op {wait})"
    if wait < first:
        return f"waited before op {wait}, which writes in place (its first reader is op {first})"
    if wait == issue:
        return "its result is read at once, so it is waited right after issue (nothing to overlap)"
    return f"waited before its first reader (op {first}), overlapping {wait - issue} op(s)"


def _positions(g, f: FoundCollective, writers: list[int], fence: int,
               move: bool) -> tuple[int, int, int, str, str]:
    """(issue, wait, first reader) positions of ``f``, and why its issue, or its issue and wait,
    stay where they were traced ("" when they move). ``fence``: no issue before it (the previous
    collective of its group); ``writers``: positions of ops that write in place (nothing moves
    across one)."""
    traced = g.pos(f.node)
    traced_wait = max((g.pos(w) for w in f.waits), default=traced)
    first = min((g.pos(u) for w in f.waits for u in w.users), default=traced_wait)
    fixed = ("move_found_collectives=False" if not move else
             "it writes its input in place" if writes_in_place(f.node) else
             "it runs synchronously" if not f.waits else "")
    if fixed:
        return traced, traced_wait, first, fixed, fixed
    ready = [_ready(g, a) for a in f.node.all_input_nodes]
    kept = "it reads a tensor shardc gathers" if None in ready else ""
    issue = traced if kept else max([fence, *ready] + [w + 1 for w in writers if w < traced])
    wait = min([first] + [w for w in writers if traced_wait <= w < first])
    return issue, max(wait, issue), first, kept, ""


def place(g, found: list[FoundCollective], roles: dict[str, tuple[str, int]], *,
          move: bool = True) -> list[Collective]:
    """Plan records for the found collectives of graph ``g`` (a ``schedule.GraphComm``); records
    each one's issue and wait position in ``g.placed``, so later planning sees them there.

    ``roles``: process group name -> (role on the mesh, ranks); others are role ``other``.
    ``move=False`` keeps every one where it was traced.
    """
    from shardc.passes.schedule import view_users

    writers = [i for i, n in enumerate(g.compute) if writes_in_place(n)]
    last_issue: dict[str, int] = {}
    counts: dict[str, int] = {}
    out = []
    for f in found:
        role, size = _role(f.group_name, roles)
        size = f.group_size or size  # what the op itself says, where it says it
        traced = g.pos(f.node)
        issue, wait, first, kept, fixed = _positions(
            g, f, writers, last_issue.get(f.group_name, 0), move)
        last_issue[f.group_name] = issue
        g.placed[f.node] = issue
        for n in f.items:
            g.placed[n] = issue
        for w in f.waits:
            g.placed[w] = wait
        views, others = [], []
        for w in f.waits:
            v, r = view_users(w)
            views += v
            others += r
        last = max([g.pos(n) for n in views + others], default=first)
        nbytes, buffer_bytes = _byte_counts(f)
        index = counts.get(role, 0)
        counts[role] = index + 1
        dtypes = [t.dtype for a in _inputs(f) for t in _tensors(a.meta.get("val"))]
        out.append(Collective(
            id=f"{g.name}.{f.kind}.{role}.{index}", kind=f.kind, graph=g.name, bucket=-1,
            params=[], bytes=nbytes, buffer_bytes=buffer_bytes,
            dtype=str(dtypes[0]).removeprefix("torch.") if dtypes else "",
            stream=lane(role, f.group_name), issue_pos=issue, wait_pos=wait, first_use_pos=first,
            last_use_pos=last,
            reason=(f"{origin(f.node, role, g.name)}; over the {role} group; "
                    f"{_issue_reason(issue, traced, kept)}; "
                    f"{_wait_reason(issue, wait, first, fixed)}"),
            group=role, origin="graph", group_size=size,
            nodes=[n.name for n in (f.node, *f.waits)],
            tensors=[_describe_tensor(n) for n in (*_inputs(f), *_outputs(f))],
        ))
    return out


def _role(group_name: str, roles: dict[str, tuple[str, int]]) -> tuple[str, int]:
    """(role, ranks) of a process group: by name, else by its ranks (DTensor may run a mesh
    dimension's collectives on an older group of the same ranks: it caches redistributions by
    mesh, and equal meshes compare equal), else ``("other", its size)``."""
    if group_name in roles:
        return roles[group_name]
    import torch.distributed as dist

    if not dist.is_initialized():
        return "other", 1
    from shardc.runtime.collectives import group_ranks

    ranks = group_ranks(group_name)
    for name, role in roles.items():
        if group_ranks(name) == ranks:
            return role
    return "other", len(ranks)


# ------------------------------------------------------------------------------------ lowering


def _anchors(g, gm: fx.GraphModule) -> list[fx.Node]:
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


def _run_before(g, anchor: fx.Node) -> list[fx.Node]:
    """The non-compute nodes right before ``anchor`` (shardc's collectives placed there, found
    collectives), in order."""
    run = []
    node = anchor.prev
    while node.op not in ("root", "placeholder", "get_attr") and node not in g.position:
        run.append(node)
        node = node.prev
    return run[::-1]


def lower(gm: fx.GraphModule, g, records: list[Collective]) -> None:
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


def _place_issue(g, f: FoundCollective, anchor: fx.Node, after: dict[fx.Node, fx.Node]) -> None:
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


def _place_wait(g, wait: fx.Node, anchor: fx.Node) -> None:
    readers = set(wait.users)
    first = next((n for n in _run_before(g, anchor) if n in readers), anchor)
    first.prepend(wait)
