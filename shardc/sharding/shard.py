"""``shardc.shard``: turn a module's parameters into dim-0 sharded DTensors, in place.

After :func:`shard`, ``module.parameters()`` and ``module.state_dict()`` see DTensor parameters with
the original global shapes and names, so optimizers and DCP work on the local shards. Inside a
forward (eager or compiled) an attribute read such as ``self.weight`` returns the gathered full
tensor through the ``shardc::gather_param`` op, whose autograd reduce-scatters the gradient. Outside
a forward the same read returns the sharded parameter, so ``reset_parameters()`` and user init code
work on the shards after sharding.

The class of each module that owns parameters is swapped for a subclass that adds one property per
parameter name (the same kind of in-place change ``fully_shard`` makes); nothing else of the user's
module is touched.
"""

from __future__ import annotations

import builtins
import contextlib
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardc._torch import dtensor_on_local_device
from shardc.compile import compile_workers
from shardc.ops.gather import GATHER_OP, gather_param
from shardc.ops.gather_args import GatherArgs
from shardc.ops.offload_copy import offload_to_device
from shardc.optim import default_local_step
from shardc.runtime import offload_check, offload_optimizer, replaced_params
from shardc.runtime.grad_sync import (
    REDUCE,
    REDUCE_STASHED,
    STASH,
    SYNC_MODES,
    UnsyncedGrads,
    sync_mode,
)
from shardc.sharding import forward_casts, packed_blocks, te_params
from shardc.sharding.auto_offload import AutoOffload
from shardc.sharding.blocks import (
    COUNTS_FORWARD,
    BlockBodies,
    set_packed_args,
    wrap_repeated_blocks,
)
from shardc.sharding.blocks import seal as seal_blocks
from shardc.sharding.fp8 import (
    Float8Policy,
    Fp8ParamInfo,
    fp8_class_attrs,
    gather_fp8_weight,
    select_fp8_params,
)
from shardc.sharding.mesh import (
    MeshLayout,
    TpSpec,
    check_mesh_covers_world,
    check_param,
    placements,
    rank_tensor,
    resolve_layout,
    tp_spec,
    wrap_tp,
)
from shardc.sharding.module_copy import deepcopy_sharded
from shardc.sharding.offload import (
    OffloadPolicy,
    check_host_memory,
    check_policy,
    copy_target,
    to_host,
    wants_pinned,
)
from shardc.sharding.packed_blocks import PackedBlocks, packed_fqn
from shardc.sharding.plain_inputs import PlainInputs, leaf_for
from shardc.sharding.scope import (
    ShardedModuleMixin,
    enter_forward,
    exit_forward,
    gathering,
    in_eager_forward,
    is_sharded,
    shard_state,
    unwrap_compiled,
)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for communication and compute; master shards keep their own dtype.

    ``param_dtype``: dtype of gathered parameters (all-gather and compute). ``reduce_dtype``: dtype
    in which gradients are reduce-scattered. ``None`` keeps the parameter's dtype.

    ``cast_forward_inputs`` (on by default, as FSDP2's): with ``param_dtype`` set, the
    floating-point tensors among the sharded root's forward arguments (positional and keyword,
    nested in tuples, lists, dicts and other pytree containers) are cast to ``param_dtype``
    before its forward; integer, boolean and complex tensors (token ids, masks) are not.
    ``output_dtype``: if set, the floating-point tensors among the root's forward outputs are
    cast to it after the forward (e.g. ``torch.float32`` for a loss computed in float32).
    Unlike FSDP2, which casts at every ``fully_shard`` module, shardc casts at the root given to
    :func:`shard` only (it shards once, at the root); see :mod:`shardc.sharding.forward_casts`.
    Fields of the wrong type raise ``TypeError`` naming the field.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(f"shardc.MixedPrecisionPolicy: {name} must be a torch.dtype or "
                                f"None, got {value!r} ({type(value).__name__})")
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError("shardc.MixedPrecisionPolicy: cast_forward_inputs must be a bool, "
                            f"got {self.cast_forward_inputs!r} "
                            f"({type(self.cast_forward_inputs).__name__})")


def as_policy(policy: object) -> MixedPrecisionPolicy:
    """``shard``'s ``mp_policy`` as shardc's policy: ``None`` is the default one, FSDP2's
    ``torch.distributed.fsdp.MixedPrecisionPolicy`` (the same four fields) is taken over field by
    field, anything else raises ``TypeError`` naming the argument."""
    if policy is None:
        return MixedPrecisionPolicy()
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    from torch.distributed.fsdp import MixedPrecisionPolicy as Fsdp2Policy

    if isinstance(policy, Fsdp2Policy):
        return MixedPrecisionPolicy(policy.param_dtype, policy.reduce_dtype, policy.output_dtype,
                                    policy.cast_forward_inputs)
    raise TypeError(f"shardc.shard: mp_policy must be a shardc.MixedPrecisionPolicy (or FSDP2's "
                    f"torch.distributed.fsdp.MixedPrecisionPolicy), got {policy!r} "
                    f"({type(policy).__name__}); e.g. shardc.MixedPrecisionPolicy("
                    "param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")


