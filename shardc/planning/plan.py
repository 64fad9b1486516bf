"""The plan: a versioned, self-explaining record of how one compiled region communicates.

A :class:`Plan` is plain data. The planners build it (``shardc.planning.schedule``), the
lowering pass (``shardc.passes.lower``) applies it to the graphs, the runtime checks that every
rank holds the same one, and renderers turn it into a text table, a Chrome/Perfetto trace and a
memory plot. Its JSON form is stable
for a given ``PLAN_VERSION``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from shardc.planning.json_ready import json_ready

PLAN_VERSION = 5
# Version 2 added the 2-D mesh fields (``Plan.mesh``, ``replicate_size``,
# ``replicate_group_name``, ``Bucket.replicate``/``replicate_group``, ``Collective.group``, kind
# ``"all_reduce"``); a version 1 plan reads as a 1-D plan with their defaults.
# Version 3 added the collectives found in the traced graph (tensor parallelism): ``Plan.tp_size``,
# ``tp_group_name``, ``Collective.origin``, ``group_size``, ``nodes``, ``tensors``, kinds
# ``"all_to_all"`` and ``"broadcast"``, and one stream per process group; older plans read with
# their defaults (every collective shardc's own).
# Version 4 made two things explicit that older plans implied: ``Collective.link`` (an HSDP
# reduce-scatter and the all-reduce of its output name each other; older plans matched their
# ids) and ``Plan.predicted``'s keys (the fields of :class:`Predictions`; the JSON is the same
# object of numbers, without the predictions a plan does not make). Older plans read with their
# links filled in from the ids.
# Version 5 added the block bodies (``Plan.bodies``: each repeated-block body the region's graphs
# call, the blocks it runs and how often its joint graph was partitioned; ``Plan.inline_blocks``:
# blocks that keep the inline path, and why), ``Plan.memory_by_category`` (the whole step's
# memory by category, for the memory plot and the capacity planner) and CPU offload
# (``Plan.copies``: the host<->device copies, kinds ``"h2d_copy"`` and ``"d2h_copy"``, on the
# ``"copy"`` lane; the predictions ``host_bytes`` and ``device_copy_bytes``). Older plans read
# with all of them empty.
# Version 5 also added ``Collective.elided``: shardc's collectives over a one-rank group (world 1,
# or HSDP with shard size 1) are still planned and listed, but lowered to no communication (the
# gather is the shard itself, the reduction the gradient itself); older plans read as not elided.
# Version 5 also added ``Plan.budget`` (:class:`MemoryBudget`): the whole-step peak budget and
# the planner's decision for every bucket (kept gathered from the forward to the backward, or
# resharded), with its predicted time saved, bytes and reason; plans made without a budget, and
# older plans, read with it ``None``. ``MemoryBudget.blocks`` (one ``BlockDecision`` per block:
# recomputed in the backward or saved) and ``MemoryBudget.resharded_bytes`` came later within
# version 5; plans without them read with none. ``MemoryBudget.margin_bytes`` and
# ``margin_fraction`` (the margin for the peak prediction's error: the planner planned for
# ``budget_bytes - margin_bytes``) came later still within version 5, optional fields like
# those: a plan without them reads with no margin (0), which is what it was planned with, and
# hashes as before (the margin enters the hash only when it is not 0).
# Activation offload came later still within version 5, optional like those:
# ``BlockDecision.offloaded``, ``offload_ms`` and ``copy_ms`` (a plan without them reads as
# offloading nothing and hashes as before: the offloaded blocks enter the hash only when there
# is one), and ``Plan.copies`` records of origin ``"activation"`` (bucket -1; ``params``: the
# saved values' names), on the same ``"copy"`` lane as CPU offload's.
# ``MemoryBudget.prefetch`` (:class:`PrefetchDecision`: the prefetch depth chosen under the
# budget, with every depth tried) came later still within version 5, optional like those: a plan
# without it reads with ``None`` (the options' depth) and hashes as before (the chosen depth
# enters the hash only when the record is there).
# The peak budget's partial optimizer offload came later still within version 5, optional like
# those: ``OptimizerDecision.host_params`` and ``buckets`` (a plan without them reads with every
# parameter's state on the host, as it was planned, and hashes as before: the parameters enter
# the hash only for a partial choice) and ``Predictions.optimizer_host_param_bytes``.
# ``BlockDecision.checkpoint_offloaded``, ``checkpoint_bytes``, ``checkpoint_ms`` and
# ``checkpoint_copy_ms`` (a recomputed block's checkpoint offloaded to the host) came later still
# within version 5, optional like those: a plan without them reads as offloading no checkpoint
# and hashes as before (the blocks enter the hash only when there is one).
# ``Plan.fused_loss`` (:class:`FusedLossDecision`: whether the output projection and
# cross-entropy were fused into the chunked op, with the tokens per chunk, bytes, predicted
# time and why) came later still within version 5, optional like those: a plan without it reads
# with ``None`` (nothing fused, as it was planned) and hashes as before (the decision enters the
# hash only when something was fused).
# ``MemoryBudget.optimizer_chunks`` (:class:`OptimizerChunksDecision`: the optimizer step in
# chunks, the device lever tried before the optimizer's offload) and
# ``Predictions.optimizer_chunk_bytes`` came later still within version 5, optional like those:
# a plan without them reads with ``None`` (one call over every parameter, as it was planned)
# and hashes as before (the decision enters the hash only where the step is chunked).
# ``BlockDecision.offloaded_part`` (a block's saved values offloaded in part, per activation)
# came later still within version 5, optional like those: a plan without it reads as offloading
# every saved value of an offloaded block, as it was planned, and hashes as before (a part
# enters the hash, by its name in ``MemoryBudget.offloaded``, only where one is offloaded).
# ``BlockDecision.recomputed_part`` (a block's cheap saved values recomputed, the rest saved)
# came later still within version 5, optional the same way: a plan without it reads as
# recomputing no part, and a part enters the hash by its name in ``MemoryBudget.recomputed``.
READABLE_VERSIONS = (1, 2, 3, 4, 5)


class CollectiveKind(str, Enum):
    """What a collective does (a ``str``: plans compare and serialize it as its value)."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    # CPU offload (Plan.copies): a bucket's host shards copied to the device before its
    # all-gather, and its reduced gradient shards copied back to the host.
    H2D_COPY = "h2d_copy"
    D2H_COPY = "d2h_copy"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass
