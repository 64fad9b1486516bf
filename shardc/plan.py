"""The plan: a versioned, self-explaining record of how one compiled region communicates.

A :class:`Plan` is plain data. Passes build it (``shardc.passes.schedule``), the lowering pass
applies it to the graphs, the runtime checks that every rank holds the same one, and renderers
turn it into a text table, a Chrome/Perfetto trace and a memory plot. Its JSON form is stable
for a given ``PLAN_VERSION``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

PLAN_VERSION = 3
# Version 2 added the 2-D mesh fields (``Plan.mesh``, ``replicate_size``,
# ``replicate_group_name``, ``Bucket.replicate``/``replicate_group``, ``Collective.group``, kind
# ``"all_reduce"``); a version 1 plan reads as a 1-D plan with their defaults.
# Version 3 added the collectives found in the traced graph (tensor parallelism): ``Plan.tp_size``,
# ``tp_group_name``, ``Collective.origin``, ``group_size``, ``nodes``, ``tensors``, kinds
# ``"all_to_all"`` and ``"broadcast"``, and one stream per process group; older plans read with
# their defaults (every collective shardc's own).
READABLE_VERSIONS = (1, 2, 3)


@dataclass
class Bucket:
    """Parameters gathered by one flat all-gather and reduced by one flat reduce-scatter."""

    index: int
    name: str
    params: list[str]
    # Per parameter: global rows, padded rows per rank and elements per row.
    dim0: list[int]
    padded_rows: list[int]
    row_numel: list[int]
    dtype: str  # communication dtype of the all-gather
    reduce_dtype: str  # communication dtype of the reduce-scatter
    world: int
    # HSDP: replicas the reduce-scattered shard is then all-reduced (averaged) over, and the group.
    replicate: int = 1
    replicate_group: str = ""

    @property
    def shard_numel(self) -> int:
        """Elements each rank contributes (the flat shard of the bucket, padding included)."""
        return self.layout(self.params)[1]

    def layout(self, params: list[str]) -> tuple[dict[str, tuple[int, int, int, int]], int]:
        """Flat layout of a subset of the bucket, in bucket order: per parameter
        ``(offset, padded_rows, row_numel, dim0)`` in one rank's flat shard, and its total numel.
        """
        wanted, out, offset = set(params), {}, 0
        for fqn, rows, numel, dim0 in zip(self.params, self.padded_rows, self.row_numel, self.dim0):
            if fqn in wanted:
                out[fqn] = (offset, rows, numel, dim0)
                offset += rows * numel
        return out, offset


@dataclass
class Collective:
    """One planned collective and why it sits where it does.

    Positions are indices into the region's compute schedule (``Plan.graphs[graph]``), in the
    original order of the partitioned graph: ``issue_pos`` is the compute op before which the
    collective is issued, ``wait_pos`` the one before which it is waited.

    ``origin`` is ``"shardc"`` for the collectives shardc creates (bucketed gathers and
    reductions) and ``"graph"`` for those already in the traced graph (DTensor's tensor-parallel
    collectives, FP8's amax all-reduce), which have no bucket (``-1``) and name their FX ``nodes``.
    """

    id: str
    # "all_gather" | "reduce_scatter" | "all_reduce" | found in the graph: "all_to_all", "broadcast"
    kind: str
    graph: str  # "forward" | "backward"
    bucket: int
    params: list[str]
    bytes: int  # bytes this rank sends (all-gather) or receives (reduce-scatter) ... see docs
    buffer_bytes: int  # bytes of the collective's full buffer (gathered / unreduced)
    dtype: str
    stream: str
    issue_pos: int
    wait_pos: int
    first_use_pos: int
    last_use_pos: int
    overlaps: list[str] = field(default_factory=list)
    reason: str = ""
    predicted_start_s: float = 0.0
    predicted_end_s: float = 0.0
    exposed_s: float = 0.0
    buffer_offset: int | None = None
    buffer_lifetime: tuple[int, int] | None = None
    # The mesh dimension it runs over: "shard" (intra-node in HSDP), "replicate" (inter-node),
    # "tp" (tensor parallelism), or "other" (a process group shardc was not told about).
    group: str = "shard"
    origin: str = "shardc"  # "shardc" | "graph" (found in the traced graph)
    group_size: int = 0  # ranks of its process group (0: not recorded, plans before version 3)
    nodes: list[str] = field(default_factory=list)  # found: FX names of its issue, then wait(s)
    tensors: list[str] = field(default_factory=list)  # found: "name: dtype[shape]", ins then outs

    def signature(self) -> tuple:
        """What every rank must agree on (independent of rank-specific shard shapes).

        A found collective contributes its id (graph, kind, group and number), kind and dtype,
        not its bytes: those follow activation shapes, which the data-parallel ranks the check
        compares may legitimately differ in (each reads its own batch)."""
        if self.origin != "shardc":
            return (self.id, self.kind, self.graph, None, (), None, self.dtype)
        return (self.id, self.kind, self.graph, self.bucket, tuple(self.params), self.buffer_bytes,
                self.dtype)


@dataclass
class ComputeOp:
    """One op of a graph's compute schedule (collective bookkeeping ops excluded)."""

    name: str
    target: str
    flops: float = 0.0
    bytes: float = 0.0
    predicted_start_s: float = 0.0
    predicted_end_s: float = 0.0


@dataclass
class Plan:
    version: int
    region: int
    world_size: int
    options: dict[str, Any]
    buckets: list[Bucket]
    collectives: list[Collective]
    graphs: dict[str, list[ComputeOp]] = field(default_factory=dict)
    # Bytes of gathered parameters and communication buffers live before each compute op.
    memory_timeline: dict[str, list[int]] = field(default_factory=dict)
    predicted: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    group_name: str = ""
    # Offset in the communication pool of each buffer, keyed "<collective id>.<send|recv>".
    pool_offsets: dict[str, int] = field(default_factory=dict)
    # The mesh (e.g. "HSDP: replicate 2 x shard 4"); HSDP's replicate dimension and its group.
    mesh: str = ""
    replicate_size: int = 1
    replicate_group_name: str = ""
    # FSDP+TP: ranks of the tensor-parallel dimension and its process group.
    tp_size: int = 1
    tp_group_name: str = ""

    def table(self, *, wide: bool = False) -> str:
        """The plan as text (``shardc.render.plan_table``): lines of at most 99 columns, or
        with ``wide=True`` one column per field (about 300 columns)."""
        from shardc.render import plan_table

        return plan_table(self, wide=wide)

    def __str__(self) -> str:
        return self.table()

    def collective_signature(self) -> list[tuple]:
        return [c.signature() for c in self.collectives]

    def hash(self) -> str:
        """Hash of what must be identical on every rank (see :meth:`Collective.signature`)."""
        blob = json.dumps(self.collective_signature(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data (tuples become lists, dtypes strings), so it equals its round trip."""
        data = json.loads(json.dumps(asdict(self), default=str))
        data["hash"] = self.hash()
        return data

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if data.get("version") not in READABLE_VERSIONS:
            raise ValueError(
                f"shardc: plan version {data.get('version')!r} is not supported "
                f"(this shardc reads versions {', '.join(map(str, READABLE_VERSIONS))})"
            )
        data = dict(data)
        data.pop("hash", None)
        data["buckets"] = [Bucket(**b) for b in data["buckets"]]
        colls = []
        for c in data["collectives"]:
            c = dict(c)
            if c.get("buffer_lifetime") is not None:
                c["buffer_lifetime"] = tuple(c["buffer_lifetime"])
            colls.append(Collective(**c))
        data["collectives"] = colls
        data["graphs"] = {g: [ComputeOp(**op) for op in ops] for g, ops in data["graphs"].items()}
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))