@dataclass(frozen=True)
class ShardedParamInfo:
    """What the gather op needs to know about one sharded parameter; constants in the graph."""

    fqn: str
    dim0: int
    world: int
    group_name: str
    compute_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: bool
    # HSDP: the gradient is also averaged over this many replicas (the replicate group).
    replicate: int = 1
    replicate_group_name: str = ""
    # FSDP+TP: the tensor-parallel placement the gathered tp-local tensor is wrapped back into.
    tp: TpSpec | None = None
    fp8: Fp8ParamInfo | None = None  # gathered in FP8 (``shard(..., fp8=...)``)
    # A TransformerEngine FP8 parameter (``te.quantized_model_init``): its FP8 bytes are
    # sharded and gathered as they are (shardc.sharding.te_params).
    quantized: bool = False
    # CPU offload: the shard lives in host memory and the forward copies it to this device
    # (``shardc::offload_to_device``) before gathering; "" without offload.
    offload_device: str = ""
    offload_pin: bool = False  # the host gradient is pinned

    def sent_shard(self, local: torch.Tensor) -> torch.Tensor:
        """What the gather sends: the local shard, or its device copy under offload."""
        if not self.offload_device:
            return local
        return offload_to_device(local, self.fqn, self.offload_device, self.offload_pin)

    def gather_args(self, shard: torch.Tensor, grad_sync: int, sync_key: str) -> GatherArgs:
        """The gather op's arguments for this parameter's local ``shard``."""
        return GatherArgs(shard, self.fqn, self.dim0, self.world, self.group_name,
                          self.compute_dtype, self.reduce_dtype, self.reshard_after_forward,
                          grad_sync, sync_key, self.replicate, self.replicate_group_name)

    def gather_constants(self, sync_key: str) -> dict[int, tuple]:
        """The gather op's arguments after the shard (:meth:`GatherArgs.constants`), by
        gradient-sync mode (``shardc.runtime.grad_sync``)."""
        return {mode: self.gather_args(None, mode, sync_key).constants()
                for mode in (REDUCE, STASH, REDUCE_STASHED)}


@dataclass
class ShardState:
    """Recorded on the root module by :func:`shard`."""

    mesh: DeviceMesh
    reshard_after_forward: bool
    mp_policy: MixedPrecisionPolicy
    params: dict[str, ShardedParamInfo]
    regions: list = field(default_factory=list)  # one record per compiled region (the backend's)
    grad_sync: UnsyncedGrads = field(default_factory=UnsyncedGrads)
    layout: MeshLayout | None = None  # the roles of the mesh's dimensions (shardc.sharding.mesh)
    fp8: Float8Policy | None = None
    # Process group name -> (role on the mesh, ranks), for the plans (MeshLayout.group_roles).
    group_roles: dict[str, tuple[str, int]] | None = None
    offload: OffloadPolicy | None = None  # CPU offload (shardc.sharding.offload)
    # OffloadPolicy(params="auto"): the peak budget may move the shards to the host
    # (shardc.sharding.auto_offload); ``offload`` is set once it has.
    auto_offload: AutoOffload | None = None
    # The repeated blocks compiled once, and those that are not (shardc.sharding.blocks).
    blocks: BlockBodies = field(default_factory=BlockBodies)
    # plain_inputs=True: the plain leaves forwards read (shardc.sharding.plain_inputs).
    plain: PlainInputs | None = None
    # pack_blocks=True: the blocks read as one packed buffer (shardc.sharding.packed_blocks).
    packed: PackedBlocks | None = None
    # The sharded root module (weak: the state lives on it), for the peak budget's optimizer
    # offload, which the planner decides at compile time for the model's parameters.
    root: weakref.ref | None = field(default=None, repr=False)
    # A region's peak budget put the optimizer's state on the host: the later regions plan
    # with it there (one optimizer steps the whole model).
    optimizer_planned_on_host: bool = False
    # A region's peak budget put only these parameters' optimizer state on the host (partial
    # offload): the later regions plan with theirs there.
    optimizer_planned_host_params: set[str] = field(default_factory=set)

    @property
    def key(self) -> str:
        """The model's key: a constant argument (``sync_key``) of every gather in its graphs."""
        return self.grad_sync.key


# Every live sharded model's state by its key. The backend finds a graph's model through the key
# its gather nodes carry (``state_for_key``), never through parameter objects: ``nn.Module._apply``
# (``to_empty``, ``.to``, ``.double()``) swaps or replaces those. Weak: a model's state lives as
# long as its root module.
_STATES: weakref.WeakValueDictionary[str, ShardState] = weakref.WeakValueDictionary()


def _live_models() -> Iterator[tuple[ShardState, nn.Module]]:
    """Each live sharded model's state and root module."""
    for state in list(_STATES.values()):
        root = state.root() if state.root is not None else None
        if root is not None:
            yield state, root


def locally_steppable_params() -> dict[int, nn.Parameter]:
    """By id, the parameters of every live sharded model whose optimizer may step their local
    shards (``shardc.optim.default_local_step``): those of models without CPU offload, not
    quantized by TransformerEngine."""
    out: dict[int, nn.Parameter] = {}
    for state, root in _live_models():
        if state.offload is not None or state.auto_offload is not None:
            continue
        params = dict(root.named_parameters(remove_duplicate=False))
        for fqn, info in state.params.items():
            p = params.get(fqn)
            if p is not None and not info.quantized:
                out[id(p)] = p
    return out


def plainly_read_params() -> dict[int, str]:
    """By id, the parameters of every live sharded model that forwards read as plain leaves
    (``plain_inputs``), with their names: those the autograd graph does not hold."""
    out: dict[int, str] = {}
    for state, root in _live_models():
        if state.plain is None:
            continue
        for prefix, module in root.named_modules(remove_duplicate=False):
            for name, p in module.named_parameters(recurse=False):
                if leaf_for(module, name) is not None:
                    out[id(p)] = f"{prefix}.{name}" if prefix else name
    return out


def state_for_key(key: str) -> ShardState | None:
    """The :class:`ShardState` of the live sharded model whose gathers carry ``key``."""
    return _STATES.get(key)