class Predictions:
    """What the cost model and the memory model predict for one region (``None``: not
    predicted, e.g. no backward graph, or no peak prediction for a plan made without one).

    Times are seconds, memory bytes (floats, as the JSON has always held them). The schedule
    (``shardc.planning.schedule``) writes the times and ``peak_comm_buffer_bytes``, the pool's
    placement (``shardc.memory.pool``) ``pool_bytes`` and ``pool_lower_bound_bytes``, the peak
    model (``shardc.memory.peak``) the rest. Readable by key too (``plan.predicted["peak_bytes"]``)
    for code written against plans before version 4.
    """

    forward_time_s: float | None = None
    forward_exposed_comm_s: float | None = None
    backward_time_s: float | None = None
    backward_exposed_comm_s: float | None = None
    step_time_s: float | None = None
    # What communication adds to the graphs' time: the stalls for collectives that host waits
    # later in the region do not absorb (``shardc.planning.schedule._Timeline``), and the
    # stalls themselves before absorption (optional within version 5).
    exposed_comm_s: float | None = None
    comm_stall_s: float | None = None
    comm_time_s: float | None = None
    peak_comm_buffer_bytes: float | None = None
    # The communication pool: its size, and the most bytes its buffers hold at once.
    pool_bytes: float | None = None
    pool_lower_bound_bytes: float | None = None
    # The whole step's memory (shardc.memory.peak.predict_peak).
    param_bytes: float | None = None
    optimizer_state_bytes: float | None = None
    forward_peak_bytes: float | None = None
    backward_peak_bytes: float | None = None
    grad_bytes: float | None = None
    optimizer_step_peak_bytes: float | None = None
    peak_bytes: float | None = None
    # CPU offload: host memory of the offloaded state (masters, gradients, optimizer state), and
    # the most device bytes the host->device copies hold at once (counted in the peaks above).
    host_bytes: float | None = None
    device_copy_bytes: float | None = None
    # Where the predicted graph times go, ``"<graph>/<category>"`` -> seconds: device time of
    # the kernels by category (``shardc.planning.estimate.KERNEL_CATEGORIES``, ``copies``: the
    # pack/unpack copies around collectives) and the compute stream's idle time waiting for the
    # host's launches (``launch_bound``) or a collective (``exposed_comm``); a graph's entries
    # add up to its ``<graph>_time_s``.
    time_by_category_s: dict[str, float] | None = None
    # The end of the backward, for the whole step (shardc.planning.step): the device time still
    # queued when the host has launched the backward's last kernel, and the host's gradient
    # hand-off after it (``ClusterProfile.grad_handoff_per_param_s`` per gradient).
    backward_queued_s: float | None = None
    grad_handoff_s: float | None = None
    # The same at the end of the forward (optional within version 5): what the backward's call
    # can hide under (profiles of version 4 and later).
    forward_queued_s: float | None = None
    # Kernels each graph launches as the cost model groups them (its host timeline charges
    # ``ClusterProfile.graph_launch_s`` each); calibration subtracts exactly these launches
    # from a measured phase (shardc.tools.host_cost). Optional within version 5.
    forward_kernels: float | None = None
    backward_kernels: float | None = None
    # The peak budget's partial optimizer offload (optional within version 5): bytes of this
    # rank's parameter shards whose optimizer state and step are on the host; the device's
    # optimizer state and step temporaries above are those of the other shards. Absent: none
    # (or, with ``MemoryBudget.optimizer`` on the host for every parameter, all of them).
    optimizer_host_param_bytes: float | None = None
    # The optimizer step's device temporaries counted in ``optimizer_step_peak_bytes``, as the
    # implementation that runs holds them (``shardc.planning.optimizer_kind``; optional within
    # version 5).
    optimizer_temp_bytes: float | None = None
    # The optimizer step in chunks (``MemoryBudget.optimizer_chunks``; optional within version
    # 5): this rank's bytes of shards in the largest chunk, whose temporaries
    # ``optimizer_temp_bytes`` counts. Absent: one call over every parameter.
    optimizer_chunk_bytes: float | None = None
    # ``shardc.no_sync``'s store of full gradients (one per parameter), held across the
    # micro-batches and counted in the forward and backward peaks above of the regions that add
    # to or take from it (optional within version 5). Absent: a region without stored gradients.
    unsynced_grad_bytes: float | None = None
    # The runtime's own device memory (cuBLAS workspaces) counted in each of the three peaks
    # above, present where the peak model counts as the CUDA caching allocator does (a plan for
    # a CUDA device: every allocation as its block, ``shardc.memory.cuda_blocks``); optional
    # within version 5. Absent: requested bytes, no workspaces (a CPU target, or an older plan).
    runtime_bytes: float | None = None

    def to_dict(self) -> dict[str, float]:
        """The predictions made, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> Predictions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"shardc: unknown plan predictions {unknown}")
        return cls(**data)

    def add_time_by_category(self, graph: str, seconds: dict[str, float]) -> None:
        """Record one graph's time by category (see ``time_by_category_s``)."""
        table = dict(self.time_by_category_s or {})
        for category, s in seconds.items():
            key = f"{graph}/{category}"
            table[key] = table.get(key, 0.0) + s
        self.time_by_category_s = table

    def set_graph(self, graph: str, time_s: float, exposed_s: float) -> None:
        """The predicted time and exposed communication of one graph ("forward"/"backward")."""
        setattr(self, f"{graph}_time_s", time_s)
        setattr(self, f"{graph}_exposed_comm_s", exposed_s)

    # Read (and written) by key, like the dictionary older plans held.
    def __getitem__(self, key: str) -> float:
        value = getattr(self, key, None) if key in self._names() else None
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: float) -> None:
        if key not in self._names():
            raise KeyError(f"shardc: {key!r} is not a plan prediction")
        setattr(self, key, value)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    def __iter__(self):
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())

    def items(self):
        return self.to_dict().items()

    def values(self):
        return self.to_dict().values()

    def keys(self):
        return self.to_dict().keys()

    @classmethod
    def _names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))


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
    kind: CollectiveKind
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
    # What it adds to the region's graphs: its stall, less what later host waits absorb
    # (``Predictions.exposed_comm_s`` is the sum). ``stall_s``: the compute stream's stall for it
    # at ``wait_pos`` (optional within version 5; plans without it read 0).
    exposed_s: float = 0.0
    stall_s: float = 0.0
    buffer_offset: int | None = None
    buffer_lifetime: tuple[int, int] | None = None
    # The mesh dimension it runs over: "shard" (intra-node in HSDP), "replicate" (inter-node),
    # "tp" (tensor parallelism), or "other" (a process group shardc was not told about).
    group: str = "shard"
    origin: str = "shardc"  # "shardc" | "graph" (found in the traced graph) | "activation" (copies)
    group_size: int = 0  # ranks of its process group (0: not recorded, plans before version 3)
    nodes: list[str] = field(default_factory=list)  # found: FX names of its issue, then wait(s)
    tensors: list[str] = field(default_factory=list)  # found: "name: dtype[shape]", ins then outs
    # The id of the collective chained with this one: an HSDP reduce-scatter names the all-reduce
    # that averages its output over the replicas, which names it back ("" for none).
    link: str = ""
    # Over a one-rank group (``group_size == 1``): there is nothing to communicate, so the
    # lowering issues no collective and allocates no buffer (no pool bytes, no lifetime); the
    # parameters' reads and gradients stay where the plan lists them. Decided from the group's
    # size alone, hence identical on every rank.
    elided: bool = False

    def __post_init__(self) -> None:
        self.kind = CollectiveKind(self.kind)

    @property
    def predicted_s(self) -> float:
        """Its predicted duration on its lane."""
        return self.predicted_end_s - self.predicted_start_s

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
class CompiledBody:
    """One repeated-block body (``shardc.sharding.blocks``): compiled once, called per block."""

    name: str  # Dynamo's subgraph name, e.g. "subgraph_0"
    block_type: str
    blocks: list[str] = field(default_factory=list)  # module names, in call order
    # How many times its joint graph was partitioned (1: once for every block; 0: forward only).
    partitions: int = 0


