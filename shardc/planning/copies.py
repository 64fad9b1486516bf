"""Plan CPU offload's copies (:mod:`shardc.sharding.offload`) like collectives, on a copy lane.

For each bucket's all-gather whose parameters are offloaded, the host->device copy of their
shards (``h2d_copy``) is issued one all-gather earlier than the all-gather itself (at the issue
position of the all-gather issued before it in the graph; the first one at its own) and waited
right before its all-gather is issued: the copy of bucket ``k`` runs on the copy lane (a CUDA
stream of its own) while bucket ``k - 1`` is gathered and computed with. The device copy lives
from its issue to its all-gather's issue, which packs it into the send buffer.

For each bucket whose gradients go back to the host, the device->host copy (``d2h_copy``) is
issued where the bucket's reduced shards are handed out (its reduce-scatter's wait, HSDP: its
all-reduce's wait; without sync, where the stashed zero gradients exist). The compute stream
waits for bucket ``k``'s copies where bucket ``k + 1``'s are issued (the last bucket's at the end
of the backward): there ``shardc.passes.lower_copies`` releases the gradients, after which
Inductor may reuse their buffers. So the copies of early buckets overlap the next bucket's
backward, and the host gradients are complete when the backward returns (the optimizer, or a
gradient norm for clipping, reads them next).
"""

from __future__ import annotations

from torch import fx

from shardc.passes.fx_utils import dtype_itemsize
from shardc.passes.offload_saved import ACTIVATION_GROUP, activation_role
from shardc.planning.graph_view import GraphView, ready_pos
from shardc.planning.plan import Bucket, Collective, CollectiveKind

Kind = CollectiveKind
COPY_LANE = "copy"
COPY_KINDS = (Kind.H2D_COPY, Kind.D2H_COPY)
# The copies' durations are the cluster profile's (``ClusterProfile.host_copy_seconds``, in
# ``shardc.planning.schedule``): the host link and its defaults live in the profile alone.


def _nbytes(node: fx.Node) -> int:
    val = node.meta["val"]
    return int(val.numel()) * dtype_itemsize(val.dtype)


def _record(g: GraphView, kind: Kind, bucket: int, params: list[str], nbytes: int, dtype: str,
            issue: int, wait: int, reason: str, lifetime: tuple[int, int] | None) -> Collective:
    return Collective(
        id=f"{g.name}.{kind}.{bucket}", kind=kind, graph=g.name, bucket=bucket, params=params,
        bytes=nbytes, buffer_bytes=nbytes, dtype=dtype, stream=COPY_LANE, issue_pos=issue,
        wait_pos=wait, first_use_pos=wait, last_use_pos=wait, reason=reason,
        buffer_lifetime=lifetime, group=COPY_LANE, group_size=1,
    )


def _dtype_name(node: fx.Node) -> str:
    return str(node.meta["val"].dtype).removeprefix("torch.")


def place_h2d(g: GraphView, colls: list[Collective]) -> list[Collective]:
    """The host->device copies of the graph's offloaded all-gathers (``colls``: planned)."""
    gathers = sorted((c for c in colls if c.kind == Kind.ALL_GATHER and c.origin == "shardc"),
                     key=lambda c: (c.issue_pos, c.bucket))
    out, previous = [], None
    for c in gathers:
        params = [p for p in c.params if p in g.to_device]
        if params:
            issue = c.issue_pos if previous is None else min(previous, c.issue_pos)
            nbytes = sum(_nbytes(g.to_device[p]) for p in params)
            out.append(_record(
                g, Kind.H2D_COPY, c.bucket, params, nbytes, _dtype_name(g.to_device[params[0]]),
                issue, c.issue_pos,
                "offload: the host shards copied to the device one all-gather ahead (issued "
                "with the previous bucket's all-gather), waited before this bucket's all-gather",
                (issue, c.issue_pos + 1)))
        previous = c.issue_pos
    return out