def _param_property(name: str, info: ShardedParamInfo, grads: UnsyncedGrads,
                    plain: bool = False, auto: AutoOffload | None = None) -> property:
    # Built once here, not at each read: Dynamo traces every parameter read of a compiled
    # forward, and tracing GatherArgs' construction and encoding (a frozen dataclass's
    # __init__, dataclasses.fields) was about half of each read's trace.
    # The sync mode is read through the store's key (sync_mode: one source for every read of
    # the model, so Dynamo does not guard that all the reads' closures hold the same store);
    # the store itself is kept alive by the read (_keep_store), never read by it.
    key = grads.key
    constants = info.gather_constants(key)
    if not (info.quantized or info.fp8 is not None or info.tp is not None
            or info.offload_device or auto is not None):
        return property(_keep_store(_read_gathered_as_is(name, info.fqn, constants, key, plain),
                                    grads),
                        doc=f"The parameter {info.fqn!r}, gathered inside a forward.")

    def read(self):  # (no plain leaf here: plain_eligible excludes every case below)
        param, gather = _param_to_gather(self, name)
        if not gather:
            return param
        sync = sync_mode(key)
        if info.quantized:
            return te_params.gather_float8_param(self, name, param, info, sync, key)
        if info.fp8 is not None:
            return gather_fp8_weight(param.to_local(), info, sync, key)
        local = param.to_local()
        if auto is not None and auto.reads_copy():  # the planner may move the shards
            sent = offload_to_device(local, info.fqn, auto.device, auto.pin)
        else:
            sent = info.sent_shard(local)
        full = gather_param(sent, *constants[sync])
        return full if info.tp is None else wrap_tp(full, info.tp)

    return property(_keep_store(read, grads),
                    doc=f"The parameter {info.fqn!r}, gathered inside a forward.")


def _keep_store(read, grads: UnsyncedGrads):
    """``read``, holding ``grads`` (an attribute Dynamo never reads): the store and its entry of
    ``sync_mode`` live as long as any read of the model does."""
    read._shardc_sync_store = grads
    return read


def _read_gathered_as_is(name: str, fqn: str, constants: dict[int, tuple], key: str,
                         plain: bool = False):
    """The read of a parameter gathered as it is: not FP8, not TransformerEngine FP8, not
    tensor-parallel, not offloaded (most parameters); ``plain``: inside a forward it gathers
    the parameter's plain leaf where it has one (``plain_inputs``). The same steps as the
    general read's path for it, with those choices made here, once: Dynamo guards every value
    a traced read consults, and the general read consults its ``ShardedParamInfo`` (``tp``,
    ``fp8``, ``quantized``, ``offload_device``, the ``sent_shard`` method) and the ``plain``
    flag, about 7 guards per parameter at every call (issue 20, docs/overhead.md "Guards per
    step"). None of them can change without shardc sharding again: the info is a frozen
    dataclass and the flag a bool, both fixed when this property is built by ``shard`` (a new
    class, so a new property, for each sharding).

    What the read does need, the parameter's name, the gather's constant arguments by sync mode
    and the gradient store's key, are constants of the read's own code (:func:`_constant_read`),
    not cells of a closure: Dynamo guards the code object of every function it inlines (one
    guard, which a read has anyway), and guarded each closure cell's contents besides, six
    guards per parameter (issue 18: guards are built at every compile and checked at every
    step). The store's mode is read through ``SYNC_MODES`` under the key, one guarded value for
    all the model's reads."""
    return _constant_read(name, _by_mode(constants), key, fqn, plain)


def _by_mode(constants: dict[int, tuple]) -> tuple:
    """``constants`` (:meth:`ShardedParamInfo.gather_constants`) as a tuple indexed by the mode
    itself (REDUCE, STASH, REDUCE_STASHED are 0, 1, 2)."""
    return tuple(constants[mode] for mode in range(len(constants)))


# The constants by mode are put into the compiled read's co_consts in place of this string:
# they hold torch.dtypes (a mixed-precision gather's dtypes), which source cannot spell as a
# constant (``torch.bfloat16`` in source is a load and an attribute, and the tuple around it
# would be built at every read that Dynamo traces).
_BY_MODE = "<shardc: the gather's constants by sync mode>"
# The read's last two lines: the DTensor parameter's local shard gathered, outside a forward the
# parameter itself.
_READ_DTENSOR = """\
    param, gather = _param_to_gather(self, {name!r})
    return GATHER_OP(param.to_local(), *{by_mode!r}[SYNC_MODES[{key!r}]]) if gather else param
"""
_READ_SOURCE = "def read(self):\n" + _READ_DTENSOR
# plain_inputs: inside a forward the plain leaf is gathered and the DTensor not read at all (no
# guards, no unwrapping); without a leaf (dropped: a replaced parameter) the read above.
_PLAIN_READ_SOURCE = """\
def read(self):
    if GATHERING():
        leaf = LEAF_FOR(self, {name!r})
        if leaf is not None:
            return GATHER_OP(leaf, *{by_mode!r}[SYNC_MODES[{key!r}]])
""" + _READ_DTENSOR


def _constant_read(name: str, by_mode: tuple, key: str, fqn: str, plain: bool = False):
    """:func:`_read_gathered_as_is`'s read: compiled from source with ``name`` and ``key``
    written in as literals, and ``by_mode`` (any objects) set among its code's constants; its
    file name, shown in tracebacks and Dynamo's logs, names the parameter ``fqn``."""
    template = _PLAIN_READ_SOURCE if plain else _READ_SOURCE
    source = template.format(name=name, by_mode=_BY_MODE, key=key)
    module = compile(source, f"<shardc read of {fqn!r}>", "exec")
    code = next(c for c in module.co_consts if isinstance(c, types.CodeType))
    consts = tuple(by_mode if isinstance(c, str) and c == _BY_MODE else c
                   for c in code.co_consts)
    return types.FunctionType(code.replace(co_consts=consts), _READ_GLOBALS, "read")


def _param_to_gather(module: nn.Module, name: str) -> tuple[torch.Tensor | None, bool]:
    """(``module``'s parameter ``name``, whether the read gathers it): a DTensor is gathered
    inside a forward (traced or eager) and returned as it is outside one; a parameter that is
    no longer a DTensor (replaced behind ``shard``'s back) is returned outside a forward and
    refused inside one, where it would train stale values."""
    param = module._parameters.get(name)
    # is_compiling() first: Dynamo folds it and never inlines the other two.
    inside = torch.compiler.is_compiling() or gathering() or in_eager_forward()
    if not isinstance(param, DTensor):
        if param is not None and inside:
            raise _replaced_error(module, name, param)
        return param, False
    return param, inside


