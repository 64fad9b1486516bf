"""Every private ``torch._*`` API shardc uses, in one place.

shardc supports several torch releases (see README); private APIs move between them. Each one is
imported here, lazily where importing it costs (Inductor, Dynamo), and guarded where releases
differ, so a torch upgrade is checked in one file. ``tests/test_architecture.py`` fails on a
``torch._*`` reference anywhere else in the package.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import re
import warnings
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

# Types and ops whose public aliases do not exist.
OpOverload = torch._ops.OpOverload
funcol = torch.ops._c10d_functional  # torch's functional collectives (the ops graphs hold)
scaled_mm = torch._scaled_mm  # FP8 matmul (CUDA)
# Multi-tensor copies, one kernel on a GPU (FSDP2's bucket copies use the same ops).
foreach_copy_ = torch._foreach_copy_  # copy (and cast) each tensor of a list into another's
chunk_cat = torch._chunk_cat  # pad, chunk and concatenate rank-major (a reduce-scatter's input)
# pytree's tree_map itself (not a wrapper: code traced by Dynamo, where each function it inlines
# is guarded; shardc.sharding.forward_casts runs in every compiled region).
tree_map = torch.utils._pytree.tree_map


def tree_map_only(cls, fn, tree):
    from torch.utils._pytree import tree_map_only as tree_map

    return tree_map(cls, fn, tree)


def detect_fake_mode(values: list) -> Any:
    from torch._guards import detect_fake_mode as detect

    return detect(values)


def unset_fake_temporarily():
    from torch._subclasses.fake_tensor import unset_fake_temporarily as unset

    return unset()


def lazy_graph_module_class() -> type | None:
    """torch's graph module that generates its code at first call, or None."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    return _LazyGraphModule


def create_node_unchecked(graph: torch.fx.Graph, op: str, target: Any, args: tuple,
                          kwargs: dict | None, name: str, type_expr: Any = None
                          ) -> torch.fx.Node:
    """``graph.create_node(op, target, args, kwargs, name, type_expr)`` less the walk over
    ``args`` and ``kwargs`` that torch 2.13's ``create_node`` makes to warn about raw symbolic
    values in them: for copies of nodes that are already in a graph (a body inlined once per
    block), where that walk cost as much as the rest of creating the node. The node is created
    without arguments, then given them as ``fx.Node.__init__`` gives them (which registers it
    as their user). Where the graph's module has hooks on node creation, they would see the node
    without its arguments: there the node is created as usual."""
    owner = graph.owning_module
    if owner is not None and getattr(owner, "_create_node_hooks", None):
        return graph.create_node(op, target, args, kwargs, name, type_expr)
    node = graph.create_node(op, target, (), None, name, type_expr)
    node._update_args_kwargs(args, kwargs or {})
    return node


def custom_partitioner_base() -> type:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    return CustomPartitionerFn


def min_cut_partition(gm, joint_inputs, **kwargs):
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)


def rng_state_wrappers() -> tuple[Any, Any, Any]:
    """The higher-order ops with which torch's partitioner wraps a recomputed random op:
    ``run_and_save_rng_state`` (forward), ``run_with_rng_state`` (backward) and CUDA's
    ``graphsafe_run_with_rng_state`` (both)."""
    from torch._prims import rng_prims

    return (rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state,
            rng_prims.graphsafe_run_with_rng_state)


def inductor_compilers() -> tuple[Any, Any]:
    """(``compile_fx``, ``compile_fx_inner``)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    return compile_fx, compile_fx_inner


def warm_inductor_compile_pool() -> None:
    """Start Inductor's pool of Triton compile workers now, as torch's own Inductor backend
    does when Dynamo hands it a graph (``maybe_warm_pool``: it honours ``TORCH_WARM_POOL=0``
    and ``TORCHINDUCTOR_COMPILE_THREADS=1``, and does nothing without Triton)."""
    from torch._inductor import async_compile

    warm = getattr(async_compile, "maybe_warm_pool", None)
    if warm is not None:
        warm()


def run_and_get_inductor_code(fn: Callable, *args, **kwargs) -> tuple[Any, list[str]]:
    """``fn(*args, **kwargs)``'s result and the wrapper code (Python source) of every graph
    Inductor compiled while it ran, in compile order (tests read the generated code)."""
    from torch._inductor.utils import run_and_get_code

    return run_and_get_code(fn, *args, **kwargs)


def inductor_decompositions_keeping(ops) -> dict:
    """Inductor's decomposition table without ``ops`` (they reach the joint graph whole)."""
    keep = set(ops)
    return {op: fn for op, fn in inductor_decompositions().items() if op not in keep}


