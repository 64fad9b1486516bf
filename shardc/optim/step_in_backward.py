"""``shardc.step_in_backward(model, optimizer)``: CPU offload's optimizer step overlapped with
the backward.

With ``shardc.shard(model, mesh, offload=shardc.OffloadPolicy())`` the fp32 master shards, their
gradients and the optimizer state live in host memory and the user's ``torch.optim`` optimizer
steps on the CPU after the backward. ``step_in_backward`` moves most of that step into the
backward: as each bucket's reduced gradients land on the host, the optimizer's update of that
bucket's parameters runs on one host worker thread while the device runs the rest of the
backward. The user's loop is unchanged (``loss.backward(); optimizer.step();
optimizer.zero_grad()``): ``optimizer.step()`` waits for the updates already under way and steps
only the parameters not stepped yet (those whose gradient came late or not through a bucket's
signal).

How a bucket is stepped: the user's optimizer itself, with its parameter groups narrowed for the
call to that bucket's parameters (each group keeps its own hyperparameters, read at that moment,
so learning-rate schedulers apply) and the parameters' state entries (keyed by parameter) shared.
The optimizer sees, for each parameter, a stand-in DTensor over the parameter's own host shard
(so the update lands in the parameter) whose ``.grad`` is the final host gradient: the parameter's
own ``.grad`` is never touched while autograd may still accumulate into it. Outside these calls
the optimizer holds the parameters and its state is keyed by them, so ``state_dict()``, DCP,
``zero_grad()`` and schedulers see what they see without overlap.

Where a bucket's gradients are known to be final:

* compiled: the backward graph signals each bucket once its device->host gradient copies are
  started (``shardc::offload_grads_ready``, placed by ``shardc.passes.lower_copies``), handing
  over the host buffers and the copies' completion events; the worker waits for the events. Only
  gradients the graph reduced itself (not stashed by ``no_sync``), copied once and returned as
  they are (no tied-weight sum after the copy) are signalled;
* eager (and, at the end of a compiled backward, whatever was not signalled): torch's
  ``register_post_accumulate_grad_hook``, which fires once a parameter's gradient of this
  backward is accumulated.

A parameter is stepped early only if its ``.grad`` was None when its gradient arrived (set
``zero_grad(set_to_none=True)``, the default) and its gradient was synchronized (not a
``no_sync`` micro-batch); otherwise ``optimizer.step()`` steps it as usual. What cannot work is
refused, not silently wrong (see docs/offload.md): clipping by global norm (it needs every
gradient before any update: an in-place change to an early-stepped gradient is detected at
``step()``), a second backward before ``step()`` (accumulation with sync on every backward),
closures, and optimizers that are not elementwise per parameter or step on the device
(``capturable``).
"""

from __future__ import annotations

import queue
import threading
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardc._torch import dtensor_local_fast as _local_of
from shardc._torch import tensor_version
from shardc.ops.offload_copy import add_ready_listener, remove_ready_listener
from shardc.optim.local_step import ELEMENTWISE, wrap_stepped_state
from shardc.sharding.scope import shard_state, unwrap_compiled

__all__ = ["StepInBackward", "step_in_backward"]


@dataclass
class _Early:
    """A parameter stepped (or being stepped) by the worker in this round."""

    param: DTensor
    fqn: str
    grad: torch.Tensor  # the host gradient (local) the worker steps with
    verified: bool = False  # its accumulated .grad was checked to be ``grad``
    # Its .grad's versions (the DTensor's, its local tensor's) when checked: an in-place edit
    # (clipping) bumps the first through DTensor, the second directly.
    version: tuple[int, int] | None = None
    # A few of its values, spread over it: ``clip_grad_norm_`` scales DTensor gradients through
    # a foreach op that bumps neither version, but changes every nonzero value.
    sample: torch.Tensor | None = None


@dataclass
class _StandIn:
    """What the worker's optimizer call sees for one parameter: ``local``, a plain alias of
    its host shard with the host gradient as ``.grad``; ``held``, the parameter's own state
    entry (DTensor values) while the call sees their local tensors."""

    param: DTensor
    local: torch.Tensor
    held: dict | None

    def put_back(self, state, optimizer) -> None:
        """The parameter's state entry back under the parameter, its new tensors (the first
        step's moments) wrapped as DTensors like it (``wrap_stepped_state``)."""
        self.local.grad = None
        stepped = state.pop(self.local, None)
        if stepped is None:
            if self.held is not None:
                state[self.param] = self.held
            return
        state[self.param] = wrap_stepped_state(self.param, self.local, self.held or {},
                                               stepped, optimizer)


