"""The copies of CPU offload (:mod:`shardc.sharding.offload`) as custom ops.

``offload_to_device`` copies a parameter's host shard to the device the forward computes on;
its autograd copies the reduced gradient shard back to the host (``offload_to_host``), in the
master's dtype. Under ``torch.compile`` both are opaque graph nodes that name their parameter,
so the planner finds them like the gather and reduce ops and places them on the plan's copy
lane; the lowering (``shardc.passes.lower``) moves each bucket's host->device copies to the
position the plan gave them.

On a CPU mesh under ``OffloadPolicy(simulate_on_cpu=True)`` the "device" is the CPU: each copy
is a fresh tensor, so the data really travels through a separate buffer, as on a GPU.
"""

from __future__ import annotations

import torch

_LIB = "shardc"


@torch.library.custom_op(f"{_LIB}::offload_to_device", mutates_args=())
def offload_to_device(shard: torch.Tensor, fqn: str, device: str, pin_grad: bool) -> torch.Tensor:
    """A device copy of the host shard of parameter ``fqn`` (same dtype: the gather casts).

    ``pin_grad``: the backward's host gradient is allocated in pinned memory."""
    target = torch.device(device)
    if target.type == shard.device.type:  # a CPU mesh simulating offload: a separate tensor
        return shard.clone()
    return shard.to(target, non_blocking=shard.is_pinned())


@offload_to_device.register_fake
def _to_device_fake(shard, fqn, device, pin_grad):
    return torch.empty(shard.shape, dtype=shard.dtype, device=torch.device(device))


