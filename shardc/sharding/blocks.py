"""Repeated blocks compiled once: find the identical children of ``nn.ModuleList``s at
:func:`shardc.shard` time and give each a forward that keeps collectives out of the compute.

Inside a compiled forward, a wrapped block's forward reads each of its parameters through
shardc's property (one ``shardc::gather_param`` per parameter, in the *outer* graph, where
shardc plans every collective of the step), then calls one ``nested_compile_region`` function per
distinct block structure: the *body*, pure compute, which runs the block's original forward on an
unsharded meta-device copy (the *skeleton*) with the gathered weights and the block's buffers
substituted (:func:`call_substituted`). Dynamo emits one subgraph per body and calls it
once per block; AOTAutograd partitions it once and Inductor compiles it once
(``shardc.compile.backend`` and ``shardc.passes.body`` handle the body's partition and keep
``reshard_after_forward``). Outside compilation the wrapped forward is the block's own forward.
Dynamo traces a body once per distinct argument description: through torch's ``reuse_hash_fn``
(keyed bodies, torch 2.13+) or, without it, through shardc's own *trace once* (later calls are
``shardc::body_call`` placeholders that the backend rewrites; see the section below).

Blocks are grouped by a structure signature (class tree, parameter and buffer names, shapes,
dtypes, sharding options, plain attribute values); a group of two or more identical blocks gets a
body, everything else keeps the usual path, and each such decision is logged once (logger
``"shardc"``) and recorded (:class:`BlockBodies`, reported in every plan).

Blocks left without an identical sibling are grouped again with their scalar attributes
(``bool``, ``int``, ``float``, ``str``) compared by type, not value: transformers numbers its
attention modules (``self_attn.layer_idx``, the KV cache's slot), so no two decoder layers were
identical. The body is traced from the first block, so such a group's calls use it only where
the forward is proven not to read the scalars that differ (``BlockGroup.varying``): the prober
runs each described call on a skeleton that records their reads (:func:`_record_varying_reads`);
an unread call shares the body, a call that reads one runs the block's own forward, said in the
plan. A call that could not be probed (symbolic sizes, an op meta tensors lack) calls the
group's member body (``BlockGroup.member_bodies``), which runs a skeleton of the calling block:
right whatever the forward reads, and shared all the same where it reads nothing that differs,
since Dynamo installs one subgraph for equal traces of one function.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from shardc import _torch
from shardc.ops.body_call import body_anchor, body_call, record_outputs
from shardc.ops.gather import GATHER_OP
from shardc.runtime.grad_sync import SYNC_MODES
from shardc.sharding.block_context import context_writes
from shardc.sharding.eager_body import substituted_copy
from shardc.sharding.module_copy import internal_deepcopy
from shardc.sharding.packed_blocks import LEAF_ATTR, PackedLayout, eligible_reason, repack
from shardc.sharding.scope import enter_forward, exit_forward

log = logging.getLogger("shardc")

__all__ = ["BlockBodies", "BlockFallback", "BlockGroup", "wrap_repeated_blocks"]

# Attribute values compared by value in the signature; anything else must be the same object.
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
# Of those, the types whose values may differ within a group (the type may not): see the module
# docstring. Exact types: an enum member compares by value.
_VARYING_TYPES = (bool, int, float, str)


@dataclass(frozen=True)
class BlockFallback:
    """A child of an ``nn.ModuleList`` that keeps the usual (inlined) compile, and why."""

    module: str
    reason: str


@dataclass
class BlockGroup:
    """Identical blocks sharing one body: their module names and what the wrapper passes."""

    index: int
    block_type: str
    members: tuple[str, ...]
    weight_names: tuple[str, ...]  # the body's leading arguments, in this order
    buffer_names: tuple[str, ...]
    # The same names split at the dots, for the traced reads (``_read``).
    weight_paths: tuple[tuple[str, ...], ...] = field(init=False, repr=False)
    buffer_paths: tuple[tuple[str, ...], ...] = field(init=False, repr=False)
    bodies: dict[bool, Callable] = field(default_factory=dict, repr=False)  # by training mode
    # The same bodies reused by key, traced once per key (torch 2.13+; see reuse_key).
    keyed: dict[bool, Callable] = field(default_factory=dict, repr=False)
    # Keyed bodies taking their arguments flat (``key, *weights, *buffers, *args``), for a
    # forward called with tensors only: torch fingerprints a call of flat tensors and
    # constants directly, nested arguments through a traced pytree flatten at every call.
    keyed_flat: dict[bool, Callable] = field(default_factory=dict, repr=False)
    prober: BodyProber | None = field(default=None, repr=False)
    # A group whose members differ in scalars (``varying``): a guard-based body per training
    # mode whose first argument, the member's number in ``members``, picks the skeleton of that
    # member it runs (:func:`_make_member_body`), for calls that have no reuse key.
    member_bodies: dict[bool, Callable] = field(default_factory=dict, repr=False)
    # pack_blocks=True: the bodies that take the block's gathered packed buffer instead.
    packed: PackedBodies | None = field(default=None, repr=False)
    # Scalar attributes whose values differ among the members, as ``(submodule, attribute)``
    # (submodule "" for the block itself); the names the probes found read, as "submodule.attr".
    varying: frozenset[tuple[str, str]] = frozenset()
    varying_read: set[str] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self.weight_paths = tuple(tuple(n.split(".")) for n in self.weight_names)
        self.buffer_paths = tuple(tuple(n.split(".")) for n in self.buffer_names)


@dataclass
class PackedBodies:
    """A group's bodies for members that read their shards packed
    (``shardc.sharding.packed_blocks``): the same block code, given the gathered buffer, which
    it unpacks into the weights first."""

    layout: PackedLayout
    bodies: dict[bool, Callable] = field(default_factory=dict, repr=False)
    keyed: dict[bool, Callable] = field(default_factory=dict, repr=False)
    keyed_flat: dict[bool, Callable] = field(default_factory=dict, repr=False)
    prober: BodyProber | None = field(default=None, repr=False)
    member_bodies: dict[bool, Callable] = field(default_factory=dict, repr=False)


_SINGLE_USE = ("Dynamo inlines a body called once "
               "(torch._dynamo.config.inline_single_use_invoke_subgraph)")


@dataclass
class BlockBodies:
    """What :func:`wrap_repeated_blocks` decided for one sharded model."""

    groups: list[BlockGroup] = field(default_factory=list)
    fallbacks: list[BlockFallback] = field(default_factory=list)
    # pack_blocks=True: groups whose blocks read their parameters one by one all the same
    # (the first member named), and why.
    unpacked: list[BlockFallback] = field(default_factory=list)
    # Blocks found inline at compile time (hooks or classes changed after shard), logged once
    # per model however many regions compile them.
    reported: set[str] = field(default_factory=set, repr=False)
    # The sharded model (weakly), recorded by ``seal``: the backend reads its blocks' layouts.
    root: Callable[[], nn.Module | None] = field(default=lambda: None, repr=False)

    def report_inline(self, module: str, reason: str) -> None:
        """Log once that group member ``module`` compiles inline after all, and why."""
        if module not in self.reported:
            self.reported.add(module)
            log.info("shardc: block %s compiles inline (no shared body): %s", module, reason)

    def inline_reason(self, module: str) -> str:
        """Why group member ``module``'s traced forward did not call its body."""
        root = self.root()
        block = root.get_submodule(module) if root is not None else None
        if block is not None and module_layout(block) != getattr(block, "_shardc_layout", None):
            return "its hooks or module classes changed after shardc.shard"
        group = self.group_of(module)
        if group is not None and group.varying:
            differ = ", ".join(sorted(_dotted(path, attr) for path, attr in group.varying))
            if group.varying_read:
                return (f"its forward reads {', '.join(sorted(group.varying_read))}, whose "
                        f"values differ among its group's blocks ({differ}), and one shared "
                        "body is traced from the first block")
            if _torch.dynamo_inlines_single_use_subgraphs():
                # Not probed: it called a body traced from its own skeleton, whose trace
                # differed from every other block's, and Dynamo inlines a body called once.
                return (f"its group's blocks differ in {differ}; this call could not be probed "
                        "for reads of them (symbolic sizes, or an op meta tensors do not "
                        "support), so it called a body traced from its own values, which no "
                        "other block's trace equals (its forward reads them, or its arguments "
                        f"differ), and {_SINGLE_USE}")
            return (f"its group's blocks differ in {differ}, and this call could not be probed "
                    "for reads of them (symbolic sizes, or an op meta tensors do not support)")
        probed = [] if group is None else [group.prober] + (
            [group.packed.prober] if group.packed is not None else [])
        probed = [p for p in probed if p is not None]
        for key in OWN_FORWARD:
            detail = next((p.own_forward[key] for p in probed if key in p.own_forward), None)
            if detail is not None:
                return "its forward " + own_forward_reason(key, detail)
        # A block that reads its shards packed called the packed bodies, described by their
        # own prober.
        prober = None if group is None else (
            group.packed.prober if group.packed is not None and block is not None
            and getattr(block, LEAF_ATTR, None) is not None else group.prober)
        if (prober is not None and _torch.dynamo_inlines_single_use_subgraphs()
                and sum(1 for k in prober.keys.values() if k > 0) > 1):
            # Its call was described apart from the others (its input does not require grad,
            # say: the first block's): a body called once, which Dynamo inlines.
            return ("its call differs from its group's other calls (the arguments' shapes, "
                    "dtypes or requires_grad), so its body would be called once, and "
                    f"{_SINGLE_USE}")
        if _torch.traces_floats_symbolically():
            # Dynamo lifts a symbolic float read inside a nested_compile_region body into the
            # root graph and fails (torch 2.11-2.13: "lift_tracked_freevar_to_input").
            return ("torch.compile(dynamic=True) traces its float attributes as symbols, which "
                    "a shared body cannot take (torch._dynamo.config.specialize_float=True "
                    "keeps compile-once)")
        # Or Dynamo broke the graph inside the body, which then runs eagerly (said in the log
        # when it does: shardc.sharding.eager_body).
        return ("its inputs have sizes known only at run time (unbacked symbolic sizes: tokens "
                "routed to one expert, or a slice under dynamic shapes), which one shared body "
                "cannot take, or Dynamo broke the graph inside the block (then its body runs "
                "eagerly, said in the log)")

    def group_of(self, module: str) -> BlockGroup | None:
        return next((g for g in self.groups if module in g.members), None)

    def block_of_param(self, fqn: str) -> tuple[str, str] | None:
        """The block (module name, type) of a group that owns parameter ``fqn``, or None."""
        for group in self.groups:
            for member in group.members:
                if fqn.startswith(member + "."):
                    return member, group.block_type
        return None