class StepInBackward:
    """The overlapped step of one sharded model's parameters in one optimizer (see the module
    docstring). ``remove()`` undoes it; ``early`` counts the parameters stepped during
    backwards, ``signalled`` those the compiled graphs handed over, ``late`` those left to
    ``optimizer.step()``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        root = unwrap_compiled(model)
        state = shard_state(root)
        named = dict(root.named_parameters(remove_duplicate=False))
        self._params: dict[str, DTensor] = (
            {f: named[f] for f in state.params if f in named} if state is not None else {})
        self._names = {id(p): f for f, p in self._params.items()}
        _check(state, optimizer, self._names)
        self.optimizer = optimizer
        self._key = state.key
        self._store = state.grad_sync
        self._round: dict[int, _Early] = {}
        self._fresh: set[int] = set()
        self._errors: list[str] = []
        self._lock = threading.Lock()
        self._narrowed: list[list] | None = None
        self._optimized: set[int] = set()
        self._internal = threading.local()
        self.early = self.signalled = self.late = 0
        self._queue: queue.Queue = queue.Queue()
        # The worker waits for CUDA events of the copies: on this thread's device.
        device = (torch.cuda.current_device()
                  if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
        self._worker = threading.Thread(target=_work,
                                        args=(weakref.ref(self), self._queue, device),
                                        name="shardc-step-in-backward", daemon=True)
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
            optimizer.register_state_dict_pre_hook(self._settle),
            optimizer.register_load_state_dict_pre_hook(self._settle_before_load),
        ]
        for p in {id(p): p for p in self._params.values()}.values():
            if p.requires_grad:
                self._handles.append(p.register_hook(self._hook_before_accumulate(p)))
                self._handles.append(p.register_post_accumulate_grad_hook(self._after_accumulate))
        self._snapshot_params()
        self._worker.start()
        add_ready_listener(self._key, self._on_bucket)
        optimizer._shardc_step_in_backward = self

    # -- signals -----------------------------------------------------------------------------

    def _stepped_here(self) -> set[int]:
        """The ids of the optimizer's parameters, as of the last ``step()`` (the worker narrows
        the live groups while it steps, so they are not read during a backward)."""
        return self._optimized

    def _snapshot_params(self) -> None:
        self._optimized = {id(p) for g in self.optimizer.param_groups for p in g["params"]}

    def _on_bucket(self, fqns: list[str], grads: list[torch.Tensor], events: list) -> None:
        """A compiled backward's bucket: its host gradients (final once ``events`` complete)."""
        items = []
        with self._lock:
            optimized = self._stepped_here()
            for fqn, grad, event in zip(fqns, grads, events):
                p = self._params.get(fqn)
                if p is None or id(p) not in optimized:
                    continue
                if id(p) in self._round:
                    self._second_gradient(fqn)
                    continue
                local = _as_local_grad(p, grad)
                if p.grad is not None or local is None:
                    continue  # accumulating into a gradient: optimizer.step() steps it
                self._round[id(p)] = _Early(p, fqn, local)
                items.append((p, local, event))
            self.signalled += len(items)
        if items:
            self._queue.put(items)

    def _hook_before_accumulate(self, p: DTensor):
        def before(grad):
            with self._lock:
                early = self._round.get(id(p))
                if early is not None and early.verified:
                    self._second_gradient(early.fqn)
                elif early is None and p.grad is None \
                        and self._names[id(p)] not in self._store.grads:
                    self._fresh.add(id(p))  # synchronized, into an empty .grad
            return None
        return before

    def _after_accumulate(self, p: torch.Tensor) -> None:
        with self._lock:
            early = self._round.get(id(p))
            fresh = id(p) in self._fresh
            self._fresh.discard(id(p))
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else None
            if early is not None and not early.verified:  # handed over by the graph
                early.verified = True
                if grad is None or not _same_memory(grad, early.grad):
                    # Not the same memory (autograd copied it, or summed it with a gradient
                    # from elsewhere): compare a sample of values, not the whole gradient.
                    if grad is None or grad.numel() != early.grad.numel() or not torch.equal(
                            _sample(grad), _sample(early.grad.view(grad.shape))):
                        self._errors.append(
                            f"the gradient of {early.fqn!r} accumulated by the backward is not "
                            "the one its overlapped step used (is the parameter read in two "
                            "compiled regions?); train it without shardc.step_in_backward")
                if grad is not None:
                    early.version, early.sample = _grad_versions(p.grad), _sample(grad)
                return
            if not fresh or grad is None or id(p) not in self._stepped_here():
                return
            self._round[id(p)] = _Early(p, self._names[id(p)], grad, True,
                                        _grad_versions(p.grad), _sample(grad))
        self._queue.put([(p, grad, None)])

    def _second_gradient(self, fqn: str) -> None:
        self._errors.append(
            f"parameter {fqn!r} got a second gradient after its overlapped step and before "
            "optimizer.step() (a second backward with gradient sync: accumulate with "
            "shardc.no_sync instead, which leaves the step to optimizer.step())")

    # -- the worker's steps ------------------------------------------------------------------

    def step_items(self, items: list[tuple[DTensor, torch.Tensor, object]]) -> None:
        """Step ``items`` (parameter, host gradient, copy event or None) with the optimizer's
        groups narrowed to them (on the worker thread).

        The optimizer steps plain stand-ins: for each parameter a detached alias of its own
        host shard (so the update lands in the parameter) whose ``.grad`` is the host gradient,
        and the local tensors of its DTensor state. Not DTensors: every op of a DTensor step
        runs Python dispatch holding the GIL, and on this worker that starves the thread
        running the backward (a Python loop beside it ran at 0.03x its speed, against 0.66x
        beside the same step on plain tensors; docs/offload.md). The math is the same
        elementwise math on the shard, so the result is bitwise the one ``optimizer.step()``
        computes over the DTensors."""
        for _, _, event in items:
            if event is not None:
                event.synchronize()
        opt, state = self.optimizer, self.optimizer.state
        with torch.no_grad():
            standins: dict[int, _StandIn] = {}
            for p, grad, _ in items:
                s = _local_of(p).detach()
                s.grad = grad
                held = state.pop(p, None)
                local = None if held is None else {
                    k: _local_of(v) if isinstance(v, DTensor) else v for k, v in held.items()}
                if local is not None:
                    state[s] = local
                standins[id(p)] = _StandIn(p, s, held)
            saved = [g["params"] for g in opt.param_groups]
            try:
                for g in opt.param_groups:
                    g["params"] = [standins[id(p)].local for p in g["params"]
                                   if id(p) in standins]
                self._internal.active = True
                opt.step()
            finally:
                self._internal.active = False
                for g, params in zip(opt.param_groups, saved):
                    g["params"] = params
                for standin in standins.values():
                    standin.put_back(state, opt)
        with self._lock:
            self.early += len(items)

    def wait(self) -> None:
        """Wait until every update handed to the worker is applied."""
        self._queue.join()

    # -- the user's optimizer ----------------------------------------------------------------

    def _before_step(self, optimizer, args, kwargs) -> None:
        if getattr(self._internal, "active", False):
            return
        self._restore()
        # torch passes the step's own arguments, the optimizer first.
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is not None:
            self._end_round()  # what was stepped early stays stepped; the rest is not
            raise RuntimeError(
                "shardc.step_in_backward: optimizer.step(closure) is not supported: the "
                "overlapped step has already updated parameters during the backward, and a "
                "closure would evaluate the loss again. Call optimizer.step() without a "
                "closure, or remove the overlap (handle.remove()).")
        self.wait()
        with self._lock:
            errors, self._errors = self._errors, []
            errors += self._edited_gradients()
            if errors:
                self._round.clear()
                self._fresh.clear()
                self._snapshot_params()
                raise RuntimeError("shardc.step_in_backward: " + "; ".join(errors))
            for group in optimizer.param_groups:
                _check_group(group, self._names)
            self.late += sum(1 for g in optimizer.param_groups for p in g["params"]
                             if id(p) in self._names and id(p) not in self._round
                             and p.grad is not None)
            self._narrowed = [g["params"] for g in optimizer.param_groups]
            for g in optimizer.param_groups:
                g["params"] = [p for p in g["params"] if id(p) not in self._round]

    def _end_round(self) -> None:
        self.wait()
        with self._lock:
            self._round.clear()
            self._fresh.clear()
            self._errors.clear()

    def _edited_gradients(self) -> list[str]:
        """Early-stepped parameters whose gradient changed in place since (clipping)."""
        out = []
        for early in self._round.values():
            grad = early.param.grad
            local = grad.to_local() if isinstance(grad, DTensor) else None
            if local is None or not early.verified:
                continue  # zero_grad() before step(), or not accumulated yet
            if early.version is not None and (_grad_versions(grad) != early.version
                                              or not torch.equal(_sample(local), early.sample)):
                out.append(
                    f"the gradient of {early.fqn!r} was changed in place after the optimizer "
                    "had already stepped it during the backward (clip_grad_norm_ or another "
                    "edit of .grad between backward() and step()): clipping by global norm "
                    "needs every gradient before any update, which the overlapped step cannot "
                    "wait for; remove shardc.step_in_backward to clip")
                break
        return out

    def _after_step(self, optimizer, args, kwargs) -> None:
        if getattr(self._internal, "active", False):
            return
        self._restore()
        with self._lock:
            self._round.clear()
            self._fresh.clear()
            self._snapshot_params()  # groups may change between steps (add_param_group)

    def _restore(self) -> None:
        if self._narrowed is None:
            return
        for g, params in zip(self.optimizer.param_groups, self._narrowed):
            g["params"] = params
        self._narrowed = None

    def _settle(self, optimizer) -> None:
        self._restore()
        self.wait()

    def _settle_before_load(self, optimizer, state_dict):
        self._settle(optimizer)
        return None

    def remove(self) -> None:
        """Stop overlapping: the optimizer steps everything in ``step()`` again."""
        remove_ready_listener(self._key, self._on_bucket)
        self._settle(self.optimizer)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._queue.put(None)
        self.optimizer._shardc_step_in_backward = None