# The globals of every read _constant_read makes: one dict, so Dynamo guards what a read looks
# up there (``SYNC_MODES``...) once for all of them, not once per read.
_READ_GLOBALS = {"_param_to_gather": _param_to_gather, "GATHER_OP": GATHER_OP,
                 "SYNC_MODES": SYNC_MODES, "GATHERING": gathering, "LEAF_FOR": leaf_for,
                 "__builtins__": builtins.__dict__}


def _replaced_error(module: nn.Module, name: str, param: torch.Tensor) -> RuntimeError:
    info = type(module)._shardc_infos[name]
    return RuntimeError(
        f"shardc: parameter {info.fqn!r} is a {type(param).__name__}, not the sharded DTensor "
        "shardc.shard installed: it was replaced after sharding (attribute assignment of a new "
        "nn.Parameter, register_parameter, load_state_dict(..., assign=True) with full tensors). "
        "Assign before shardc.shard, load values in place (load_state_dict without assign, or "
        "torch.distributed.checkpoint), or copy into the shard with "
        "param.to_local().copy_(...) under torch.no_grad()."
    )


def _apply_sharded(self, fn, recurse: bool = True):
    """``nn.Module._apply`` (``to_empty``, ``.to``, ``.double()``...) of a sharded module: the
    DTensor parameters are converted in place (torch swaps their contents, identity and ties
    kept) and checked to still be this module's shards; what shardc recorded about the module is
    keyed by the model, not by parameter objects, so it stays valid."""
    before = {name: self._parameters.get(name) for name in type(self)._shardc_param_names}
    layout = {name: _shard_layout(p) for name, p in before.items() if isinstance(p, DTensor)}
    # The class shardc made (a later class swap, e.g. torch.nn.utils.parametrize, derives from it).
    owner = next(c for c in type(self).__mro__ if "_shardc_infos" in vars(c))
    out = super(owner, self)._apply(fn, recurse)
    for name, expected in layout.items():
        _check_applied(self, name, self._parameters.get(name), expected)
    packed_blocks.drop_read(self)
    plain = owner._shardc_plain
    if plain is not None:  # the parameters' contents were swapped: the leaves alias new shards
        for name in layout:
            info = owner._shardc_infos[name]
            plain.refresh(info.fqn, plain_eligible(info))
    return out


def _register_sharded(self, name: str, param) -> None:
    """``register_parameter`` (attribute assignment, ``load_state_dict(assign=True)``) of a
    sharded module: a sharded parameter replaced by another object is read as it is from now
    on (no plain leaf: see :mod:`shardc.sharding.plain_inputs`; its block no longer reads
    packed: :mod:`shardc.sharding.packed_blocks`)."""
    owner = next(c for c in type(self).__mro__ if "_shardc_infos" in vars(c))
    super(owner, self).register_parameter(name, param)
    if name in owner._shardc_infos:
        packed_blocks.drop_read(self, replaced=True)
    plain, info = owner._shardc_plain, owner._shardc_infos.get(name)
    if plain is not None and info is not None:
        plain.refresh(info.fqn, eligible=False)


def plain_eligible(info: ShardedParamInfo) -> bool:
    """Whether a forward may read the parameter as a plain leaf (plain_inputs=True): not
    for FP8 gathers, TransformerEngine FP8, tensor-parallel or offloaded parameters, whose
    reads need the DTensor or a host copy."""
    return (info.fp8 is None and not info.quantized and info.tp is None
            and not info.offload_device)


def _shard_layout(p: DTensor) -> tuple:
    local = p.to_local()
    return p.device_mesh, p.placements, tuple(p.shape), tuple(local.shape), local.dtype


def _check_applied(module: nn.Module, name: str, param, expected: tuple) -> None:
    info = type(module)._shardc_infos[name]
    mesh, placements, shape, local_shape, dtype = expected
    problem = None
    if not isinstance(param, DTensor):
        problem = f"became a {type(param).__name__}"
    elif param.device_mesh != mesh or param.placements != placements:
        # Equality, not identity: DTensor's propagation cache may hand back an equal mesh object.
        problem = (f"changed its mesh or placements ({mesh} {placements} -> "
                   f"{param.device_mesh} {param.placements})")
    elif tuple(param.shape) != shape or tuple(param.to_local().shape) != local_shape:
        problem = "changed its shape"
    elif param.to_local().device.type != _local_device_type(info, mesh):
        problem = (f"moved to {param.to_local().device} but its mesh is of device type "
                   f"{mesh.device_type!r}" + (" and it is offloaded to the host (cpu)"
                                              if info.offload_device else ""))
    elif info.quantized and param.to_local().dtype != dtype:
        problem = "changed dtype (a TransformerEngine FP8 parameter keeps its FP8 format)"
    if problem is not None:
        raise RuntimeError(
            f"shardc: after {type(module).__name__}._apply (to_empty / .to / .float() / "
            f".half() ...) the sharded parameter {info.fqn!r} {problem}; shardc cannot keep "
            "sharding it. Change devices by building the mesh on the target device (meta-device "
            "build, shardc.shard, then to_empty(device=...) onto the mesh's device type), and "
            "change dtypes with .to(dtype) / MixedPrecisionPolicy."
        )


def _local_device_type(info: ShardedParamInfo, mesh: DeviceMesh) -> str:
    """Where a parameter's local shard lives: the mesh's device, or the host if offloaded."""
    return "cpu" if info.offload_device else mesh.device_type


def _refuse_share_memory(self):
    raise NotImplementedError(
        f"shardc: share_memory() on a sharded module ({type(self).__name__}) is not supported: "
        "torch's DTensor.share_memory_() ends the process. Sharded parameters are already "
        "spread over the ranks of the process group; call share_memory() before "
        "shardc.shard if another process needs the unsharded module."
    )