def _refusal(block: nn.Module, shared: set[int], special: set[int]) -> str | None:
    """Why ``block`` cannot run as a body, or None."""
    for name, sub in block.named_modules():
        where = f" (submodule {name!r})" if name else ""
        if (sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks
                or sub._backward_pre_hooks or getattr(sub, "_forward_hooks_with_kwargs", None)):
            return f"it has module hooks{where}; the body's copy would not run them"
        if parametrize.is_parametrized(sub):
            return f"it is parametrized{where}"
        if getattr(sub, "track_running_stats", False):
            return f"its forward updates buffers (running statistics){where}"
        for attr, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and attr not in ("_parameters", "_buffers"):
                return f"it holds a tensor attribute {attr!r}{where} that is no parameter or buffer"
    writes = context_writes(block)
    if writes:
        return (f"its forward sets the context variable {writes[0].describe()}: Dynamo cannot "
                "trace ContextVar.set (a graph break), which a shared body cannot hold")
    for pname, p in tree_parameters(block, remove_duplicate=False):
        if id(p) in shared:
            return f"its parameter {pname!r} is shared with another module"
        if id(p) in special:
            return f"its parameter {pname!r} is gathered in FP8 or tensor-parallel"
    return None


def tree_parameters(block: nn.Module, remove_duplicate: bool = True):
    """``block``'s parameters named by their paths in its module tree, as the root model's
    ``named_parameters()`` names them below the block: ``nn.Module.named_parameters`` itself,
    not an override. torch's ``checkpoint_wrapper`` (torchtitan's activation checkpointing)
    strips its ``_checkpoint_wrapped_module.`` prefix from the names its own
    ``named_parameters`` gives, so a group's names did not match the model's: ``shardc.shard``
    failed with a ``KeyError`` on every model whose blocks it wrapped (s75)."""
    return nn.Module.named_parameters(block, remove_duplicate=remove_duplicate)


def _attr_signature(sub: nn.Module, scalar_values: bool) -> tuple:
    """The public attributes of ``sub``: plain values by value (scalars by type only without
    ``scalar_values``: see the module docstring), anything else by identity."""
    items = []
    for attr, value in sorted(vars(sub).items()):
        if attr.startswith("_") or attr == "training":
            continue
        if not scalar_values and type(value) in _VARYING_TYPES:
            items.append((attr, type(value).__name__))
        elif _plain(value):
            items.append((attr, repr(value)))
        else:
            items.append((attr, *(_callable_signature(value, sub) or ("id", id(value)))))
    return tuple(items)


def _plain(value) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, tuple)
                                         and all(isinstance(v, _PLAIN) for v in value))


def _callable_signature(value, owner: nn.Module) -> tuple | None:
    """A callable attribute that each block makes for itself, by what it calls: a
    ``functools.partial`` of one function with plain arguments (transformers' ``GELUTanh``:
    ``partial(F.gelu, approximate="tanh")`` per instance) or a method bound to ``owner`` itself
    (by its function). None for anything else (compared by identity)."""
    if isinstance(value, functools.partial):
        keywords = tuple(sorted(value.keywords.items()))
        parts = [_argument_signature(v, owner) for v in (*value.args, *(v for _, v in keywords))]
        if all(part is not None for part in parts):
            return ("partial", id(value.func), tuple(k for k, _ in keywords), tuple(parts))
        return None
    if isinstance(value, types.MethodType) and value.__self__ is owner:
        return ("own method", id(value.__func__))
    return None


def _argument_signature(value, owner: nn.Module) -> tuple | None:
    """An argument of a partial attribute (:func:`_callable_signature`): a plain value by value,
    a function defined once (a module's, shared by every block: no closure) by identity, a
    partial of such by what it calls (torch's ``checkpoint_wrapper`` keeps
    ``partial(checkpoint, context_fn=partial(create_selective_checkpoint_contexts, policy))`` in
    each wrapper); None for anything else."""
    if _plain(value):
        return ("plain", repr(value))
    if isinstance(value, types.FunctionType) and value.__closure__ is None:
        return ("function", id(value))
    if isinstance(value, functools.partial):
        return _callable_signature(value, owner)
    return None


def _scalar_values(block: nn.Module) -> dict[tuple[str, str], str]:
    """``{(submodule, attribute): repr(value)}`` of ``block``'s public scalar attributes."""
    return {(name, attr): repr(value) for name, sub in block.named_modules()
            for attr, value in vars(sub).items()
            if not attr.startswith("_") and attr != "training" and type(value) in _VARYING_TYPES}


def varying_attributes(blocks: list[nn.Module]) -> frozenset[tuple[str, str]]:
    """The ``(submodule, attribute)`` scalars whose values differ among ``blocks`` (one
    signature: the same scalar attributes, of the same types)."""
    values = [_scalar_values(b) for b in blocks]
    return frozenset(k for k in values[0] if any(v[k] != values[0][k] for v in values[1:]))


def _dotted(path: str, attr: str) -> str:
    return f"{path}.{attr}" if path else attr


def block_signature(block: nn.Module, infos: dict, scalar_values: bool = True) -> tuple:
    """What must be equal for two blocks to share one compiled body: the class tree (checkpoint
    wrapping included), attribute values, parameters (shape, dtype, sharding options but not
    their names in the model) and buffers. Without ``scalar_values`` scalar attributes count by
    type only (blocks identical but for those: see the module docstring)."""
    modules = tuple((name, type(sub).__qualname__, type(sub).__module__, sub.training,
                     _attr_signature(sub, scalar_values)) for name, sub in block.named_modules())
    params = []
    for name, p in tree_parameters(block):
        info = infos.get(id(p))
        options = None if info is None else (info.compute_dtype, info.reduce_dtype,
                                              info.reshard_after_forward, info.world,
                                              info.group_name, info.replicate)
        params.append((name, tuple(p.shape), p.dtype, p.requires_grad, options))
    buffers = tuple((name, tuple(b.shape), b.dtype) for name, b in block.named_buffers())
    return modules, tuple(params), buffers


def _skeleton(block: nn.Module) -> nn.Module:
    """An unsharded copy of ``block`` whose parameters and buffers are meta tensors (the body
    substitutes the real ones): no storage is copied."""
    memo: dict[int, object] = {}
    for p in block.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in block.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    skeleton = internal_deepcopy(block, memo)
    if isinstance(getattr(type(block), "gradient_checkpointing", None), bool):
        # transformers' GradientCheckpointingLayer checkpoints a layer's own call (in its
        # __call__; since transformers 5.25 in a wrapper of its class's forward, which the class
        # shardc swaps in gets too): the live block does that around the gathers and the body
        # call. The body's copy must not checkpoint again inside the body: a recompute nested in
        # the recompute, and a region inside the body that Dynamo cannot leave (a side effect
        # there, as the kernels package's attention wrapper makes, failed the compile, s47).
        skeleton.gradient_checkpointing = False
    return skeleton


def substitution_slots(skeleton: nn.Module, names: tuple[str, ...]
                       ) -> tuple[tuple[dict, str], ...]:
    """For each dotted parameter or buffer name of ``skeleton``, the table that holds it (its
    submodule's ``_parameters`` or ``_buffers``) and its key there: where
    :func:`call_substituted` puts the tensor that stands for it."""
    slots = []
    for name in names:
        path, _, attr = name.rpartition(".")
        module = skeleton.get_submodule(path)
        slots.append((module._parameters if attr in module._parameters else module._buffers,
                      attr))
    return tuple(slots)


def call_substituted(skeleton: nn.Module, slots: tuple[tuple[dict, str], ...],
                     tensors: tuple, args: tuple, kwargs: dict):
    """``skeleton(*args, **kwargs)`` with ``tensors[i]`` in ``slots[i]`` for the call and the
    skeleton's own tensors put back after it: ``torch.func.functional_call`` for a skeleton whose
    tensors are untied, with the tables found once (:func:`substitution_slots`). Traced by
    Dynamo once per body, where functional_call's walk of the module tree (``named_modules``,
    the swap's checks per name, the untying) was most of the body's interpreted instructions.
    Run eagerly (Dynamo could not trace the body), the call runs a copy of the skeleton that
    keeps the tensors, which a checkpoint inside the block recomputes with in the backward
    (:mod:`shardc.sharding.eager_body`)."""
    if not torch.compiler.is_compiling():
        return substituted_copy(skeleton, slots, tensors)(*args, **kwargs)
    originals = []
    for slot, tensor in zip(slots, tensors):  # a plain loop: traced by Dynamo (see describe)
        table, attr = slot
        originals.append(table[attr])
        table[attr] = tensor
    try:
        return skeleton(*args, **kwargs)
    finally:
        for slot, original in zip(slots, originals):
            table, attr = slot
            table[attr] = original


