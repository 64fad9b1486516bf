"""The whole step's predicted memory peak.

``predict_peak`` walks the partitioned graphs' liveness (FX frees a value after its last use;
views share their base's storage) and adds the state that lives across the step: parameter
shards and optimizer state (``optimizer_state_factor`` bytes per parameter byte, 2 for Adam).
Gradients are the backward graph's outputs and count from where they are produced. After the
backward the optimizer's step holds parameter shards, gradient shards, its state and its own
temporaries (``optimizer_temp_factor`` bytes per parameter byte: one parameter-sized temporary
for torch's ``foreach`` Adam/AdamW), which can be the step's peak when activations are small. Under
Inductor the liveness follows what its generated code does (:class:`Fusion`,
:func:`held_for_reuse`): loops inlined into their readers take no memory, copies are made right
before the matmul that reads them, a dead buffer stays allocated until the next buffer of its
size reuses it, and a kernel that is the last reader of an input of its output's size may write
its output into that input's buffer (:mod:`shardc.memory.inplace`), a pointwise kernel sharing an
input buffer with an earlier one of its size runs in that kernel (:func:`_horizontal`), and
each block-body call keeps dead buffers for its own allocations only (its own reuse pool in the
generated code; :func:`held_for_reuse`'s ``scopes``). Checked against a CUDA
memory history of the wide model on 2 H200s (``docs/bench/README.md``): the backward's live bytes
at its peak match to 0.1%.

For a CUDA target (``predict_peak``'s ``allocator="cuda"``) every allocation counts as the
caching allocator's block (:func:`shardc.memory.cuda_blocks.block_bytes`), what
``torch.cuda.max_memory_allocated`` counts, and the runtime's own workspaces (cuBLAS's) are
added to each phase; a CPU target counts the requested bytes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import fx

import shardc.runtime.grad_sync  # noqa: F401  (registers the ops of _UNSYNCED_OPS)
from shardc import _torch
from shardc.memory import breakdown
from shardc.memory.cuda_blocks import sized
from shardc.memory.gc_pause import collector_paused
from shardc.memory.inplace import inplace_reuses
from shardc.ops import fused_ce
from shardc.ops.fused_ce import FUSED_CE_OP
from shardc.ops.gather import GATHER_OP
from shardc.ops.gather_args import GatherArgs
from shardc.ops.pool import POOL_PACK_OP, POOL_UNPACK_OP, filled_buffers, is_filled_copy
from shardc.passes.body import BODY_SCOPE, flattened
from shardc.passes.fx_utils import (
    has_tag,
    is_view,
    op_overload,
    size_hint,
    tensor_nbytes,
    view_chain_root,
    view_users,
)
from shardc.planning import optimizer_kind
from shardc.planning.plan import Plan
from shardc.runtime.collectives import is_float8

_nbytes = tensor_nbytes  # hints: a prediction must add no guard
Counted = Callable[[int], int]  # one request's bytes -> the bytes the allocator counts for it
_WAIT = _torch.funcol.wait_tensor.default


def _counted(value, count: Counted) -> int:
    """Bytes the allocator counts for a value: ``count`` of each tensor's bytes (a list or
    tuple of tensors: each its own allocation), 0 for anything else."""
    if isinstance(value, torch.Tensor):
        return count(_nbytes(value))
    if isinstance(value, (list, tuple)):
        return sum(_counted(v, count) for v in value)
    return 0


def _is_alias(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is _WAIT:
        return True
    if getattr(node.target, "__name__", "") == "getitem":
        return not _unpacked(node)  # the pool's copies are tensors of their own
    return is_view(node)


def _unpacked(node: fx.Node) -> bool:
    """Whether ``node`` is one of the new tensors ``shardc::pool_unpack`` returns (a getitem
    of it): each its own storage, freed after its own last use, as the per-parameter copies
    out of the pool it replaces were."""
    source = node.args[0] if node.args else None
    return isinstance(source, fx.Node) and source.op == "call_function" \
        and source.target is POOL_UNPACK_OP


def _pack_of(node: fx.Node) -> fx.Node | None:
    """The ``shardc::pool_pack`` filling ``node`` where ``node`` is a send buffer that lowering
    allocated with ``empty`` (``shardc.passes.lower._pack_new``), else None. Such a buffer is
    modelled as the ``cat`` it replaces: born where the first of its pieces is produced
    (:func:`fused_start` of the pack), allocated from Inductor's reuse pool, and no kernel of
    its own (the pack is the one)."""
    if node.op != "call_function" or node.target is not _EMPTY:
        return None
    return next((u for u in node.users if u.target is POOL_PACK_OP and u.args[0] is node), None)


def _is_collective(node: fx.Node) -> bool:
    op = op_overload(node)
    return op is not None and op.namespace == "_c10d_functional" and op is not _WAIT


_CAT = torch.ops.aten.cat.default
_EMPTY = torch.ops.aten.empty.memory_format
# no_sync's ops on its store of full gradients (shardc.runtime.grad_sync)
_TAKE_OP = torch.ops.shardc.take_stashed_grad.default
_UNSYNCED_OPS = frozenset({torch.ops.shardc.stash_grad.default, _TAKE_OP})
_STORE_META = "shardc_no_sync_store"  # a stored gradient's node (unsynced_grad_lives)
_PAD = torch.ops.aten.constant_pad_nd.default
_aten = torch.ops.aten
# Ops that Inductor lowers to loops it can inline into their consumers' kernels, besides those
# tagged pointwise: indexing (embedding lookups too), padding, constant fills and scatters into
# slices.
_LOOP_OPS = frozenset({
    _aten.gather.default, _aten.index.Tensor, _aten.embedding.default, _PAD, _aten.full.default,
    _aten.slice_backward.default, _aten.select_backward.default, _aten.slice_scatter.default,
    _aten.select_scatter.default})


@dataclass(frozen=True)
class NodeKinds:
    """What the liveness walk of one graph needs to know of each node, decided once per node:
    :class:`Fusion`'s sweeps, :func:`_horizontal`, :func:`fused_start`, :func:`held_for_reuse`
    and the walk itself ask it of a node several times over (about 100,000 questions, each a
    few calls deep, in a flattened step of 64 blocks), and the graph does not change while it is
    walked.

    ``loops``: the nodes Inductor computes as loops that it can inline into their readers: ops
    tagged pointwise, those of ``_LOOP_OPS``, and the buffers that ``shardc::unpack_into`` or
    ``shardc::cast_into`` fills (:func:`~shardc.ops.pool.is_filled_copy`), each modelled as
    the per-parameter copy or cast it replaces; the filling op itself is no kernel of its own
    and reads its inputs where those copies did (:func:`lifetimes_and_storage`)."""

    aliases: frozenset[fx.Node]  # share their input's storage (:func:`_is_alias`)
    loops: frozenset[fx.Node]
    pointwise: frozenset[fx.Node]  # ops tagged pointwise
    reductions: frozenset[fx.Node]  # ops tagged reduction
    collectives: frozenset[fx.Node]  # :func:`_is_collective`
    fills: dict[fx.Node, tuple[fx.Node, ...]]  # the buffers a node fills (:func:`filled_buffers`)
    packs: dict[fx.Node, fx.Node]  # a send buffer's pack (:func:`_pack_of`)

    @classmethod
    def of(cls, nodes: list[fx.Node]) -> NodeKinds:
        """The kinds of ``nodes``, a whole graph's (a buffer's filling op is one of its users)."""
        aliases, loops, pointwise, reductions, collectives = set(), set(), set(), set(), set()
        fills: dict[fx.Node, tuple[fx.Node, ...]] = {}
        packs: dict[fx.Node, fx.Node] = {}
        # Per target: (tagged pointwise, tagged reduction, in _LOOP_OPS, a collective), read
        # once per op (a tag test compares torch.Tag values one by one: about 0.5 us a node).
        of_op: dict[object, tuple[bool, bool, bool, bool]] = {}
        for node in nodes:
            if node.op != "call_function":
                continue  # (a placeholder, get_attr or output is none of these)
            op_kinds = of_op.get(node.target)
            if op_kinds is None:
                op_kinds = of_op[node.target] = _op_kinds(node)
            is_pointwise, is_reduction, is_loop_op, is_collective = op_kinds
            if is_pointwise:
                pointwise.add(node)
            if is_reduction:
                reductions.add(node)
            if is_collective:
                collectives.add(node)
            if is_pointwise or is_loop_op or is_filled_copy(node):
                loops.add(node)
            if _is_alias(node):
                aliases.add(node)
            if written := filled_buffers(node):
                fills[node] = written
            if (pack := _pack_of(node)) is not None:
                packs[node] = pack
        return cls(frozenset(aliases), frozenset(loops), frozenset(pointwise),
                   frozenset(reductions), frozenset(collectives), fills, packs)


def _op_kinds(node: fx.Node) -> tuple[bool, bool, bool, bool]:
    """Whether ``node``'s op is tagged pointwise, tagged reduction, one of ``_LOOP_OPS``, a
    collective (the same for every node calling it)."""
    return (has_tag(node, torch.Tag.pointwise), has_tag(node, torch.Tag.reduction),
            node.target in _LOOP_OPS, _is_collective(node))


@dataclass
class Fusion:
    """Where a fusing compiler (Inductor) materializes each value of a graph.

    ``inlined``: loops computed inside every reader's kernel (pointwise ops, reductions, or the
    concatenation they fill), so they take no memory of their own. ``deferred``: loops with one
    reader that needs them in memory (an extern kernel such as a matmul): Inductor realizes them
    right before that reader, not where the graph defines them (an all-gathered parameter's copy
    is made just before its matmul, so the gathered buffer lives until the layer's last one).
    ``span``: the first and last position where a node's computation runs, i.e. where it reads
    its inputs (its readers' positions for inlined and deferred loops).
    """

    inlined: set[fx.Node]
    deferred: set[fx.Node]
    span: dict[fx.Node, tuple[int, int]]
    joined: dict[fx.Node, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, nodes: list[fx.Node], kinds: NodeKinds | None = None) -> Fusion:
        """The fusion of ``nodes`` (a whole graph's, in order; ``kinds``: theirs, if known)."""
        kinds = kinds if kinds is not None else NodeKinds.of(nodes)
        readers = {node: _loop_readers(node, kinds) for node in kinds.loops}
        inlined: set[fx.Node] = set()
        deferred: set[fx.Node] = set()
        joined: dict[fx.Node, int] = {}
        span: dict[fx.Node, tuple[int, int]] = {}
        for sweep in range(2):  # the second with the horizontal fusions the first allows
            if sweep:
                joined = _horizontal(nodes, inlined, deferred, kinds)
                if not joined:
                    break
                inlined, deferred = set(), set()
            cls._sweep(nodes, kinds, readers, inlined, deferred, span, joined)
        return cls(inlined, deferred, span, joined)

    @staticmethod
    def _sweep(nodes: list[fx.Node], kinds: NodeKinds, readers: dict[fx.Node, list[fx.Node]],
               inlined: set[fx.Node], deferred: set[fx.Node],
               span: dict[fx.Node, tuple[int, int]], joined: dict[fx.Node, int]) -> None:
        """One sweep, readers first (``readers``: each loop's, :func:`_loop_readers`)."""
        for i in range(len(nodes) - 1, -1, -1):
            node = nodes[i]
            span[node] = (joined[node],) * 2 if node in joined else (i, i)
            its_readers = readers.get(node)
            if its_readers is None:
                continue  # no loop
            if not its_readers or any(r.op == "output" for r in its_readers):
                continue  # a graph output: realized where it is defined
            if all(r in kinds.loops or r in kinds.reductions or r.target is _CAT
                   for r in its_readers):
                inlined.add(node)
            elif len(its_readers) == 1:
                deferred.add(node)
            else:
                continue
            span[node] = (min(span[r][0] for r in its_readers),
                          max(span[r][1] for r in its_readers))


def _loop_readers(node: fx.Node, kinds: NodeKinds) -> list[fx.Node]:
    """The nodes that read ``node`` or a view of it, less those filling it (the op that fills a
    copy's buffer is its writer, not a reader)."""
    return [r for r in view_users(node)[1] if node not in kinds.fills.get(r, ())]


# Inductor's max_fusion_buffer_group_pairwise_attempts: the kernels reading one buffer are paired
# for fusion only with the next 64 kernels in order.
_FUSION_WINDOW = 64


def _kernel_inputs(node: fx.Node, inlined: set[fx.Node], aliases: frozenset[fx.Node]
                   ) -> set[fx.Node]:
    """The values in memory that ``node``'s kernel reads: its inputs, through views
    (``aliases``: the graph's, :attr:`NodeKinds.aliases`) and the loops inlined into it,
    theirs."""
    found: set[fx.Node] = set()
    stack, seen = list(node.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in inlined or n in aliases:
            stack.extend(n.all_input_nodes)
        else:
            found.add(n)
    return found


def _horizontal(nodes: list[fx.Node], inlined: set[fx.Node], deferred: set[fx.Node],
                kinds: NodeKinds) -> dict[fx.Node, int]:
    """Pointwise kernels Inductor fuses horizontally into an earlier one: ``{kernel: position
    of the kernel it joins}``. Its scheduler fuses two kernels of one iteration space that share
    an input buffer and do not depend on each other (e.g. the SwiGLU backward's two gradients,
    ``g * silu(a)`` and ``g * b * silu'(a)``, one kernel reading ``g``, ``a`` and ``b``): the
    later one runs where the earlier does, so its output exists from there and its inputs are
    read there. Joined here: a realized pointwise value whose kernel reads a buffer that an
    earlier realized pointwise kernel of the same element count (and the same block-body call)
    reads, when every buffer it reads exists before that kernel and the two are at most
    ``_FUSION_WINDOW`` kernels apart. ``kinds``: the graph's (:class:`NodeKinds`)."""
    index = {n: i for i, n in enumerate(nodes)}
    groups: list[tuple[int, int, tuple, int, set[fx.Node]]] = []  # position, kernel no., ...
    joined: dict[fx.Node, int] = {}
    kernels = 0
    for i, node in enumerate(nodes):
        if node.op != "call_function" or node in inlined or node in kinds.aliases \
                or node in kinds.packs or node in kinds.fills:
            continue
        kernels += 1
        val = node.meta.get("val")
        if node not in kinds.pointwise or node in deferred or not isinstance(val, torch.Tensor):
            continue
        numel = math.prod(size_hint(d) for d in val.shape)
        where = node.meta.get(BODY_SCOPE, ())
        reads = _kernel_inputs(node, inlined, kinds.aliases)
        groups = [g for g in groups if kernels - g[1] <= _FUSION_WINDOW]
        for pos, _, g_scope, g_numel, g_reads in groups:
            if g_numel == numel and g_scope == where and reads & g_reads \
                    and all(index[r] < pos for r in reads):
                joined[node] = pos
                g_reads |= reads
                break
        else:
            groups.append((i, kernels, where, numel, reads))
    return joined


def fused_start(node: fx.Node, index: dict[fx.Node, int], kinds: NodeKinds) -> int:
    """Where a fusing compiler first writes a concatenation (a collective's send buffer): it
    fuses the casts, padding and copies that fill it into the kernels right after the producers
    of its pieces, so the buffer exists from the earliest of those casts, not from the ``cat``.
    ``index``: each node's position; ``kinds``: the graph's (:class:`NodeKinds`)."""
    start = index[node]
    stack, seen = list(node.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if n in kinds.loops or n in kinds.aliases:
            start = min(start, index[n])
            stack.extend(n.all_input_nodes)
    return start


@dataclass(frozen=True)
class Lifetime:
    """A value's memory: ``nbytes`` from position ``born`` through ``last`` (inclusive)."""

    node: fx.Node
    born: int
    last: int
    nbytes: int


def lifetimes(gm: fx.GraphModule, skip: set[fx.Node], *,
              fusion: bool = False, count: Counted = int) -> list[Lifetime]:
    """Every value's lifetime while ``gm`` runs (``skip``: placeholders counted elsewhere);
    see :func:`lifetimes_and_storage`."""
    return lifetimes_and_storage(gm, skip, fusion=fusion, count=count)[0]


def lifetimes_and_storage(gm: fx.GraphModule, skip: set[fx.Node], *, fusion: bool = False,
                          count: Counted = int
                          ) -> tuple[list[Lifetime], dict[fx.Node, fx.Node]]:
    """Every value's lifetime while ``gm`` runs (``skip``: placeholders counted elsewhere), and
    each node's storage owner (itself, or the node it is an alias of).

    A value is alive from its definition to the last use of it or of any view of it; graph
    outputs stay alive to the end. ``fusion`` models Inductor (:class:`Fusion`): inlined
    values take no memory, deferred ones are born at their reader, inputs are read where the
    kernel reading them runs, and concatenations are born at :func:`fused_start`. ``count``
    gives each allocation's counted bytes from its requested ones
    (:func:`shardc.memory.cuda_blocks.sized`; default: the request itself).
    """
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    kinds = NodeKinds.of(nodes)
    fused = Fusion.of(nodes, kinds) if fusion else Fusion(set(), set(), {})
    storage: dict[fx.Node, fx.Node] = {}
    size: dict[fx.Node, int] = {}
    born: dict[fx.Node, int] = {}
    last: dict[fx.Node, int] = {}
    end = len(nodes)
    pending: dict[fx.Node, list[fx.Node]] = {}
    for i, node in enumerate(nodes):
        inputs = node.all_input_nodes
        if node.op == "output":
            for arg in inputs:
                last[storage[arg]] = end
            continue
        reads_at = i
        written = kinds.fills.get(node, ())  # (a buffer an op fills lives as its readers say)
        if node in kinds.aliases and inputs:
            storage[node] = storage[inputs[0]]
        else:
            storage[node] = node
            # (an unpack's list holds no memory of its own: its getitems own their tensors)
            dropped = node in skip or node in fused.inlined or node.target is POOL_UNPACK_OP
            size[node] = 0 if dropped else _counted(node.meta.get("val"), count)
            born[node] = fused.span[node][0] if node in fused.deferred or node in fused.joined \
                else i
            if _unpacked(node):  # allocated while the unpack runs, as it reads the pool
                born[node] = born[node.args[0]]
            if fusion and node.target is _CAT:
                born[node] = fused_start(node, index, kinds)
            elif fusion and (pack := kinds.packs.get(node)) is not None:
                born[node] = min(i, fused_start(pack, index, kinds))
            last[node] = born[node]
            reads_at = fused.span.get(node, (i, i))[1]
            if fusion and written:
                reads_at = max([reads_at, *(fused.span[o][1] for o in written)])
        for arg in inputs:
            if arg in written:
                continue
            key = storage[arg]
            if last[key] < reads_at:
                last[key] = reads_at
        if node in kinds.collectives:
            pending[node] = [storage[a] for a in inputs]
        elif node.op == "call_function" and node.target is _WAIT:
            # A collective's inputs stay referenced by its work until the wait (the process
            # group holds them so the compute stream cannot reuse them while it runs).
            for key in pending.pop(node.args[0], ()):
                last[key] = max(last[key], i)
    taken = inplace_reuses(nodes, fused.inlined, storage, born, last, size) if fusion else {}
    for out, buf in taken.items():  # the kernel writes ``out`` into ``buf``: one buffer
        last[buf] = born[out] - 1
    lives = [Lifetime(key, born[key], last[key], nbytes) for key, nbytes in size.items()]
    lives.extend(fused_loss_workspaces(nodes, count))
    if not fusion:
        return lives, storage
    scopes = [n.meta.get(BODY_SCOPE, ()) for n in nodes]
    return held_for_reuse(lives, end, kinds, taken, scopes), storage


def fused_loss_workspaces(nodes: list[fx.Node], count: Counted = int) -> list[Lifetime]:
    """The fused cross-entropy's per-chunk workspace (``shardc.ops.fused_ce.workspace_bytes``:
    a chunk's logits, their fp32 copy and gradient, the weight's fp32 accumulator), alive
    while the op runs. Keyed by the op's first getitem, an alias that no category owns, so the
    memory breakdown counts it as a temporary. ``count``: as :func:`lifetimes_and_storage`'s,
    applied to the workspace's total (its pieces' own rounding is not modelled)."""
    out = []
    for i, node in enumerate(nodes):
        if node.op != "call_function" or node.target is not FUSED_CE_OP:
            continue
        h, weight, _target, chunk, _ignore, _reduction, upcast = node.args
        hv, wv = h.meta["val"], weight.meta["val"]
        nbytes = fused_ce.workspace_bytes(size_hint(hv.shape[0]), size_hint(hv.shape[1]),
                                          size_hint(wv.shape[0]), chunk, hv.dtype, wv.dtype,
                                          upcast)
        key = next(iter(node.users), node)
        out.append(Lifetime(key, i, i, count(nbytes)))
    return out


# Kernels whose output Inductor allocates itself (and may take from its reuse pool): its
# generated loops, reductions and concatenations, and the matmuls it calls with ``out=``.
_OUT_KERNELS = frozenset({_aten.mm.default, _aten.bmm.default, _aten.addmm.default,
                          _aten.baddbmm.default})


def _reuse_key(node: fx.Node) -> tuple | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return val.dtype, math.prod(size_hint(s) for s in val.shape)  # Inductor: storage size


def _allocates_from_pool(node: fx.Node, kinds: NodeKinds) -> bool:
    return node.op == "call_function" and (
        node in kinds.loops or node in kinds.reductions or node.target is _CAT
        or node.target in _OUT_KERNELS or node in kinds.packs)


def held_for_reuse(lives: list[Lifetime], end: int, kinds: NodeKinds,
                   inplace: dict[fx.Node, fx.Node] | None = None,
                   scopes: list[tuple] | None = None) -> list[Lifetime]:
    """Inductor's buffer reuse, as its generated code does it: a dead buffer is not freed but
    kept for the next buffer of the same dtype and size that the code allocates, however much
    later that is (the most recently freed first). Such a buffer stays allocated until then;
    e.g. an all-gather's send buffer, freed at its wait, lives on until the next all-gather
    packs its send buffer into it. ``inplace`` (``{output: input buffer}``,
    :func:`shardc.memory.inplace.inplace_reuses`): outputs written into an input's buffer,
    which allocate nothing, and inputs whose buffer lives on as that output, never kept.

    ``scopes`` (a flattened graph's, :data:`shardc.passes.body.BODY_SCOPE` of each position):
    each block-body call is a function of its own in the generated code, with its own reuse
    pool. A buffer is kept only by the function that frees it, and only if it is that
    function's own (allocated there, or returned to it by a body it called): a body's input
    (the caller's value, or an output of the recompute's body passed into the backward's) is
    freed where the body last reads it. A kept buffer is reused only by an allocation of the
    same call, and freed when the call returns (its dead buffers are locals of the function).
    ``kinds``: the graph's (:class:`NodeKinds`)."""
    inplace = inplace or {}
    scopes = scopes or []

    def scope(node: fx.Node) -> tuple:
        return node.meta.get(BODY_SCOPE, ()) if scopes else ()
    overwritten = set(inplace.values())
    pooled = [_allocates_from_pool(life.node, kinds) for life in lives]
    # Each counted value's storage key, where a birth or death below asks for it.
    keys = [_reuse_key(life.node) if life.nbytes and (pooled[i] or life.node.op == "placeholder")
            else None for i, life in enumerate(lives)]
    by_birth: dict[int, list[int]] = {}  # the allocations that may take a kept buffer
    by_death: dict[int, list[int]] = {}
    for i, life in enumerate(lives):
        if life.nbytes and pooled[i] and life.node not in inplace:
            by_birth.setdefault(life.born, []).append(i)
        if life.nbytes and life.last < end:
            by_death.setdefault(life.last, []).append(i)
    held = list(lives)
    pool: dict[tuple, list[int]] = {}
    for pos in range(end + 1):
        for i in by_birth.get(pos, ()):
            key = (scope(lives[i].node), keys[i])
            if pool.get(key):
                j = pool[key].pop()
                held[j] = Lifetime(lives[j].node, lives[j].born, pos - 1, lives[j].nbytes)
        for i in by_death.get(pos, ()):
            node = lives[i].node
            if node in overwritten:
                continue
            frees_it = scopes[pos] if pos < len(scopes) else ()
            if scope(node)[:len(frees_it)] != frees_it:
                continue  # a body's input: freed where the body last reads it
            if pooled[i] or node.op == "placeholder":
                pool.setdefault((frees_it, keys[i]), []).append(i)
    return held


def liveness_peak(gm: fx.GraphModule, skip: set[fx.Node], *,
                  fusion: bool = False, count: Counted = int) -> tuple[int, list[int]]:
    """Peak bytes of the values of :func:`lifetimes` alive at once, and the bytes alive at
    each position of ``gm``."""
    return _timeline(lifetimes(gm, skip, fusion=fusion, count=count), len(gm.graph.nodes))


def _timeline(lives: list[Lifetime], end: int) -> tuple[int, list[int]]:
    delta = [0] * (end + 2)
    for life in lives:
        delta[life.born] += life.nbytes
        delta[life.last + 1] -= life.nbytes
    timeline = list(accumulate(delta[:end + 1]))
    return max(timeline, default=0), timeline


def param_placeholders(gm: fx.GraphModule) -> set[fx.Node]:
    """Placeholders holding parameter shards (found through the gathers: call before lowering).

    A gather sends its parameter's shard placeholder (or a view of it), except an FP8 gather,
    which sends the quantized shard (:func:`fp8_shard_placeholder`)."""
    roots = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is GATHER_OP:
            sent = GatherArgs.of(node).shard
            root = fp8_shard_placeholder(sent) if is_float8(_dtype(sent)) \
                else view_chain_root(sent)
            if root is not None:
                roots.add(root)
    return roots


def _root(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` views (itself if it is no view)."""
    while _is_alias(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _dtype(node: fx.Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def fp8_shard_placeholder(sent: fx.Node) -> fx.Node | None:
    """The parameter shard placeholder an FP8 gather's quantized shard ``sent`` comes from, or
    None where it comes from none: in a backward, ``sent`` is (a view of) the quantized shard the
    forward saved, a placeholder of its own that is live memory, not a parameter.

    In a forward the quantization ``(shard * scale).clamp(..).to(float8)`` is computed in the
    graph; its inputs of the shard's shape lead back to the shard (the scale is 0-d, and FP8
    weights are 2-D), so the walk follows only those."""
    if view_chain_root(sent) is not None:
        return None
    shape = sent.meta["val"].shape
    stack, seen = [sent], {sent}
    while stack:
        for node in stack.pop().all_input_nodes:
            val = node.meta.get("val")
            if node in seen or not isinstance(val, torch.Tensor) or val.shape != shape:
                continue
            seen.add(node)
            if node.op == "placeholder":
                return None if is_float8(val.dtype) else node
            stack.append(node)
    return None


# The flattened graph copies it walks are garbage once it returns: the collector is held off
# while it runs, so they die young (shardc.memory.gc_pause).
@collector_paused()
def predict_peak(
    forward: fx.GraphModule,
    backward: fx.GraphModule | None,
    plan: Plan,
    params: set[fx.Node],
    bw_params: set[fx.Node],
    *,
    optimizer_state_factor: float = 2.0,
    optimizer_temp_factor: float = 1.0,
    persistent_bytes: int = 0,
    fusion: bool = False,
    host: set[fx.Node] = frozenset(),
    optimizer_host_param_bytes: int = 0,
    optimizer_impl: str = "auto",
    optimizer_per_tensor_bytes: float | None = None,
    optimizer_chunk_bytes: int | None = None,
    allocator: str = "exact",
    runtime_bytes: int = 0,
) -> dict[str, int]:
    """Whole-step peak prediction from the lowered graphs; ``params``/``bw_params`` are the
    parameter-shard placeholders (:func:`param_placeholders`, taken before lowering);
    ``persistent_bytes``: memory held across steps besides those (the static pool), counted
    in the optimizer step (the graphs' liveness already covers it inside the step);
    ``host``: values in host memory (CPU offload, :mod:`shardc.memory.host`), not counted;
    ``optimizer_host_param_bytes``: bytes of the shards whose optimizer state and step are on
    the host (the peak budget's partial optimizer offload): the state and the step's
    temporaries are counted for the other shards only. ``optimizer_impl``: the implementation
    the optimizer runs (``shardc.planning.optimizer_kind``), whose temporaries the step holds:
    ``"auto"`` runs per tensor on a group that mixes host-stepped shards with these;
    ``optimizer_per_tensor_bytes``: the per-tensor implementation's temporaries
    (``optimizer_kind.per_tensor_temp_bytes``; default: over ``params``, all on the device).
    ``optimizer_chunk_bytes``: the step runs in chunks (``shardc.planning.optimizer_chunks``)
    whose largest holds these bytes of shards (counted as ``allocator`` counts): ``foreach``'s
    temporaries are that chunk's (None: one call over every shard).

    ``allocator``: how an allocation's bytes are counted (``shardc.memory.cuda_blocks``):
    ``"cuda"``, as the CUDA caching allocator's block (what ``torch.cuda.max_memory_allocated``
    counts: every graph value, parameter shard, gradient, optimizer state tensor, optimizer
    temporary and the static pool rounded by :func:`~shardc.memory.cuda_blocks.block_bytes`),
    for a plan whose target is a CUDA device; ``"exact"``, the bytes requested (a CPU target,
    which has no allocator statistics). ``runtime_bytes``: the runtime's own device memory
    (cuBLAS workspaces) held through every phase, added to each of the three peaks
    (``ClusterProfile.runtime_bytes``; 0 for an exact count). The caller decides both once, from
    the plan's target (``shardc.compile.pipeline.memory_model``). Under ``"cuda"`` the device's
    optimizer state counts ``optimizer_state_factor`` times the shards' blocks less the
    host-stepped shards' requested bytes: an over-count by their rounding, safe for a budget.

    Returns (and records in ``plan.predicted``) ``param_bytes``, ``optimizer_state_bytes``,
    ``forward_peak_bytes``, ``backward_peak_bytes``, ``grad_bytes``,
    ``optimizer_step_peak_bytes`` and ``peak_bytes`` (the largest of the three peaks), and
    under ``allocator="cuda"`` ``runtime_bytes``.
    """
    count = sized(allocator)
    param_bytes = sum(_counted(p.meta.get("val"), count) for p in params)
    stepped_here = max(param_bytes - optimizer_host_param_bytes, 0)  # the device's optimizer
    optim = int(stepped_here * optimizer_state_factor)
    ran = optimizer_kind.ran(optimizer_impl, optimizer_temp_factor,
                             host_in_group=optimizer_host_param_bytes > 0)
    if optimizer_per_tensor_bytes is None:
        optimizer_per_tensor_bytes = optimizer_kind.per_tensor_temp_bytes(
            (_counted(p.meta.get("val"), count) for p in params), optimizer_state_factor)
    chunked = optimizer_chunk_bytes is not None and ran == "foreach"
    # foreach allocates its lists per call: a chunked step's are the largest chunk's.
    in_one_call = min(stepped_here, optimizer_chunk_bytes) if chunked else stepped_here
    temps = optimizer_kind.step_temp_bytes(ran, in_one_call, optimizer_per_tensor_bytes,
                                           optimizer_temp_factor)
    persistent_bytes = count(persistent_bytes)  # the static pool: one allocation
    constants = {breakdown.PARAM_SHARDS: param_bytes, breakdown.OPTIMIZER: optim,
                 breakdown.RUNTIME: runtime_bytes}
    held = param_bytes + optim + runtime_bytes  # at every position of the step
    # Block bodies (invoke_subgraph calls) are walked as the ops they run, where they run them.
    forward, params, fw_host = _flat(forward, params, host)
    if backward is not None:
        backward, bw_params, bw_host = _flat(backward, bw_params, host)
    # no_sync's store of full gradients (shardc.runtime.grad_sync), held outside the graphs
    # across the micro-batches: values of both graphs (:func:`unsynced_grad_lives`).
    stored = _unsynced(backward, count) if backward is not None else []
    unsynced = sum(nbytes for _, _, nbytes in stored)
    fw_lives, fw_storage = lifetimes_and_storage(forward, params | fw_host, fusion=fusion,
                                                 count=count)
    fw_lives = fw_lives + unsynced_grad_lives(forward, stored, taken=False)
    fw_peak, _ = _timeline(fw_lives, len(forward.graph.nodes))
    out = {"param_bytes": param_bytes, "optimizer_state_bytes": optim,
           "forward_peak_bytes": held + fw_peak}
    walked = [("forward", forward, fw_lives, fw_storage)]
    peak = out["forward_peak_bytes"]
    if backward is not None:
        bw_lives, bw_storage = lifetimes_and_storage(backward, bw_params | bw_host,
                                                     fusion=fusion, count=count)
        bw_lives = bw_lives + unsynced_grad_lives(backward, stored, taken=True)
        bw_peak, _ = _timeline(bw_lives, len(backward.graph.nodes))
        walked.append(("backward", backward, bw_lives, bw_storage))
        out["backward_peak_bytes"] = held + bw_peak
        grads = sum(_counted(n.meta.get("val"), count)
                    for n in backward.graph.output_node().args[0]
                    if isinstance(n, fx.Node) and _root(n) not in bw_host)
        out["grad_bytes"] = grads
        out["optimizer_step_peak_bytes"] = held + grads + persistent_bytes + temps
        out["optimizer_temp_bytes"] = temps
        peak = max(peak, out["backward_peak_bytes"], out["optimizer_step_peak_bytes"])
        constants_step = {**constants, breakdown.GRADIENTS: grads,
                          breakdown.COMM: persistent_bytes,
                          breakdown.TEMPORARIES: temps}
    plan.memory_by_category = _step_breakdown(
        walked, constants, constants_step if backward is not None else None)
    out["peak_bytes"] = peak
    if unsynced:
        out["unsynced_grad_bytes"] = unsynced
    if allocator == "cuda":
        out["runtime_bytes"] = runtime_bytes
    if chunked:
        out["optimizer_chunk_bytes"] = in_one_call
    if optimizer_host_param_bytes:
        out["optimizer_host_param_bytes"] = min(optimizer_host_param_bytes, param_bytes)
    for key, value in out.items():
        setattr(plan.predicted, key, float(value))
    return out


def _unsynced(backward: fx.GraphModule, count: Counted = int
              ) -> list[tuple[fx.Node, str, int]]:
    """``backward``'s (flattened) ops on ``shardc.no_sync``'s store of full gradients
    (``stash_grad``: adds to it, ``take_stashed_grad``: takes and frees it): each op, the
    parameter's name and its full gradient's bytes; none in a synchronized backward without
    stored gradients."""
    first: dict[str, tuple[fx.Node, str, int]] = {}  # a parameter's one stored gradient
    for n in backward.graph.nodes:
        if n.op == "call_function" and n.target in _UNSYNCED_OPS:
            first.setdefault(n.args[2], (n, n.args[2], _counted(n.args[0].meta.get("val"),
                                                                  count)))
    return list(first.values())


def unsynced_grad_lives(gm: fx.GraphModule, stored: list[tuple[fx.Node, str, int]], *,
                        taken: bool) -> list[Lifetime]:
    """The stored gradients' memory while ``gm`` (flattened) runs: one value per parameter,
    alive from the start (earlier micro-batches filled the store: an over-count in the first
    one, safe for the budget) through the end, or (``taken``: ``gm`` is the backward) through
    the op that takes it; a stash adds the new sum while the old one lives (``held + grad``),
    one more gradient at that op. Each value is a node outside the graph, named
    ``no_sync_store:<parameter>`` (breakdown: gradients)."""
    positions = {n: i for i, n in enumerate(gm.graph.nodes)}
    end = len(positions)  # past the output node, as the graph outputs (lifetimes_and_storage)
    lives = []
    for op, fqn, nbytes in stored:
        held = fx.Node(gm.graph, f"no_sync_store:{fqn}", "call_function", op.target, (), {})
        held.meta[_STORE_META] = True
        if not taken:
            lives.append(Lifetime(held, 0, end, nbytes))
        elif op.target is _TAKE_OP:
            lives.append(Lifetime(held, 0, positions[op], nbytes))
        else:
            lives += [Lifetime(held, 0, end, nbytes),
                      Lifetime(held, positions[op], positions[op], nbytes)]
    return lives


def shard_bytes_by_param(gm: fx.GraphModule) -> dict[str, int]:
    """Bytes of each parameter's shard (this rank's), by name, found through the gathers as
    :func:`param_placeholders` finds them (call before lowering); FP8 gathers, which send a
    quantized shard, are left out."""
    out: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is GATHER_OP:
            args = GatherArgs.of(node)
            if is_float8(_dtype(args.shard)):
                continue
            root = view_chain_root(args.shard)
            if root is not None:
                out.setdefault(args.fqn, _nbytes(root.meta.get("val")))
    return out


def _flat(gm: fx.GraphModule, params: set[fx.Node], host: set[fx.Node]
          ) -> tuple[fx.GraphModule, set[fx.Node], set[fx.Node]]:
    """``gm`` with its block bodies inlined (:func:`flattened`), and the parameter and host
    nodes among ``params`` and ``host`` as nodes of that graph."""
    flat, mapping = flattened(gm, module_stacks=False, check=False)  # read-only, one walk
    return flat, {mapping[p] for p in params}, {mapping[h] for h in host if h in mapping}


def _step_breakdown(walked: list, constants: dict[str, int],
                    optimizer_step: dict[str, int] | None) -> dict:
    """``Plan.memory_by_category``: per graph the sampled positions and the bytes of each
    category there (``shardc.memory.breakdown``), the optimizer step as one column, and the
    peak: where it is, its bytes by category and the largest values alive there."""
    graphs: dict[str, dict] = {}
    # (total, graph, position, (lives, categories), bytes by category) at the peak so far
    best: tuple = (-1, "", 0, None, {})
    for name, gm, lives, storage in walked:
        cats = breakdown.categorize(gm, name, storage)
        cats.update({life.node: breakdown.GRADIENTS for life in lives
                     if life.node.meta.get(_STORE_META)})
        timeline = breakdown.category_timeline(lives, cats, len(gm.graph.nodes))
        keep, columns = breakdown.graph_columns(timeline, constants)
        graphs[name] = {"positions": keep, "bytes": columns}
        totals = [sum(at) for at in zip(*(columns[c] for c in breakdown.CATEGORIES))]
        for i, (pos, total) in enumerate(zip(keep, totals)):
            if total > best[0]:
                best = (total, name, pos, (lives, cats), {c: columns[c][i] for c in columns})
    peak = {"graph": best[1], "position": best[2], "bytes": best[4],
            "largest": breakdown.largest_at(*best[3], best[2]) if best[3] else []}
    if optimizer_step is not None:
        graphs["optimizer step"] = {"positions": [0], "bytes": {
            c: [optimizer_step.get(c, 0)] for c in breakdown.CATEGORIES}}
        if sum(optimizer_step.values()) > best[0]:
            peak = {"graph": "optimizer step", "position": 0, "bytes": dict(optimizer_step),
                    "largest": []}
    return {"categories": list(breakdown.CATEGORIES), "graphs": graphs, "peak": peak}