def _swap_class(
    module: nn.Module, infos: dict[str, ShardedParamInfo], grads: UnsyncedGrads,
    fp8: Float8Policy | None = None, plain: PlainInputs | None = None,
    auto: AutoOffload | None = None,
) -> None:
    cls = type(module)
    attrs = {name: _param_property(name, info, grads,
                                   plain is not None and plain_eligible(info), auto)
             for name, info in infos.items()}
    attrs.update(fp8_class_attrs(module, infos, grads, fp8))
    attrs["_shardc_param_names"] = tuple(infos)
    attrs["_shardc_infos"] = dict(infos)
    attrs["_apply"] = _apply_sharded
    attrs["_shardc_plain"] = plain
    # A replaced parameter drops its leaf (plain_inputs) or its block's packed read.
    attrs["register_parameter"] = _register_sharded
    attrs["share_memory"] = _refuse_share_memory
    attrs["__deepcopy__"] = deepcopy_sharded
    attrs["__module__"] = cls.__module__
    module.__class__ = type(f"Shardc{cls.__name__}", (ShardedModuleMixin, cls), attrs)


def _swap_root_class(module: nn.Module) -> None:
    """A root that owns no parameter itself gets only the ``share_memory`` refusal (its
    children's ``_apply`` checks their own parameters); it is not marked sharded."""
    cls = type(module)
    attrs = {"share_memory": _refuse_share_memory, "__module__": cls.__module__}
    module.__class__ = type(f"ShardcRoot{cls.__name__}", (cls,), attrs)


def _default_mesh(module: nn.Module) -> DeviceMesh:
    devices = {p.device.type for p in module.parameters() if p.device.type != "meta"}
    if len(devices) == 1:
        device_type = devices.pop()
    else:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return DeviceMesh.from_group(dist.group.WORLD, device_type)


def _check_inputs(module: nn.Module, mesh: DeviceMesh, allow_partial_mesh: bool) -> MeshLayout:
    if not allow_partial_mesh:
        check_mesh_covers_world(mesh, dist.get_world_size())
    for name, sub in module.named_modules():
        if is_sharded(sub) or shard_state(sub) is not None:
            where = f"submodule {name!r}" if name else "the module"
            raise ValueError(
                f"shardc.shard: {where} is already sharded; call shardc.shard once, on the root."
            )
    layout = resolve_layout(mesh)
    devices: dict[torch.device, str] = {}
    for fqn, p in module.named_parameters():
        devices.setdefault(p.device, fqn)
        if p.device.type == "meta":
            continue
        if p.device.type != mesh.device_type:
            raise ValueError(
                f"shardc.shard: parameter {fqn!r} is on {p.device} but the mesh is of device type "
                f"{mesh.device_type!r}; move the module to {mesh.device_type} first or build the "
                f"mesh with init_device_mesh({p.device.type!r}, ...)."
            )
    if len(devices) > 1:
        found = ", ".join(f"{fqn!r} on {dev}" for dev, fqn in devices.items())
        raise ValueError(
            f"shardc.shard: parameters are on different devices ({found}); build the module "
            "entirely on the meta device or move it to one device first."
        )
    _check_aliases(module)
    for fqn, p in module.named_parameters():
        if p.dim() == 0:
            raise NotImplementedError(
                f"shardc.shard: parameter {fqn!r} is a scalar (0-d); shardc shards along dim 0. "
                "Store it as a 1-element tensor instead."
            )
        if te_params.is_quantized(p):
            _check_quantized(fqn, p, layout)
            continue
        check_param(fqn, p, layout)
    return layout