# A body's output that is one of its tensor arguments (T5's layers return the position bias
# they were given): torch refuses a region output aliasing an input, so the guard-based bodies
# return such an output as None beside where it came from, and the wrapped forward puts the
# argument itself back (no copy). Keyed bodies never see one: their prober gives such a call no
# key. The mark is a constant of the traced output; no block returns it as its first value.
_PASSED = -731_415_926


def take_out_passed_inputs(out, args: tuple, kwargs: dict):
    """``out`` as a body returns it (traced inside the body): unchanged, or, where it is a tuple
    or list with an element that *is* a tensor of ``args`` or a value of ``kwargs``,
    ``(_PASSED, "tuple" or "list", out's elements with None there, ((element, argument),
    ...))``, arguments numbered over ``args`` then ``kwargs``' values."""
    if type(out) is not tuple and type(out) is not list:
        return out
    inputs = [*args, *kwargs.values()]
    items, where = [], []
    for i, item in enumerate(out):  # plain loops: traced by Dynamo (see describe)
        found = -1
        if isinstance(item, torch.Tensor):
            for j, value in enumerate(inputs):
                if value is item:
                    found = j
                    break
        items.append(None if found >= 0 else item)
        if found >= 0:
            where.append((i, found))
    if not where:
        return out
    return (_PASSED, type(out).__name__, tuple(items), tuple(where))


def put_back_passed_inputs(result, args: tuple, kwargs: dict):
    """A body's ``result`` as the block returns it: :func:`take_out_passed_inputs` undone with
    the call's own ``args`` and ``kwargs`` (traced in the wrapped forward)."""
    if type(result) is not tuple or len(result) != 4 or type(result[0]) is not int \
            or result[0] != _PASSED:
        return result
    _, kind, items, where = result
    items = list(items)
    inputs = [*args, *kwargs.values()]
    for i, j in where:
        items[i] = inputs[j]
    return tuple(items) if kind == "tuple" else items


# Arguments that share a storage (GPT-J's rotary ``(sin, cos)``: two halves of one tensor):
# torch refuses a region whose inputs alias each other, so the wrapped forward passes a copy of
# each such tensor after the first, found at trace time from the fake values (one ``comptime``
# per call; what it found is read by the constant-result function below).
_ALIASED: list[tuple] = [()]


def _record_aliased_arguments(ctx) -> None:
    """Run by Dynamo at trace time (``comptime``): the positions of the tensors of the local
    ``arguments`` that share a storage with an earlier, other tensor (one tensor passed twice
    is one input of the region: not copied)."""
    first, later = {}, []
    try:
        found = _torch.traced_storages(ctx, "arguments")
    except Exception as exc:  # Dynamo's internals moved: copy nothing (torch then says why)
        log.debug("shardc: the block's arguments could not be read at trace time (%s)", exc)
        found = []
    for position, storage, node in found:
        if first.setdefault(storage, node) is not node:
            later.append(position)
    _ALIASED[0] = tuple(later)


@torch.compiler.assume_constant_result
def _aliased_positions() -> tuple:
    found, _ALIASED[0] = _ALIASED[0], ()
    return found


def without_aliased_arguments(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with a copy of each tensor (an item, or an item of a tuple or list
    item) that shares its storage with another tensor before it (traced in the wrapped
    forward)."""
    arguments = (*args, *kwargs.values())
    if len(arguments) < 2 and not (arguments and type(arguments[0]) in (tuple, list)):
        return args, kwargs  # one tensor cannot alias another: no trace-time read
    _torch.comptime(_record_aliased_arguments)
    copies = _aliased_positions()
    if not copies:
        return args, kwargs
    items = list(arguments)
    for i, j in copies:
        if j < 0:
            items[i] = items[i].clone()
        else:
            inner = list(items[i])
            inner[j] = inner[j].clone()
            items[i] = type(items[i])(inner)
    return tuple(items[:len(args)]), dict(zip(kwargs.keys(), items[len(args):]))


def _passes_an_input(out, args: tuple, kwargs: dict) -> bool:
    """Whether a probe's output is a tuple or list holding one of its tensor arguments."""
    return take_out_passed_inputs(out, args, kwargs) is not out


def _make_body(skeleton: nn.Module, group: BlockGroup, training: bool,
               layout: PackedLayout | None = None
               ) -> tuple[Callable, Callable | None, Callable | None]:
    """The bodies for one training mode: guard-based, keyed, and keyed with flat arguments
    (both None before torch 2.13). With ``layout``, their one weight is the block's gathered
    packed buffer, unpacked first."""
    names = group.weight_names + group.buffer_names
    n_weights = len(group.weight_names) if layout is None else 1
    n_inputs = n_weights + len(group.buffer_names)
    skeleton.train(training)

    slots = substitution_slots(skeleton, names)

    # Two functions, not one testing ``layout``: Dynamo would guard the closure cell.
    if layout is None:
        def shardc_block_body(weights, buffers, args, kwargs):
            return take_out_passed_inputs(
                call_substituted(skeleton, slots, (*weights, *buffers), args, kwargs),
                args, kwargs)
    else:
        def shardc_block_body(weights, buffers, args, kwargs):
            return take_out_passed_inputs(
                call_substituted(skeleton, slots, (*layout.unpack(weights[0]), *buffers),
                                 args, kwargs), args, kwargs)

    def shardc_block_body_keyed(key, weights, buffers, args, kwargs):
        return shardc_block_body(weights, buffers, args, kwargs)

    def shardc_block_body_keyed_flat(key, *tensors):
        return shardc_block_body(tensors[:n_weights], tensors[n_weights:n_inputs],
                                 tensors[n_inputs:], {})

    name = f"shardc_block_body_{group.index}_{group.block_type}"
    if layout is not None:
        name += "_packed"
    shardc_block_body.__qualname__ = name
    shardc_block_body_keyed.__qualname__ = name + "_keyed"
    shardc_block_body_keyed_flat.__qualname__ = name + "_keyed_flat"
    return (_torch.nested_compile_region(shardc_block_body),
            _torch.keyed_compile_region(shardc_block_body_keyed),
            _torch.keyed_compile_region(shardc_block_body_keyed_flat))


# ----------------------------------------------------------------------------------------------
# Reuse keys. Dynamo traces every call of a guard-based body (its reuse needs a body without side
# effects, and the body's swap of the skeleton's parameters is one), which made the trace grow
# with depth.
# A keyed body is traced once per key and stamped out for the other calls; the key must then
# stand for everything the trace depends on. It is computed in two steps: while Dynamo traces the
# wrapped forward, ``describe`` turns the body's arguments into a constant (symbolic sizes by
# their expressions, below; None if a size is known only at run time or an argument is of a
# type it does not know, and the guard-based body is used); then
# ``BodyProber.key`` runs eagerly, at trace time, on that constant (through
# torch.compiler.assume_constant_result): it runs the block's forward on meta tensors of those
# shapes and returns 0 unless the output is a tensor or a list/tuple of tensors, which torch
# requires of a keyed region (it raises, rather than re-traces, otherwise).

_TENSOR = "tensor"
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)
_static = _torch.has_static_value  # a module global: one lookup per size in traced code
_PROBER_IDS = itertools.count(1)
# Reuse keys, numbered across every group and model of the process: Dynamo finds a keyed body's
# earlier trace by the body function's code object and the key alone, and every group's keyed
# body is the same nested function (one code object, other closures). Keys numbered per group
# made the first description of two groups in one compiled frame share key 1, so Dynamo
# stamped the first group's trace out for the second (an encoder and a decoder ModuleList).
_REUSE_KEYS = itertools.count(1)
# The key of a call whose forward reads a scalar that differs among its group's members: the
# call runs its block's own forward (0 is "no key": a guard-based body).
READS_VARYING = -1
# The key of a packed call whose forward leaves a weight out of its gradient's graph (a
# parameter the block does not use, or uses only in another mode): read packed, the block's one
# gradient would hand that parameter zeros where autograd leaves its .grad None (an optimizer
# then steps it: AdamW's weight decay, Adam's momentum), so the call reads the block's
# parameters one by one, as ``pack_blocks=False`` does.
LEAVES_A_WEIGHT = -2
# The key of a call whose forward changes a buffer or an argument in place (a counter, a
# running average): torch's invoke_subgraph refuses a body that mutates its inputs in training,
# so the call runs its block's own forward, traced into the region (where AOTAutograd keeps the
# mutation).
MUTATES_AN_INPUT = -3
# The key of a call whose forward runs an op at which Dynamo breaks the graph (a data-dependent
# output shape, ``nonzero`` in an MoE's expert loop; ``.item()``): Dynamo cannot break the graph
# inside a body (``UncapturedHigherOrderOpError``), so the call runs its block's own forward,
# where Dynamo breaks the graph as it does without shardc.
BREAKS_THE_GRAPH = -4
# The key of a call with gradients whose forward computes with complex tensors (a complex
# rotary embedding: ``view_as_complex``, a complex multiply): its backward takes a conjugated
# tensor saved by the forward, and torch's ``invoke_subgraph`` has no kernel for the Conjugate
# dispatch key (torch 2.13: "could not find kernel for HigherOrderOperator invoke_subgraph at
# dispatch key DispatchKey.Conjugate", plain ``nested_compile_region`` too), so the call runs
# its block's own forward.
COMPUTES_COMPLEX = -5
# The keys of calls that run their block's own forward, in the order an inline reason names them.
OWN_FORWARD = (BREAKS_THE_GRAPH, COMPUTES_COMPLEX, MUTATES_AN_INPUT)