def inductor_decompositions() -> dict:
    """Inductor's decomposition table (op overload -> decomposition)."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def trace_decomposed(fn, table: dict, args: list):
    """``make_fx`` of ``fn(*args)`` through the decomposition ``table`` (call it under the
    arguments' fake mode)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, decomposition_table=table)(*args)


def aot_autograd(**kwargs):
    from torch._dynamo.backends.common import aot_autograd as aot

    return aot(**kwargs)


def no_autograd_cache() -> contextlib.AbstractContextManager:
    """AOTAutograd's cache off, local and remote (a hit would skip shardc's partitioner)."""
    config = torch._functorch.config
    off = {"enable_autograd_cache": False}
    if hasattr(config, "enable_remote_autograd_cache"):  # looked up even with the local one off
        off["enable_remote_autograd_cache"] = False
    return config.patch(**off)


def no_donated_buffers() -> contextlib.AbstractContextManager:
    """AOTAutograd's donated buffers off (``donated_buffer``, torch 2.11-2.14) while a region
    compiles. Inductor lowers every graph of a backward, the ``invoke_subgraph`` bodies it
    calls included, with the donated positions of the backward's own inputs (``bw_donated_idxs``
    from the tracing context), so a body's input at such a position is lowered as a buffer the
    body owns and overwrites, though it is its caller's; with the switch off no input of either
    is donated."""
    config = torch._functorch.config
    if not hasattr(config, "donated_buffer"):
        return contextlib.nullcontext()
    return config.patch(donated_buffer=False)


def donated_buffers_enabled() -> bool:
    """Whether AOTAutograd donates saved values to backwards now (``donated_buffer``)."""
    return bool(getattr(torch._functorch.config, "donated_buffer", False))


def set_donated_buffers(on: bool) -> None:
    """Set AOTAutograd's ``donated_buffer``. Only inside :func:`no_donated_buffers`, whose exit
    restores the value it found: a region's partitioner turns donations back on for the rest of
    its own compile (AOTAutograd reads the switch after the partition returns)."""
    config = torch._functorch.config
    if hasattr(config, "donated_buffer"):
        config.donated_buffer = on


def donated_saved_tensors(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule,
                          num_fwd_outputs: int, num_saved_tensors: int) -> list[int] | None:
    """Which of the forward's saved tensors (positions among them, the forward's outputs
    ``num_fwd_outputs`` to ``num_fwd_outputs + num_saved_tensors``) AOTAutograd donates to the
    backward: its own rule (``collect_fw_donated_buffer_idxs``, torch 2.11-2.14: no storage
    shared with a forward input, a user output or a backward output; none at all if either
    graph changes a tensor's metadata). None where this torch has no such rule."""
    try:
        from torch._functorch._aot_autograd import graph_compile as gc
        from torch._functorch._aot_autograd.utils import contain_metadata_mutation_ops
        collect = gc.collect_fw_donated_buffer_idxs
    except (ImportError, AttributeError):
        return None
    if contain_metadata_mutation_ops(fw) or contain_metadata_mutation_ops(bw):
        return []

    def vals(nodes) -> list:
        return [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in nodes]

    fw_outs = fw.graph.output_node().args[0]
    bw_outs = bw.graph.output_node().args[0]
    saved = fw_outs[num_fwd_outputs:num_fwd_outputs + num_saved_tensors]
    return collect(vals(fw.graph.find_nodes(op="placeholder")), vals(fw_outs[:num_fwd_outputs]),
                   vals(bw_outs), vals(saved))


def autograd_cache_enabled() -> bool:
    """Whether AOTAutograd would look its local cache up (``enable_autograd_cache``, and no
    ``torch.compiler.config.force_disable_caches``), as torch 2.11-2.14 decide it."""
    compiler_config = getattr(torch.compiler, "config", None)
    if getattr(compiler_config, "force_disable_caches", False):
        return False
    return bool(getattr(torch._functorch.config, "enable_autograd_cache", False))


def set_unpickle_tracer(gm, tracer_cls: type) -> None:
    """Have FX re-trace ``gm``'s code with ``tracer_cls`` (an ``fx.Tracer`` subclass, importable
    by name) when ``gm`` is unpickled: ``GraphModule.__reduce__`` pickles the module's
    ``__dict__``, whose ``_tracer_cls`` ``torch.fx.graph_module._deserialize_graph_module``
    subclasses to rebuild the graph (FX has read it there since long before torch 2.11)."""
    gm._tracer_cls = tracer_cls


# AOTAutograd's cache logs every lookup on this logger, with the key as the only argument:
# "AOTAutograd cache hit for key %s" / "AOTAutograd cache miss for key %s" (the same text in
# torch 2.11 through 2.14). shardc reads the key there: no API returns it.
_AOT_CACHE_LOGGER = "torch._functorch._aot_autograd.autograd_cache"
_AOT_CACHE_MESSAGES = {"AOTAutograd cache hit for key %s": "hit",
                       "AOTAutograd cache miss for key %s": "miss"}


@contextlib.contextmanager
def autograd_cache_lookups() -> Iterator[list[tuple[str, str]]]:
    """Collect ``(outcome, key)`` for every AOTAutograd cache lookup in this context
    (``outcome``: ``"hit"`` or ``"miss"``), from the cache's log records. The logger is opened
    to INFO for the context if it was not; a record the logger's own level would have dropped is
    dropped after it is read, so handlers see exactly what they would have. If torch's message
    changes, nothing is collected (callers must treat that as "unknown", never as a hit)."""
    logger = logging.getLogger(_AOT_CACHE_LOGGER)
    shown = logger.getEffectiveLevel()
    seen: list[tuple[str, str]] = []

    def read(record: logging.LogRecord) -> bool:
        outcome = _AOT_CACHE_MESSAGES.get(record.msg) if isinstance(record.msg, str) else None
        if outcome is not None and isinstance(record.args, tuple) and len(record.args) == 1:
            seen.append((outcome, str(record.args[0])))
        return record.levelno >= shown

    level = logger.level
    if shown > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.addFilter(read)
    try:
        yield seen
    finally:
        logger.removeFilter(read)
        logger.setLevel(level)


def autograd_cache_hits() -> int:
    """AOTAutograd cache hits so far in this process (Dynamo's counters)."""
    from torch._dynamo.utils import counters

    return int(counters["aot_autograd"]["autograd_cache_hit"])


def inductor_cache_dir() -> str | None:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR`` or its default), under which
    AOTAutograd keeps its entries too (``<dir>/aotautograd``); None where torch moved it."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # pragma: no cover - torch 2.11-2.14 all have it
        return None
    return cache_dir()