def _storage_span(p: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage identity, first byte, end byte) of what this rank holds of ``p`` (meta tensors
    too: their storages have no data pointer but are distinct objects); None where there is
    nothing to compare (empty tensors, tensor subclasses without one storage)."""
    try:
        t = rank_tensor(p)
        if t.numel() == 0:
            return None
        storage = t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    first = t.storage_offset() * t.element_size()
    return storage, first, first + extent * t.element_size()


def _check_aliases(module: nn.Module) -> None:
    """Refuse distinct parameters whose memory overlaps (one a view of another): each would get
    its own shard, and updating one would no longer update the other. The same parameter object
    registered twice (tied weights) is one parameter and is fine, and so are disjoint views of
    one buffer (cuDNN's flattened RNN weights), which nothing couples. Decided from the module
    alone, so every rank raises the same error before any collective."""
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for fqn, p in module.named_parameters():  # one entry per distinct parameter object
        if te_params.is_quantized(p):
            continue
        span = _storage_span(p)
        if span is None:
            continue
        storage, first, end = span
        for other_first, other_end, other in spans.get(storage, []):
            if first < other_end and other_first < end:
                raise ValueError(
                    f"shardc.shard: parameters {other!r} and {fqn!r} share storage (one is a "
                    "view of the other, or both view one tensor); sharding would give each its "
                    "own shard and an update of one would no longer reach the other. Tie them "
                    "as one parameter (assign the same nn.Parameter object to both modules, "
                    "e.g. child.weight = other.weight) or give each its own storage (.clone()) "
                    "before shardc.shard."
                )
        spans.setdefault(storage, []).append((first, end, fqn))


def _check_quantized(fqn: str, p: torch.Tensor, layout: MeshLayout) -> None:
    """Quantized parameters bring their own all-gather hooks for FSDP2 (``fsdp_pre_all_gather``);
    shardc does not call them but shards and gathers TE's FP8 parameters itself
    (:mod:`shardc.sharding.te_params`). Anything else is refused, naming the parameter."""
    te_params.check_quantized_param(fqn, p)
    if layout.kind != "fsdp":
        raise NotImplementedError(
            f"shardc.shard: FP8 parameter {fqn!r} on a {layout.kind.upper()} mesh; FP8 "
            "parameters (te.quantized_model_init) are sharded over 1-D meshes only."
        )


def _shard_tensor(p: torch.Tensor, layout: MeshLayout,
                  offload: OffloadPolicy | None = None) -> DTensor:
    """Keep this rank's ``torch.chunk`` slice of what the rank holds of ``p`` (never the whole of
    a meta tensor), as a DTensor on the whole mesh (placements: :mod:`shardc.sharding.mesh`);
    with ``offload``, the slice is a host tensor (pinned on CUDA)."""
    t, mesh = rank_tensor(p), layout.mesh
    world, rank = layout.shard_world, layout.shard_rank
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if (
        mesh.device_type == "cuda"
    ) else torch.device(mesh.device_type)
    chunk = -(-t.shape[0] // world)
    start = min(rank * chunk, t.shape[0])
    rows = max(0, min(chunk, t.shape[0] - start))
    if te_params.is_quantized(t):
        local = te_params.shard_float8_param(t, start, rows, device)
    elif t.device.type == "meta":  # offloaded: allocated on the host at once
        local = torch.empty((rows, *t.shape[1:]), dtype=t.dtype,
                            device=device if offload is None else torch.device("cpu"))
    else:
        local = t.detach().narrow(0, start, rows).to(device).clone()
    if offload is not None:
        local = to_host(local, offload, mesh.device_type)
    spec = tp_spec(p)
    shape = spec.shape if spec is not None else t.shape
    stride = spec.stride if spec is not None else t.contiguous().stride()
    if offload is not None and local.device.type != mesh.device_type:
        # A host shard on a CUDA mesh: from_local would move it back to the device.
        return dtensor_on_local_device(local, mesh, placements(layout, spec), shape, stride)
    return DTensor.from_local(
        local, mesh, placements(layout, spec), run_check=False, shape=shape, stride=stride
    )


def _holds_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def shard(
    module: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    fp8: Float8Policy | None = None,
    allow_partial_mesh: bool = False,
    offload: OffloadPolicy | None = None,
    plain_inputs: bool = True,
    pack_blocks: bool | None = None,
) -> nn.Module:
    """Shard every parameter of ``module`` on dim 0 over ``mesh``, in place; returns ``module``.

    ``mesh`` defaults to a 1-D mesh over the default process group. A 2-D mesh named
    ``("replicate", "shard")`` shards within ``shard`` and replicates across ``replicate`` (HSDP);
    one named ``("dp", "tp")`` shards the tp-local tensors of a model parallelized on ``mesh["tp"]``
    over ``dp`` (FSDP+TP). See :mod:`shardc.sharding.mesh` and docs/meshes.md.
    Like ``fully_shard``, each rank keeps its own slice of its own values (no broadcast): build
    the model with the same seed on every rank, build it on the meta device and initialize
    after sharding, or load a checkpoint. A meta-device module gets uninitialized local shards
    (never a full parameter). On a CUDA mesh it first starts Inductor's Triton compile workers
    (:mod:`shardc.compile.compile_workers`; ``TORCH_WARM_POOL=0`` leaves that to the first compile).
    ``reshard_after_forward``: free gathered parameters after the forward and gather them again
    for the backward (less memory) instead of keeping them.
    ``mp_policy``: the dtypes of the gathered parameters and the reduced gradients
    (:class:`MixedPrecisionPolicy`, or FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy``,
    taken field by field); with ``param_dtype`` set, the root's floating-point forward
    inputs are cast to it (``cast_forward_inputs``, on by default), and with ``output_dtype``
    set its floating-point outputs to that, by forward hooks on ``module``
    (:mod:`shardc.sharding.forward_casts`; FSDP2 casts at every ``fully_shard`` module).
    ``fp8``: gather the weights it selects (``nn.Linear`` by default) in FP8 and, on CUDA, compute
    with them in FP8; see :mod:`shardc.sharding.fp8`.
    ``allow_partial_mesh``: by default ``mesh`` must cover every rank of the default process
    group, or be a slice of a mesh that does (``mesh["dp"]`` of an ``init_device_mesh(...,
    mesh_dim_names=("pp", "dp"))`` mesh); any other mesh raises ``ValueError`` on every rank,
    because the ranks outside it would train unsynchronized copies. ``True`` skips this check,
    for code that synchronizes the model across such meshes itself.
    ``offload``: keep the parameter shards, their gradients and the optimizer state in host
    memory and step the optimizer on the CPU (:class:`shardc.OffloadPolicy`,
    :mod:`shardc.sharding.offload`); ``OffloadPolicy(params=False, optimizer=True)`` keeps
    the shards and gradients on the device and only the optimizer's state and step on the
    host (:mod:`shardc.runtime.offload_optimizer`); ``OffloadPolicy(params="auto")`` keeps
    everything on the device and lets a peak memory budget move the shards, gradients and
    optimizer state to the host where no other lever meets it
    (:mod:`shardc.sharding.auto_offload`).
    ``plain_inputs`` (on by default since the fifty-third session): forwards read each
    parameter's local shard as a plain tensor and its gradient is handed to the DTensor
    parameter afterwards, which removes per-parameter DTensor work from every step (guards,
    AOTAutograd's wrapping, DTensor gradient accumulation); parameters, ``.grad``, parameter
    hooks, optimizers and checkpoints are unchanged. The DTensor parameters are not in the
    autograd graph then: ``torch.autograd.grad`` / ``backward(inputs=...)`` with respect to
    them need ``plain_inputs=False`` (FSDP2's sharded parameters are not in it either). Off
    with CPU offload; see :mod:`shardc.sharding.plain_inputs` for what keeps the DTensor read.
    ``pack_blocks`` (by default, ``None``, what ``plain_inputs`` is: on since the seventieth
    session): each repeated block (compiled once, ``shardc.sharding.blocks``) keeps its local
    shards in one buffer, and compiled forwards read and gather it as one tensor (one graph
    input, one all-gather and one reduce-scatter per block): less to trace, guard and compile
    per block, so the first step hardly grows with depth. Parameters stay DTensors (views of
    the buffer); their gradients are handed over after the backward as with ``plain_inputs``.
    ``False`` reads each parameter on its own. Off with CPU offload, and for a block with a
    frozen, FP8, tensor-parallel or differently typed parameter; see
    :mod:`shardc.sharding.packed_blocks`.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shardc.shard: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) (or init_device_mesh) before sharding."
        )
    if pack_blocks is not None and not isinstance(pack_blocks, bool):
        raise TypeError(f"shardc.shard: pack_blocks must be True, False or None (the default: "
                        f"as plain_inputs), got {pack_blocks!r}")
    # By default the blocks are packed wherever the forwards read plain leaves: a caller keeping
    # the DTensor reads in the autograd graph (plain_inputs=False) keeps each parameter's too.
    pack_blocks = plain_inputs if pack_blocks is None else pack_blocks
    mp_policy = as_policy(mp_policy)  # before the mesh and the compile workers
    mesh = mesh if mesh is not None else _default_mesh(module)
    layout = _check_inputs(module, mesh, allow_partial_mesh)
    # First: the compile workers start while the rest of this and the user's setup runs.
    compile_workers.start_for(mesh.device_type)
    if fp8 is not None and layout.kind != "fsdp":
        # The FP8 gather reduces over the shard group only; HSDP's replicate all-reduce and
        # TP's DTensor re-wrapping are not wired into it.
        raise NotImplementedError(
            f"shardc.shard: fp8=... works on 1-D meshes only, got a {layout.kind.upper()} mesh "
            f"{tuple(mesh.shape)}; shard without fp8 or over a 1-D mesh."
        )
    group_name = layout.shard_group_name
    offload = _check_offload(module, offload, layout, fp8)
    auto = None
    if offload is not None and offload.planner_decides:
        # The shards start on the device; the peak budget may move them (auto_offload).
        auto = AutoOffload(replace(offload, params=True), copy_target(mesh.device_type),
                           wants_pinned(offload, mesh.device_type))
        offload = None

    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    canonical: dict[int, tuple[str, nn.Parameter]] = {}
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for pname, p in sub._parameters.items():
            if p is None:
                continue
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            canonical.setdefault(id(p), (fqn, p))
            owners.setdefault(id(p), []).append((sub, pname))

    if fp8 is not None and not isinstance(fp8, Float8Policy):
        raise TypeError(f"shardc.shard: fp8 must be a shardc.Float8Policy, got {fp8!r}")
    fp8_fqns = select_fp8_params(
        module, fp8, {fqn: len(owners[key]) for key, (fqn, _) in canonical.items()}
    ) if fp8 is not None else set()
    # FP8 parameters are gathered in their own FP8 format; a policy that selects them changes
    # nothing.
    quantized = {fqn for fqn, p in canonical.values() if te_params.is_quantized(p)}
    fp8_fqns -= quantized

    infos: dict[str, ShardedParamInfo] = {}
    for fqn, p in canonical.values():
        infos[fqn] = ShardedParamInfo(
            fqn=fqn,
            dim0=rank_tensor(p).shape[0],
            world=layout.shard_world,
            group_name=group_name,
            compute_dtype=mp_policy.param_dtype,
            reduce_dtype=mp_policy.reduce_dtype,
            reshard_after_forward=reshard_after_forward,
            replicate=layout.replicate_world,
            replicate_group_name=layout.replicate_group_name,
            tp=tp_spec(p),
            fp8=Fp8ParamInfo(fp8.dtype, mp_policy.param_dtype)
            if fqn in fp8_fqns else None,
            quantized=fqn in quantized,
            offload_device=copy_target(mesh.device_type) if offload and offload.params else "",
            offload_pin=bool(offload) and offload.params
            and wants_pinned(offload, mesh.device_type),
        )
    # Before any parameter is replaced: the bodies run unsharded copies of the blocks.
    blocks = wrap_repeated_blocks(
        module, {key: infos[fqn] for key, (fqn, _) in canonical.items()},
        shared={key for key, where in owners.items() if len(where) > 1},
        special={key for key, (fqn, _) in canonical.items()
                 if infos[fqn].fp8 is not None or infos[fqn].quantized or infos[fqn].tp},
        pack=pack_blocks and offload is None and auto is None,
        # CPU offload (either kind) reads each parameter from its host shard or steps host
        # copies of the DTensor parameters: its blocks keep the per-parameter reads.
        not_packed="CPU offload reads each parameter on its own (offload=...)"
        if pack_blocks and (offload is not None or auto is not None) else None)
    per_module: dict[int, tuple[nn.Module, dict[str, ShardedParamInfo]]] = {}
    host_shards = offload if offload is not None and offload.params else None
    for key, (fqn, p) in canonical.items():
        info = infos[fqn]
        new_param = nn.Parameter(_shard_tensor(p, layout, host_shards),
                                 requires_grad=p.requires_grad)
        if info.quantized:
            te_params.bind_shard(new_param, mesh.get_group())
        if host_shards is not None:
            offload_check.remember(new_param, fqn)
        elif offload is not None:  # optimizer-only: the optimizer steps on host copies
            offload_optimizer.remember(new_param, fqn, wants_pinned(offload, mesh.device_type))
        for sub, pname in owners[key]:
            sub._parameters[pname] = new_param
            per_module.setdefault(id(sub), (sub, {}))[1][pname] = info

    # CPU offload (either kind) keeps every parameter on the DTensor read: its reads copy host
    # shards, and optimizer-only offload steps host copies of the DTensor parameters.
    plain = PlainInputs() if plain_inputs and offload is None and auto is None else None
    state = ShardState(mesh, reshard_after_forward, mp_policy, infos, layout=layout, fp8=fp8,
                       group_roles=layout.group_roles(), blocks=blocks, offload=offload,
                       plain=plain, root=weakref.ref(module), auto_offload=auto)
    _STATES[state.key] = state
    for fqn, p in canonical.values():  # an optimizer still holding these is named at its step
        replaced_params.remember(p, fqn)
    # After the check above (its hook runs first): it sees the DTensor parameters.
    default_local_step.install(locally_steppable_params, plainly_read_params)
    # Before the root's forward count hooks, so that it runs first without ``prepend``
    # (forward_casts says why).
    forward_casts.register_input_cast(module, mp_policy.param_dtype, mp_policy.cast_forward_inputs)
    for sub, sub_infos in per_module.values():
        _swap_class(sub, sub_infos, state.grad_sync, fp8, plain, auto)
        if plain is not None:
            for pname, info in sub_infos.items():
                plain.add_owner(info.fqn, sub, pname)
        sub.register_forward_pre_hook(enter_forward)
        sub.register_forward_hook(exit_forward, always_call=True)
        fp8_names = tuple(n for n, i in sub_infos.items() if i.quantized)
        if fp8_names:
            sub.register_forward_pre_hook(te_params.clear_gathered)
            sub.register_forward_hook(te_params.clear_gathered, always_call=True)
            sub.register_state_dict_post_hook(te_params.state_dict_hook(fp8_names))
    # The other modules that hold a parameter below them count their forward too, not only the
    # root: activation checkpointing recomputes a block's forward eagerly inside the backward,
    # outside the root's forward, so a block without parameters of its own that reads a child's
    # parameter directly (``self.child.weight``) would otherwise get the sharded DTensor there.
    # A module with no parameter below it (activations, dropout, rotary tables) cannot read one
    # and gets no hooks: each hook is traced into every graph and run by every eager call.
    for sub in module.modules():
        if id(sub) not in per_module and (sub is module or _holds_params(sub)):
            if getattr(type(sub), "_shardc_block", False):
                # A compile-once block counts its eager forward itself (blocks.counted): hooks
                # on it were traced at every block of every compiled forward (issue 18).
                sub.__dict__[COUNTS_FORWARD] = True
                continue
            sub.register_forward_pre_hook(enter_forward)
            sub.register_forward_hook(exit_forward, always_call=True)
    if id(module) not in per_module:
        _swap_root_class(module)
    # After the root's forward count hooks.
    forward_casts.register_output_cast(module, mp_policy.output_dtype)
    if plain is not None:
        for fqn, info in infos.items():
            plain.refresh(fqn, plain_eligible(info))
    seal_blocks(blocks, module)
    if pack_blocks:
        state.packed = _pack_blocks(module, blocks, state)
    module._shardc_state = state
    return module


