"""Plan the communication of one compiled region: buckets, issue and wait positions, predictions.

Input: the partitioned forward and backward graphs, still holding shardc's ``gather_param`` and
``reduce_scatter_grad`` nodes. Output: a :class:`shardc.plan.Plan`; the graphs are not changed
(``shardc.passes.lower`` applies the plan).

Placement rules, each recorded as the collective's ``reason``:
- all-gather of bucket ``k`` waits right before the first op that reads one of its parameters, and
  is issued before the first op of bucket ``k - prefetch_depth`` (prefetch), moved later one
  bucket at a time while the gathered bytes in flight would exceed the memory budget;
- reduce-scatter of a bucket is issued right after the last gradient of the bucket is computed and
  waited before the next bucket's send buffer is first written (or at the end of the graph): a
  fusing compiler writes a gradient that a reduction computes (a norm's weight) straight into
  the send buffer, so that buffer exists from that reduction on, and waiting the previous
  reduce-scatter first lets the new buffer take its place instead of adding a second one;
- collectives already in the traced graph (tensor parallelism) are planned by
  ``shardc.passes.graph_comm`` first: issued as soon as their inputs exist, waited before their
  first reader.

The cost model simulates one lane per process group (each has its own stream on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from shardc.passes import graph_comm
from shardc.passes.bucketing import ParamComm, assign_buckets, bucket_name
from shardc.passes.cost_model import ClusterSpec, node_flops_and_bytes
from shardc.passes.fx_utils import is_call, is_view, view_chain
from shardc.passes.reshard import gather_derived
from shardc.plan import PLAN_VERSION, Bucket, Collective, ComputeOp, Plan
from shardc.runtime.collectives import padded_rows
from shardc.runtime.ops import GATHER_OP, REDUCE_SCATTER_OP


@dataclass
class GraphComm:
    """A graph's compute order, its shardc nodes keyed by parameter name, and the collectives
    found in it (``graph_comm``), whose nodes are not compute ops."""

    name: str
    compute: list[fx.Node]
    position: dict[fx.Node, int]
    gathers: dict[str, fx.Node] = field(default_factory=dict)
    reduces: dict[str, fx.Node] = field(default_factory=dict)
    found: list[graph_comm.FoundCollective] = field(default_factory=list)
    # Planned positions of the found collectives' nodes (set by graph_comm.place).
    placed: dict[fx.Node, int] = field(default_factory=dict)

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


def view_chain_root(node: fx.Node) -> fx.Node | None:
    """The placeholder ``node`` is a chain of single-input views of, if it is one."""
    chain = view_chain(node)
    if chain is None:
        return None
    return chain[-1].all_input_nodes[0] if chain else node


def view_users(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(views taken of ``node``, transitively; the other nodes that read any of them)."""
    views, readers, stack = [], [], [node]
    while stack:
        for user in stack.pop().users:
            if is_view(user):
                if user not in views:
                    views.append(user)
                    stack.append(user)
            elif user not in readers:
                readers.append(user)
    return views, readers


def ready_pos(g: GraphComm, node: fx.Node) -> int:
    """Earliest position at which ``node``'s value exists: after its compute op, or where a
    bookkeeping node (a found collective's wait) is placed."""
    if node.op == "placeholder":
        return 0
    return g.pos(node) + 1 if node in g.position else g.pos(node)


def available_pos(g: GraphComm, node: fx.Node) -> int:
    """Earliest position a collective reading ``node`` can be issued at (views are re-taken)."""
    if view_chain_root(node) is not None:
        return 0
    return g.pos(node) + 1


def _nodes_after(node: fx.Node):
    n = node.next
    while n.op != "root":
        yield n
        n = n.next