def forget_mesh_hashes(example_inputs) -> None:
    """Clear the cached ``hash()`` of the ``DeviceMesh`` objects among a graph's example inputs
    (graphs of DTensor parameters take their mesh as an opaque input, torch 2.13), and of the
    spec and mesh of its DTensor inputs (torch 2.11 pickles the DTensors themselves into
    AOTAutograd's key).

    Why: Inductor's FX graph cache and AOTAutograd's cache pickle these objects into their keys,
    and a mesh's or spec's pickled state includes ``_hash``, memoized from ``hash()`` of a tuple
    holding strings and ``None``, which differs in every process, so a restart never hit the
    cache. Clearing the memo changes nothing else: ``__hash__`` recomputes the same value within
    this process when it finds it unset. A workaround for torch; remove it once their pickled
    state leaves the memo out. Objects without that memo (other releases) are left alone.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    def forget(obj: object) -> None:
        if isinstance(vars(obj).get("_hash"), int):
            obj._hash = None

    for value in example_inputs:
        if isinstance(value, DTensor):
            spec = getattr(value, "_spec", None)
            if spec is not None and hasattr(spec, "__dict__"):
                forget(spec)
                if isinstance(getattr(spec, "mesh", None), DeviceMesh):
                    forget(spec.mesh)
            continue
        mesh = getattr(value, "real_obj", None) if not isinstance(value, torch.Tensor) else None
        if isinstance(mesh, DeviceMesh):
            forget(mesh)


def dynamo_compile_start_ns() -> int | None:
    """When Dynamo began compiling the frame being compiled now (``time.time_ns``), from its
    metrics context, or None (not compiling, or a torch without it)."""
    with contextlib.suppress(Exception):
        from torch._dynamo.utils import get_metrics_context

        context = get_metrics_context()
        started = getattr(context, "_start_time_ns", 0)
        if context.in_progress() and started:
            return int(started)
    return None


def dynamo_reset() -> None:
    torch._dynamo.reset()


def resolve_process_group(group_name: str):
    from torch.distributed import distributed_c10d

    return distributed_c10d._resolve_process_group(group_name)


def process_group_store(group):
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_process_group_store(group)


def process_group_timeout(group, device: torch.device):
    return group._get_backend(device).options._timeout


def strided_shard(dim: int, split_factor: int):
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def fake_store():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def root_mesh(mesh):
    """The device mesh ``mesh`` was sliced from, or None where this torch cannot tell
    (``DeviceMesh._get_root_mesh``; ``_mesh_resources.get_root_mesh`` in older releases)."""
    from torch.distributed.device_mesh import DeviceMesh

    get = getattr(mesh, "_get_root_mesh", None)
    if callable(get):
        with contextlib.suppress(Exception):
            root = get()
            if isinstance(root, DeviceMesh):
                return root
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in the torch versions that have the above
        from torch.distributed.device_mesh import _mesh_resources

        root = _mesh_resources.get_root_mesh(mesh)
        if isinstance(root, DeviceMesh):
            return root
    return None


def flatten_state_dict(state_dict: dict):
    """DCP's own flattening of a nested state dict: ``(flat dict, mapping)`` whose keys are the
    checkpoint's metadata keys."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(state_dict)