def _pack_blocks(root: nn.Module, blocks: BlockBodies, state: ShardState) -> PackedBlocks:
    """Pack the shards of every member of the groups that have packed bodies, and record each
    member's packed gather arguments (its parameters' options, one 1-D tensor of the layout's
    elements per rank)."""
    packed = PackedBlocks()
    for group in blocks.groups:
        if group.packed is None:
            continue
        layout = group.packed.layout
        for member in group.members:
            block = root.get_submodule(member)
            first = state.params[f"{member}.{layout.entries[0].name}"]
            info = replace(first, fqn=packed_fqn(member), dim0=layout.world * layout.numel)
            set_packed_args(block, state.key, _by_mode(info.gather_constants(state.key)))
            packed.add(block, member, layout)
    return packed


def _check_offload(module: nn.Module, offload: OffloadPolicy | None, layout: MeshLayout,
                   fp8: Float8Policy | None) -> OffloadPolicy | None:
    """The offload policy to apply (None: none), checked before any shard is allocated; every
    rank decides the same from the same module and mesh."""
    if offload is None:
        return None
    check_policy(offload, layout.mesh.device_type)
    if not offload.enabled():
        return None
    if fp8 is not None or any(te_params.is_quantized(p) for p in module.parameters()):
        raise NotImplementedError(
            "shardc.shard: offload=... with FP8 (fp8=... or TransformerEngine FP8 parameters) "
            "is not supported; shard without one of them."
        )
    if layout.kind == "fsdp+tp":
        raise NotImplementedError(
            "shardc.shard: offload=... on an FSDP+TP mesh is not supported; offload works on "
            "1-D (FSDP) and HSDP meshes."
        )
    if not offload.planner_decides:  # "auto": checked when the planner moves the shards
        check_host_memory(_local_shard_bytes(module, layout), offload)
    return offload