@dataclass
class InlineBlock:
    """A child of an ``nn.ModuleList`` traced and compiled inline, not as a shared body."""

    module: str
    reason: str


@dataclass
class BucketDecision:
    """The budget planner's choice for one bucket (``shardc.planning.budget``).

    ``kept``: its gathered parameters stay alive from their forward use to their backward use
    (no all-gather in the backward); otherwise they are resharded after the forward and
    gathered again. ``saved_ms``: the predicted time of the backward all-gather(s) that keeping
    it removes; ``bytes``: the gathered bytes keeping it holds through the forward-backward
    boundary (the planner's estimate of what it adds to the peak). Both depend only on the
    bucket's global sizes and the cost model, never on a rank's shard shapes."""

    bucket: int
    name: str
    kept: bool
    saved_ms: float
    bytes: int
    reason: str
    params: list[str] = field(default_factory=list)


# A block's *part*: some of its saved values (``shardc.passes.recompute.Block.saved_values``,
# by index), named ``"<block>#<i>.<j>..."`` wherever block names are (the budget planner's
# configurations, :attr:`MemoryBudget.offloaded`): module names never hold a ``#``.
_PART = "#"


def part_name(block: str, indices: Sequence[int]) -> str:
    """The name of ``block``'s part made of its saved values at ``indices``."""
    return f"{block}{_PART}{'.'.join(str(i) for i in sorted(indices))}"