def own_forward_reason(key: int, detail: str) -> str:
    """Why a call with key ``key`` (one of :data:`OWN_FORWARD`) runs its block's own forward,
    as a predicate of "a call" or "its forward"; ``detail``: the op it saw, where it names
    one."""
    if key == BREAKS_THE_GRAPH:
        return (f"runs {detail}, at which Dynamo breaks the graph (its output's shape or value "
                "depends on the data), which it cannot do inside a shared body "
                "(UncapturedHigherOrderOpError)")
    if key == COMPUTES_COMPLEX:
        return (f"computes with complex tensors ({detail}) with gradients, whose backward "
                "torch's invoke_subgraph cannot run in a shared body (no kernel for the "
                "Conjugate dispatch key)")
    return ("changes a buffer or an argument in place, which torch's invoke_subgraph refuses "
            "in a shared body in training")
_PROBERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def describe(value) -> tuple | None:
    """A constant standing for ``value`` in a reuse key (traced by Dynamo), or None."""
    # Dynamo traces this at every block call, so it is written for Dynamo: plain loops, no
    # generator expressions (each generator step is inlined at a cost; torch 2.11: generators
    # were most of the wrapped forward's trace), and plain tensors described inside the loop
    # over a sequence (_describe_items), not in an inlined call each (a block's weights).
    if isinstance(value, (tuple, list)):
        items = _describe_items(value)
        return None if items is None else (type(value).__name__, items)
    if isinstance(value, torch.Tensor):
        items = _describe_items((value,))
        return None if items is None else items[0]
    if value is None or isinstance(value, (bool, float, str)):
        return ("const", value)
    if isinstance(value, int):
        return ("const", value) if _static(value) else _symbolic_item(value)
    if isinstance(value, dict):
        pairs = []
        for k, v in value.items():
            d = describe(v) if isinstance(k, str) else None
            if d is None:
                return None
            pairs.append((k, d))
        return ("dict", tuple(pairs))
    return None


def _describe_tensor_call(args: tuple) -> tuple | None:
    """:func:`describe` of ``(args, {})`` for ``args`` of tensors only (the usual block call),
    without walking the structure (traced by Dynamo at every block)."""
    items = _describe_items(args)
    return None if items is None else ("tuple", (("tuple", items), ("dict", ())))


_CALL: list = [None]  # what _record_tensor_call recorded, taken by _recorded_tensor_call
# Descriptions recorded at trace time, by number (``_CALLS[n - 1]``). The traced code holds the
# number only: a description handed to Dynamo as a constant tuple is wrapped item by item (about
# 50 variables per block call), where one number is one.
_CALL_NUMBERS: dict[tuple, int] = {}
_CALLS: list[tuple] = []


def _record_tensor_call(ctx) -> None:
    """Run by Dynamo at trace time (``comptime``): :func:`_describe_tensor_call` of the traced
    local ``args`` computed from its fake values, where every item is a plain tensor with static
    sizes (else None: the caller describes the call in traced code)."""
    # Each item as _describe_items builds a static plain tensor's (built apart on purpose: the
    # traced loop there must not inline a helper call per tensor); a test keeps the two equal.
    values = _torch.traced_plain_tensors(ctx, "args", _PLAIN_TENSORS)
    _CALL[0] = None if values is None else ("tuple", (("tuple", tuple(
        (_TENSOR, tuple(v.shape), v.stride(), v.dtype, v.device.type, v.device.index,
         v.requires_grad) for v in values)), ("dict", ())))


@torch.compiler.assume_constant_result
def _recorded_tensor_call() -> int:
    """The number of what :func:`_record_tensor_call` recorded just before (run at trace
    time), taken; 0 where nothing was recorded. :func:`call_description` turns it back."""
    call, _CALL[0] = _CALL[0], None
    if call is None:
        return 0
    number = _CALL_NUMBERS.get(call)
    if number is None:
        _CALLS.append(call)
        number = _CALL_NUMBERS[call] = len(_CALLS)
    return number


def call_description(call: tuple | int) -> tuple:
    """:func:`describe` of a block call's ``(args, kwargs)`` from what the wrapped forward holds:
    the description itself, or the number :func:`_recorded_tensor_call` gave it."""
    return _CALLS[call - 1] if isinstance(call, int) else call


def _describe_items(values) -> tuple | None:
    """:func:`describe` of each of ``values``, or None if any is None."""
    items = []
    for v in values:
        if type(v) in _PLAIN_TENSORS:
            shape, stride = tuple(v.shape), v.stride()
            # One check for all: a sum of sizes and strides (none negative) is static only if
            # each term is; Dynamo folds the sum of static ones, where a loop of checks cost
            # it about 60 instructions per tensor.
            if not _static(sum(shape) + sum(stride)):
                symbolic = _symbolic_item(v)
                if symbolic is None:
                    return None
                items.append(symbolic)
                continue
            items.append((_TENSOR, shape, stride, v.dtype, v.device.type, v.device.index,
                          v.requires_grad))
        elif isinstance(v, torch.Tensor):
            return None  # subclasses: their metadata is more than sizes and dtype
        else:
            d = describe(v)
            if d is None:
                return None
            items.append(d)
    return tuple(items)


# Symbolic sizes (dynamic shapes). A value with a symbolic size is described by a number for
# its description in symbolic expressions (``_torch.symbolic_signature``), taken at trace time
# through Dynamo's comptime: equal numbers, equal symbols, so equal sizes in every run. Only
# with keyed bodies (torch 2.13+), which then trace a dynamic call once per key too; torch 2.11
# and 2.12 keep the guard-based body for such calls (their trace-once path needs static sizes).
_SYMBOLIC = "symbolic"
_SYMBOLIC_KEYS = _torch.supports_keyed_regions()
_SYMBOLS: dict[tuple, int] = {}  # a symbolic description -> its number
_SYMBOL_HINTS: dict[int, tuple] = {}  # its number -> (description, the hints of its last use)
_RECORDED: list = [None]  # what the last comptime recorded, taken by _symbolic_number


def _record_symbolic(ctx) -> None:
    """Run by Dynamo at trace time (``comptime``): describe ``_symbolic_item``'s ``value``."""
    _RECORDED[0] = _torch.symbolic_signature(ctx.get_local("value").as_fake())


@torch.compiler.assume_constant_result
def _symbolic_number() -> int:
    """The number of what ``_record_symbolic`` recorded just before (0: not describable); run at
    trace time."""
    signed, _RECORDED[0] = _RECORDED[0], None
    if signed is None:
        return 0
    number = _SYMBOLS.setdefault(signed[0], len(_SYMBOLS) + 1)
    _SYMBOL_HINTS[number] = signed
    return number


def _symbolic_item(value) -> tuple | None:
    """:func:`describe` of a tensor or ``int`` with a symbolic size or value, or None (traced by
    Dynamo; ``value`` is read by name at trace time)."""
    if not _SYMBOLIC_KEYS:
        return None
    _torch.comptime(_record_symbolic)
    number = _symbolic_number()
    return None if number == 0 else (_SYMBOLIC, number)


def _meta_value(desc: tuple):
    kind, *rest = desc
    if kind == _SYMBOLIC:  # probed at the sizes the symbols have now
        (what, *parts), hints = _SYMBOL_HINTS[rest[0]]
        if what == "symint":
            return hints
        _, _, dtype, _, _, requires_grad = parts
        return torch.empty_strided(hints[0], hints[1], dtype=dtype, device="meta",
                                   requires_grad=requires_grad)
    if kind == _TENSOR:
        shape, stride, dtype, _, _, requires_grad = rest
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta",
                                   requires_grad=requires_grad)
    if kind == "const":
        return rest[0]
    if kind == "dict":
        return {k: _meta_value(d) for k, d in rest[0]}
    items = [_meta_value(d) for d in rest[0]]
    return tuple(items) if kind == "tuple" else items


def _tensor_output(out) -> bool:
    return isinstance(out, torch.Tensor) or (
        isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out))