def analyze(gm: fx.GraphModule, name: str) -> GraphComm:
    found = graph_comm.find(gm)
    bookkeeping = {n for f in found for n in f.nodes}
    compute, gathers, reduces = [], {}, {}
    for node in gm.graph.nodes:
        if is_call(node, GATHER_OP):
            gathers[node.args[1]] = node
        elif is_call(node, REDUCE_SCATTER_OP):
            reduces[node.args[1]] = node
        elif node.op not in ("placeholder", "output") and node not in bookkeeping:
            compute.append(node)
    return GraphComm(name, compute, {n: i for i, n in enumerate(compute)}, gathers, reduces,
                     found)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def param_comm(gather: fx.Node) -> ParamComm:
    shard, fqn, dim0, world, group_name, compute_dtype, reduce_dtype = gather.args[:7]
    # HSDP's trailing arguments (gather_param's defaults when a caller leaves them out).
    replicate = gather.args[10] if len(gather.args) > 10 else 1
    replicate_group = gather.args[11] if len(gather.args) > 11 else ""
    val = shard.meta["val"]
    dtype = compute_dtype or val.dtype
    row_numel = 1
    for s in val.shape[1:]:
        row_numel *= int(s)
    return ParamComm(
        fqn=fqn,
        dim0=dim0,
        padded_rows=padded_rows(dim0, world),
        row_numel=row_numel,
        dtype=_dtype_name(dtype),
        reduce_dtype=_dtype_name(reduce_dtype or val.dtype),
        group_name=group_name,
        world=world,
        itemsize=torch.empty((), dtype=dtype).element_size(),
        replicate=replicate,
        replicate_group=replicate_group if replicate > 1 else "",
    )


def make_buckets(fw: GraphComm, options) -> list[Bucket]:
    order = sorted(fw.gathers, key=lambda fqn: (fw.first_use(fqn), fw.pos(fw.gathers[fqn])))
    comms = [param_comm(fw.gathers[fqn]) for fqn in order]
    groups = assign_buckets(
        comms, by=options.bucket_by, patterns=options.bucket_modules,
        cap_bytes=options.bucket_cap_bytes,
    )
    return [
        Bucket(
            index=i,
            name=bucket_name(members, options.bucket_modules),
            params=[p.fqn for p in members],
            dim0=[p.dim0 for p in members],
            padded_rows=[p.padded_rows for p in members],
            row_numel=[p.row_numel for p in members],
            dtype=members[0].dtype,
            reduce_dtype=members[0].reduce_dtype,
            world=members[0].world,
            replicate=members[0].replicate,
            replicate_group=members[0].replicate_group,
        )
        for i, members in enumerate(groups)
    ]


def _itemsize(dtype_name: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype_name)).element_size()


def _collective(g: GraphComm, kind: str, bucket: Bucket, params: list[str], nbytes: int,
                dtype: str, issue: int, wait: int, first_use: int, last_use: int,
                reason: str, *, group: str = "shard") -> Collective:
    """One planned collective of ``bucket`` over ``nbytes`` (the gathered or unreduced buffer;
    each rank sends its ``1/world``, all of it for an all-reduce); its buffer lives from issue to
    last use."""
    per_rank = nbytes if kind == "all_reduce" else nbytes // bucket.world
    return Collective(
        id=f"{g.name}.{kind}.{bucket.index}", kind=kind, graph=g.name, bucket=bucket.index,
        params=params, bytes=per_rank, buffer_bytes=nbytes, dtype=dtype,
        stream=graph_comm.lane(group), issue_pos=issue, wait_pos=wait, first_use_pos=first_use,
        last_use_pos=last_use, reason=reason, buffer_lifetime=(issue, last_use + 1), group=group,
        group_size=bucket.replicate if group == "replicate" else bucket.world,
    )


def _place_all_gathers(g: GraphComm, buckets: list[Bucket], options) -> list[Collective]:
    present = [(b, [p for p in b.params if p in g.gathers]) for b in buckets]  # bucket order
    present = [(b, ps) for b, ps in present if ps]
    present.sort(key=lambda item: min(g.first_use(p) for p in item[1]))
    first = [min(g.first_use(p) for p in ps) for _, ps in present]
    last = [max(g.last_use(p) for p in ps) for _, ps in present]
    live = [0] * (g.end + 1)
    budget = options.memory_budget_bytes
    depth = options.prefetch_depth if options.prefetch else 0
    out = []
    for k, (bucket, params) in enumerate(present):
        nbytes = bucket.layout(params)[1] * bucket.world * _itemsize(bucket.dtype)
        earliest = max(available_pos(g, g.gathers[p].args[0]) for p in params)
        candidates = [max(earliest, 0 if j < 0 else first[j]) for j in range(k - depth, k + 1)]
        issue, reason = first[k], "no prefetch: issued at the first use of its parameters"
        for j, pos in zip(range(k - depth, k + 1), candidates):
            fits = not budget or all(live[q] + nbytes <= budget for q in range(pos, last[k] + 1))
            if fits:
                issue = pos
                if j == k:
                    reason = "issued at first use (prefetch off or memory budget)"
                elif j < 0:
                    reason = "graph start: nothing earlier to overlap with"
                else:
                    reason = (f"prefetched {k - j} bucket(s) ahead, overlapping bucket "
                              f"{present[j][0].index}")
                break
        else:
            reason = f"over memory budget ({budget} B) even without prefetch; issued at first use"
        for q in range(issue, last[k] + 1):
            live[q] += nbytes
        out.append(_collective(g, "all_gather", bucket, params, nbytes, bucket.dtype, issue,
                               first[k], first[k], last[k], reason))
    return out