def place_d2h(g: GraphView, colls: list[Collective], buckets: list[Bucket]) -> list[Collective]:
    """The device->host copies of the graph's offloaded gradients, one per bucket."""
    handed_out: dict[str, int] = {}
    by_id = {c.id: c for c in colls}
    for c in colls:
        if c.kind == Kind.REDUCE_SCATTER and c.origin == "shardc":
            last = by_id[c.link] if c.link in by_id else c
            # An elided reduction (one-rank group, no HSDP all-reduce after it) hands its
            # gradients out where they are cast, at its issue: nothing to wait for.
            pos = c.issue_pos if c.elided and last is c else last.wait_pos
            for p in c.params:
                handed_out[p] = pos
    out = []
    for bucket in buckets:
        params = [p for p in bucket.params if p in g.to_host]
        if not params:
            continue
        issue = max(handed_out[p] if p in handed_out
                    else min(ready_pos(g, g.to_host[p].all_input_nodes[0]), g.end)
                    for p in params)
        nbytes = sum(_nbytes(g.to_host[p]) for p in params)
        out.append(_record(
            g, Kind.D2H_COPY, bucket.index, params, nbytes, _dtype_name(g.to_host[params[0]]),
            issue, g.end,
            "offload: the reduced gradient shards copied to the host once handed out; the "
            "compute stream waits for them where the next bucket's copies are issued (their "
            "buffers are released there), the last bucket's at the end of the backward (host "
            "gradients complete when it returns)", None))
    # The lowering orders the releases by the copies' starts (shardc.passes.lower_copies).
    out.sort(key=lambda c: (c.issue_pos, c.bucket))
    for c, following in zip(out, out[1:]):
        c.wait_pos = c.first_use_pos = c.last_use_pos = min(following.issue_pos, g.end)
    return out


# Activation offload (``shardc.passes.offload_saved``): its copies are already in the graph
# (the pass placed them); the plan records them per group on the copy lane, origin "activation".
ACTIVATION_ORIGIN = "activation"


def place_activations(g: GraphView) -> list[Collective]:
    """The activation copies of the graph, one record per group (a block's saved values): in
    the forward their device->host copies (issued as the values are computed; the compute
    stream waits for them where they are released, after the next block's forward; the last
    block's are not waited in the forward: the lane's tail counts at the forward's end, where
    the backward's prefetch follows it on the same lane), in the backward their prefetched
    host->device copies (issued where the previous group is first read, waited before the
    group's first reader)."""
    starts: dict[str, list[fx.Node]] = {}
    waits: dict[str, list[fx.Node]] = {}
    for node in g.activation_copies:
        role, group = activation_role(node), node.meta[ACTIVATION_GROUP]
        if role in ("d2h", "h2d"):
            starts.setdefault(group, []).append(node)
        elif role == "wait" or (role == "release" and node.args[2]):
            waits.setdefault(group, []).append(node)
    out = []
    for group, nodes in starts.items():
        forward = activation_role(nodes[0]) == "d2h"
        kind = Kind.D2H_COPY if forward else Kind.H2D_COPY
        issue = min(g.pos(n) for n in nodes)
        wait = min((g.pos(n) for n in waits.get(group, ())), default=g.end)
        nbytes = sum(_nbytes(n) for n in nodes)
        reason = ("activation offload: the block's saved values copied to the host as they are "
                  "computed, asynchronously (the CPU never waits); released on the device "
                  + ("after the next block's forward, where the compute stream waits for the "
                     "copies" if group in waits else
                     "at the forward's end without a wait (the prefetch back follows them on "
                     "the copy lane)") if forward else
                  "activation offload: the block's saved values prefetched from the host one "
                  "block ahead (issued where the previous block's are first read), waited "
                  "before their first reader")
        c = _record(g, kind, -1, [n.args[1] for n in nodes], nbytes, _dtype_name(nodes[0]),
                    issue, wait, reason, None)
        c.id = f"{g.name}.{kind}.act.{group}"
        c.origin = ACTIVATION_ORIGIN
        out.append(c)
    return out