class BodyProber:
    """Reuse keys of one group's keyed bodies (:func:`reuse_key`): one meta-device run of the
    block's forward per distinct description, and a number of its own for each eligible one."""

    def __init__(self, skeleton: nn.Module, group: BlockGroup,
                 layout: PackedLayout | None = None) -> None:
        self.skeleton = skeleton  # its own copy: probed eagerly while Dynamo traces the others
        self.names = group.weight_names + group.buffer_names
        self.layout = layout
        # A gathered weight's shape is its parameter's full shape, the same in every block of
        # the group (block_signature): the traced description carries only what can differ.
        # Packed: the one weight is the gathered buffer.
        self.weight_shapes = ((layout.world * layout.numel,),) if layout is not None else tuple(
            tuple(skeleton.get_parameter(n).shape) for n in group.weight_names)
        self.keys: dict[tuple, int] = {}
        self.uid = next(_PROBER_IDS)  # distinguishes groups of several models in one process
        # Passed to trace-time functions by number: torch 2.11's Dynamo passes only constants.
        _PROBERS[self.uid] = self
        self.group = group
        self.reads: list[str] = []  # the varying attributes the probes read, in order
        # Packed: the weights some probed call's gradient did not reach (LEAVES_A_WEIGHT).
        self.leaves_weights: set[str] = set()
        # The OWN_FORWARD keys some probed call got, each with what the first one saw.
        self.own_forward: dict[int, str] = {}
        if group.varying:
            _record_varying_reads(skeleton, group.varying, self.reads)

    def key(self, desc: tuple) -> int:
        if desc not in self.keys:
            self.keys[desc] = self._probe(desc)
        return self.keys[desc]

    def _probe(self, desc: tuple) -> int:
        training, _, _, weight_state, _, arguments = desc
        buffers, args, kwargs = _meta_value(arguments)
        weights = [torch.empty(shape, dtype=dtype, device="meta", requires_grad=requires_grad)
                   for shape, (dtype, _, requires_grad) in zip(self.weight_shapes, weight_state)]
        if self.layout is not None:
            weights = self.layout.unpack(weights[0])
        self.skeleton.train(training)
        varying = bool(self.group.varying)
        read_before = len(self.reads)
        given = _flat_tensors((args, kwargs), list(buffers))
        versions = [_torch.tensor_version(t) for t in given]
        # Packed, a call with gradients is probed with them too: which weights its outputs'
        # gradients reach (see LEAVES_A_WEIGHT).
        packed_grads = self.layout is not None and desc[1]
        ops = _ProbedOps()
        try:
            # A group whose blocks differ in scalars is probed in the call's own grad mode: a
            # read of one must be seen on the path the trace takes.
            with torch.set_grad_enabled(desc[1] and (varying or packed_grads)), \
                    _torch.op_watch(ops.run):
                out = torch.func.functional_call(
                    self.skeleton, dict(zip(self.names, (*weights, *buffers))), args, kwargs)
        except _BreaksTheGraph as exc:
            return self._runs_own_forward(BREAKS_THE_GRAPH, exc.op)
        except Exception as exc:  # an op meta tensors do not support: trace every call
            log.debug("shardc: block body probe failed (%s); its calls are traced each", exc)
            return 0
        if desc[1] and (ops.complex or any(t.is_complex() for t in _flat_tensors(out, []))):
            return self._runs_own_forward(COMPUTES_COMPLEX, ops.complex or "its output")
        if any(_torch.tensor_version(t) != v for t, v in zip(given, versions)):
            return self._runs_own_forward(MUTATES_AN_INPUT, "")
        if varying and len(self.reads) > read_before:
            read = sorted(set(self.reads[read_before:]))
            self.group.varying_read.update(read)
            log.info("shardc: blocks %s ... %s run their own forwards: it reads %s, which "
                     "differ among them", self.group.members[0], self.group.members[-1],
                     ", ".join(read))
            return READS_VARYING
        if packed_grads:
            left = _weights_left_out(out, weights, self.names)
            if left:
                if not self.leaves_weights:
                    log.info("shardc: blocks %s ... %s read their parameters one by one where "
                             "a call's gradient does not reach %s (pack_blocks would hand them "
                             "zeros, not None)", self.group.members[0], self.group.members[-1],
                             ", ".join(left))
                self.leaves_weights.update(left)
                return LEAVES_A_WEIGHT
        if not _tensor_output(out) or _passes_an_input(out, args, kwargs):
            return 0  # a keyed region returns tensors, none of them an input
        # Numbered, not hashed: two descriptions never share a key (a hash could collide), nor
        # do two groups' descriptions (_REUSE_KEYS).
        return next(_REUSE_KEYS)

    def _runs_own_forward(self, key: int, detail: str) -> int:
        """Record that a call gets ``key`` (one of :data:`OWN_FORWARD`), said once per key."""
        if key not in self.own_forward:
            self.own_forward[key] = detail
            log.info("shardc: blocks %s ... %s run their own forwards: a call %s",
                     self.group.members[0], self.group.members[-1],
                     own_forward_reason(key, detail))
            if key == BREAKS_THE_GRAPH:
                _warn_recompile_limit(self.group.members)
                _warn_rank_dependent_regions(
                    self.group.members, detail, _world_size(),
                    _torch.captured_data_dependent_ops_run_in_bodies())
        return key


def _warn_recompile_limit(members: list[str]) -> None:
    """Warn where Dynamo will stop compiling some of ``members``' forwards: a block whose
    forward breaks the graph has the functions around the break compiled once per block
    (shardc gives each block's modules classes of their own, which Dynamo's guards tell apart),
    and past ``recompile_limit`` entries Dynamo runs the rest eagerly (correct, slower: s73,
    transformers' DBRX at 12 layers compiled 4 of its blocks;
    docs/bench/compat_s72/summary.md)."""
    limit = _torch.dynamo_recompile_limit()
    if len(members) <= limit:
        return
    warnings.warn(
        f"shardc: blocks {members[0]} ... {members[-1]} ({len(members)}) break Dynamo's graph "
        f"in their forward, which Dynamo then compiles once per block; past its recompile "
        f"limit ({limit}) it runs the remaining blocks eagerly. Set "
        f"torch._dynamo.config.recompile_limit to at least {2 * len(members)} before the first "
        f"step to compile them all", stacklevel=2)


