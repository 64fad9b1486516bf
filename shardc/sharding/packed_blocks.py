"""Packed blocks (``shardc.shard(..., pack_blocks=True)``): each repeated block keeps its
parameters' local shards end to end in one buffer, and a compiled forward reads and gathers the
block as that one tensor.

Why (issue 18): Dynamo traces every parameter read of a forward (the property, the gather's
arguments, a graph input with its guards), and AOTAutograd and Inductor carry each gathered
weight as a node of its own. A llama block has nine weights; read one by one they were most of
what Dynamo's trace and guards grew by per block. Packed, a block is one graph input, one guard
set and one all-gather; the shared body (``shardc.sharding.blocks``) unpacks the gathered buffer
into the weights, so that code is traced and compiled once for every block of the group.

The layout, per rank: for each of the block's parameters in the group's order, its local shard
padded to ``ceil(dim0 / world)`` rows (the ``torch.chunk`` split every shardc shard follows), then
padded to an aligned offset. Gathered over the ranks, the buffer is ``[world, numel]``, and a
weight is ``gathered[:, offset:offset + rows * row_numel]`` read rank after rank, its first
``dim0`` rows: the same copy-out FSDP2 makes of its all-gather buffer. Its gradient is the packed
buffer's, reduce-scattered once per block.

What users see is unchanged: each parameter is still a DTensor of its own (its local tensor a
view of the buffer), so optimizers, ``state_dict``, DCP and in-place updates reach the buffer the
next forward reads. The buffer's gradient is handed to the parameters after the backward as
DTensor views of it (as ``plain_inputs`` does), so what ``plain_inputs`` says of parameter hooks
(they run from the hand-off) and ``torch.autograd.grad`` holds for these parameters too.

What keeps the buffer and the parameters one: ``nn.Module._apply`` of the block (``to_empty``,
``.to``) repacks the converted shards into a new buffer; ``_apply`` of a module inside the block
alone, or a parameter replaced (``register_parameter``, ``load_state_dict(assign=True)``),
drops the block's packed read (the block reads its parameters one by one from then on, so a
replaced one gets shardc's usual "replaced after sharding" error); anything else that gives a
parameter new storage (``param.data = ...``) is found by the gradient hand-off, which raises
naming the parameter. ``copy.deepcopy`` of a packed parameter (of the model:
``torch.optim.swa_utils.AveragedModel``) is refused, naming it (:class:`RefuseDeepcopy`).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardc import _torch
from shardc.sharding.plain_inputs import give_grad

# On each block that reads packed: its leaf (a tensor requiring grad), or None once dropped.
LEAF_ATTR = "_shardc_packed"
# On each packed block: its PackedBlock.
PACKED_STATE_ATTR = "_shardc_packed_state"
# On each module inside a packed block (the block included): a weak reference to the block.
OWNER_ATTR = "_shardc_packed_block"
# The name the packed buffer's gather carries after its block's name, e.g. "layers.3.<packed>".
PACKED_NAME = "<packed>"
_ALIGN_BYTES = 64


@dataclass(frozen=True)
class PackedEntry:
    """Where one parameter of a block lives in the block's buffer (per rank)."""

    name: str  # in the block, e.g. "attn.q_proj.weight"
    dim0: int
    rows: int  # padded rows per rank: ceil(dim0 / world)
    row_shape: tuple[int, ...]
    offset: int  # elements

    @property
    def row_numel(self) -> int:
        return math.prod(self.row_shape)

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel


@dataclass(frozen=True)
class PackedLayout:
    """One group's buffer layout: the same in every member block and on every rank."""

    entries: tuple[PackedEntry, ...]
    numel: int  # per rank
    world: int
    dtype: torch.dtype

    @staticmethod
    def of(block: nn.Module, names: tuple[str, ...], world: int) -> PackedLayout:
        """The layout of ``block``'s parameters ``names`` (unsharded, any device)."""
        params = [block.get_parameter(n) for n in names]
        dtype = params[0].dtype
        align = max(1, _ALIGN_BYTES // dtype.itemsize)
        entries, offset = [], 0
        for name, p in zip(names, params):
            rows = -(-p.shape[0] // world)
            entry = PackedEntry(name, p.shape[0], rows, tuple(p.shape[1:]), offset)
            entries.append(entry)
            offset += -(-entry.numel // align) * align
        return PackedLayout(tuple(entries), offset, world, dtype)

    def unpack(self, gathered: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The full weights from the gathered buffer (``world * numel`` elements). Traced inside
        a block's body: compiled once per group.

        One ``split`` of the buffer (alignment gaps included) rather than a slice per weight:
        its backward is one ``cat`` of the weights' gradients, which Inductor writes slice by
        slice, where the slices' backwards summed ``world * numel``-element masked terms into
        one buffer (s73: the largest body kernel of the 1b llama's backward)."""
        by_rank = gathered.view(self.world, self.numel)
        sizes, slots, end = [], [], 0
        for e in self.entries:
            if e.offset > end:
                sizes.append(e.offset - end)
            slots.append(len(sizes))
            sizes.append(e.numel)
            end = e.offset + e.numel
        if self.numel > end:
            sizes.append(self.numel - end)
        pieces = by_rank.split(sizes, dim=1)
        weights = []
        for e, slot in zip(self.entries, slots):
            full = pieces[slot].reshape(self.world * e.rows, *e.row_shape)
            weights.append(full if full.shape[0] == e.dim0 else full[:e.dim0])
        return tuple(weights)

    def meta_gathered(self, requires_grad: bool) -> torch.Tensor:
        return torch.empty(self.world * self.numel, dtype=self.dtype, device="meta",
                           requires_grad=requires_grad)


def eligible_reason(params: list[tuple[str, torch.Tensor, object]]) -> str | None:
    """Why a block with these ``(name, parameter, ShardedParamInfo)`` cannot be packed, or
    None."""
    first = params[0][2]
    options = (first.compute_dtype, first.reduce_dtype, first.reshard_after_forward,
               first.world, first.group_name, first.replicate, first.replicate_group_name)
    dtype = params[0][1].dtype
    for name, p, info in params:
        if info.fp8 is not None or info.quantized or info.tp is not None or info.offload_device:
            return f"its parameter {name!r} is gathered in FP8, tensor-parallel or offloaded"
        if not p.requires_grad:
            return f"its parameter {name!r} is frozen"
        if not p.dtype.is_floating_point or p.dtype != dtype:
            return f"its parameters differ in dtype ({name!r} is {p.dtype}, not {dtype})"
        if (info.compute_dtype, info.reduce_dtype, info.reshard_after_forward, info.world,
                info.group_name, info.replicate, info.replicate_group_name) != options:
            return f"its parameter {name!r} has other sharding options"
    return None


class PackedBlock:
    """One block's buffer and leaf; repacked after ``_apply``, dropped when broken."""

    def __init__(self, block: nn.Module, fqn: str, layout: PackedLayout,
                 packed: PackedBlocks) -> None:
        self.fqn = fqn
        self.layout = layout
        self._block = weakref.ref(block)
        self._packed = packed
        self.buffer: torch.Tensor | None = None
        # (owning module, attribute name) per entry: the parameter is looked up at each
        # hand-off, never held (a reference would make torch.utils.swap_tensors refuse it).
        self._owners: list[tuple[weakref.ref, str]] = []
        for e in layout.entries:
            module_path, _, pname = e.name.rpartition(".")
            owner = block.get_submodule(module_path) if module_path else block
            self._owners.append((weakref.ref(owner), pname))
        for sub in block.modules():
            sub.__dict__[OWNER_ATTR] = weakref.ref(block)
        block.__dict__[PACKED_STATE_ATTR] = self
        block.register_state_dict_post_hook(_state_dict_hook(
            tuple(e.name for e in layout.entries)))
        self.pack()

    def params(self) -> list[DTensor | None]:
        out = []
        for ref, pname in self._owners:
            owner = ref()
            out.append(None if owner is None else owner._parameters.get(pname))
        return out

    def pack(self) -> None:
        """Copy the block's current shards into a new buffer, make each parameter's local
        tensor a view of it (the parameter object kept: ties, optimizer references), and give
        the block a leaf over it. Drops the packed read instead where a parameter is not the
        DTensor shard shardc made."""
        block = self._block()
        params = self.params()
        if block is None or not all(isinstance(p, DTensor) for p in params):
            self.drop()
            return
        locals_ = [_torch.dtensor_local(p) for p in params]
        device = locals_[0].device
        if any(t.device != device or t.dtype != self.layout.dtype for t in locals_):
            self.drop()
            return
        buffer = torch.zeros(self.layout.numel, dtype=self.layout.dtype, device=device)
        with torch.no_grad():
            for e, p, local in zip(self.layout.entries, params, locals_):
                view = buffer[e.offset:e.offset + local.numel()].view(local.shape)
                view.copy_(local)
                if local.data_ptr() != view.data_ptr():
                    torch.utils.swap_tensors(p, nn.Parameter(
                        DTensor.from_local(view, p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride()),
                        requires_grad=p.requires_grad))
                # An instance attribute, which copy.deepcopy looks up before the class's.
                p.__dict__["__deepcopy__"] = RefuseDeepcopy(f"{self.fqn}.{e.name}")
        self.buffer = buffer
        leaf = buffer.detach().requires_grad_(True)
        leaf.register_post_accumulate_grad_hook(self._hand_off)
        block.__dict__[LEAF_ATTR] = leaf
        self._follow_plain_leaves()

    def _follow_plain_leaves(self) -> None:
        """With plain inputs (``shardc.sharding.plain_inputs``), each parameter's plain leaf
        (read where the block is not read packed: eagerly, or once its packed read is dropped)
        must alias the shard now in the buffer, not the storage it was moved out of."""
        for ref, pname in self._owners:
            owner = ref()
            plain = None if owner is None else getattr(owner, "_shardc_plain", None)
            if plain is not None:
                plain.follow(owner._shardc_infos[pname].fqn)

    def drop(self) -> None:
        """From now on the block reads its parameters one by one."""
        block = self._block()
        if block is not None:
            block.__dict__[LEAF_ATTR] = None
        self.buffer = None

    def _hand_off(self, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        if grad is None or self.buffer is None:
            return
        base = self.buffer.data_ptr()
        size = self.buffer.element_size()
        for e, param in zip(self.layout.entries, self.params()):
            local = _torch.dtensor_local(param) if isinstance(param, DTensor) else None
            # An empty shard (fewer rows than ranks) holds nothing a forward could read stale,
            # and its data_ptr() is 0 wherever it lives: not checked.
            if local is None or (local.numel() and local.data_ptr() != base + e.offset * size):
                raise RuntimeError(
                    f"shardc: parameter {self.fqn}.{e.name!r} got new storage after "
                    "shardc.shard without shardc seeing it (param.data = ..., "
                    "torch.utils.swap_tensors, or a parameter put directly into _parameters), "
                    "so this forward read its old values (pack_blocks=True reads the block's "
                    "packed shards); its gradient is refused. Change values in place "
                    "(param.to_local().copy_(...) under torch.no_grad(), load_state_dict, DCP), "
                    "move the model with to_empty() / .to(), or shard with pack_blocks=False.")
            if not param.requires_grad:
                continue
            give_grad(param, grad[e.offset:e.offset + local.numel()].view(local.shape))
        self._packed.handed += 1


class RefuseDeepcopy:
    """A packed parameter's ``__deepcopy__``: refused, naming the parameter. torch's
    ``Tensor.__deepcopy__`` takes the DTensor wrapper, which carries its view's storage offset
    (a nonzero ``data_ptr()`` without storage of its own), for a tensor with storage and fails
    ("Attempted to call copy_() on an invalid python storage"); and a copy would not be packed
    (its parameters' own storages beside a copy of the buffer its forwards read). A class, not
    a closure: a pickled parameter pickles its ``__dict__``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, memo) -> None:
        raise RuntimeError(
            f"shardc: copy.deepcopy of parameter {self.name!r}, whose shard lives in its "
            "block's packed buffer (shardc.shard's pack_blocks, on by default), is not "
            "supported (copy.deepcopy of the model, torch.optim.swa_utils.AveragedModel). "
            "Deepcopy the model before shardc.shard and shard the copy too, or build and "
            "shard a second model and load_state_dict() into it; copy.deepcopy(model."
            "state_dict()) works.")


def _state_dict_hook(names: tuple[str, ...]):
    """A ``state_dict`` post-hook of a packed block: each of its parameters ``names`` whose
    value is a DTensor over a view inside the buffer with the view's storage offset (a
    detached parameter: ``state_dict()`` detaches, and DTensor's detach builds the wrapper from
    its local tensor) is given as the same view under an offset-0 wrapper
    (:func:`shardc._torch.dtensor_over_view`: DCP's async staging fails on the other)."""

    def hook(module, state_dict, prefix, local_metadata) -> None:
        for name in names:
            key = prefix + name
            value = state_dict.get(key)
            # keep_vars=True gives the parameters themselves, which keep the view's offset:
            # Dynamo fakes a DTensor's wrapper and local tensor with one storage offset.
            if (isinstance(value, DTensor) and not isinstance(value, nn.Parameter)
                    and value.storage_offset() != 0):
                state_dict[key] = _torch.dtensor_over_view(_torch.dtensor_local(value), value)

    return hook


class PackedBlocks:
    """One sharded model's packed blocks, by block name."""

    def __init__(self) -> None:
        self.blocks: dict[str, PackedBlock] = {}
        self.handed = 0  # blocks' gradients handed to parameters (tests read it)

    def add(self, block: nn.Module, fqn: str, layout: PackedLayout) -> None:
        self.blocks[fqn] = PackedBlock(block, fqn, layout, self)

    def members(self, fqn: str) -> list[str]:
        """The parameters (full names) a packed gather ``fqn`` (``<block>.<packed>``) reads."""
        block = packed_block_name(fqn)
        packed = self.blocks.get(block) if block is not None else None
        return [] if packed is None else [f"{block}.{e.name}" for e in packed.layout.entries]


def packed_block_names(model: nn.Module) -> tuple[str, ...]:
    """The names (in ``model.named_modules()`` order, relative to ``model``) of the blocks inside
    ``model`` that a compiled forward reads packed now: those :func:`shardc.shard` packed and whose
    packed read was not dropped since. Empty for a model not sharded, sharded with
    ``pack_blocks=False``, or whose blocks ``shard`` could not pack (:func:`eligible_reason`,
    CPU offload, blocks without an identical sibling). What ``shard`` did, read from the model,
    where a caller must not guess it from the arguments it passed (``shardc.tools.planner``)."""
    # The leaf is what a traced block reads (blocks._packed_weights): set by PackedBlock.pack,
    # None once dropped; no other module has it.
    return tuple(name for name, sub in model.named_modules()
                 if sub.__dict__.get(LEAF_ATTR) is not None)


def packed_fqn(block: str) -> str:
    """The name a packed gather of ``block`` carries."""
    return f"{block}.{PACKED_NAME}"


def packed_block_name(fqn: str) -> str | None:
    """The block a packed gather's name ``fqn`` stands for, or None (a parameter's name)."""
    suffix = "." + PACKED_NAME
    return fqn[:-len(suffix)] if fqn.endswith(suffix) else None


def repack(block: nn.Module) -> None:
    """After ``nn.Module._apply`` of ``block`` (its shards converted): a packed block packs
    them into a new buffer; any other block is left as it is."""
    packed = block.__dict__.get(PACKED_STATE_ATTR)
    if packed is not None:
        packed.pack()


def drop_read(module: nn.Module, replaced: bool = False) -> None:
    """A module inside a packed block had its parameters converted alone (``_apply`` of the
    module, not of the block, which packs again after its own: ``repack``) or one of them
    ``replaced``: the block reads its parameters one by one from now on."""
    ref = module.__dict__.get(OWNER_ATTR)
    block = None if ref is None else ref()
    if block is None or (block is module and not replaced):
        return
    packed = block.__dict__.get(PACKED_STATE_ATTR)
    if packed is not None:
        packed.drop()


def expand(fqns, packed: PackedBlocks | None) -> list[str]:
    """``fqns`` with each packed gather's name replaced by its parameters' names."""
    out = []
    for f in fqns:
        members = packed.members(f) if packed is not None else []
        out.extend(members or [f])
    return out