def first_write(g: GraphComm, grad: fx.Node) -> int | None:
    """Position of the reduction that computes ``grad`` when only casts and views lie between
    them: a fusing compiler writes its result straight into the send buffer, which therefore
    exists from there on. ``None`` when the gradient comes from another kernel (a matmul): it is
    copied into the send buffer where the buffer is packed."""
    node = grad
    while node.op == "call_function" and len(node.all_input_nodes) == 1 and (
            is_view(node) or torch.Tag.pointwise in getattr(node.target, "tags", ())):
        node = node.all_input_nodes[0]
    if node in g.position and torch.Tag.reduction in getattr(node.target, "tags", ()):
        return g.pos(node)
    return None


def _place_reduce_scatters(g: GraphComm, buckets: list[Bucket]) -> list[Collective]:
    items = []
    for bucket in buckets:
        params = [p for p in bucket.params if p in g.reduces]
        if not params:
            continue
        ready = max(ready_pos(g, g.reduces[p].args[0]) for p in params)
        ready = min(ready, g.end)
        # The wait must precede every reader of the reduced shards (the output, or additions).
        # (views of the shards are moved behind the wait by the lowering)
        latest = min(g.pos(u) for p in params for u in view_users(g.reduces[p])[1])
        if latest < ready:  # dedupe moves the readers of merged reductions to the end
            reader = g.compute[latest].name if latest < g.end else "the output"
            raise RuntimeError(
                f"shardc schedule: bucket {bucket.index} ({bucket.name}) reads a reduced gradient "
                f"at {reader} (op {latest}) before its last gradient exists (op {ready}); "
                "this is a shardc bug, please report it with the model")
        writes = [w for w in (first_write(g, g.reduces[p].args[0]) for p in params)
                  if w is not None]
        items.append((ready, bucket, params, latest, min(writes, default=ready)))
    items.sort(key=lambda item: (item[0], item[1].index))
    out = []
    for j, (ready, bucket, params, latest, _) in enumerate(items):
        # Waited before the next bucket's send buffer is first written (its reduction) if that
        # is later than this issue, else when the next one is issued: either way at most one
        # fp32 send buffer is alive besides the one being filled, and with the early wait the
        # new buffer reuses this one's memory (one instead of two at the backward's peak).
        wait = g.end
        if j + 1 < len(items):
            next_ready, next_write = items[j + 1][0], items[j + 1][4]
            wait = next_write if next_write > ready else next_ready
        wait = min(max(wait, ready), latest)
        nbytes = bucket.layout(params)[1] * bucket.world * _itemsize(bucket.reduce_dtype)
        out.append(_collective(
            g, "reduce_scatter", bucket, params, nbytes, bucket.reduce_dtype, ready, wait, wait,
            wait, "issued once the last gradient of the bucket exists; waited before the next "
            "bucket's send buffer is first written (one in flight while the next is filled)"))
        if bucket.replicate > 1:
            out.append(replicate_all_reduce(g, bucket, params, wait, latest))
    return out