def _work(owner: weakref.ref, work: queue.Queue, device: int | None) -> None:
    """The worker thread: step whatever is queued, in one optimizer call per batch."""
    if device is not None:
        torch.cuda.set_device(device)
    while True:
        batch = [work.get()]
        while True:
            try:
                batch.append(work.get_nowait())
            except queue.Empty:
                break
        try:
            items = [item for b in batch if b is not None for item in b]
            self = owner()
            if self is None:
                return
            if items:
                try:
                    self.step_items(items)
                except BaseException as exc:  # reported at optimizer.step()
                    with self._lock:
                        self._errors.append(f"the overlapped step failed: "
                                            f"{type(exc).__name__}: {exc}")
            del self
        finally:
            for _ in batch:
                work.task_done()
        if any(b is None for b in batch):
            return


def _as_local_grad(p: DTensor, grad: torch.Tensor) -> torch.Tensor | None:
    local = p.to_local()
    if grad.dtype != local.dtype or grad.numel() != local.numel():
        return None
    return grad if grad.shape == local.shape else grad.view(local.shape)


def _sample(local: torch.Tensor, n: int = 16) -> torch.Tensor:
    flat = local.detach().reshape(-1)
    return flat[::max(1, flat.numel() // n)][:n].clone()


def _grad_versions(grad: DTensor) -> tuple[int, int]:
    return tensor_version(grad), tensor_version(grad.to_local())


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() == 0 or (a.data_ptr() == b.data_ptr() and a.numel() == b.numel())


def _check_group(group: dict, names: dict[int, str]) -> None:
    fqn = next((names[id(p)] for p in group["params"] if id(p) in names), None)
    if fqn is None:
        return
    for flag in ("capturable", "differentiable"):
        if group.get(flag):
            raise RuntimeError(
                f"shardc.step_in_backward: the optimizer's parameter group holding {fqn!r} has "
                f"{flag}=True; the overlapped step runs on the host, per parameter, outside "
                f"autograd. Build the optimizer without {flag}=True.")


def _check(state, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> None:
    if state is None or state.offload is None or not state.offload.params:
        raise ValueError(
            "shardc.step_in_backward: the model must be sharded with "
            "shardc.shard(..., offload=shardc.OffloadPolicy()) (parameters and optimizer on "
            "the host): the overlapped step is CPU offload's optimizer step on host gradients.")
    if not isinstance(optimizer, ELEMENTWISE):
        raise TypeError(
            f"shardc.step_in_backward: {type(optimizer).__name__} is not one of the optimizers "
            f"whose update of a parameter depends only on that parameter's gradient and state "
            f"({', '.join(c.__name__ for c in ELEMENTWISE)}); stepping it bucket by bucket "
            "during the backward could be wrong. Use optimizer.step() after the backward "
            "(without step_in_backward).")
    if getattr(optimizer, "_shardc_step_in_backward", None) is not None:
        raise ValueError("shardc.step_in_backward: already applied to this optimizer.")
    for group in optimizer.param_groups:
        _check_group(group, names)


def step_in_backward(model: nn.Module, optimizer: torch.optim.Optimizer) -> StepInBackward:
    """Overlap ``optimizer``'s host step of ``model``'s offloaded parameters with the backward
    (see :mod:`shardc.optim.step_in_backward` and docs/offload.md); returns the handle
    (``remove()`` undoes it). ``model``: sharded with ``offload=shardc.OffloadPolicy()`` (or its
    ``torch.compile`` wrapper); ``optimizer``: built over its parameters after ``shardc.shard``,
    an elementwise torch.optim optimizer (AdamW, Adam, SGD, ...) without ``capturable``."""
    return StepInBackward(model, optimizer)