def dtensor_on_local_device(local: torch.Tensor, mesh, placements, shape, stride):
    """A DTensor of ``local`` that keeps ``local`` where it is: ``DTensor.from_local`` moves a
    local tensor to the mesh's device type, which CPU offload (host shards on a CUDA mesh) must
    not do. Built from its spec (``DTensorSpec``/``TensorMeta``, private; FSDP2's CPU offload
    builds its sharded parameters the same way). Same signatures in torch 2.11 through 2.13."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
    return DTensor(local, spec, requires_grad=False)


def move_dtensor_local(dtensor, local: torch.Tensor) -> None:
    """Make the DTensor ``dtensor`` (a parameter or a gradient, kept as the same object: the
    user's optimizer and autograd hold it) hold ``local``, of the same shape, on another device
    (CPU offload chosen by the planner, :mod:`shardc.sharding.auto_offload`). Two steps:
    ``.data`` gives the wrapper the new device, and ``_local_tensor`` (private; FSDP2 assigns it
    the same way when it resets its sharded parameters) the new shard. ``torch.utils.
    swap_tensors`` would do both but refuses tensors with weak references, which Dynamo and
    shardc's parameter registries hold."""
    if tuple(local.shape) != tuple(dtensor._local_tensor.shape):
        raise ValueError(f"move_dtensor_local: shape {tuple(local.shape)} for a local shard of "
                         f"shape {tuple(dtensor._local_tensor.shape)}")
    moved = dtensor_on_local_device(local, dtensor.device_mesh, dtensor.placements,
                                    dtensor.shape, dtensor.stride())
    dtensor.data = moved
    dtensor._local_tensor = local


def forget_fake(fake_mode, real: torch.Tensor) -> None:
    """Make ``fake_mode`` fakify ``real`` anew next time: it remembers the fake it made of each
    real tensor (``FakeTensorConverter``'s memo, private: the describer's ``lookup_tensor``,
    the same in torch 2.11 through 2.13), with the device the tensor had then. A parameter
    whose shard the planner moved to the host (:mod:`shardc.sharding.auto_offload`) must be
    traced again as a host tensor."""
    if fake_mode is None:
        return
    lookup = fake_mode.fake_tensor_converter.meta_converter.describer.lookup_tensor
    if real in lookup:
        del lookup[real]


def is_fake(t: object) -> bool:
    """Whether ``t`` is a fake tensor, or a DTensor over one."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or isinstance(getattr(t, "_local_tensor", None), FakeTensor)


def fake_of(fake_mode, real: torch.Tensor) -> Any:
    """``real`` as a fake tensor of ``fake_mode`` (Dynamo's), shapes static."""
    return fake_mode.from_tensor(real, static_shapes=True)


def dtensor_with_spec_of(local: torch.Tensor, like) -> Any:
    """A DTensor of ``local`` (no copy) with the spec of the DTensor ``like`` (its mesh,
    placements, global shape, stride and dtype): the gradient handed to a parameter by
    ``shardc.sharding.plain_inputs``. The spec object is shared, not rebuilt (``_spec``,
    private; the DTensor constructor takes it in torch 2.11 through 2.13)."""
    cls, new = _DTENSOR
    if torch.compiler.is_compiling():
        return cls(local, like._spec, requires_grad=False)
    # Eagerly (the hand-off runs in autograd's engine, once per parameter per backward), the
    # constructor without its Dynamo-disabling wrapper, which costs more than the rest of it.
    return new(cls, local, like._spec, requires_grad=False)


def dtensor_over_view(view: torch.Tensor, like) -> Any:
    """A DTensor with the spec of the DTensor ``like`` whose local tensor is ``view`` (no copy)
    and whose wrapper has storage offset 0, as a DTensor over a tensor of its own has. Not for
    tensors a compiled region reads: Dynamo fakes a DTensor's wrapper and local tensor with one
    storage offset.

    Why: torch's DTensor constructor gives the wrapper its local tensor's storage offset
    (pytorch#167597), so a DTensor over a view inside a larger buffer (a packed block's
    parameter, :mod:`shardc.sharding.packed_blocks`) reports a nonzero ``data_ptr()`` though
    the wrapper has no storage; DCP's async staging (``StateDictStager._offload_tensor``,
    torch 2.11 through 2.13) takes such a tensor for one with storage and fails ("invalid
    python storage"). Built over an offset-0 alias of ``view``'s storage (in bounds: that
    storage holds ``view``), then given ``view`` as its local tensor (``_local_tensor``,
    private, as :func:`move_dtensor_local`)."""
    cls, new = _DTENSOR
    out = new(cls, view.as_strided(view.shape, view.stride(), 0), like._spec,
              requires_grad=False)
    out._local_tensor = view
    return out


def _dtensor_new() -> tuple[type, Callable]:
    from torch.distributed.tensor import DTensor

    new = DTensor.__new__
    return DTensor, getattr(new, "__wrapped__", new)


_DTENSOR = _dtensor_new()


def dtensor_local(t) -> torch.Tensor:
    """The local tensor a DTensor wraps (``_local_tensor``), without ``to_local``'s autograd."""
    return t._local_tensor


# :func:`dtensor_local` as a C-level callable (no Python frame): for per-parameter loops that run
# every step (``shardc.optim.local_step``). Unlike ``DTensor.to_local()`` it never makes a view:
# under no_grad torch 2.11's ``to_local()`` returns ``_local_tensor`` itself, as this always does,
# while torch 2.13's returns a fresh view flagged ``_is_param`` for a parameter.
dtensor_local_fast: Callable[[Any], torch.Tensor] = operator.attrgetter("_local_tensor")

# A DTensor's spec object (``_spec``: mesh, placements, global shape), read C-level: shardc's
# gradient hand-offs give a gradient its parameter's spec object, which an identity test finds
# without comparing placements (``shardc.optim.default_local_step``, every step).
dtensor_spec_fast: Callable[[Any], Any] = operator.attrgetter("_spec")


def grad_hooks(t: torch.Tensor) -> tuple[tuple[Callable, ...], tuple[Callable, ...]]:
    """The hooks registered on ``t``'s gradient (``register_hook``) and on its accumulation
    (``register_post_accumulate_grad_hook``), each in registration order: the private dicts
    autograd keeps them in, read where shardc hands a gradient to ``t`` itself (once per
    parameter per backward: nothing is allocated where there are none)."""
    pre = getattr(t, "_backward_hooks", None)
    post = getattr(t, "_post_accumulate_grad_hooks", None)
    return (tuple(pre.values()) if pre else (), tuple(post.values()) if post else ())


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter (bumped by every in-place change of it or of a view of it)."""
    return t._version


# The fused attention kernels a GPU runs for ``F.scaled_dot_product_attention`` (their meta
# kernels give the output and log-sum-exp shapes; ``shardc.tools.attention`` traces them).
flash_attention = torch.ops.aten._scaled_dot_product_flash_attention.default
efficient_attention = torch.ops.aten._scaled_dot_product_efficient_attention.default


def backend_failure_cause(exc: BaseException) -> BaseException | None:
    """The exception a torch.compile backend raised, if ``exc`` is Dynamo's wrapper of it."""
    from torch._dynamo.exc import BackendCompilerFailed

    if isinstance(exc, BackendCompilerFailed):
        return exc.inner_exception
    return None


def dynamo_to_local_closure(target: object) -> tuple[tuple, dict] | None:
    """If ``target`` is the function torch 2.11's Dynamo puts in its graph for
    ``DTensor.to_local(*args, **kwargs)`` (``TensorVariable.method_to_local``: a closure named
    ``prim_to_local`` over the call's constant arguments), those arguments; else None.

    AOTAutograd's cache refuses such a node ("Unsupported call_function target"); torch 2.13's
    Dynamo traces ``to_local`` through and leaves no node."""
    if not callable(target) or getattr(target, "__name__", None) != "prim_to_local":
        return None
    code = getattr(target, "__code__", None)
    cells = getattr(target, "__closure__", None) or ()
    if code is None or code.co_freevars != ("args_as_value", "kwargs_as_value"):
        return None
    args, kwargs = (cell.cell_contents for cell in cells)
    return tuple(args), dict(kwargs)


def nested_compile_region(fn):
    """``torch.compiler.nested_compile_region(fn)``: Dynamo traces every call of ``fn`` and
    deduplicates identical subgraphs. torch 2.13's guard-based reuse, which skips the trace,
    never applies to shardc's bodies (they swap the skeleton's parameters,
    ``blocks.call_substituted``: a side effect); torch 2.11's Dynamo has no reuse of a region's
    trace at all (``InvokeSubgraphHigherOrderVariable`` traces each call, then compares the
    subgraph with the installed ones). Used for inputs with symbolic sizes, where
    :func:`keyed_compile_region`'s stamp-out across activation-checkpoint regions failed
    (``KeyError: s27``), and on torch < 2.13."""
    return torch.compiler.nested_compile_region(fn)


def supports_keyed_regions() -> bool:
    """Whether ``torch.compiler.nested_compile_region`` takes a ``reuse_hash_fn`` (torch 2.13+):
    what :func:`keyed_compile_region` needs."""
    import inspect

    return "reuse_hash_fn" in inspect.signature(torch.compiler.nested_compile_region).parameters


def keyed_compile_region(fn):
    """``torch.compiler.nested_compile_region(fn)`` whose reuse key is ``fn``'s first argument,
    the decimal ``str`` of an ``int`` the caller derived from everything a trace of ``fn``
    depends on (:func:`region_key`): Dynamo traces the first call per key and stamps that trace
    out for the other calls with the same key, instead of tracing every call (torch 2.13+'s
    ``reuse_hash_fn``). None where torch has no ``reuse_hash_fn`` (2.11, 2.12): the caller keeps
    the guard-based region."""
    if not supports_keyed_regions():
        return None
    mark = torch.compiler.nested_compile_region

    def reuse_key(key: str, *args, **kwargs) -> int:
        return int(key)

    return mark(fn, reuse_hash_fn=reuse_key)


def region_key(key: int) -> str:
    """A :func:`keyed_compile_region`'s key argument. A string, not the ``int``: where Dynamo
    cannot trace a region's body (a graph break inside it), the region's own frame runs, and
    Dynamo compiles that frame on its own with the key as an input. An ``int`` input that takes a
    second value there (two blocks' calls with different keys: the first block's input without
    ``requires_grad``) becomes symbolic under automatic dynamic shapes, and the reuse key must
    be a constant ("reuse_hash_fn must return a constant integer"); a string input is guarded
    by value and never made symbolic."""
    return str(key)


def _static_value_check() -> Callable[[object], bool]:
    from torch.fx.experimental import symbolic_shapes

    check = getattr(symbolic_shapes, "has_static_value", None)
    return check if check is not None else (lambda value: False)


# Whether an ``int`` (a tensor size, a stride, an argument) has one value for the trace, not a
# symbolic one: torch's own function, which Dynamo folds while it traces (there a symbolic size
# passes for an ``int``: ``isinstance(size, torch.SymInt)`` is False); always False where torch
# lacks it. Bound once here, not looked up at each call: traced code calls it for every size of
# every block's arguments, and Dynamo interpreted the lookup (an import and a getattr) at each.
has_static_value: Callable[[object], bool] = _static_value_check()


def selective_checkpoint_policy(gm) -> object | None:
    """The ``context_fn`` (selective activation checkpointing policy) Dynamo recorded on the
    subgraph of a ``torch.utils.checkpoint`` region, or None (no region, or plain
    checkpointing)."""
    return gm.meta.get("_checkpoint_context_fn") if gm is not None else None


def data_dependent_size_check() -> Callable[[tuple, dict], bool]:
    """A function ``(args, kwargs) -> bool``: whether a tensor among ``args`` or ``kwargs``'
    values has a size known only at run time (an unbacked symbol). Meant to be called in code
    that Dynamo traces: it is answered from the fake tensors while tracing, so it costs nothing
    at run time and adds nothing to the graph. Call this outside tracing (it picks the check
    that the installed Dynamo folds)."""
    unbacked = _unbacked_size_check()

    def has_data_dependent_sizes(args: tuple, kwargs: dict) -> bool:
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and unbacked(value):
                return True
        return False

    return has_data_dependent_sizes


def traces_floats_symbolically() -> bool:
    """Whether Dynamo, in the compile under way, traces Python floats (a module's ``eps``) as
    symbols: ``torch.compile(dynamic=True)`` without ``specialize_float``. Safe to call in
    traced code (read from Dynamo's config, folded while tracing)."""
    config = torch._dynamo.config
    return not config.assume_static_by_default and not config.specialize_float


def guards_module_hooks() -> bool:
    """Whether Dynamo guards the hooks of the modules it traces, so that a hook registered
    after compiling recompiles (``skip_nnmodule_hook_guards`` off; torch's default keeps it on
    and ignores such hooks until something else recompiles). Safe to call in traced code (read
    from Dynamo's config, folded while tracing)."""
    return not getattr(torch._dynamo.config, "skip_nnmodule_hook_guards", True)


def _unbacked_size_check() -> Callable[[torch.Tensor], bool]:
    from torch._dynamo import trace_rules
    from torch.fx.experimental import symbolic_shapes

    folded = getattr(trace_rules, "manual_torch_name_rule_map", {})
    name = "torch.fx.experimental.symbolic_shapes.has_free_unbacked_symbols"
    if name in folded or not hasattr(symbolic_shapes, "size_hint"):  # torch 2.12+
        return symbolic_shapes.has_free_unbacked_symbols
    # torch 2.11's Dynamo graph-breaks on ``has_free_unbacked_symbols`` (a break in every
    # block's forward) but folds ``size_hint``, which hints each unbacked symbol of a size with
    # its fallback: a size whose hint changes with the fallback depends on one.
    size_hint = symbolic_shapes.size_hint

    def has_unbacked_size(tensor: torch.Tensor) -> bool:
        # No isinstance(size, torch.SymInt): torch 2.11's Dynamo answers it False for a SymInt.
        return any(size_hint(size, 1) != size_hint(size, 2) for size in tensor.shape)

    return has_unbacked_size


def _dynamo_comptime() -> Callable:
    from torch._dynamo.comptime import comptime

    return comptime


# ``comptime(fn)`` in code Dynamo traces runs ``fn(ctx)`` at that point of the trace, where
# ``ctx.get_local(name)`` is a variable of the traced frame and ``.as_fake()`` its fake value
# (symbolic sizes included); a no-op when run eagerly. Bound here so that traced code reaches
# the object Dynamo recognizes through a module attribute.
comptime: Callable = _dynamo_comptime()


def traced_storages(ctx: Any, name: str) -> list[tuple[tuple[int, int], int, object]]:
    """In a ``comptime`` callback: for the traced local ``name`` (a tuple), each tensor among
    its items and the items of its tuple or list items, ``((item, inner), storage, node)``:
    its position (``inner`` -1 for an item itself), a number equal for tensors that share a
    storage (from their fake values) and its graph node (the same for one tensor met twice).
    Anything else is skipped (a cache object, a constant)."""
    from torch._dynamo.variables import BaseListVariable, TensorVariable

    found = []
    top = ctx.get_local(name)._i_will_not_complain_if_bc_breaks_VariableTracker()
    for i, item in enumerate(top.items if isinstance(top, BaseListVariable) else ()):
        inner = item.items if isinstance(item, BaseListVariable) else None
        for j, vt in (enumerate(inner) if inner is not None else ((-1, item),)):
            if not isinstance(vt, TensorVariable):
                continue
            node = vt.as_proxy().node
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                found.append(((i, j), value.untyped_storage()._cdata, node))
    return found


def traced_plain_tensors(ctx: Any, name: str, plain: tuple[type, ...]) -> list | None:
    """In a ``comptime`` callback: the fake values of the traced local ``name`` (a tuple or
    list) if every item is a tensor of a type in ``plain`` with static sizes and strides, else
    None."""
    from torch._dynamo.variables import BaseListVariable, TensorVariable

    top = ctx.get_local(name)._i_will_not_complain_if_bc_breaks_VariableTracker()
    if not isinstance(top, BaseListVariable):
        return None
    values = []
    for vt in top.items:
        if not isinstance(vt, TensorVariable) or vt.python_type() not in plain:
            return None
        value = vt.as_proxy().node.meta.get("example_value")
        if not isinstance(value, torch.Tensor) or not all(
                type(n) is int for n in (*value.shape, *value.stride())):
            return None
        values.append(value)
    return values


def symbolic_signature(value: Any) -> tuple[tuple, Any] | None:
    """A description of a fake tensor or ``SymInt`` met while Dynamo traces (``comptime``'s
    ``as_fake()``) by its symbolic expressions, and the values it has now (hints), or None:
    a size known only at run time (unbacked), or a value of another kind.

    A tensor: ``(("symtensor", sizes, strides, dtype, device type, device index,
    requires_grad), (size hints, stride hints))`` with each size and stride an ``int`` or its
    expression's text (``"s0"``, ``"4096*s0"``); a ``SymInt``: ``(("symint", text), hint)``.
    Within one trace equal texts are the same symbols (one ShapeEnv), so two values with equal
    descriptions have equal sizes in every run of the compiled code."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    def term(n) -> tuple[Any, int] | None:
        if not isinstance(n, torch.SymInt):
            return n, n
        node = n.node
        if free_unbacked_symbols(n) or node.hint is None:
            return None
        return str(node.expr), int(node.hint)

    if isinstance(value, torch.Tensor):
        terms = [term(n) for n in (*value.shape, *value.stride())]
        if any(t is None for t in terms):
            return None
        rank = value.dim()
        texts, hints = zip(*terms) if terms else ((), ())
        desc = ("symtensor", texts[:rank], texts[rank:], value.dtype, value.device.type,
                value.device.index, value.requires_grad)
        return desc, (hints[:rank], hints[rank:])
    if isinstance(value, torch.SymInt):
        t = term(value)
        return None if t is None else (("symint", t[0]), t[1])
    return None


def run_frame_eagerly(fn) -> None:
    """Never compile ``fn``'s frame when Dynamo meets it as a frame of its own (it runs as plain
    Python there); a call to ``fn`` inside code Dynamo is tracing is still inlined into the graph
    (unlike ``torch.compiler.disable``, which breaks the graph there)."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(fn.__code__)


def cuda_allocator_settings() -> str:
    """The CUDA caching allocator's settings string (``"expandable_segments:True,..."``): torch's
    own getter where it has one (2.13+: also what was set at run time), else the environment
    variables it reads at start-up (``PYTORCH_ALLOC_CONF``, ``PYTORCH_CUDA_ALLOC_CONF``)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        return str(getter())
    return ",".join(v for v in (os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                                os.environ.get("PYTORCH_ALLOC_CONF")) if v)


def inductor_mode_options(mode: str) -> dict[str, Any]:
    """Inductor's config patches for ``torch.compile(..., mode=mode)`` (``reduce-overhead``:
    ``{"triton.cudagraphs": True}``); raises for an unknown mode."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def inductor_cudagraphs_on() -> bool:
    """Whether Inductor's global config asks for CUDA graphs (``triton.cudagraphs``)."""
    from torch._inductor import config

    return bool(config.triton.cudagraphs)