def is_part(name: str) -> bool:
    """Whether ``name`` names a block's part (:func:`part_name`), not a whole block."""
    return _PART in name


def split_part(name: str) -> tuple[str, tuple[int, ...] | None]:
    """``(block, indices)`` of a part's name; ``(name, None)`` for a whole block's."""
    block, sep, rest = name.partition(_PART)
    if not sep:
        return name, None
    return block, tuple(int(i) for i in rest.split("."))


@dataclass
class BlockDecision:
    """The budget planner's choice for one block (``shardc.planning.recompute``).

    ``recomputed``: its forward runs again in the backward and its activations are not saved
    (its inputs are); otherwise they are saved, as without a budget. ``cost_ms``: the predicted
    time of its forward (what recomputing it adds to the backward); ``bytes``: the activations
    recomputing it frees (the planner's estimate: its saved values less its inputs). Both are
    the largest over the ranks. ``kind``: ``"body"`` (a compile-once body's call, recomputed as
    a whole) or ``"inline"``.

    ``offloaded`` (the third lever, ``shardc.planning.offload``): its saved activations are
    copied to host memory in the forward and prefetched back for the backward instead
    (``bytes``: the saved bytes offloaded); ``offload_ms``: the predicted time the copies add
    to the step (their part not hidden behind compute on the copy lane), ``copy_ms``: one
    copy's predicted time (each way, on the copy lane). Both 0 where offload was not priced
    (plans made before it, and ``activation_offload='never'``).

    ``checkpoint_offloaded`` (recompute and offload combined; ``recomputed`` is then True too):
    what the recomputed block still saves, its checkpoint (its input hidden state), is copied
    to host memory in the forward and prefetched back one block ahead of its recomputation;
    ``checkpoint_bytes``: the checkpoint's bytes (what that frees besides ``bytes``);
    ``checkpoint_ms``: the copies' predicted time not hidden by compute, ``checkpoint_copy_ms``:
    one copy's. All 0/False in plans made before it.

    ``offloaded_part`` (with ``offloaded``; per saved activation): only the saved values at
    these indices of the block's (``Block.saved_values``) are offloaded, those whose copies its
    forward hides (``shardc.planning.offload.hidden_part``), the rest saved; ``bytes``: theirs.
    Empty: all of them (and in plans made before it).

    ``recomputed_part`` (``recomputed`` is then False: the block is not recomputed whole):
    the saved values at these indices (``Block.saved_values``; each one its body computes
    cheaply from the others, ``shardc.passes.recompute_part``) are computed again in the
    backward instead of saved; ``cost_ms`` is then their recomputation's predicted time and
    ``bytes`` what they free (with the offloaded part's bytes where a part is offloaded too).
    Empty in plans made before it."""

    block: str
    kind: str
    recomputed: bool
    cost_ms: float
    bytes: int
    reason: str
    offloaded: bool = False
    offload_ms: float = 0.0
    copy_ms: float = 0.0
    checkpoint_offloaded: bool = False
    checkpoint_bytes: int = 0
    checkpoint_ms: float = 0.0
    checkpoint_copy_ms: float = 0.0
    offloaded_part: tuple[int, ...] = ()
    recomputed_part: tuple[int, ...] = ()