def replicate_all_reduce(g: GraphComm, bucket: Bucket, params: list[str], issue: int,
                         latest: int) -> Collective:
    """HSDP: the all-reduce (average) of a bucket's reduce-scattered shard over the replicate
    group, issued at the reduce-scatter's wait (it reduces its output) and waited before the
    first reader of the reduced shards (``latest``: the graph's output, or an accumulation)."""
    nbytes = bucket.layout(params)[1] * _itemsize(bucket.reduce_dtype)
    wait = max(issue, latest)
    return _collective(
        g, "all_reduce", bucket, params, nbytes, bucket.reduce_dtype, issue, wait, wait, wait,
        f"HSDP: averages the bucket's shard over the {bucket.replicate} replicas (inter-node); "
        "issued at its reduce-scatter's wait, waited before the first reader of the reduced "
        "gradients", group="replicate")


def _duration(c: Collective, cluster: ClusterSpec) -> float:
    level = "inter" if c.group == "replicate" else "intra"
    return cluster.collective_seconds(c.kind, c.buffer_bytes, c.group_size, level)


def _simulate(g: GraphComm, colls: list[Collective], cluster: ClusterSpec):
    """Timing: compute runs its ops in order; each process group's collectives run first-in
    first-out on their own lane (stream), from their issue; a wait stalls compute until the
    collective ends. At one position the events follow the lowered graph's order: found
    collectives' issues, then (when shardc issues there) shardc's waits of earlier issues
    (not HSDP all-reduces), shardc's issues, its other waits, and last the found collectives'
    waits, as ``lower.apply_plan`` orders them. An HSDP
    all-reduce is issued by its reduce-scatter's wait. Fills the predictions."""
    ops = []
    free: dict[str, float] = {}  # per lane: when its last collective ends
    chained = {c.id.replace(".all_reduce.", ".reduce_scatter."): c for c in colls
               if c.origin == "shardc" and c.kind == "all_reduce"}
    chained_ids = {id(c) for c in chained.values()}
    by_issue: dict[int, list[Collective]] = {}
    by_wait: dict[int, list[Collective]] = {}
    for c in colls:
        if id(c) not in chained_ids:
            by_issue.setdefault(c.issue_pos, []).append(c)
        by_wait.setdefault(c.wait_pos, []).append(c)
    t = exposed = 0.0

    def issue(c: Collective) -> None:
        c.predicted_start_s = max(t, free.get(c.stream, 0.0))
        c.predicted_end_s = free[c.stream] = c.predicted_start_s + _duration(c, cluster)

    def wait(c: Collective) -> None:
        nonlocal t, exposed
        if c.predicted_end_s > t:
            c.exposed_s = c.predicted_end_s - t
            exposed += c.exposed_s
            t = c.predicted_end_s
        if c.id in chained:
            issue(chained[c.id])

    for p in range(g.end + 1):
        issues, waits = by_issue.get(p, []), by_wait.get(p, [])
        own = [c for c in issues if c.origin == "shardc"]
        early = [c for c in waits if own and c.origin == "shardc" and c.kind != "all_reduce"
                 and c.issue_pos < p]
        for c in [c for c in issues if c.origin != "shardc"]:
            issue(c)
        for c in early:
            wait(c)
        for c in own:
            issue(c)
        rest = [c for c in waits if c.origin == "shardc" and all(c is not e for e in early)]
        for c in sorted(rest, key=lambda c: c.kind == "all_reduce"):
            wait(c)
        for c in [c for c in waits if c.origin != "shardc"]:
            wait(c)
        if p < g.end:
            node = g.compute[p]
            flops, nbytes = node_flops_and_bytes(node)
            dur = cluster.compute_seconds(flops, nbytes)
            ops.append(ComputeOp(node.name, str(node.target), flops, nbytes, t, t + dur))
            t += dur
    for c in colls:
        c.overlaps = [op.name for op in ops[c.issue_pos:c.wait_pos]][:64]
    return ops, t, exposed


def _memory_timeline(g: GraphComm, colls: list[Collective]) -> list[int]:
    """Bytes of shardc's communication buffers live before each position (found collectives'
    tensors are ordinary activations: the whole-step peak counts them)."""
    live = [0] * (g.end + 1)
    for c in colls:
        if c.buffer_lifetime is None:
            continue
        start, end = c.buffer_lifetime
        for q in range(start, min(end, g.end + 1)):
            live[q] += c.buffer_bytes
    return live


