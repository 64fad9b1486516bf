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
- :func:`shardc.passes.lower_found.lower` then moves the issue and wait nodes to those positions
  in the graph.

Positions are those of the plan (``p``: before compute op ``p``). Among the nodes shardc puts before
op ``p``, a found collective's issue goes first (it starts as early as possible) and its wait last
(it stalls compute as late as possible), unless a data dependency needs another order.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
from dataclasses import dataclass, field

import torch
from torch import fx

from shardc import _torch
from shardc.passes.fx_utils import op_overload, tensor_nbytes, tensors_in, view_users
from shardc.planning.plan import Collective, CollectiveKind

Kind = CollectiveKind
funcol = _torch.funcol

# Metadata a pass may put on a collective it adds before planning: a phrase saying where it came
# from, for the plan's reason (e.g. shardc's FP8 amax all-reduce).
ORIGIN_META = "shardc_origin"

# Functional collectives by op packet name (the names of torch's ``_c10d_functional`` ops) -> kind.
_FUNCOL_KINDS = {
    "all_gather_into_tensor": Kind.ALL_GATHER,
    "all_gather_into_tensor_out": Kind.ALL_GATHER,
    "all_gather_into_tensor_coalesced": Kind.ALL_GATHER,
    "reduce_scatter_tensor": Kind.REDUCE_SCATTER,
    "reduce_scatter_tensor_out": Kind.REDUCE_SCATTER,
    "reduce_scatter_tensor_coalesced": Kind.REDUCE_SCATTER,
    "all_reduce": Kind.ALL_REDUCE,
    "all_reduce_": Kind.ALL_REDUCE,
    "all_reduce_coalesced": Kind.ALL_REDUCE,
    "all_reduce_coalesced_": Kind.ALL_REDUCE,
    "all_to_all_single": Kind.ALL_TO_ALL,
    "broadcast": Kind.BROADCAST,
    "broadcast_": Kind.BROADCAST,
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


@functools.cache
def _op_table() -> dict[object, CollectiveKind]:
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
        table[alltoall] = Kind.ALL_TO_ALL
    return table


def collective_kind(node: fx.Node) -> CollectiveKind | None:
    """The kind of collective ``node`` runs, if it is one (``wait_tensor`` is not). The table
    of ops is built once, lazily (it needs the ops registered): a constant, not state."""
    op = op_overload(node)
    return None if op is None else _op_table().get(op.overloadpacket)


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
    op = op_overload(node)
    return op is not None and any(a.alias_info is not None and a.alias_info.is_write
                                  for a in op._schema.arguments)


@dataclass
class FoundCollective:
    """One collective of the traced graph and its bookkeeping nodes."""

    node: fx.Node  # the collective: issues it
    kind: CollectiveKind
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


def _describe_tensor(node: fx.Node) -> str:
    parts = []
    for t in tensors_in(node.meta.get("val")):
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
    sent = tensor_nbytes([t for a in _inputs(f) for t in tensors_in(a.meta.get("val"))])
    got = tensor_nbytes([t for o in _outputs(f) for t in tensors_in(o.meta.get("val"))])
    if f.kind == Kind.ALL_GATHER:
        return sent, got
    if f.kind in (Kind.REDUCE_SCATTER, Kind.ALL_TO_ALL):
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
    """Plan records for the found collectives of graph ``g`` (a ``graph_view.GraphView``); records
    each one's issue and wait position in ``g.placed``, so later planning sees them there.

    ``roles``: process group name -> (role on the mesh, ranks); others are role ``other``.
    ``move=False`` keeps every one where it was traced.
    """
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
        dtypes = [t.dtype for a in _inputs(f) for t in tensors_in(a.meta.get("val"))]
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