@dataclass
class PrefetchTrial:
    """One prefetch depth the budget planner predicted for the chosen configuration: the
    step's predicted time and peak (each the largest over the ranks) and whether it fits."""

    depth: int
    step_ms: float
    peak_bytes: int
    fits: bool


@dataclass
class PrefetchDecision:
    """The budget planner's prefetch depth (``shardc.planning.prefetch``): how many buckets
    ahead an all-gather is issued (0: no prefetch), ``default_depth`` the options' depth,
    ``step_ms`` and ``peak_bytes`` the chosen depth's predicted step time and peak, ``reason``
    why, ``tried`` every depth predicted."""

    depth: int
    default_depth: int
    step_ms: float
    peak_bytes: int
    reason: str
    tried: list[PrefetchTrial] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefetchDecision:
        data = dict(data)
        data["tried"] = [PrefetchTrial(**t) for t in data.get("tried", [])]
        return cls(**data)


@dataclass
class OptimizerDecision:
    """The budget planner's choice on the optimizer's state (``shardc.planning.optimizer_offload``,
    the last lever): ``on_host``: its state and step live in host memory (as with
    ``OffloadPolicy(params=False, optimizer=True)``) for every parameter of the model; the
    device keeps the parameter shards and gradients. ``freed_bytes``: device bytes it frees at
    the step's peak (the state and the step's temporaries, predicted); ``host_bytes``: what it
    puts in host memory (masters, their gradients, the state); ``d2h_ms`` / ``step_ms`` /
    ``h2d_ms``: the predicted copies of shards and gradients to the host, the host step and the
    copies back, all inside ``optimizer.step()`` (``predicted_ms``, their sum, is added to the
    step). Every number is the largest over the ranks."""

    on_host: bool
    freed_bytes: int
    host_bytes: int
    params: int
    d2h_ms: float
    step_ms: float
    h2d_ms: float
    reason: str
    # Partial offload (optional within version 5): the parameters whose state and step are on
    # the host, and the buckets they fill (None: every parameter of the model, as in plans made
    # before it); the others keep theirs on the device.
    host_params: list[str] | None = None
    buckets: list[int] = field(default_factory=list)

    @property
    def partial(self) -> bool:
        """Whether only some parameters' state is on the host (:attr:`host_params`)."""
        return self.on_host and self.host_params is not None

    @property
    def predicted_ms(self) -> float:
        return self.d2h_ms + self.step_ms + self.h2d_ms