def inductor_cudagraph_skips() -> int:
    """How many graphs Inductor has declined to record into CUDA graphs in this process."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def current_subgraph_tracer() -> object | None:
    """The (sub)graph Dynamo is recording into right now (its ``SubgraphTracer``: the frame's
    root graph, or the body of a higher-order op being speculated, e.g. a checkpoint region), or
    None outside a trace. Called eagerly at trace time (from an ``assume_constant_result``
    function). A restarted analysis records into new tracers (``InstructionTranslator.current_tx``
    and ``OutputGraph.current_tracer``: the same in torch 2.11 through 2.13)."""
    with contextlib.suppress(Exception):
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        if tx is not None:
            return tx.output.current_tracer
    return None


def compiling_backend_marked(marker: str) -> bool:
    """Whether the backend of the compile Dynamo is tracing now carries attribute ``marker``
    (looked up through Dynamo's wrappers: ``OutputGraph.compiler_fn``, then
    ``_torchdynamo_orig_backend`` / ``compiler_fn`` / ``__wrapped__`` / ``func``). Called eagerly
    at trace time; False when it cannot tell."""
    with contextlib.suppress(Exception):
        from torch._dynamo.symbolic_convert import InstructionTranslator

        fn = InstructionTranslator.current_tx().output.compiler_fn
        for _ in range(16):
            if fn is None:
                return False
            if getattr(fn, marker, False) is True:
                return True
            fn = next((getattr(fn, a) for a in ("_torchdynamo_orig_backend", "compiler_fn",
                                                "__wrapped__", "func")
                       if getattr(fn, a, None) is not None and getattr(fn, a) is not fn), None)
    return False


def dynamo_recompile_limit() -> int:
    """How many compiled entries Dynamo keeps per code object before it runs the frame
    eagerly (``recompile_limit``; ``cache_size_limit`` before torch renamed it; 8 by
    default)."""
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", getattr(config, "cache_size_limit", 8)))


def dynamo_inlines_single_use_subgraphs() -> bool:
    """Whether Dynamo inlines an ``invoke_subgraph`` call whose subgraph has one use (or every
    one) before the backend sees the graph (``inline_single_use_invoke_subgraph``, on by
    default in torch 2.13; ``inline_invoke_subgraph``); False where torch has neither (2.11)."""
    config = torch._dynamo.config
    return bool(getattr(config, "inline_single_use_invoke_subgraph", False)
                or getattr(config, "inline_invoke_subgraph", False))


def cached_guards(code, every_part: bool = False) -> list[tuple[str, str]]:
    """The leaf guards of every cache entry Dynamo holds for ``code`` (a compiled function's
    ``__code__``): (kind, the guard's text), e.g. ``("EQUALS_MATCH", "...")``; for the guard
    census (docs/overhead.md, "Guards per step") and the tests that bound it. A guard's text is
    its first code part; ``every_part``: one entry per code part instead (a lambda guard that
    checks several things, e.g. Dynamo's object-aliasing epilogue, one ``a is b`` per part)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    def kinds(guard) -> list[tuple[str, str]]:
        parts = guard.verbose_code_parts()
        if every_part:
            return [(type(guard).__name__, part) for part in parts]
        return [(type(guard).__name__, parts[0] if parts else "")]

    found: list[tuple[str, str]] = []

    def walk(mgr) -> None:
        found.extend(k for g in mgr.get_leaf_guards() for k in kinds(g))
        if hasattr(mgr, "get_key_value_managers"):  # dict managers: their keys and values
            for key_mgr, value_mgr in mgr.get_key_value_managers().values():
                for sub in (key_mgr, value_mgr):
                    if sub is not None:
                        walk(sub)
        for child in mgr.get_child_managers():
            walk(child)

    for entry in _debug_get_cache_entry_list(code):
        root = entry.guard_manager.root
        walk(root)
        found.extend(k for g in getattr(root, "get_epilogue_lambda_guards", list)()
                     for k in kinds(g))
    return found


def cached_guard_check(code) -> Callable[[dict], bool]:
    """The guard check of ``code``'s first cache entry: called with a frame's locals, it is
    what Dynamo's cache lookup evaluates at each call (for timing it)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return _debug_get_cache_entry_list(code)[0].guard_manager.check


def optimizer_step_hooks(optimizer) -> list:
    """Every step hook that runs around ``optimizer.step()``: the process-wide pre-hooks, the
    optimizer's own pre- and post-hooks, the process-wide post-hooks. torch keeps them in
    private dicts (``torch.optim.optimizer._global_optimizer_pre_hooks`` and the like, the
    optimizer's ``_optimizer_step_pre_hooks``); there is no public accessor (2.11-2.13)."""
    from torch.optim import optimizer as optim_module

    return [*optim_module._global_optimizer_pre_hooks.values(),
            *optimizer._optimizer_step_pre_hooks.values(),
            *optimizer._optimizer_step_post_hooks.values(),
            *optim_module._global_optimizer_post_hooks.values()]


# Where torch keeps what it traced of each invoke_subgraph body in a compile, keyed by the call's
# identifier (torch._guards.InvokeSubgraphCache; the same fields on torch 2.11-2.14): the
# autograd function, the dispatch-traced graph, the lazily traced backward, the effects; the
# functionalized schema by (id(subgraph), identifier, operand types).
_SUBGRAPH_TRACE_TABLES = ("autograd_cache", "proxy_dispatch_cache", "lazy_bwd_cache",
                          "effects_cache")


def forget_subgraph_traces(identifiers: Collection[str]) -> int:
    """Drop what this compile's tracing context recorded for the ``invoke_subgraph`` bodies
    named ``identifiers`` (and the forward/backward calls torch derives from them,
    ``fw_<identifier>``, ``bw_<identifier>_<n>``), so that a graph traced again with other
    bodies under those identifiers (the region compiled again without
    ``sink_block_residual``) does not reuse the first attempt's traces. Dropping more than
    needed only costs a trace. Returns how many entries were dropped (0 outside a compile)."""

    from torch._guards import TracingContext  # noqa: PLC0415

    context = TracingContext.try_get()
    sets = getattr(context, "hop_dispatch_set_cache", None)
    cache = sets.get_cache(torch.ops.higher_order.invoke_subgraph) if sets is not None else None
    if cache is None or not identifiers:
        return 0
    named = re.compile("|".join(rf"(?<![A-Za-z0-9]){re.escape(i)}(?![0-9])"
                                for i in sorted(identifiers)))

    def names(key: object) -> bool:
        key = key[1] if isinstance(key, tuple) and len(key) > 1 else key
        return isinstance(key, str) and named.search(key) is not None

    dropped = 0
    for attr in (*_SUBGRAPH_TRACE_TABLES, "functionalize_schema_cache"):
        table = getattr(cache, attr, None)
        if isinstance(table, dict):
            for key in [k for k in table if names(k)]:
                del table[key]
                dropped += 1
    return dropped


def op_watch(run_op: Callable[[Any, tuple, dict], Any]) -> contextlib.AbstractContextManager:
    """A dispatch mode that runs each aten op as ``run_op(func, args, kwargs)`` (which calls
    ``func(*args, **kwargs)`` itself): shardc's block prober looks at the ops a block's forward
    runs on meta tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return run_op(func, args, kwargs or {})

    return Watch()


def captured_data_dependent_ops_run_in_bodies() -> bool:
    """Whether a block whose forward runs a data-dependent op that Dynamo captures
    (``capture_dynamic_output_shape_ops``, ``capture_scalar_outputs``) still compiles: from
    torch 2.12 its body runs eagerly where Dynamo cannot trace it (s78: transformers' DBRX at
    parity over two ranks on 2.13, the tests' MoE blocks on 2.12-2.14); torch 2.11 fails inside
    the body (``UncapturedHigherOrderOpError``, a size constraint on the captured op's output)."""
    return torch.torch_version.TorchVersion(torch.__version__) >= "2.12"


def dynamo_may_break_on(func: Any) -> bool:
    """Whether Dynamo, as configured now, may break the graph at op ``func``: an op whose
    output's shape depends on the data (``nonzero``; ``index`` with a boolean mask; the tag
    alone overclaims: ``index`` with integer indices is tagged too), or a tensor's value read
    as a Python number (``.item()``). A caller that ran ``func`` on meta tensors and saw it
    fail knows Dynamo breaks there (meta tensors have no data either), which it cannot do
    inside a ``nested_compile_region`` body."""
    tags = getattr(func, "tags", ())
    config = torch._dynamo.config
    if torch.Tag.dynamic_output_shape in tags:
        return not config.capture_dynamic_output_shape_ops
    if torch.Tag.data_dependent_output in tags:
        return not config.capture_scalar_outputs
    return False
