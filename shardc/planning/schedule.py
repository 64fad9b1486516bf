"""Plan the communication of one compiled region: buckets, issue and wait positions, predictions.

Input: the partitioned forward and backward graphs, still holding shardc's ``gather_param`` and
``reduce_scatter_grad`` nodes. Output: a :class:`shardc.planning.plan.Plan`; the graphs are not
changed (``shardc.passes.lower`` applies the plan).

Placement rules, each recorded as the collective's ``reason``:
- all-gather of bucket ``k`` waits right before the first op that reads one of its parameters, and
  is issued before the first op of bucket ``k - prefetch_depth`` (prefetch), moved later one
  bucket at a time while the gathered bytes in flight would exceed the memory budget;
- reduce-scatter of a bucket is issued right after the last gradient of the bucket is computed and
  waited before the next bucket's send buffer is first written (or at the end of the graph): a
  fusing compiler writes a gradient that a reduction computes (a norm's weight) straight into
  the send buffer, so that buffer exists from that reduction on, and waiting the previous
  reduce-scatter first lets the new buffer take its place instead of adding a second one.
  With ``reduce_scatter_wait_past_small_buckets`` the wait passes over the next buckets of at
  most 1/16 its send bytes (FP8's norm bucket right after a layer's Linear bucket) to the next
  larger one's first write, never past the first reader of the reduced gradients;
- collectives already in the traced graph (tensor parallelism) are planned by
  ``shardc.planning.found`` first: issued as soon as their inputs exist, waited before their
  first reader;
- shardc's collectives over a one-rank group (world 1, HSDP with shard size 1) are planned as
  above but marked ``elided``: no time, no buffer; the lowering reads the shard in place and
  takes the gradient as the reduced one (an HSDP all-reduce then starts where they exist).
  Under CPU offload too (not with HSDP replicas): the gathered parameter is then the device
  copy of the host shard, cast, and the reduced gradient goes back to the host as it is (no
  send or receive buffer).

The cost model simulates one lane per process group (each has its own stream on GPU).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import fx

from shardc.ops.gather_args import GatherArgs, ReduceArgs
from shardc.ops.offload_copy import is_to_host
from shardc.passes.fx_utils import dtype_itemsize, is_view, subgraph_module, view_users
from shardc.planning import found as found_comm
from shardc.planning.bucketing import ParamComm, assign_buckets, bucket_name
from shardc.planning.copies import (
    COPY_KINDS,
    COPY_LANE,
    place_activations,
    place_d2h,
    place_h2d,
)
from shardc.planning.cost_model import model_flops, node_flops_and_bytes
from shardc.planning.estimate import (
    collective_copy_bytes,
    elided_cast_bytes,
    graph_input_bytes,
    kernel_category,
    kernel_seconds,
    memory_seconds,
)
from shardc.planning.graph_view import GraphView, analyze, available_pos, ready_pos
from shardc.planning.kernels import anchor, count_calls, group_kernels
from shardc.planning.plan import PLAN_VERSION, Bucket, Collective, CollectiveKind, ComputeOp, Plan
from shardc.planning.profile import ClusterProfile, resolve_profile
from shardc.runtime.collectives import padded_rows

Kind = CollectiveKind


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def param_comm(gather: fx.Node) -> ParamComm:
    a = GatherArgs.of(gather)
    val = a.shard.meta["val"]
    dtype = a.compute_dtype or val.dtype
    row_numel = 1
    for s in val.shape[1:]:
        row_numel *= int(s)
    return ParamComm(
        fqn=a.fqn,
        dim0=a.dim0,
        padded_rows=padded_rows(a.dim0, a.world),
        row_numel=row_numel,
        dtype=_dtype_name(dtype),
        reduce_dtype=_dtype_name(a.reduce_dtype or val.dtype),
        group_name=a.group_name,
        world=a.world,
        itemsize=dtype.itemsize,
        replicate=a.replicate,
        replicate_group=a.replicate_group if a.replicate > 1 else "",
    )


def make_buckets(fw: GraphView, options) -> list[Bucket]:
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
    return dtype_itemsize(getattr(torch, dtype_name))


def _collective(g: GraphView, kind: Kind, bucket: Bucket, params: list[str], nbytes: int,
                dtype: str, issue: int, wait: int, first_use: int, last_use: int,
                reason: str, *, group: str = "shard") -> Collective:
    """One planned collective of ``bucket`` over ``nbytes`` (the gathered or unreduced buffer;
    each rank sends its ``1/world``, all of it for an all-reduce); its buffer lives from issue to
    last use."""
    per_rank = nbytes if kind == Kind.ALL_REDUCE else nbytes // bucket.world
    group_size = bucket.replicate if group == "replicate" else bucket.world
    # With CPU offload too (off22), where no HSDP replica follows: the lowering orders an
    # elided gather's cast after its bucket's host->device copy is waited
    # (``shardc.passes.lower_copies.lower_h2d``), and copies an elided reduction's gradient to
    # the host as it would the reduced shard. HSDP with one-rank shard groups under offload
    # keeps them lowered, as before (not tested elided).
    offloaded = bool(g.to_device or g.to_host)
    elided = group_size == 1 and not (offloaded and bucket.replicate > 1)
    if elided:
        reason = f"{ELIDED_REASON[kind]} (placement as planned: {reason})"
    return Collective(
        id=f"{g.name}.{kind}.{bucket.index}", kind=kind, graph=g.name, bucket=bucket.index,
        params=params, bytes=per_rank, buffer_bytes=nbytes, dtype=dtype,
        stream=found_comm.lane(group), issue_pos=issue, wait_pos=wait, first_use_pos=first_use,
        last_use_pos=last_use, reason=reason,
        buffer_lifetime=None if elided else (issue, last_use + 1), group=group,
        group_size=group_size, elided=elided,
    )


# Why a collective over a one-rank group is elided (``Collective.elided``), by kind.
ELIDED_REASON = {
    Kind.ALL_GATHER: "elided: one-rank shard group, the gathered parameter is the shard itself "
                     "(cast to the compute dtype), read in place",
    Kind.REDUCE_SCATTER: "elided: one-rank shard group, the reduced gradient is the gradient "
                         "itself (cast to the reduce and shard dtypes)",
    Kind.ALL_REDUCE: "elided: one-rank replicate group",
}


def _place_all_gathers(g: GraphView, buckets: list[Bucket], options) -> list[Collective]:
    present = [(b, [p for p in b.params if p in g.gathers]) for b in buckets]  # bucket order
    present = [(b, ps) for b, ps in present if ps]
    present.sort(key=lambda item: min(g.first_use(p) for p in item[1]))
    first = [min(g.first_use(p) for p in ps) for _, ps in present]
    last = [max(g.last_use(p) for p in ps) for _, ps in present]
    live = [0] * (g.end + 1)
    # The bound on gathered bytes in flight (``ShardcOptions.memory_budget_bytes``; the pipeline
    # bounds the pool with the same option, see its docstring).
    in_flight_limit = options.memory_budget_bytes
    depth = options.prefetch_depth if options.prefetch else 0
    out = []
    for k, (bucket, params) in enumerate(present):
        nbytes = bucket.layout(params)[1] * bucket.world * _itemsize(bucket.dtype)
        earliest = max(available_pos(g, GatherArgs.of(g.gathers[p]).shard) for p in params)
        candidates = [max(earliest, 0 if j < 0 else first[j]) for j in range(k - depth, k + 1)]
        issue, reason = first[k], "no prefetch: issued at the first use of its parameters"
        for j, pos in zip(range(k - depth, k + 1), candidates):
            fits = not in_flight_limit or all(live[q] + nbytes <= in_flight_limit
                                              for q in range(pos, last[k] + 1))
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
            reason = (f"over memory budget ({in_flight_limit} B) even without prefetch; issued at "
                      "first use")
        for q in range(issue, last[k] + 1):
            live[q] += nbytes
        out.append(_collective(g, Kind.ALL_GATHER, bucket, params, nbytes, bucket.dtype, issue,
                               first[k], first[k], last[k], reason))
    return out


def _cast_chain(grad: fx.Node) -> tuple[list[fx.Node], fx.Node]:
    """The casts and views that end in ``grad`` (single-input pointwise ops and views, from
    ``grad`` back) and the node that produced what they cast."""
    chain, node = [], grad
    while node.op == "call_function" and len(node.all_input_nodes) == 1 and (
            is_view(node) or torch.Tag.pointwise in getattr(node.target, "tags", ())):
        chain.append(node)
        node = node.all_input_nodes[0]
    return chain, node


def first_write(g: GraphView, grad: fx.Node) -> int | None:
    """Position of the reduction that computes ``grad`` when only casts and views lie between
    them: a fusing compiler writes its result straight into the send buffer, which therefore
    exists from there on. ``None`` when the gradient comes from another kernel (a matmul): it is
    copied into the send buffer where the buffer is packed."""
    _, node = _cast_chain(grad)
    if node in g.position and torch.Tag.reduction in getattr(node.target, "tags", ()):
        return g.pos(node)
    return None


def fused_fill(g: GraphView, grad: fx.Node) -> int:
    """Where the kernel that fills the send buffer with ``grad`` runs: a fusing compiler folds
    the casts and views that end in ``grad`` into the copy that packs the bucket, so that copy
    starts where the first of them is (the ``ready_pos`` of ``grad`` when it is computed by
    another kind of op, a matmul or an accumulation)."""
    start = None
    for node in _cast_chain(grad)[0]:
        if node not in g.position:
            break
        start = node
    return g.pos(start) if start is not None else ready_pos(g, grad)


class _Reduction(NamedTuple):
    """One bucket's reduce-scatter in the backward, before its wait is placed: ``ready`` (its
    issue: the bucket's last gradient exists), ``latest`` (the first reader of the reduced
    shards), ``first_write`` (where a reduction writes a gradient straight into the send
    buffer, :func:`first_write`; ``None``: none does), ``fill`` (where the packing copy runs,
    :func:`fused_fill`) and ``send_bytes`` (the whole unreduced send buffer)."""

    ready: int
    bucket: Bucket
    params: list[str]
    latest: int
    first_write: int | None
    fill: int
    send_bytes: int


# Under ``ShardcOptions.reduce_scatter_wait_past_small_buckets`` a reduce-scatter's wait passes
# over the next buckets whose send buffers hold at most 1/SMALL_BUCKET_DIVISOR of its bytes.
SMALL_BUCKET_DIVISOR = 16


def _reduction(g: GraphView, bucket: Bucket) -> _Reduction | None:
    """The reduce-scatter of ``bucket`` in ``g`` (``None`` where no gradient of it is reduced
    there)."""
    params = [p for p in bucket.params if p in g.reduces]
    if not params:
        return None
    grads = [ReduceArgs.of(g.reduces[p]).grad for p in params]
    ready = max(ready_pos(g, grad) for grad in grads)
    ready = min(ready, g.end)
    # The wait must precede every reader of the reduced shards (the output, or additions).
    # (views of the shards are moved behind the wait by the lowering)
    latest = min(g.pos(u) for p in params for u in _readers(g.reduces[p]))
    if latest < ready:  # dedupe moves the readers of merged reductions to the end
        reader = g.compute[latest].name if latest < g.end else "the output"
        raise RuntimeError(
            f"shardc schedule: bucket {bucket.index} ({bucket.name}) reads a reduced gradient "
            f"at {reader} (op {latest}) before its last gradient exists (op {ready}); "
            "this is a shardc bug, please report it with the model")
    writes = [w for w in (first_write(g, grad) for grad in grads)
              if w is not None]
    last = max(grads, key=lambda grad: ready_pos(g, grad))
    send_bytes = bucket.layout(params)[1] * bucket.world * _itemsize(bucket.reduce_dtype)
    return _Reduction(ready, bucket, params, latest, min(writes, default=None),
                      fused_fill(g, last), send_bytes)


def _wait_before(following: _Reduction | None, ready: int, end: int) -> int:
    """Where a reduce-scatter issued at ``ready`` is waited ahead of the ``following`` bucket's
    send buffer (``end``, the graph's end, where none follows), before the clamps.

    Before that buffer is first written (its reduction) if that is later than this issue, else
    where it is packed: either way at most one fp32 send buffer is alive besides the one being
    filled, and with the early wait the new buffer reuses this one's memory (one instead of two
    at the backward's peak). The packing copy starts where the casts of the following bucket's
    last gradient do (Inductor fuses them into it: measured on two H200s, the embedding
    gradient's fp32 cast ran after the previous reduce-scatter, docs/cost_model.md), not after
    them."""
    if following is None:
        return end
    if following.first_write is not None and following.first_write > ready:
        return following.first_write
    return following.fill if following.fill > ready else following.ready


def _clamped(r: _Reduction, wait: int) -> int:
    """``wait`` kept between ``r``'s issue and the first reader of its reduced shards."""
    return min(max(wait, r.ready), r.latest)


def _next_large(items: list[_Reduction], j: int) -> int:
    """Index in ``items`` of the first bucket after ``j`` whose send buffer is more than
    1/:data:`SMALL_BUCKET_DIVISOR` of ``j``'s (``len(items)`` where none is)."""
    k = j + 1
    while k < len(items) and items[k].send_bytes * SMALL_BUCKET_DIVISOR <= items[j].send_bytes:
        k += 1
    return k


# The reduce-scatter's ``reason`` under the default rule.
WAIT_BEFORE_NEXT = ("issued once the last gradient of the bucket exists; waited before the next "
                    "bucket's send buffer is first written (one in flight while the next is "
                    "filled)")


def _wait_past_small(items: list[_Reduction], j: int, end: int, default_wait: int
                     ) -> tuple[int, str]:
    """``ShardcOptions.reduce_scatter_wait_past_small_buckets``: the wait of ``items[j]``'s
    reduce-scatter before the next bucket that is not small (:func:`_next_large`), clamped as
    the default one is, and its ``reason`` (the default's where nothing moved). Never earlier
    than ``default_wait`` (the default rule's): the option only passes over small buckets."""
    r, k = items[j], _next_large(items, j)
    target = items[k] if k < len(items) else None
    unclamped = _wait_before(target, r.ready, end)
    wait = max(_clamped(r, unclamped), default_wait)
    if wait == default_wait:
        return wait, WAIT_BEFORE_NEXT
    if unclamped > r.latest:
        where = "the first reader of its reduced gradients"
    elif target is not None:
        where = f"bucket {target.bucket.index}'s send buffer is first written"
    else:
        where = "the end of the graph"
    return wait, (
        f"issued once the last gradient of the bucket exists; waited past the {k - j - 1} next "
        f"bucket(s) of at most 1/{SMALL_BUCKET_DIVISOR} its send bytes (option "
        f"reduce_scatter_wait_past_small_buckets: their buffers live beside this one), before "
        f"{where} (op {wait}; op {default_wait} without the option)")


def _place_reduce_scatters(g: GraphView, buckets: list[Bucket],
                           wait_past_small: bool = False) -> list[Collective]:
    """The backward's reduce-scatters, one per bucket with a gradient here, each issued once
    its bucket's last gradient exists and waited by :func:`_wait_before` the next bucket (in
    issue order), clamped between its issue and the first reader of its reduced shards.
    ``wait_past_small`` (``ShardcOptions.reduce_scatter_wait_past_small_buckets``): by the next
    bucket that is not small instead (:func:`_wait_past_small`)."""
    items = [r for r in (_reduction(g, bucket) for bucket in buckets) if r is not None]
    items.sort(key=lambda r: (r.ready, r.bucket.index))
    out = []
    for j, r in enumerate(items):
        bucket, params, ready = r.bucket, r.params, r.ready
        following = items[j + 1] if j + 1 < len(items) else None
        wait = _clamped(r, _wait_before(following, ready, g.end))
        reason = WAIT_BEFORE_NEXT
        if wait_past_small:
            wait, reason = _wait_past_small(items, j, g.end, wait)
        if bucket.world == 1 and not (g.to_device or g.to_host):
            # Elided (a one-rank shard group): nothing to wait for; HSDP's all-reduce of the
            # gradients starts as soon as they exist.
            wait, reason = ready, WAIT_BEFORE_NEXT
        out.append(_collective(
            g, Kind.REDUCE_SCATTER, bucket, params, r.send_bytes, bucket.reduce_dtype, ready, wait,
            wait, wait, reason))
        if bucket.replicate > 1:
            reduce_scatter, all_reduce = out[-1], replicate_all_reduce(g, bucket, params, wait,
                                                                        r.latest)
            reduce_scatter.link, all_reduce.link = all_reduce.id, reduce_scatter.id
            out.append(all_reduce)
    return out


def _readers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read ``node`` or its views; through an offload device->host copy, which
    the lowering moves to where the plan's copy lane issues it, its readers."""
    out = []
    for user in view_users(node)[1]:
        out += _readers(user) if is_to_host(user) else [user]
    return out


def replicate_all_reduce(g: GraphView, bucket: Bucket, params: list[str], issue: int,
                         latest: int) -> Collective:
    """HSDP: the all-reduce (average) of a bucket's reduce-scattered shard over the replicate
    group, issued at the reduce-scatter's wait (it reduces its output) and waited before the
    first reader of the reduced shards (``latest``: the graph's output, or an accumulation)."""
    nbytes = bucket.layout(params)[1] * _itemsize(bucket.reduce_dtype)
    wait = max(issue, latest)
    return _collective(
        g, Kind.ALL_REDUCE, bucket, params, nbytes, bucket.reduce_dtype, issue, wait, wait, wait,
        f"HSDP: averages the bucket's shard over the {bucket.replicate} replicas (inter-node); "
        "issued at its reduce-scatter's wait, waited before the first reader of the reduced "
        "gradients", group="replicate")


def _duration(c: Collective, profile: ClusterProfile, tp_size: int = 1,
              shard_size: int = 1) -> float:
    if c.kind in COPY_KINDS:  # CPU offload: host<->device, on the copy lane
        return profile.host_copy_seconds(c.buffer_bytes, to_device=c.kind == Kind.H2D_COPY)
    # A group crosses nodes once the consecutive ranks it spans exceed a node. The inner mesh
    # dimension's ranks are adjacent: under tensor parallelism the shard group's ranks are
    # tp_size apart (the tp group is inner), so it spans group_size * tp_size ranks; HSDP's
    # replicate group is the outer dimension, its ranks shard_size apart (shard_size * tp_size
    # ranks per replica), so it spans group_size * shard_size ranks: on different nodes when
    # a replica fills a node (the usual HSDP), within one when the replicas fit in a node
    # (e.g. 2 x 1 on 2 GPUs of one host, which runs at the intra-node link).
    stride = {"shard": tp_size, "replicate": shard_size * tp_size}.get(c.group, 1)
    span = c.group_size * stride
    level = "inter" if span > profile.node_size else "intra"
    return profile.collective_seconds(c.kind, c.buffer_bytes, c.group_size, level)


def _copy_seconds(g: GraphView, c: Collective, profile: ClusterProfile) -> tuple[float, float]:
    """Device time of the copy kernels around one of shardc's collectives (pack, unpack)."""
    if c.origin != "shardc" or c.kind not in (Kind.ALL_GATHER, Kind.REDUCE_SCATTER):
        return 0.0, 0.0
    if c.kind == Kind.ALL_GATHER:
        inputs = [GatherArgs.of(g.gathers[p]).shard for p in c.params if p in g.gathers]
    else:
        inputs = [ReduceArgs.of(g.reduces[p]).grad for p in c.params if p in g.reduces]
    pack, unpack = collective_copy_bytes(str(c.kind), (graph_input_bytes(inputs),
                                                       c.buffer_bytes), c.group_size)
    return (memory_seconds(pack, profile) + profile.kernel_gpu_s if pack else 0.0,
            memory_seconds(unpack, profile) + profile.kernel_gpu_s if unpack else 0.0)


def _elided_casts(g: GraphView, c: Collective, profile: ClusterProfile) -> list[float]:
    """Device seconds of the casts an elided collective is lowered to, one kernel per parameter
    (``shardc.passes.lower.elide``): the forward's and the backward's re-gather casts and the
    gradients' casts at one rank, which are real kernels (about 18 bytes per parameter per step
    in bf16 with fp32 shards) even though nothing is communicated."""
    nodes = g.gathers if c.kind == Kind.ALL_GATHER else (
        g.reduces if c.kind == Kind.REDUCE_SCATTER else {})
    out = []
    for fqn in c.params:
        moved = elided_cast_bytes(nodes[fqn]) if fqn in nodes else 0
        if moved:
            out.append(memory_seconds(moved, profile) + profile.kernel_gpu_s)
    return out


class _Timeline:
    """The step as the device runs it: the host launching kernels one after the other
    (``host``), the compute stream (``t``), and one lane per process group (``free``: when its
    last collective ends). A kernel starts once the host has launched it and the stream is
    free; while a collective runs on any lane, compute runs ``overlap_slowdown`` times slower
    (for the overlapping part); host<->device copies (the copy lane) do not slow it.

    ``entry_s``: host work per parameter tensor before the graph's first launch (a region's
    forward: ``region_entry_per_param_s`` times its parameters), after ``graph_call_s``; the
    stream's idle time it causes is reported as ``param_host``, the rest of its idle time
    waiting for the host as ``launch_bound``. ``launch_extra_s``: host seconds added to every
    kernel's launch (a forward's ``forward_graph_per_param_s`` times its parameters, spread
    over its kernels). ``host_ahead_s``: how far the host is ahead of the device when it
    calls the graph (the device work the previous graph left queued: the graph's call and
    entry hide under it as far as it goes); times are the device's from the end of that
    work.

    Exposed communication is what the waits add to the stream's time. Beside the stream the
    timeline keeps its shadow: the same kernels, of the same durations, launched by the same
    host, where no wait stalls (``t - delay_s``). A wait stalls the stream beyond where its
    next kernel could start anyway (the stream free, the host there): ``Collective.stall_s``,
    the stream's ``exposed_comm`` time. The stall is owed to the collective (``owed``: seconds
    by the record's ``id()``, as copies' ids can repeat) until a later kernel finds the host
    later than the shadow stream: the stream would have idled for the host then anyway, so
    that much of the delay was not the communication's, and every collective's debt shrinks in
    proportion. What is owed at the end is what communication adds to the graph
    (``delay_s``; the same every run: no clock, no randomness). ``owed``: debts carried in
    from the region's previous graph (its forward), still to be absorbed."""

    def __init__(self, profile: ClusterProfile, entry_s: float = 0.0,
                 launch_extra_s: float = 0.0, host_ahead_s: float = 0.0,
                 owed: dict[int, float] | None = None) -> None:
        self.profile = profile
        self.t = 0.0
        self.owed: dict[int, float] = dict(owed or {})
        # The host reaches the graph's first kernel after calling it (guards, wrappers) and
        # handling its parameters (entry_s), from where it was.
        self.host = profile.graph_call_s + entry_s - max(host_ahead_s, 0.0)
        self._entry_left = entry_s
        self._launch_s = profile.graph_launch_s() + launch_extra_s
        self.free: dict[str, float] = {}
        self.launches = 0  # kernels launched (each at ``graph_launch_s`` of host time)
        # Device seconds by kernel category, and the stream's idle time waiting for the host
        # (``launch_bound``, ``param_host``) or for a collective (``exposed_comm``): they add up
        # to the graph's time (see :func:`kernel_category`).
        self.by_category: dict[str, float] = {}

    def _add(self, category: str, seconds: float) -> None:
        if seconds > 0:
            self.by_category[category] = self.by_category.get(category, 0.0) + seconds

    @property
    def delay_s(self) -> float:
        """How far the stream is behind its shadow (no stalls for collectives): what the
        communication owed so far adds to the graph."""
        return sum(self.owed.values())

    def _absorb(self, ready: float) -> None:
        """The stream is ready for its next event at ``ready`` (the stream free, the host
        there); the shadow would be at the later of its own time and the host: where the host
        comes later than the shadow, the stalls owed are absorbed, in proportion, down to the
        two times' difference."""
        delay = self.delay_s
        if delay <= 0.0:
            return
        left = ready - max(self.t - delay, self.host)
        if left < delay:
            scale = max(left, 0.0) / delay
            self.owed = {cid: s * scale for cid, s in self.owed.items()}

    def _idle(self, seconds: float) -> None:
        """The stream idles ``seconds`` waiting for the host: the first ``entry_s`` of such
        waiting is the per-parameter entry work's (the host does it before anything else)."""
        if seconds <= 0:
            return
        entry = min(seconds, self._entry_left)
        self._entry_left -= entry
        self._add("param_host", entry)
        self._add("launch_bound", seconds - entry)

    def kernel(self, seconds: float, category: str = "other",
               launched: bool = True) -> tuple[float, float]:
        """Run one kernel of ``seconds`` device time; returns its (start, end). ``launched``
        False: its host launch is priced elsewhere (an elided collective's cast: in the
        per-parameter host terms, whose calibration ran it)."""
        if launched:
            self.host += self._launch_s
            self.launches += 1
        start = max(self.t, self.host)
        self._absorb(start)
        self._idle(start - self.t)
        # Host<->device copies run on the copy engines, not the SMs: they do not slow compute
        # (measured on one H200, docs/memory_budget.md, "per saved activation"); collectives do.
        busy_until = max((t for lane, t in self.free.items() if lane != COPY_LANE), default=0.0)
        if busy_until > start and seconds > 0:
            overlap = min(seconds * self.profile.overlap_slowdown, busy_until - start)
            # The overlapped part runs slower; the rest at full speed.
            seconds = overlap + (seconds - overlap / self.profile.overlap_slowdown)
        self.t = start + seconds
        self._add(category, seconds)
        return start, self.t

    def queued_s(self) -> float:
        """Device time still queued when the host has issued everything so far: how much host
        work after this point can hide under the device's."""
        return max(self.t - self.host, 0.0)

    def issue(self, c: Collective, seconds: float) -> None:
        # (Not for an elided collective, over a one-rank group: it is lowered to none.)
        self.host += self.profile.collective_launch_s
        c.predicted_start_s = max(self.t, self.host, self.free.get(c.stream, 0.0))
        c.predicted_end_s = self.free[c.stream] = c.predicted_start_s + seconds

    def wait(self, c: Collective) -> None:
        """The stream waits for ``c``; what it waits beyond the point where the next kernel
        could start anyway (the stream free and the host there) is its stall
        (``c.stall_s``), owed to it until later host waits absorb it (see the class)."""
        ready = max(self.t, self.host)
        self._absorb(ready)
        c.stall_s = max(c.predicted_end_s - ready, 0.0)
        if c.stall_s > 0:
            self.owed[id(c)] = self.owed.get(id(c), 0.0) + c.stall_s
        self._idle(min(self.host, c.predicted_end_s) - self.t)
        self._add("exposed_comm", c.predicted_end_s - max(self.t, self.host))
        self.t = max(self.t, c.predicted_end_s)


def _simulate(g: GraphView, colls: list[Collective], profile: ClusterProfile,
              tp_size: int = 1, entry_s: float = 0.0, graph_host_s: float = 0.0,
              host_ahead_s: float = 0.0, shard_size: int = 1,
              owed: dict[int, float] | None = None):
    """Timing: the compute stream runs the graph's kernels (:mod:`shardc.planning.kernels`:
    fused groups, matmuls, attention) in order, each at the end of its last op and priced by
    :mod:`shardc.planning.estimate`; each process group's collectives run first-in first-out
    on their own lane, from their issue (after the kernel packing their send buffer); a wait
    stalls compute until the collective ends, then the received buffer is unpacked. At one
    position the events follow the lowered graph's order: found collectives' issues, then
    (when shardc issues there) shardc's waits of earlier issues (not HSDP all-reduces),
    shardc's issues, its other waits, and last the found collectives' waits, as
    ``lower.apply_plan`` orders them. An HSDP all-reduce is issued by its reduce-scatter's
    wait. ``entry_s``: the host's per-parameter work before the first launch;
    ``graph_host_s``: its per-parameter work spread over the graph's kernels;
    ``host_ahead_s``: the previous graph's device work still queued (see :class:`_Timeline`);
    ``tp_size``, ``shard_size``: the mesh's tp and shard group sizes (where each group's ranks
    sit, :func:`_duration`).
    ``owed``: the stalls the region's previous graph left unabsorbed (:class:`_Timeline`).
    Fills the predictions (each collective's ``stall_s``; not ``exposed_s``, which only the
    region's last graph settles); returns ``(ops, graph seconds, stalls owed at the end by
    collective record (``id()``), seconds by category, device time queued after the host's
    last launch, kernels launched)``."""
    ops = []
    by_id = {c.id: c for c in colls}
    chained = {c.link: c for c in colls
               if c.origin == "shardc" and c.kind == Kind.ALL_REDUCE and c.link in by_id}
    chained_ids = {id(c) for c in chained.values()}
    by_issue: dict[int, list[Collective]] = {}
    by_wait: dict[int, list[Collective]] = {}
    for c in colls:
        if id(c) not in chained_ids:
            by_issue.setdefault(c.issue_pos, []).append(c)
        by_wait.setdefault(c.wait_pos, []).append(c)
    kernels = group_kernels(g.compute[0].graph, g.compute) if g.compute else []
    line = _Timeline(profile, entry_s, graph_host_s / len(kernels) if kernels else 0.0,
                     host_ahead_s, owed)
    kernel_at = {}
    body_flops: dict[fx.GraphModule, float] = {}
    # A block body's kernels come once per call of it, as copies of one list (``kernels``'s
    # ``_expand_body_call``): each is priced once, not once per block (thousands of prices at
    # 64 blocks). The price reads only the kernel's kind, ops and bytes.
    body_seconds: dict[tuple, float] = {}

    def seconds(k) -> float:
        if "call" not in k.extra:
            return kernel_seconds(k, profile)
        key = (k.kind, tuple(k.nodes), k.read_bytes, k.write_bytes)
        if key not in body_seconds:
            body_seconds[key] = kernel_seconds(k, profile)
        return body_seconds[key]
    for k in kernels:
        kernel_at.setdefault(g.position[anchor(k)], []).append(k)

    def issue(c: Collective) -> None:
        if c.elided:  # lowered to no communication: no pack, no lane; only its casts run
            for seconds in _elided_casts(g, c, profile):
                line.kernel(seconds, "fused", launched=False)
            c.predicted_start_s = c.predicted_end_s = line.t
            return
        pack, _ = _copy_seconds(g, c, profile)
        if pack:
            line.kernel(pack, "copies")
        line.issue(c, _duration(c, profile, tp_size, shard_size))

    def wait(c: Collective) -> None:
        if not c.elided:
            line.wait(c)
            _, unpack = _copy_seconds(g, c, profile)
            if unpack:
                line.kernel(unpack, "copies")
        if c.id in chained:
            issue(chained[c.id])

    for p in range(g.end + 1):
        issues, waits = by_issue.get(p, []), by_wait.get(p, [])
        own = [c for c in issues if c.origin == "shardc"]
        early = [c for c in waits if own and c.origin == "shardc" and c.kind != Kind.ALL_REDUCE
                 and c.issue_pos < p]
        for c in [c for c in issues if c.origin != "shardc"]:
            issue(c)
        for c in early:
            wait(c)
        for c in own:
            issue(c)
        rest = [c for c in waits if c.origin == "shardc" and all(c is not e for e in early)]
        for c in sorted(rest, key=lambda c: c.kind == Kind.ALL_REDUCE):
            wait(c)
        for c in [c for c in waits if c.origin != "shardc"]:
            wait(c)
        if p < g.end:
            node = g.compute[p]
            flops, nbytes = node_flops_and_bytes(node)
            body = subgraph_module(node)
            if body is not None:  # a body call: its body's FLOPs (MFU), summed once per body
                if body not in body_flops:
                    body_flops[body] = model_flops(node)
                flops = body_flops[body]
            spans = [line.kernel(seconds(k), kernel_category(k))
                     for k in kernel_at.get(p, ())]
            # An op fused into a later kernel (or a view) takes no time: it sits where the
            # device could run the next kernel (the stream free, the host past its launch).
            here = max(line.t, line.host)
            start, end = (spans[0][0], spans[-1][1]) if spans else (here, here)
            ops.append(ComputeOp(node.name, str(node.target), flops, nbytes, start, end))
    for c in colls:
        c.overlaps = [op.name for op in ops[c.issue_pos:min(c.wait_pos, c.issue_pos + 64)]]
    return ops, line.t, line.owed, line.by_category, line.queued_s(), line.launches


def _settle_exposure(plan: Plan, owed: dict[int, float]) -> None:
    """Each collective's exposed communication is what it still owes when the region's last
    graph ends (:class:`_Timeline`); each graph's is its collectives' sum, the region's the
    sum of both: what communication adds to the region's graphs. ``comm_stall_s``: the
    stream's stalls at the waits before any absorption (what a step without host gaps, a
    CUDA-graph replay, would wait)."""
    for c in plan.collectives + plan.copies:
        c.exposed_s = owed.get(id(c), 0.0)
    for graph in plan.graphs:
        plan.predicted.set_graph(graph, plan.predicted[f"{graph}_time_s"], sum(
            c.exposed_s for c in plan.collectives + plan.copies if c.graph == graph))
    plan.predicted.exposed_comm_s = sum(owed.values())
    plan.predicted.comm_stall_s = sum(c.stall_s for c in plan.collectives + plan.copies)


def _memory_timeline(g: GraphView, colls: list[Collective]) -> list[int]:
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


def group_roles(fw: GraphView, known: dict[str, tuple[str, int]] | None
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


def device_name(gm: fx.GraphModule) -> str | None:
    """The name of the GPU the graph's inputs live on (``None`` on CPU/meta), for the default
    cluster profile."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            if val.device.type == "cuda" and torch.cuda.is_available():
                return torch.cuda.get_device_name(val.device)
            return None
    return None


def _host_work(cluster: ClusterProfile, g: GraphView, first: bool
               ) -> tuple[float, float, float]:
    """The host work of one graph that the profile prices per parameter tensor and per step:
    ``(entry before the first launch, work spread over the launches, gradient hand-off after
    the last launch)``. A forward has the first two (its parameters: its gathers), a backward
    all three (its gradients: its reduce-scatters); ``first``: the region called
    first, which also carries the step's fixed host work (each phase's total at least
    zero). FP8's host work (profile version 6) is spread over the launches too: the profile's
    ``fp8_{forward,backward}_per_scaled_mm_s`` times the graph's ``_scaled_mm`` ops."""
    scaled_mms = count_calls(g.compute, "_scaled_mm")
    if g.name == "forward":
        n = len(g.gathers)
        entry = cluster.region_entry_per_param_s * n \
            + (cluster.region_entry_fixed_s if first else 0.0)
        spread = cluster.forward_graph_per_param_s * n \
            + (cluster.forward_graph_fixed_s if first else 0.0)
        spread += cluster.fp8_forward_per_scaled_mm_s * scaled_mms
        return max(entry, 0.0), max(spread, 0.0), 0.0
    n = len(g.reduces)
    entry = cluster.backward_entry_per_param_s * n \
        + (cluster.backward_entry_fixed_s if first else 0.0)
    spread = cluster.backward_graph_per_param_s * n \
        + (cluster.backward_graph_fixed_s if first else 0.0)
    spread += cluster.fp8_backward_per_scaled_mm_s * scaled_mms
    handoff = cluster.grad_handoff_per_param_s * n \
        + (cluster.grad_handoff_fixed_s if first else 0.0)
    return max(entry, 0.0), max(spread, 0.0), max(handoff, 0.0)


def plan_region(
    forward: fx.GraphModule,
    backward: fx.GraphModule | None,
    options,
    *,
    region: int = 0,
    cluster: ClusterProfile | None = None,
    groups: dict[str, tuple[str, int]] | None = None,
) -> Plan:
    """Plan all collectives of one region (see the module docstring for the rules).

    ``groups``: process group name -> (role on the mesh, ranks) for the groups the graphs'
    found collectives may run over (e.g. the tp group); shardc's own groups are read from the
    graph."""
    cluster = cluster or resolve_profile(options.cluster, device_name(forward))
    fw = analyze(forward, "forward")
    bw = analyze(backward, "backward") if backward is not None else None
    graphs = [fw] + ([bw] if bw is not None else [])
    roles = group_roles(fw, groups)
    found = {g.name: found_comm.place(g, g.found, roles, move=options.move_found_collectives)
             for g in graphs}
    buckets = make_buckets(fw, options)
    world = buckets[0].world if buckets else 1
    plan = Plan(PLAN_VERSION, region, world, options.as_dict(), buckets, [])
    plan.group_name = GatherArgs.of(next(iter(fw.gathers.values()))).group_name \
        if fw.gathers else ""
    _describe_mesh(plan, roles)
    total_time = 0.0
    queued = 0.0  # device work the previous graph left queued when its host work ended
    owed: dict[int, float] = {}  # stalls not yet absorbed, carried from graph to graph
    for g in graphs:
        colls = _place_all_gathers(g, buckets, options)
        if g.name == "backward":
            colls += _place_reduce_scatters(
                g, buckets, wait_past_small=options.reduce_scatter_wait_past_small_buckets)
        colls += found[g.name]
        copies = place_h2d(g, colls) + (place_d2h(g, colls, buckets)
                                        if g.name == "backward" else [])
        copies += place_activations(g)  # activation offload: on the same copy lane
        # Found collectives first at a position, in graph order (the sort is stable): their
        # group's order is the traced one.
        colls.sort(key=lambda c: (c.issue_pos, c.origin == "shardc",
                                  c.origin == "shardc" and c.kind != Kind.ALL_GATHER, c.bucket))
        # Per-parameter host work: entering the region (its forward, before the first launch)
        # and handing the gradients off (after the backward's last launch; the step places it,
        # shardc.planning.step). The fixed host work per step (profile version 4) goes to the
        # region called first (region 0): its forward is the step's first, its backward the
        # step's last.
        entry_s, graph_host_s, handoff_s = _host_work(cluster, g, first=region == 0)
        # The backward is called right after the forward returns (autograd): its call and
        # entry hide under the forward's queued device work. (With several regions the next
        # graph after a forward is the next region's forward; crediting the region's own
        # backward hides the same amount once per forward.) Profiles before version 4 predict
        # as they did, each graph from an idle device.
        ahead = queued if g.name == "backward" and cluster.version >= 4 else 0.0
        ops, step, owed, by_category, queued, launches = _simulate(
            g, colls + copies, cluster, plan.tp_size, entry_s, graph_host_s, host_ahead_s=ahead,
            shard_size=plan.world_size, owed=owed)
        setattr(plan.predicted, f"{g.name}_kernels", float(launches))
        setattr(plan.predicted, f"{g.name}_queued_s", queued)
        if g.name == "backward":
            plan.predicted.grad_handoff_s = handoff_s
        plan.collectives.extend(colls)
        plan.copies.extend(copies)
        plan.graphs[g.name] = ops
        plan.memory_timeline[g.name] = _memory_timeline(g, colls + copies)
        plan.predicted.set_graph(g.name, step, 0.0)  # exposure settled below
        plan.predicted.add_time_by_category(g.name, by_category)
        total_time += step
    _settle_exposure(plan, owed)
    elided = [c for c in plan.collectives if c.elided]
    if elided:
        plan.notes.append(
            f"{len(elided)} collective(s) over one-rank groups elided: listed where planned, "
            "lowered to no communication and no buffer (the shard read in place, the gradient "
            "taken as reduced)")
    if any(found.values()):
        plan.notes.append(_found_note([c for cs in found.values() for c in cs],
                                      options.move_found_collectives))
    plan.predicted.step_time_s = total_time
    plan.predicted.comm_time_s = sum(c.predicted_s for c in plan.collectives)
    plan.predicted.peak_comm_buffer_bytes = max(
        (max(t, default=0) for t in plan.memory_timeline.values()), default=0
    )
    return plan