def _local_shard_bytes(module: nn.Module, layout: MeshLayout) -> int:
    """This rank's parameter shard bytes after sharding (the largest rank's: every rank
    checks the same number), from shapes and dtypes only."""
    total, seen = 0, set()
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        t = rank_tensor(p)
        if t.dim() == 0 or t.shape[0] == 0:
            continue
        rows = -(-t.shape[0] // layout.shard_world)
        total += rows * (t.numel() // t.shape[0]) * t.element_size()
    return total


__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "ShardState", "ShardedParamInfo",
           "is_sharded", "no_sync", "set_requires_gradient_sync", "shard", "shard_state"]


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction off (``False``) for the following backwards of a sharded model,
    e.g. for all but the last micro-batch of a gradient-accumulation step; turning it back on
    makes the next backward reduce everything accumulated meanwhile. See
    :mod:`shardc.runtime.grad_sync`."""
    state = shard_state(unwrap_compiled(module))
    if state is None:
        raise ValueError(
            "shardc.set_requires_gradient_sync: the module was not sharded with shardc.shard; "
            "pass the module given to shardc.shard (or its torch.compile wrapper)."
        )
    state.grad_sync.set_requires_sync(requires_gradient_sync)


@contextlib.contextmanager
def no_sync(module: nn.Module):
    """Context manager: gradients of backwards run inside are accumulated, not reduced."""
    set_requires_gradient_sync(module, False)
    try:
        yield
    finally:
        set_requires_gradient_sync(module, True)