@dataclass
class OptimizerChunksDecision:
    """The budget planner's choice on the optimizer step in chunks
    (``shardc.planning.optimizer_chunks``): ``chunked``: ``optimizer.step()`` steps the
    parameters in ``chunks`` calls (one per bucket, one more for parameters in none;
    ``shardc.runtime.chunked_step``), so the ``foreach`` implementation's temporaries are the
    largest chunk's, ``chunk_bytes`` of shards, not every shard's; ``saved_bytes``: the device
    bytes that frees at the optimizer step (predicted); ``predicted_ms``: the extra launches'
    and calls' time per step; ``mode``: the option ``optimizer_step_chunks``. Every number is
    the largest over the ranks."""

    chunked: bool
    chunks: int
    chunk_bytes: int
    saved_bytes: int
    predicted_ms: float
    reason: str
    mode: str = "auto"

    def signature(self) -> tuple | None:
        """What enters the plan hash (None: not chunked)."""
        return ("optimizer_chunks", self.chunks) if self.chunked else None


@dataclass
class FusedLossDecision:
    """Whether the region's output projection + cross-entropy were fused into the chunked op
    (``shardc.passes.fused_loss``, ``shardc.ops.fused_ce``), and why. ``fused``: the nll
    nodes replaced, each with its tokens per chunk (``chunks``); ``logits_bytes``: the
    unfused graph's ``[tokens, V]`` values that the op never holds whole; ``workspace_bytes``:
    the op's per-chunk workspace; ``peak_saved_bytes``: the predicted peak's drop where the
    planner measured it (the fully resharded plans with and without, largest over the ranks;
    None where it did not); ``predicted_ms``: the fused op's predicted time; ``cost_ms``: its
    predicted time cost over the unfused step (where measured); ``refused``: the cross-entropies
    left alone, with why."""

    fused: list[str]
    chunks: list[int]
    logits_bytes: int
    workspace_bytes: int
    predicted_ms: float
    reason: str
    mode: str = "auto"
    peak_saved_bytes: int | None = None
    cost_ms: float | None = None
    refused: list[str] = field(default_factory=list)

    def note(self) -> str:
        """The plan's note on the decision."""
        if not self.fused:
            return f"fused loss ({self.mode}): not used: {self.reason}"
        saved = (f", predicted peak {self.peak_saved_bytes / 2**20:.1f} MiB lower"
                 if self.peak_saved_bytes is not None else "")
        return (f"fused loss ({self.mode}): {', '.join(self.fused)} fused, "
                f"{self.chunks} tokens per chunk; the unfused [tokens, V] values (logits, fp32 "
                f"copy, log-probs, gradients) {self.logits_bytes / 2**20:.1f} MiB never whole, "
                f"workspace {self.workspace_bytes / 2**20:.1f} MiB{saved}; "
                f"predicted {self.predicted_ms:.3f} ms: {self.reason}")

    def signature(self) -> tuple | None:
        """What enters the plan hash (None: nothing fused)."""
        return (tuple(self.fused), tuple(self.chunks)) if self.fused else None