@torch.library.custom_op(f"{_LIB}::offload_to_host", mutates_args=())
def offload_to_host(grad: torch.Tensor, fqn: str, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """The host copy, in ``dtype`` (the master's), of the reduced gradient shard of ``fqn``.

    The copy is synchronous: the optimizer (or a norm for clipping) may read the host gradient
    as soon as the backward returns."""
    if grad.device.type == "cpu":
        return grad.to(dtype, copy=True)
    out = torch.empty(grad.shape, dtype=dtype, device="cpu",
                      pin_memory=pin and torch.cuda.is_available())
    out.copy_(grad)
    return out


@offload_to_host.register_fake
def _to_host_fake(grad, fqn, dtype, pin):
    return torch.empty(grad.shape, dtype=dtype, device="cpu")


def _setup(ctx, inputs, output) -> None:
    shard, fqn, _device, pin_grad = inputs
    ctx.fqn, ctx.dtype, ctx.pin = fqn, shard.dtype, pin_grad
    # A shard still on the device (OffloadPolicy(params="auto") before the planner moves it,
    # traced only: the backend drops these copies, shardc.passes.offload_unplaced) gets its
    # gradient where it is; autograd refuses a gradient on another device than its input.
    ctx.on_host = shard.device.type == "cpu"


def _backward(ctx, grad):
    if not ctx.on_host:
        return grad.to(ctx.dtype), None, None, None
    return offload_to_host(grad, ctx.fqn, ctx.dtype, ctx.pin), None, None, None


offload_to_device.register_autograd(_backward, setup_context=_setup)

TO_DEVICE_OP = torch.ops.shardc.offload_to_device.default
TO_HOST_OP = torch.ops.shardc.offload_to_host.default


def is_to_device(node) -> bool:
    """Whether ``node`` calls ``offload_to_device``: in AOTAutograd's graphs the op itself, in
    Dynamo's also its overload packet or the function (torch 2.11-2.13 differ there)."""
    return getattr(node, "op", None) == "call_function" and node.target in (
        TO_DEVICE_OP, TO_DEVICE_OP.overloadpacket, offload_to_device)


def is_to_host(node) -> bool:
    return getattr(node, "op", None) == "call_function" and node.target is TO_HOST_OP


def copy_fqn(node) -> str:
    """The parameter an offload copy node moves."""
    return node.args[1] if len(node.args) > 1 else node.kwargs["fqn"]


def copied_shard(node):
    """The shard argument of an ``offload_to_device`` call (positional or by keyword)."""
    return node.args[0] if node.args else node.kwargs["shard"]


# -- The split form the lowering uses: a copy started at the plan's issue position on a copy
# stream, and waited at its wait position (the compute stream waits for a host->device copy; the
# CPU waits for a device->host one). On a CPU mesh (simulation) the copy is made at the start and
# the wait does nothing. Activation offload (``shardc.passes.offload_saved``) never waits on the
# CPU: its device->host copies are waited by the compute stream where their sources may be
# reused (``offload_copy_release``) and by the copy stream before the host copy is read back
# (``offload_copy_start`` from a host tensor whose copy is pending).

_PENDING: dict[tuple[str, int], object] = {}  # (device, data pointer) of a started copy -> event
_PRUNE_AT = 1024  # pending copies at which the completed ones are dropped (see _remember)
_COPY_STREAMS: dict[int, object] = {}


def _copy_stream(index: int):
    stream = _COPY_STREAMS.get(index)
    if stream is None:
        stream = _COPY_STREAMS[index] = torch.cuda.Stream(index)
    return stream


def _key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.data_ptr()


@torch.library.custom_op(f"{_LIB}::offload_copy_start", mutates_args=())
def offload_copy_start(src: torch.Tensor, fqn: str, device: str, dtype: torch.dtype,
                       pin: bool, record: bool = True) -> torch.Tensor:
    """Start copying ``src`` (of parameter ``fqn``) to ``device`` as ``dtype``; the result may be
    read only after ``offload_copy_wait`` of it.

    ``record``: a device ``src`` freed before its copy ends stays allocated until the copy is
    done (``record_stream``). False where the graph orders every reuse of ``src`` after the
    copy itself (``offload_copy_release`` with ``wait``): the caching allocator may then hand
    the freed block to the compute stream at once, instead of holding it until the CPU sees the
    copy completed, which a CPU running far ahead of the device sees late."""
    target = torch.device(device)
    cuda = src.device if src.device.type == "cuda" else target
    if cuda.type != "cuda" or src.numel() == 0:
        return src.to(device=target, dtype=dtype, copy=True)
    current = torch.cuda.current_stream(cuda)
    stream = _copy_stream(cuda.index if cuda.index is not None else torch.cuda.current_device())
    # Allocated on the compute stream, which waits for the copy before any use (and so before
    # the memory can be freed and reused).
    out = torch.empty(src.shape, dtype=dtype, device=target,
                      pin_memory=pin and target.type == "cpu")
    stream.wait_stream(current)
    if src.device.type == "cpu":
        await_host_copy(stream, src)
    with torch.cuda.stream(stream):
        out.copy_(src, non_blocking=True)
    if src.device.type == "cuda" and record:
        # A device value freed before its copy ends stays allocated (the caching allocator
        # waits for the copy stream before reusing it). Pinned host buffers get the same
        # guarantee from torch's host allocator, which records the copy on them.
        src.record_stream(stream)
    event = torch.cuda.Event()
    event.record(stream)
    _remember(out, event)
    return out


def await_host_copy(stream, host: torch.Tensor) -> bool:
    """Make ``stream`` wait for the pending copy into ``host`` (an offloaded activation, not
    waited by the CPU) before it reads ``host``; the copy is then no longer pending. (On one
    copy stream the order holds anyway; the event makes it hold on any stream.) Returns whether
    a copy was pending."""
    filling = _PENDING.pop(_key(host), None)
    if filling is not None:
        stream.wait_event(filling)
    return filling is not None


def release_wait(stream, host: torch.Tensor) -> bool:
    """Make ``stream`` (the compute stream) wait for the pending copy into ``host``, which stays
    pending for the copy back. Returns whether a copy was pending."""
    event = _PENDING.get(_key(host))
    if event is not None:
        stream.wait_event(event)
    return event is not None


def _remember(out: torch.Tensor, event) -> None:
    """Record ``event`` as the pending copy into ``out``. A device->host copy of an activation
    whose backward never runs (a forward without backward) is never waited: once many are
    pending, the completed ones are dropped (waiting for a completed copy does nothing)."""
    if len(_PENDING) >= _PRUNE_AT:
        for key in [k for k, e in _PENDING.items() if e.query()]:
            del _PENDING[key]
    _PENDING[_key(out)] = event


@offload_copy_start.register_fake
def _copy_start_fake(src, fqn, device, dtype, pin, record=True):
    return torch.empty(src.shape, dtype=dtype, device=torch.device(device))


@torch.library.custom_op(f"{_LIB}::offload_copy_wait", mutates_args=("dst",))
def offload_copy_wait(dst: torch.Tensor) -> None:
    """Wait for the copy into ``dst``: the compute stream waits for a device destination, the
    CPU for a host one. (Declared as mutating ``dst`` so that no compiler moves a reader of
    ``dst`` above it or drops it.)"""
    if dst.numel() == 0:
        return
    event = _PENDING.pop(_key(dst), None)
    if event is None:
        return
    if dst.device.type == "cuda":
        torch.cuda.current_stream(dst.device).wait_event(event)
    else:
        event.synchronize()


@torch.library.custom_op(f"{_LIB}::offload_copy_release", mutates_args=("src",))
def offload_copy_release(src: torch.Tensor, host: torch.Tensor, wait: bool) -> None:
    """From here on the graph may reuse ``src``'s memory, whose copy into ``host`` was started
    by ``offload_copy_start``: with ``wait``, the compute stream waits for that copy (the CPU
    does not); without, nothing in the graph may reuse it (the caching allocator keeps ``src``
    for the copy stream once it is freed). The copy stays pending for the copy back. (Declared as
    mutating ``src`` so that no compiler drops it, moves it, or reuses ``src``'s buffer for a
    value computed before it: Inductor reuses dead buffers without the caching allocator.)"""
    if wait and src.device.type == "cuda" and host.numel():
        release_wait(torch.cuda.current_stream(src.device), host)


@offload_copy_release.register_fake
def _copy_release_fake(src, host, wait):
    return None


@torch.library.custom_op(f"{_LIB}::offload_copy_cast", mutates_args=())
def offload_copy_cast(copy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``copy`` (a parameter's waited host->device copy) cast to ``dtype``, a new tensor: the
    value ``prims.convert_element_type`` computes. An opaque op so that it runs where the graph
    places it, right after the copy's wait, and the copy can be freed there: Inductor computes
    a cast as a loop realized right before the kernel that reads it (a matmul, often much
    later), which holds the full-precision copy alive until then (issue 22, ``cast22``)."""
    return copy.to(dtype, copy=True)


@offload_copy_cast.register_fake
def _copy_cast_fake(copy, dtype):
    return torch.empty_like(copy, dtype=dtype)


COPY_START_OP = torch.ops.shardc.offload_copy_start.default
COPY_WAIT_OP = torch.ops.shardc.offload_copy_wait.default
COPY_RELEASE_OP = torch.ops.shardc.offload_copy_release.default
COPY_CAST_OP = torch.ops.shardc.offload_copy_cast.default

# Meta key of a gradient's device->host ``offload_copy_start`` (set by the lowering,
# ``shardc.passes.lower_copies.lower_d2h``): its result is host memory, the gradient the host
# optimizer steps. The copy's target alone does not say so: on a CPU mesh simulating offload
# (``OffloadPolicy(simulate_on_cpu=True)``, as the capacity planner plans a GPU's step) the
# parameters' host->device copies target ``"cpu"`` too, and those are device memory.
GRAD_D2H = "shardc_grad_d2h"


def is_grad_d2h_start(node) -> bool:
    """Whether ``node`` starts a gradient's device->host copy (:data:`GRAD_D2H`)."""
    return getattr(node, "op", None) == "call_function" and node.target is COPY_START_OP \
        and bool(node.meta.get(GRAD_D2H))


# -- Per-bucket "gradients on the host" signal (``shardc.step_in_backward``). The lowering puts
# one ``offload_grads_ready`` after each bucket's device->host gradient copies are started; it
# hands the host gradient buffers and their copies' completion events to the listener of the
# model (``key``), which steps the optimizer on them on a host thread while the device runs the
# rest of the backward. Without a listener (no ``step_in_backward`` for the model) it does
# nothing.

# model key -> callables(fqns, host gradients, completion events or None): one per optimizer
# stepping some of the model's parameters in the backward.
_READY_LISTENERS: dict[str, list] = {}


def add_ready_listener(key: str, listener) -> None:
    """Route the ready signals of the model ``key`` to ``listener`` too."""
    _READY_LISTENERS.setdefault(key, []).append(listener)


def remove_ready_listener(key: str, listener) -> None:
    listeners = _READY_LISTENERS.get(key, [])
    if listener in listeners:
        listeners.remove(listener)
    if not listeners:
        _READY_LISTENERS.pop(key, None)


@torch.library.custom_op(f"{_LIB}::offload_grads_ready", mutates_args=("grads",))
def offload_grads_ready(grads: list[torch.Tensor], fqns: str, key: str) -> None:
    """The host gradients ``grads`` of parameters ``fqns`` (newline-separated names; one bucket
    of the model ``key``) are being copied; each is final once its copy completes. (Declared
    as mutating ``grads`` so that no compiler drops it or moves it past their waits: it must
    run while the backward goes on.)"""
    listeners = _READY_LISTENERS.get(key)
    if not listeners:
        return
    events = [_PENDING.get(_key(g)) if g.numel() else None for g in grads]
    for listener in list(listeners):
        listener(fqns.split("\n"), list(grads), events)


@offload_grads_ready.register_fake
def _grads_ready_fake(grads, fqns, key):
    return None


READY_OP = torch.ops.shardc.offload_grads_ready.default