def group_roles(fw: GraphComm, known: dict[str, tuple[str, int]] | None
                ) -> dict[str, tuple[str, int]]:
    """Process group name -> (role on the mesh, ranks): the shard and replicate groups named by
    the gathers, and whatever the caller knows (``shardc.shard`` records the tp group)."""
    roles = {}
    for gather in fw.gathers.values():
        comm = param_comm(gather)
        roles[comm.group_name] = ("shard", comm.world)
        if comm.replicate > 1:
            roles[comm.replicate_group] = ("replicate", comm.replicate)
    roles.update(known or {})
    return roles


def _describe_mesh(plan: Plan, roles: dict[str, tuple[str, int]]) -> None:
    """Fill the plan's mesh fields (HSDP's replicate group, FSDP+TP's tp group)."""
    for name, (role, size) in sorted(roles.items()):
        if role == "replicate" and size > 1:
            plan.replicate_size, plan.replicate_group_name = size, name
            plan.mesh = f"HSDP: replicate {size} x shard {plan.world_size}"
        elif role == "tp":
            plan.tp_size, plan.tp_group_name = size, name
            plan.mesh = f"FSDP+TP: dp {plan.world_size} x tp {size}"


def _found_note(found: list[Collective], moved: bool) -> str:
    counts: dict[str, int] = {}
    for c in found:
        counts[c.group] = counts.get(c.group, 0) + 1
    groups = ", ".join(f"{n} over {role}" for role, n in sorted(counts.items()))
    where = ("issued once its input exists and waited before its first reader" if moved else
             "kept where traced (move_found_collectives=False)")
    return (f"{len(found)} collective(s) found in the traced graphs ({groups}): each on its "
            f"group's lane, {where}")


def plan_region(
    forward: fx.GraphModule,
    backward: fx.GraphModule | None,
    options,
    *,
    region: int = 0,
    cluster: ClusterSpec | None = None,
    groups: dict[str, tuple[str, int]] | None = None,
) -> Plan:
    """Plan all collectives of one region (see the module docstring for the rules).

    ``groups``: process group name -> (role on the mesh, ranks) for the groups the graphs'
    found collectives may run over (e.g. the tp group); shardc's own groups are read from the
    graph."""
    cluster = cluster or ClusterSpec(**(options.cluster or {}))
    fw = analyze(forward, "forward")
    bw = analyze(backward, "backward") if backward is not None else None
    graphs = [fw] + ([bw] if bw is not None else [])
    roles = group_roles(fw, groups)
    found = {g.name: graph_comm.place(g, g.found, roles, move=options.move_found_collectives)
             for g in graphs}
    buckets = make_buckets(fw, options)
    world = buckets[0].world if buckets else 1
    plan = Plan(PLAN_VERSION, region, world, options.as_dict(), buckets, [])
    plan.group_name = next(iter(fw.gathers.values())).args[4] if fw.gathers else ""
    _describe_mesh(plan, roles)
    total_time = total_exposed = 0.0
    for g in graphs:
        colls = _place_all_gathers(g, buckets, options)
        if g.name == "backward":
            colls += _place_reduce_scatters(g, buckets)
        colls += found[g.name]
        # Found collectives first at a position, in graph order (the sort is stable): their
        # group's order is the traced one.
        colls.sort(key=lambda c: (c.issue_pos, c.origin == "shardc",
                                  c.origin == "shardc" and c.kind != "all_gather", c.bucket))
        ops, step, exposed = _simulate(g, colls, cluster)
        plan.collectives.extend(colls)
        plan.graphs[g.name] = ops
        plan.memory_timeline[g.name] = _memory_timeline(g, colls)
        plan.predicted[f"{g.name}_time_s"] = step
        plan.predicted[f"{g.name}_exposed_comm_s"] = exposed
        total_time += step
        total_exposed += exposed
    if any(found.values()):
        plan.notes.append(_found_note([c for cs in found.values() for c in cs],
                                      options.move_found_collectives))
    plan.predicted["step_time_s"] = total_time
    plan.predicted["exposed_comm_s"] = total_exposed
    plan.predicted["comm_time_s"] = sum(c.predicted_end_s - c.predicted_start_s
                                        for c in plan.collectives)
    plan.predicted["peak_comm_buffer_bytes"] = max(
        (max(t, default=0) for t in plan.memory_timeline.values()), default=0
    )
    return plan