def _world_size() -> int:
    """The default process group's size (1 without one)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _warn_rank_dependent_regions(members: list[str], op: str, world: int,
                                 capture_works: bool) -> None:
    """Warn, over more than one rank (``world``), that ``members``' forwards break Dynamo's graph
    at ``op``, a data-dependent op: the regions after the break take their shapes from each
    rank's data (an MoE's tokens per expert), so ranks may compile different regions, whose
    collectives then differ (s78: transformers' DBRX with AdamW at two ranks; shardc's plan check
    raises, and past Dynamo's recompile limit the eager rest crashed on gloo's collective
    mismatch). ``capture_works`` (torch 2.12+): with Dynamo capturing such ops the blocks run
    as an eagerly run body on weights gathered before it, the same collectives on every rank
    (DBRX at parity); the warning says so, or that this torch has no such way."""
    if world <= 1:
        return
    remedy = (
        "Set torch._dynamo.config.capture_dynamic_output_shape_ops = True and "
        "torch._dynamo.config.capture_scalar_outputs = True before the first step: the blocks "
        "then run eagerly on weights gathered before them, with the same collectives on every "
        "rank" if capture_works else
        "This torch (before 2.12) has no way around it: with Dynamo capturing the op the block "
        "fails inside its body (UncapturedHigherOrderOpError); torch 2.12 or later runs it")
    warnings.warn(
        f"shardc: blocks {members[0]} ... {members[-1]} break Dynamo's graph at {op} in their "
        f"forward, over {world} ranks: the regions after the break take their shapes from each "
        "rank's data (an MoE's tokens per expert), so ranks can compile different regions and "
        "issue different collectives (shardc's plan check then raises PlanMismatchError; "
        f"Dynamo's eager fallback can crash or hang). {remedy} (docs/support.md)", stacklevel=2)


class _BreaksTheGraph(Exception):
    def __init__(self, op: str) -> None:
        super().__init__(op)
        self.op = op


class _ProbedOps:
    """What a probe sees of the ops a block's forward runs (:func:`_torch.op_watch`): it stops
    at an op that Dynamo breaks the graph at (:class:`_BreaksTheGraph`), and notes the first
    op that takes or makes a complex tensor."""

    def __init__(self) -> None:
        self.complex: str | None = None

    def run(self, func, args: tuple, kwargs: dict):
        try:
            out = func(*args, **kwargs)
        except Exception:
            # On meta tensors (no data), an op whose output's shape or value depends on the
            # data fails where Dynamo breaks the graph.
            if _torch.dynamo_may_break_on(func):
                raise _BreaksTheGraph(str(func.overloadpacket.__name__)) from None
            raise
        if self.complex is None and any(
                t.is_complex() for t in _flat_tensors((args, kwargs, out), [])):
            self.complex = str(func.overloadpacket.__name__)
        return out


def _weights_left_out(out, weights, names: tuple[str, ...]) -> list[str]:
    """The names of ``weights`` (a probe's unpacked weights, views of one buffer that requires
    grad) that no gradient of ``out`` reaches: its autograd graph is walked, no kernel runs.
    None is said to be left out where the graph holds a custom ``autograd.Function`` (reentrant
    activation checkpointing is one): its backward may reach weights its graph does not show
    (the closure it recomputes), so the packed read stays, as it was before this check."""
    reached, stack = set(), []
    for t in _flat_tensors(out, []):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
    while stack:
        node = stack.pop()
        if node in reached:
            continue
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            return []
        reached.add(node)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    if not reached:  # no gradient at all: the packed buffer takes none either
        return []
    return [name for name, w in zip(names, weights) if w.grad_fn not in reached]


# Per block class, the subclass a prober's skeleton module takes to record reads of its varying
# attributes (:func:`_record_varying_reads`); only the prober's own copy is ever given one.
_RECORDING_CLASSES: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    if cls not in _RECORDING_CLASSES:
        def __getattr__(self, name: str):
            values = self.__dict__.get("_shardc_varying_values")
            if values is not None and name in values:
                self.__dict__["_shardc_varying_reads"].append(values[name][0])
                return values[name][1]
            return cls.__getattr__(self, name)

        _RECORDING_CLASSES[cls] = type(cls.__name__, (cls,), {"__getattr__": __getattr__,
                                                             "__module__": cls.__module__})
    return _RECORDING_CLASSES[cls]


def _record_varying_reads(skeleton: nn.Module, varying: frozenset[tuple[str, str]],
                          reads: list[str]) -> None:
    """Make ``skeleton`` (a prober's own copy) append ``"submodule.attr"`` to ``reads`` at each
    read of a ``varying`` attribute: each is moved out of its module's ``__dict__`` and served
    (with its first block's value) by the module's ``__getattr__``, which Python calls only for
    names its ``__dict__`` lacks. A read that bypasses attribute access (``vars(m)[name]``)
    fails the probe instead, which is as safe (the call runs its block's own forward)."""
    for path, attr in sorted(varying):
        sub = skeleton.get_submodule(path)
        if "_shardc_varying_values" not in sub.__dict__:  # its first varying attribute
            sub.__dict__["_shardc_varying_values"] = {}
            sub.__dict__["_shardc_varying_reads"] = reads
            sub.__class__ = _recording_class(type(sub))
        sub.__dict__["_shardc_varying_values"][attr] = (_dotted(path, attr),
                                                        sub.__dict__.pop(attr))


@torch.compiler.assume_constant_result
def _probed_key(uid: int, state: tuple, described_buffers: tuple, call: tuple | int) -> int:
    # describe((buffers, args, kwargs)), from the parts already described.
    arguments = ("tuple", (("tuple", described_buffers), *call_description(call)[1]))
    return _PROBERS[uid].key((*state, arguments))


def reuse_key(prober: BodyProber | None, training: bool, weights: tuple, buffers: tuple,
              call: tuple | int | None, identity: tuple = ()) -> int:
    """The key under which a call of ``group``'s keyed body reuses an earlier call's trace, 0
    (use a guard-based body) or ``READS_VARYING`` (the prober saw the call read a scalar that
    differs among the members). ``call`` is :func:`describe` of the call's ``(args, kwargs)``
    or its number (:func:`call_description`; None: not describable); ``identity`` the
    :func:`identity_pattern` of its buffers and argument tensors. Called while Dynamo traces
    the wrapped forward."""
    if prober is None or call is None:
        return 0
    described_buffers = _describe_items(buffers)
    if described_buffers is None:
        return 0
    autocast = (torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"))
    key = _probed_key(prober.uid, (training, torch.is_grad_enabled(), autocast,
                                   _weight_state(weights), identity), described_buffers, call)
    # A fresh constant: Dynamo's result of assume_constant_result has a source that cannot be
    # guarded, which flattening the keyed body's arguments would try.
    return key + 0


def _weight_state(weights: tuple) -> tuple:
    """What a reuse key needs of a block's gathered weights besides their shapes: each one's
    dtype, device and ``requires_grad``. The rest is fixed for the group: each weight is a
    gather's output, contiguous, of its parameter's full shape (the prober's
    ``weight_shapes``), and parameters keep their shapes (a replaced one is refused inside a
    forward). Describing them like any tensor (sizes and strides, each checked static) was a
    quarter of the instructions Dynamo interpreted per block."""
    state = []
    for w in weights:  # a plain loop: traced by Dynamo (see describe)
        state.append((w.dtype, w.device, w.requires_grad))
    return tuple(state)


# ----------------------------------------------------------------------------------------------
# Trace once without reuse_hash_fn (torch 2.11, 2.12: Dynamo traces every call of a
# nested_compile_region, shardc.ops.body_call). A *slot* is one group's reuse key (the prober's
# number for the arguments' description, grad mode, training and the pattern of identical tensor
# arguments); per Dynamo (sub)graph, its first call is traced and anchored, later calls are
# one opaque ``shardc::body_call`` node that shardc's backend turns into an ``invoke_subgraph``
# call of the first call's subgraph. Only under shardc's backend (which does the rewrite).

_FIRST, _LATER, _TRACE = 0, 1, 2
_KINDS = ("tensor", "tuple", "list")
_SLOTS: dict[tuple, int] = {}  # (prober uid, key: it holds the identity pattern) -> slot
_SLOT_KIND: dict[int, int] = {}  # slot -> index in _KINDS of the body's output structure
# Per Dynamo (sub)graph tracer: slot -> True once its first call was anchored, False if the
# slot cannot be reused there. Weak: a restarted analysis or a discarded speculation records
# into new tracers.
_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
BACKEND_MARKER = "_shardc_trace_once"


def trace_once_enabled() -> bool:
    return os.environ.get("SHARDC_TRACE_ONCE", "1") != "0"


def identity_pattern(tensors: list) -> tuple:
    """For each of ``tensors``, the position of the first one that is the same tensor (its own
    where none is). Dynamo lifts a tensor passed twice into a subgraph once, so a body traced
    for one pattern computes another function for a call with another: ``block(h, h)`` and
    ``block(h, r)`` must not share a trace, even where their tensors' descriptions are equal
    (under ``no_grad``, or where both require grad). Traced in the wrapped forward."""
    pattern = list(range(len(tensors)))
    for i in range(1, len(tensors)):
        for j in range(i):
            if tensors[j] is tensors[i]:
                pattern[i] = j
                break
    return tuple(pattern)


def _flat_tensors(value, out: list) -> list:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _flat_tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _flat_tensors(v, out)
    return out


@torch.compiler.assume_constant_result
def _trace_once_plan(uid: int, key: int) -> int:
    """``slot * 3 + mode`` for this call (mode: _FIRST, _LATER or _TRACE); run at trace time."""
    slot = _SLOTS.setdefault((uid, key), len(_SLOTS) + 1)
    tracer = _torch.current_subgraph_tracer()
    # Dynamo must hand the first call's invoke_subgraph to the backend even though the graph
    # it sees calls it once (torch 2.13 inlines single-use subgraphs by default).
    if (tracer is None or not trace_once_enabled()
            or _torch.dynamo_inlines_single_use_subgraphs()
            or not _torch.compiling_backend_marked(BACKEND_MARKER)):
        return slot * 3 + _TRACE
    seen = _SEEN.setdefault(tracer, {})
    if slot not in seen:
        return slot * 3 + _FIRST
    return slot * 3 + (_LATER if seen[slot] else _TRACE)


@torch.compiler.assume_constant_result
def _trace_once_first(slot: int, kind: int, outputs: tuple, grad: bool) -> bool:
    """After the first call of ``slot`` in the current tracer: whether later calls may reuse it
    (the outputs' metadata, from Dynamo's trace, is what ``shardc::body_call`` will claim, and
    each output requires grad exactly when the placeholder op's would); run at trace time."""
    ok = (all(o is not None and o[0] == _TENSOR and o[6] == grad for o in outputs)
          and _SLOT_KIND.setdefault(slot, kind) == kind
          and record_outputs(slot, tuple(o[1:6] for o in outputs)))
    tracer = _torch.current_subgraph_tracer()
    if tracer is not None:
        _SEEN.setdefault(tracer, {})[slot] = ok
    return ok


@torch.compiler.assume_constant_result
def _broke_the_graph(uid: int) -> bool:
    """Whether a probed call of prober ``uid``'s blocks broke Dynamo's graph (run at trace
    time: only ``uid`` is guarded)."""
    prober = _PROBERS.get(uid)
    return prober is not None and BREAKS_THE_GRAPH in prober.own_forward


@torch.compiler.assume_constant_result
def _trace_once_kind(slot: int) -> int:
    return _SLOT_KIND[slot]


def _slot_and_mode(group: BlockGroup | PackedBodies, key: str) -> tuple[int, int]:
    """The slot and mode :func:`_trace_once_plan` gives the call with reuse key ``key``."""
    plan = _trace_once_plan(group.prober.uid, int(key))
    return plan // 3, plan % 3


def _trace_once_call(group: BlockGroup | PackedBodies, training: bool, key: str, weights,
                     buffers, args, kwargs, inputs: list):
    """A body call that Dynamo traces only the first time per slot and graph (see above);
    ``group``: the bodies and prober to call (a group's, or its packed ones); ``key``: the
    call's reuse key (as :func:`shardc._torch.region_key` passes it: a string, for the same
    reason), which holds the :func:`identity_pattern` of ``inputs`` (the buffers and the
    argument tensors, flat; the weights are distinct tensors made in this forward, each its
    own gather of another parameter, so none is a buffer or an argument)."""
    flat = [*weights, *inputs]
    slot, mode = _slot_and_mode(group, key)
    if mode == _LATER:
        outs = body_call(slot, flat)
        kind = _trace_once_kind(slot)
        return outs[0] if kind == 0 else (tuple(outs) if kind == 1 else list(outs))
    out = group.bodies[training](weights, buffers, args, kwargs)
    # Read again, not kept across the body's call: where the body breaks Dynamo's graph, the
    # rest runs as a frame of its own, whose int inputs turn symbolic once they take a second
    # value (two blocks' slots), and the calls below need constants; the key string does not.
    slot, mode = _slot_and_mode(group, key)
    if mode == _TRACE:
        return out
    if type(out) is tuple:
        kind, outs = 1, list(out)
    elif type(out) is list:
        kind, outs = 2, list(out)
    else:
        kind, outs = 0, [out]
    grad = False
    if torch.is_grad_enabled():
        for t in flat:
            if t.requires_grad:
                grad = True
                break
    described = []
    for o in outs:
        described.append(describe(o) if type(o) is torch.Tensor else None)
    if not outs or not _trace_once_first(slot, kind, tuple(described), grad):
        return out
    anchored = body_anchor(slot, flat, outs)
    return anchored[0] if kind == 0 else (tuple(anchored) if kind == 1 else list(anchored))


def _read(module: nn.Module, path: tuple[str, ...]):
    """The attribute at ``path`` (a dotted name, split) of ``module``: its submodules' then the
    last one's, read by plain ``getattr`` (Dynamo traces this for every weight of every block;
    ``get_submodule`` would be traced again each time)."""
    for name in path:
        module = getattr(module, name)
    return module


def module_layout(block: nn.Module) -> tuple:
    """The classes and hook counts of ``block`` and its submodules, depth first: a block whose
    layout changed after :func:`shardc.shard` (a hook added, a parametrization registered)
    runs its own forward."""
    # Where Dynamo guards module hooks it traces this at every block (:func:`_layout_kept`):
    # plain loops over ``_modules``, no generators
    # (``nn.Module.modules()`` and a generator expression were about a seventh of the
    # instructions Dynamo interpreted for a 16-block llama).
    layout: list[tuple] = []
    pending = [block]  # depth first, children in reverse order: one frame, no recursion
    while pending:
        module = pending.pop()
        if module is None:  # a child slot set to None
            continue
        layout.append((type(module), len(module._forward_hooks),
                       len(module._forward_pre_hooks), len(module._backward_hooks),
                       len(module._backward_pre_hooks)))
        # One call, not a loop over the children: Dynamo interprets every instruction of a
        # loop body, about 11 per child.
        pending.extend(module._modules.values())
    return tuple(layout)


# Each sealed block by the key recorded on it (``_shardc_layout_key``): the traced forward hands
# Dynamo only that integer, not the recorded layout itself (see :func:`_layout_unchanged`).
_SEAL_KEYS = itertools.count(1)
_SEALED: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()


def seal(bodies: BlockBodies, root: nn.Module) -> None:
    """Record each wrapped block's :func:`module_layout` once :func:`shardc.shard` is done."""
    bodies.root = weakref.ref(root)
    for group in bodies.groups:
        for member in group.members:
            block = root.get_submodule(member)
            block._shardc_layout = module_layout(block)
            # A fresh key at every seal: a block sealed again (its layout recorded anew) fails
            # the guard on its key, so no compiled code answered for the old record.
            block._shardc_layout_key = key = next(_SEAL_KEYS)
            _SEALED[key] = block


@torch.compiler.assume_constant_result
def _layout_unchanged(layout: tuple, key: int) -> bool:
    """Whether ``layout`` (a block's live :func:`module_layout`) is the one recorded at seal
    under ``key``.

    Dynamo calls this while tracing instead of tracing it (``assume_constant_result``) and guards
    only its arguments: the live layout, which it reads from the modules anyway (their classes,
    their hook dicts: a hook added later recompiles), and the key, one integer per block. The
    recorded layout itself (a tuple of about 5 values per submodule) is not guarded, and need not
    be: it is written once per key by :func:`seal` and never changed, so the answer is a function
    of the two guarded arguments. Comparing ``module_layout(self) != self._shardc_layout`` in
    traced code made Dynamo specialize on every element of the record: about 80 guards per
    block, evaluated at every call (issue 20, docs/overhead.md "Guards per step")."""
    block = _SEALED.get(key)
    return block is not None and getattr(block, "_shardc_layout", None) == layout


@torch.compiler.assume_constant_result
def _sealed_layout_kept(key: int) -> bool:
    """Whether the block sealed under ``key`` still has the layout recorded then, computed in
    plain Python while Dynamo traces (``assume_constant_result``): nothing about the modules is
    guarded, only ``key``. Used where Dynamo does not guard module hooks (its default,
    ``skip_nnmodule_hook_guards``): a block is then checked when a region is traced, as torch
    checks the hooks of the modules it inlines, and a hook registered after that is ignored until
    something recompiles, as torch ignores it on any compiled module. Tracing the walk instead
    (:func:`_layout_unchanged`) cost about half of the instructions Dynamo interpreted per block
    and a guard per submodule's class and name (issue 18)."""
    block = _SEALED.get(key)
    return block is not None and getattr(block, "_shardc_layout", None) == module_layout(block)


def _layout_kept(block: nn.Module) -> bool:
    """Whether ``block``'s layout is the one sealed (traced by Dynamo): walked in traced code,
    with guards, only where Dynamo guards module hooks (see :func:`_sealed_layout_kept`)."""
    if _torch.guards_module_hooks():
        return _layout_unchanged(module_layout(block), block._shardc_layout_key)
    return _sealed_layout_kept(block._shardc_layout_key)


def _wrapped_forward(group: BlockGroup, original: Callable) -> Callable:
    has_data_dependent_sizes = _torch.data_dependent_size_check()
    # The members differ in scalar attributes: a call shares the body only with a reuse key,
    # i.e. once the prober ran it and saw none of them read (see the module docstring).
    needs_key = bool(group.varying)

    def forward(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            if self.__dict__.get(COUNTS_FORWARD, False):
                return counted_call(self, original, args, kwargs)
            return original(self, *args, **kwargs)
        if not _layout_kept(self) or _torch.traces_floats_symbolically():
            return original(self, *args, **kwargs)
        given = args, kwargs  # what a body's output that is an argument gives back
        args, kwargs = without_aliased_arguments(args, kwargs)
        # A description (sizes static, or symbols with hints) rules out data-dependent sizes:
        # only a call that cannot be described pays for the check.
        call = None
        if not kwargs:  # the usual call: described at trace time, not interpreted
            _torch.comptime(_record_tensor_call)
            call = _recorded_tensor_call() or None  # a number (call_description)
        tensors_only = call is not None or not kwargs and _all_tensors(args)
        if call is None:
            call = _describe_tensor_call(args) if tensors_only else describe((args, kwargs))
        if call is None and has_data_dependent_sizes(args, kwargs):
            return original(self, *args, **kwargs)
        source, weights = group, None
        if group.packed is not None:
            weights = _packed_weights(self)
            if weights is not None:
                source = group.packed
        if weights is None:
            weights = tuple([_read(self, p) for p in group.weight_paths])  # no generator
        buffers = tuple([_read(self, p) for p in group.buffer_paths])
        # The buffers and argument tensors, flat (the usual call, (h, ...): no walk).
        inputs = [*buffers, *args] if tensors_only else _flat_tensors((args, kwargs),
                                                                      list(buffers))
        identity = identity_pattern(inputs) if len(inputs) > 1 else ()
        key = reuse_key(source.prober, self.training, weights, buffers, call, identity)
        if key == LEAVES_A_WEIGHT:  # packed, it would hand a weight zeros: read one by one
            source = group
            weights = tuple([_read(self, p) for p in group.weight_paths])
            key = reuse_key(source.prober, self.training, weights, buffers, call, identity)
        if key in OWN_FORWARD:
            return original(self, *args, **kwargs)
        if key <= 0 and source.prober is not None and _broke_the_graph(source.prober.uid):
            # Not probed (no static description: torch 2.11 under dynamic shapes) where probed
            # calls broke Dynamo's graph: a body would fail at the same op inside it
            # (UncapturedHigherOrderOpError; transformers' DBRX at its recompile).
            return original(self, *args, **kwargs)
        if needs_key and key <= 0:
            if key == READS_VARYING:
                return original(self, *args, **kwargs)
            # Not probed (no static description, e.g. under dynamic shapes): the body run on
            # this member's own skeleton. Where the forward does not read what differs, the
            # members' traces are equal, and Dynamo installs one subgraph for them.
            return put_back_passed_inputs(source.member_bodies[self.training](
                self._shardc_member, weights, buffers, args, kwargs), *given)
        if key and source.keyed:
            region_key = _torch.region_key(key)
            if tensors_only:
                return source.keyed_flat[self.training](region_key, *weights, *buffers, *args)
            return source.keyed[self.training](region_key, weights, buffers, args, kwargs)
        if key and not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
            return _trace_once_call(source, self.training, _torch.region_key(key), weights,
                                    buffers, args, kwargs, inputs)
        return put_back_passed_inputs(source.bodies[self.training](weights, buffers, args,
                                                                   kwargs), *given)

    return forward


# A packed block's gather arguments (the model's gradient store key, and the gather's constant
# arguments by sync mode) by the number recorded on the block (``_shardc_packed_key``): a traced
# read hands Dynamo that one integer (guarded), not the tuple (a guard per element).
_PACKED_KEYS = itertools.count(1)
_PACKED_ARGS: dict[int, tuple[str, tuple]] = {}


def set_packed_args(block: nn.Module, sync_key: str, by_mode: tuple) -> None:
    """Record the gather arguments of ``block``'s packed read (``by_mode[mode]``: the gather's
    arguments after the shard in sync mode ``mode``)."""
    key = next(_PACKED_KEYS)
    _PACKED_ARGS[key] = (sync_key, by_mode)
    block.__dict__["_shardc_packed_key"] = key
    weakref.finalize(block, _PACKED_ARGS.pop, key, None)


@torch.compiler.assume_constant_result
def _packed_args(key: int) -> tuple[str, tuple]:
    return _PACKED_ARGS[key]


def _packed_weights(block: nn.Module) -> tuple | None:
    """``(gathered packed buffer,)`` of a block that reads its shards packed, or None (dropped:
    the block reads its parameters one by one). Traced by Dynamo."""
    leaf = getattr(block, LEAF_ATTR, None)
    if leaf is None:
        return None
    sync_key, by_mode = _packed_args(block._shardc_packed_key)
    return (GATHER_OP(leaf, *by_mode[SYNC_MODES[sync_key]]),)


# On a wrapped block that shardc.shard gave no forward hooks: its eager forward is counted by
# the wrapped forward itself (shardc.sharding.scope's count of eager forwards).
COUNTS_FORWARD = "_shardc_counts_forward"


def counted_call(block: nn.Module, forward: Callable, args: tuple, kwargs: dict):
    """``forward(block, *args, **kwargs)`` run eagerly, counted as a sharded module's forward
    as shardc's forward hooks count one (``scope.enter_forward`` / ``exit_forward``)."""
    enter_forward(block, args)
    try:
        return forward(block, *args, **kwargs)
    finally:
        exit_forward(block, args, None)


def _all_tensors(values: tuple) -> bool:
    for value in values:  # a plain loop: traced by Dynamo (see describe)
        if not isinstance(value, torch.Tensor):
            return False
    return True


def _swap_block_class(block: nn.Module, forward: Callable) -> None:
    cls = type(block)
    block.__class__ = type(f"ShardcBlock{cls.__name__}", (cls,),
                           {"forward": forward, "__module__": cls.__module__,
                            "_shardc_block": True, "_apply": _apply_block})


def _apply_block(self, fn, recurse: bool = True):
    """``nn.Module._apply`` (``to_empty``, ``.to``) of a wrapped block: a packed block packs
    its converted shards again (``shardc.sharding.packed_blocks``)."""
    owner = next(c for c in type(self).__mro__ if vars(c).get("_apply") is _apply_block)
    out = super(owner, self)._apply(fn, recurse)
    if recurse:
        repack(self)
    return out


def _add_packed_bodies(result: BlockBodies, group: BlockGroup, first: nn.Module,
                       template: nn.Module, infos_by_param: dict) -> None:
    params = [(n, p, infos_by_param[id(p)]) for n, p in tree_parameters(first)]
    reason = eligible_reason(params)
    if reason is not None:
        _not_packed(result, group, reason)
        return
    layout = PackedLayout.of(first, group.weight_names, params[0][2].world)
    group.packed = PackedBodies(layout)
    _fill_bodies(group.packed, group, template, layout)


def _not_packed(result: BlockBodies, group: BlockGroup, reason: str) -> None:
    """Record and log (once, at info level: the group trains as it would unpacked) that
    ``group``'s blocks read their parameters one by one."""
    result.unpacked.append(BlockFallback(group.members[0], reason))
    log.info("shardc: blocks %s ... %s read their parameters one by one (pack_blocks): %s",
             group.members[0], group.members[-1], reason)


def _fill_bodies(target: BlockGroup | PackedBodies, group: BlockGroup, template: nn.Module,
                 layout: PackedLayout | None = None) -> None:
    """Give ``target`` (``group`` itself, or its packed bodies with ``layout``) one body per
    training mode, made now: the wrapped forward runs under Dynamo, which must find them ready
    (and guards on the block's ``training`` to pick one); and the prober of their reuse keys
    (keyed bodies on torch 2.13+, shardc's own trace once before). Each on its own copy of the
    skeleton ``template``."""
    for training in (True, False):
        target.bodies[training], keyed, keyed_flat = _make_body(
            internal_deepcopy(template), group, training, layout)
        if keyed is not None and keyed_flat is not None:
            target.keyed[training], target.keyed_flat[training] = keyed, keyed_flat
    target.prober = BodyProber(internal_deepcopy(template), group, layout)


def _fill_member_bodies(group: BlockGroup, blocks: list[nn.Module]) -> None:
    """Give ``group`` (and its packed bodies) a member body per training mode
    (:func:`_make_member_body`) over a skeleton of each of ``blocks``: their scalars are their
    own, so a call that could not be probed for reads of ``group.varying`` is right whatever
    its forward reads. One skeleton per member and mode, shared by the plain and packed body
    (they only read it)."""
    for training in (True, False):
        skeletons = tuple(_skeleton(block).train(training) for block in blocks)
        group.member_bodies[training] = _make_member_body(skeletons, group)
        if group.packed is not None:
            group.packed.member_bodies[training] = _make_member_body(skeletons, group,
                                                                     group.packed.layout)


def _make_member_body(skeletons: tuple[nn.Module, ...], group: BlockGroup,
                      layout: PackedLayout | None = None) -> Callable:
    """A guard-based body whose first argument, a member's number, picks the skeleton it runs.
    One function for every member, not one each: torch 2.11's Dynamo deduplicates equal traces
    of one function object only (2.13's, of one code object)."""
    names = group.weight_names + group.buffer_names
    slots = tuple(substitution_slots(skeleton, names) for skeleton in skeletons)
    if layout is None:
        def shardc_block_body_member(member, weights, buffers, args, kwargs):
            return take_out_passed_inputs(
                call_substituted(skeletons[member], slots[member], (*weights, *buffers),
                                 args, kwargs), args, kwargs)
    else:
        def shardc_block_body_member(member, weights, buffers, args, kwargs):
            return take_out_passed_inputs(
                call_substituted(skeletons[member], slots[member],
                                 (*layout.unpack(weights[0]), *buffers), args, kwargs),
                args, kwargs)
    shardc_block_body_member.__qualname__ = (
        f"shardc_block_body_{group.index}_{group.block_type}_member"
        + ("_packed" if layout is not None else ""))
    return _torch.nested_compile_region(shardc_block_body_member)


def wrap_repeated_blocks(root: nn.Module, infos_by_param: dict, shared: set[int],
                         special: set[int], pack: bool = False,
                         not_packed: str | None = None) -> BlockBodies:
    """Group the children of every ``nn.ModuleList`` of ``root`` (and of every ``nn.Sequential``
    stack of identical blocks: :func:`_is_block_stack`) by :func:`block_signature` and give each
    group of two or more a body (before any class of ``root`` is swapped, so the
    skeletons are unsharded copies). ``infos_by_param``: parameter id -> ``ShardedParamInfo``;
    ``shared``: ids of parameters owned by more than one module; ``special``: ids of parameters
    gathered in FP8 or wrapped for tensor parallelism, whose blocks keep the usual path.
    ``pack``: give each group whose parameters can be packed (``packed_blocks``) the bodies
    that take the gathered packed buffer too; :func:`shardc.shard` packs their shards.
    ``not_packed``: packing was asked for but does not apply to this model (CPU offload), and
    why: each group records and logs it as a group that cannot be packed does."""
    result = BlockBodies()
    for list_name, container in root.named_modules():
        if not (isinstance(container, nn.ModuleList) and len(container) >= 2
                or _is_block_stack(container, infos_by_param)):
            continue
        by_signature: dict[tuple, list[tuple[str, nn.Module]]] = {}
        for child_name, block in container.named_children():
            fqn = f"{list_name}.{child_name}" if list_name else child_name
            if getattr(type(block), "_shardc_block", False) or not any(True for _ in
                                                                    block.parameters()):
                continue
            reason = _refusal(block, shared, special)
            if reason is not None:
                result.fallbacks.append(BlockFallback(fqn, reason))
                continue
            by_signature.setdefault(block_signature(block, infos_by_param), []).append(
                (fqn, block))
        # Blocks without an identical sibling, by their signature without scalar values: two or
        # more that differ only there (transformers' layer_idx) are one group after all, whose
        # calls share the body where the forward does not read those scalars.
        loose: dict[tuple, list[tuple[str, nn.Module]]] = {}
        for members in by_signature.values():
            if len(members) < 2:
                fqn, block = members[0]
                loose.setdefault(block_signature(block, infos_by_param, scalar_values=False),
                                 []).append((fqn, block))
                continue
            _add_group(result, members, infos_by_param if pack else None, not_packed)
        for members in loose.values():
            if len(members) < 2:
                result.fallbacks.append(BlockFallback(
                    members[0][0], "no identical sibling in its nn.ModuleList (structure, "
                    "shapes, attributes or checkpoint wrapping differ)"))
                continue
            _add_group(result, members, infos_by_param if pack else None, not_packed)
    _pack_each_parameter_once(result, root)
    for fallback in result.fallbacks:
        log.info("shardc: block %s compiles inline (no shared body): %s", fallback.module,
                 fallback.reason)
    return result


def _is_block_stack(container: nn.Module, infos_by_param: dict) -> bool:
    """Whether ``container`` is an ``nn.Sequential`` of two or more identical blocks (timm's
    ``self.blocks = nn.Sequential(*blocks)``, called as one), grouped as a ``nn.ModuleList``'s
    children are. Only a stack of blocks (children that have children of their own, all of one
    signature but for scalar values): a sequence of layers (``Linear, GELU, Linear``) is no
    repeated block (s75; before, no ``nn.Sequential`` was grouped, so such stacks compiled every
    block inline)."""
    if not isinstance(container, nn.Sequential) or len(container) < 2:
        return False
    children = list(container.children())
    if not all(any(True for _ in child.children()) for child in children):
        return False
    # Scalars aside (a block's own index, as in transformers' layers): the groups are then
    # formed as for a ModuleList, exact and loose.
    first = block_signature(children[0], infos_by_param, scalar_values=False)
    return all(block_signature(child, infos_by_param, scalar_values=False) == first
               for child in children[1:])


def _pack_each_parameter_once(result: BlockBodies, root: nn.Module) -> None:
    """Nested ``nn.ModuleList``s make groups inside groups, and packing both moved a parameter
    into the inner block's buffer after the outer one's: the outer block's packed read (and,
    after ``to_empty``, the inner one's) read a stale copy, refused at the gradient's hand-off
    but silent in a forward without backward. A group of blocks without a forward of their own
    (a ``ModuleList`` of ``ModuleList``s: never called) is not packed, and of two nested
    groups that would be, the outer one is (its body gathers the whole block; the inner blocks
    run inside it on the body's own copy)."""
    def forwardless(group: BlockGroup) -> bool:
        cls = type(root.get_submodule(group.members[0]))
        original = cls.__bases__[0] if vars(cls).get("_shardc_block", False) else cls
        return original.forward is nn.Module.forward

    for group in result.groups:
        if group.packed is not None and forwardless(group):
            group.packed = None
            _not_packed(result, group, "they have no forward of their own (a container)")
    outers = [m for g in result.groups if g.packed is not None for m in g.members]
    for group in result.groups:
        inside = next((o for o in outers for m in group.members if m.startswith(o + ".")), None)
        if group.packed is not None and inside is not None:
            group.packed = None
            _not_packed(result, group, f"they are inside {inside}, whose group is packed")


def _add_group(result: BlockBodies, members: list[tuple[str, nn.Module]],
               pack_infos: dict | None, not_packed: str | None = None) -> None:
    first = members[0][1]
    group = BlockGroup(
        index=len(result.groups), block_type=type(first).__name__,
        members=tuple(fqn for fqn, _ in members),
        weight_names=tuple(n for n, _ in tree_parameters(first)),
        buffer_names=tuple(n for n, _ in first.named_buffers()),
        varying=varying_attributes([block for _, block in members]),
    )
    template = _skeleton(first)
    _fill_bodies(group, group, template)
    if pack_infos is not None:
        _add_packed_bodies(result, group, first, template, pack_infos)
    elif not_packed is not None:
        _not_packed(result, group, not_packed)
    if group.varying:
        _fill_member_bodies(group, [block for _, block in members])
    forwards: dict[type, Callable] = {}
    for number, (_, block) in enumerate(members):
        block.__dict__["_shardc_member"] = number
        cls = type(block)
        if cls not in forwards:
            forwards[cls] = _wrapped_forward(group, cls.forward)
        _swap_block_class(block, forwards[cls])
    result.groups.append(group)
    log.info("shardc: %d blocks of type %s share one compiled body (%s ... %s)%s",
             len(members), group.block_type, group.members[0], group.members[-1],
             "" if not group.varying else " where their forwards do not read " + ", ".join(
                 sorted(_dotted(path, attr) for path, attr in group.varying)))