@dataclass
class MemoryBudget:
    """The whole-step peak budget of a region and what the planner decided under it.

    ``budget_bytes``: the bound (``peak_memory_budget_bytes``, or the device's capacity less a
    margin for ``"auto"``); ``margin_bytes``: the part of it kept for the peak prediction's
    error (``peak_memory_margin``, as a fraction ``margin_fraction`` of the planned-for bytes):
    the planner made every decision against :attr:`planned_bytes`, ``budget_bytes -
    margin_bytes``; ``minimum_bytes``: the predicted peak with every bucket resharded
    (the least this plan's levers reach); ``peak_bytes``: the predicted peak of the chosen plan.
    Peaks here are the largest over the ranks (``shardc.runtime.plan_check.agree_on_largest``):
    every rank compares the same numbers. ``trials``: partitions evaluated besides the fully
    resharded one.
    """

    budget_bytes: int
    minimum_bytes: int
    peak_bytes: int
    trials: int = 0
    decisions: list[BucketDecision] = field(default_factory=list)
    # Recompute (the second lever): one decision per block of the region (empty where it has
    # none, and in plans made before it), and the fully resharded plan's peak without
    # recomputing anything where recompute was needed (``minimum_bytes`` is then the fully
    # recomputed plan's; 0: recompute was not needed, ``minimum_bytes`` is the former).
    blocks: list[BlockDecision] = field(default_factory=list)
    resharded_bytes: int = 0
    # The margin for the prediction's error (0 in plans made before it).
    margin_bytes: int = 0
    margin_fraction: float = 0.0
    # The prefetch depth chosen under the budget (None in plans made before it).
    prefetch: PrefetchDecision | None = None
    # The optimizer's state on the host (the last lever; None: not considered, as in plans made
    # before it and where the levers above met the budget).
    optimizer: OptimizerDecision | None = None
    # The host memory the search fitted its host levers to, where it left one out for it
    # ("" otherwise, as in plans made before it; not in the hash: the decisions are).
    host: str = ""
    # The optimizer step in chunks (None: not considered, as in plans made before it and where
    # the optimizer step's peak met the budget).
    optimizer_chunks: OptimizerChunksDecision | None = None

    @property
    def optimizer_chunked(self) -> bool:
        """Whether the planner chose the optimizer step in chunks."""
        return self.optimizer_chunks is not None and self.optimizer_chunks.chunked

    @property
    def optimizer_on_host(self) -> bool:
        """Whether the planner put the optimizer's state and step on the host."""
        return self.optimizer is not None and self.optimizer.on_host

    @property
    def planned_bytes(self) -> int:
        """What the planner planned for: the budget less the margin."""
        return self.budget_bytes - self.margin_bytes

    @property
    def kept(self) -> list[int]:
        """Indices of the buckets kept gathered."""
        return [d.bucket for d in self.decisions if d.kept]

    @property
    def recomputed(self) -> list[str]:
        """Names of the blocks recomputed in the backward; of a block recomputed in part (some
        saved values), its part's (:func:`part_name`)."""
        return [d.block if d.recomputed else part_name(d.block, d.recomputed_part)
                for d in self.blocks if d.recomputed or d.recomputed_part]

    @property
    def offloaded(self) -> list[str]:
        """Names of the blocks whose saved activations are offloaded to host memory; of a block
        offloaded in part, its part's (:func:`part_name`)."""
        return [part_name(d.block, d.offloaded_part) if d.offloaded_part else d.block
                for d in self.blocks if d.offloaded]

    @property
    def offloaded_whole(self) -> list[str]:
        """Names of the blocks offloaded whole (every saved value, not a part)."""
        return [d.block for d in self.blocks if d.offloaded and not d.offloaded_part]

    @property
    def checkpoint_offloaded(self) -> list[str]:
        """Names of the recomputed blocks whose checkpoints (what they still save: their
        input) are offloaded to host memory."""
        return [d.block for d in self.blocks if d.checkpoint_offloaded]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryBudget:
        data = dict(data)
        data["decisions"] = [BucketDecision(**d) for d in data.get("decisions", [])]
        data["blocks"] = [
            BlockDecision(**{**d, "offloaded_part": tuple(d.get("offloaded_part", ())),
                             "recomputed_part": tuple(d.get("recomputed_part", ()))})
            for d in data.get("blocks", [])]
        if data.get("prefetch") is not None:
            data["prefetch"] = PrefetchDecision.from_dict(data["prefetch"])
        if data.get("optimizer"):
            data["optimizer"] = OptimizerDecision(**data["optimizer"])
        if data.get("optimizer_chunks"):
            data["optimizer_chunks"] = OptimizerChunksDecision(**data["optimizer_chunks"])
        return cls(**data)


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
    predicted: Predictions = field(default_factory=Predictions)
    # The whole step's memory by category (``shardc.memory.peak``): {"categories": [...],
    # "graphs": {graph: {"positions": [...], "bytes": {category: [...]}}}, "peak": {"graph",
    # "position", "bytes": {category: n}, "largest": [[value, category, n], ...]}}.
    memory_by_category: dict[str, Any] = field(default_factory=dict)
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
    # Repeated blocks compiled once (version 5).
    bodies: list[CompiledBody] = field(default_factory=list)
    inline_blocks: list[InlineBlock] = field(default_factory=list)
    # CPU offload: the host<->device copies (kinds h2d_copy / d2h_copy, lane "copy"), planned
    # like collectives but not collectives (no process group; the pool holds none of them).
    copies: list[Collective] = field(default_factory=list)
    # The whole-step peak budget and the decisions made under it (None: no budget).
    budget: MemoryBudget | None = None
    # The fused output projection + cross-entropy (None: not considered, as in plans before it).
    fused_loss: FusedLossDecision | None = None

    def table(self, *, wide: bool = False) -> str:
        """The plan as text (``shardc.tools.render.plan_table``): lines of at most 99 columns, or
        with ``wide=True`` one column per field (about 300 columns)."""
        from shardc.tools.render import plan_table

        return plan_table(self, wide=wide)

    def __str__(self) -> str:
        return self.table()

    def collective(self, collective_id: str) -> Collective | None:
        """The collective with this id, or None."""
        return next((c for c in self.collectives if c.id == collective_id), None)

    def linked(self, c: Collective) -> Collective | None:
        """The collective ``c`` is chained with (:attr:`Collective.link`), or None."""
        return self.collective(c.link) if c.link else None

    def collective_signature(self) -> list[tuple]:
        return [c.signature() for c in self.collectives]

    def budget_signature(self) -> tuple | None:
        """The peak budget, the buckets kept gathered, (where any is) the blocks recomputed
        under it and (where not 0) the margin in bytes (None: no budget)."""
        if self.budget is None:
            return None
        b = self.budget
        recomputed = b.recomputed
        out = (b.budget_bytes, b.kept, recomputed) if recomputed else (b.budget_bytes, b.kept)
        out = out + (("margin", b.margin_bytes),) if b.margin_bytes else out
        out = out + (("offloaded", b.offloaded),) if b.offloaded else out
        checkpoints = b.checkpoint_offloaded
        out = out + (("checkpoints_offloaded", checkpoints),) if checkpoints else out
        out = out + (("prefetch", b.prefetch.depth),) if b.prefetch is not None else out
        out = out + (("optimizer_on_host", True),) if b.optimizer_on_host else out
        partial = b.optimizer is not None and b.optimizer.partial
        out = out + (("optimizer_host_params", b.optimizer.host_params),) if partial else out
        chunks = b.optimizer_chunks.signature() if b.optimizer_chunks is not None else None
        return out + (chunks,) if chunks is not None else out

    def hash(self) -> str:
        """Hash of what must be identical on every rank (see :meth:`Collective.signature`)."""
        signature: list = self.collective_signature()
        if self.budget is not None:  # the decisions too (a plan without a budget: as before)
            signature = signature + [["budget", *self.budget_signature()]]
        fused = self.fused_loss.signature() if self.fused_loss is not None else None
        if fused is not None:  # something fused (a plan without: as before)
            signature = signature + [["fused_loss", *fused]]
        blob = json.dumps(signature, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data (tuples become lists, dtypes strings), so it equals its round trip."""
        data = json.loads(json.dumps(json_ready(self), default=str))
        data["predicted"] = self.predicted.to_dict()
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
        version = data["version"]
        data = dict(data)
        data.pop("hash", None)
        data["predicted"] = Predictions.from_dict(data.get("predicted") or {})
        data["buckets"] = [Bucket(**b) for b in data["buckets"]]
        colls = []
        for c in data["collectives"]:
            c = dict(c)
            if c.get("buffer_lifetime") is not None:
                c["buffer_lifetime"] = tuple(c["buffer_lifetime"])
            colls.append(Collective(**c))
        if version < 4:
            _link_by_id(colls)
        data["collectives"] = colls
        data["copies"] = [Collective(**_tuples(c)) for c in data.get("copies", [])]
        data["graphs"] = {g: [ComputeOp(**op) for op in ops] for g, ops in data["graphs"].items()}
        data["bodies"] = [CompiledBody(**b) for b in data.get("bodies", [])]
        data["inline_blocks"] = [InlineBlock(**b) for b in data.get("inline_blocks", [])]
        budget = data.get("budget")
        data["budget"] = MemoryBudget.from_dict(budget) if budget else None
        fused = data.get("fused_loss")
        data["fused_loss"] = FusedLossDecision(**fused) if fused else None
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))


def _tuples(c: dict[str, Any]) -> dict[str, Any]:
    c = dict(c)
    if c.get("buffer_lifetime") is not None:
        c["buffer_lifetime"] = tuple(c["buffer_lifetime"])
    return c


def _link_by_id(collectives: list[Collective]) -> None:
    """Plans before version 4: an HSDP all-reduce had its reduce-scatter's id with the kind
    replaced; link the two."""
    by_id = {c.id: c for c in collectives}
    for c in collectives:
        if c.origin == "shardc" and c.kind == CollectiveKind.ALL_REDUCE:
            rs = by_id.get(c.id.replace(".all_reduce.", ".reduce_scatter."))
            if rs is not None:
                c.link, rs.link = rs.id, c.id
