"""The optimizer step in chunks: the peak budget's device lever on the optimizer step's
temporaries (``shardc.planning.optimizer_chunks``, docs/memory_budget.md).

torch's ``foreach`` implementation of Adam/AdamW (torch's default on CUDA) allocates
parameter-sized temporary lists for a whole parameter group at once (``_foreach_sqrt`` of the
second moments: as many bytes as the group's shards). Every optimizer of
``shardc.optim.local_step.ELEMENTWISE`` updates each parameter from its own gradient, state and
the group's scalars only, so stepping the parameters in several calls, each with every group
narrowed to one chunk of its parameters (each group keeping its hyperparameters, read at that
moment, and the parameters' state entries, keyed by parameter), gives bitwise the same
parameters and state as one call; the temporaries then exist for one chunk at a time.

Where a compiled region's plan decided it (``MemoryBudget.optimizer_chunks``), the backend
calls :func:`adopt` with the plan's buckets; from then on ``optimizer.step()`` of any optimizer
holding those parameters steps them in chunks: one per bucket (a parameter in two buckets in
the first), the optimizer's parameters in no bucket (another region's, another model's) in one
more. How, with torch's public process-wide step hooks (``register_optimizer_step_pre_hook`` /
``..._post_hook``, registered once per process, as ``shardc.runtime.offload_optimizer`` does):

1. the pre-hook of the user's ``optimizer.step()`` narrows the groups to each chunk but the
   last in turn and calls ``optimizer.step()`` for it (our hooks do nothing inside those calls:
   a re-entrancy flag per optimizer), then narrows them to the last chunk and returns: the
   user's call steps that one;
2. the post-hook puts the groups' parameter lists back (the same list objects).

So every other step hook runs once per chunk and sees that chunk's parameters in the
groups. shardc's own hooks are written for that (``local_shard_step``'s swaps each group's
parameters for their local shards, whatever they are); a hook of anyone else's is written for
one call per step (a gradient clip by the global norm in a pre-hook would clip again at every
chunk), so an optimizer with such a hook is refused (below). An LR scheduler is unaffected (it
writes the groups' ``lr``, which the narrowed groups are; its "step() before
optimizer.step()" check sees the user's call). Outside ``step()`` the groups hold every
parameter as before, so ``state_dict()``, ``load_state_dict()``, DCP and ``zero_grad()`` see
nothing different. If a chunk's step raises, the groups are put back before the error
propagates (the chunks stepped before it stay stepped, as with any optimizer raising half-way);
a state-dict pre-hook puts them back too, should an error leave them narrowed.

``fused=True`` and the per-tensor implementation hold no group-sized temporaries: chunking
changes nothing for their memory, and it is still exact, so it is done all the same (a few more
launches; the planner does not choose it for them). ``capturable`` and a tensor ``lr`` are
exact too (their ops are per parameter) and not refused.

Refused, with an error naming the optimizer's class and the way out (``optimizer_step_chunks=
'never'`` or a larger ``peak_memory_budget_bytes``), where it cannot be exact: a class not
exactly one of ``ELEMENTWISE`` (a subclass may step otherwise), ``step(closure)`` (the
closure would run once per chunk), and step hooks that are not shardc's (the optimizer's own
or process-wide, :func:`foreign_hooks`: they would run once per chunk). Not applied (a
warning, once per optimizer) where another shardc step change holds the optimizer: optimizer
offload (some of its parameters step on the host, ``shardc.runtime.offload_optimizer``) or
``shardc.step_in_backward``; the planner does not choose the chunked step where those are
planned.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from shardc._torch import optimizer_step_hooks
from shardc.optim.local_step import ELEMENTWISE

__all__ = ["adopt", "chunk_of", "chunks_of", "foreign_hooks"]

log = logging.getLogger("shardc")

# id(parameter) -> (weak reference to it, its chunk's key, the key's order among the chunks).
_CHUNK: dict[int, tuple[weakref.ref, Hashable, int]] = {}
_HOOKS: list = []
# chunk key -> the order it was adopted in; a key goes with its last parameter (recompiles and
# dropped models leave nothing behind), so the orders come from a counter, never reused.
_ORDER: dict[Hashable, int] = {}
_NEXT_ORDER = itertools.count()


@dataclass
class _Stepping:
    """An optimizer's chunked step in progress (or left by one that raised)."""

    saved: list[list] | None = None  # per group, its parameter list (the same object)
    inner: bool = False  # inside the chunks' own ``optimizer.step()`` calls
    hooked: bool = False  # its state-dict pre-hooks are registered
    warned: bool = False
    handles: list = field(default_factory=list)


_STEPPING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> _Stepping


def adopt(chunks: Sequence[tuple[Hashable, Sequence[torch.Tensor]]]) -> int:
    """Step these parameters in chunks from the next ``optimizer.step()`` on: ``chunks`` is
    ``(key, parameters)`` per chunk, in the order they are to be stepped. A parameter already
    adopted keeps its chunk. Returns how many parameters were added."""
    added = 0
    for key, params in chunks:
        order = _ORDER[key] if key in _ORDER else next(_NEXT_ORDER)
        for p in params:
            if id(p) in _CHUNK and _CHUNK[id(p)][0]() is p:
                continue
            _CHUNK[id(p)] = (weakref.ref(p, _forgetter(id(p), key)), key, order)
            _ORDER[key] = order
            added += 1
    if added and not _HOOKS:
        _HOOKS.append(register_optimizer_step_pre_hook(_pre_step))
        _HOOKS.append(register_optimizer_step_post_hook(_post_step))
    return added


def _forgetter(pid: int, key: Hashable):
    """The weak reference's callback: the parameter is gone, so is its entry (and its chunk's
    key with its last parameter)."""
    def forget(_ref) -> None:
        _CHUNK.pop(pid, None)
        if all(k != key for _, k, _ in _CHUNK.values()):
            _ORDER.pop(key, None)
    return forget


def chunk_of(p: torch.Tensor) -> tuple[int, Hashable] | None:
    """``p``'s chunk (its order, its key), None where it steps in no chunk."""
    entry = _CHUNK.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[2], entry[1]


def chunks_of(optimizer: torch.optim.Optimizer) -> list[list[list]]:
    """The chunks ``optimizer.step()`` steps: per chunk, per group, that group's parameters
    in the chunk (in the group's order); adopted chunks in adoption order, then the
    parameters in none. Chunks with no parameter are left out; fewer than two: no chunking."""
    order: dict[object, list[list]] = {}
    n = len(optimizer.param_groups)
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            found = chunk_of(p)
            key = found[0] if found is not None else float("inf")  # no chunk: last
            order.setdefault(key, [[] for _ in range(n)])[i].append(p)
    return [order[k] for k in sorted(order)]


def steps_in_chunks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s parameters are in two chunks or more (its step is chunked where
    it is exact and no other shardc change holds it), or its chunked step is in progress (a
    chunk's own step, or the user's call once the groups are narrowed to the last chunk: the
    process-wide hooks run in the order they were registered)."""
    stepping = _STEPPING.get(optimizer)
    if stepping is not None and (stepping.inner or stepping.saved is not None):
        return True
    return bool(_CHUNK) and len(chunks_of(optimizer)) >= 2


def _why_not_exact(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> str:
    """Why chunking ``optimizer``'s step could be inexact ("" where it is exact)."""
    if type(optimizer) not in ELEMENTWISE:
        return (f"{type(optimizer).__name__} is not exactly one of the optimizers known to "
                f"update each parameter elementwise ({', '.join(c.__name__ for c in ELEMENTWISE)}"
                "; a subclass may step otherwise)")
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if closure is not None:
        return "optimizer.step(closure) would evaluate the closure once per chunk"
    foreign = foreign_hooks(optimizer)
    if foreign:
        return (f"its step hooks {', '.join(foreign)} are not shardc's: they would run once "
                "per chunk, each time seeing only that chunk's parameters (do their work "
                "before or after optimizer.step() instead)")
    return ""


def foreign_hooks(optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the step hooks around ``optimizer.step()`` (its own and process-wide,
    pre and post) that are not shardc's, i.e. not defined in a ``shardc`` module."""
    names = []
    for hook in optimizer_step_hooks(optimizer):
        fn = getattr(hook, "__func__", hook)  # a bound method's function
        module = getattr(fn, "__module__", None) or ""
        if module != "shardc" and not module.startswith("shardc."):
            names.append(getattr(fn, "__qualname__", None) or repr(hook))
    return names


def _why_not_applied(optimizer: torch.optim.Optimizer) -> str:
    """Why the chunked step is left out for ``optimizer`` ("" where it applies): another
    shardc change to its step holds it."""
    from shardc.runtime import offload_optimizer

    if getattr(optimizer, "_shardc_step_in_backward", None) is not None:
        return "shardc.step_in_backward steps its parameters"
    if any(offload_optimizer.steps_on_host(p)
           for g in optimizer.param_groups for p in g["params"]):
        return "some of its parameters' state and step are on the host (optimizer offload)"
    return ""


def _pre_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    stepping = _STEPPING.get(optimizer)
    if stepping is not None and stepping.inner:
        return  # one chunk's own step
    _restore(optimizer)  # a step that raised left the groups narrowed
    if not _CHUNK:
        return
    chunks = chunks_of(optimizer)
    if len(chunks) < 2:
        return
    if stepping is None:
        stepping = _STEPPING[optimizer] = _Stepping()
    why = _why_not_applied(optimizer)
    if why:
        if not stepping.warned:
            stepping.warned = True
            log.warning("shardc: the optimizer step in chunks is not applied to this %s: %s",
                        type(optimizer).__name__, why)
        return
    why = _why_not_exact(optimizer, args, kwargs)
    if why:
        raise RuntimeError(
            f"shardc: the compiled model's plan steps this optimizer in chunks (the peak "
            f"budget's choice, or optimizer_step_chunks='always'), which is exact only for "
            f"the elementwise torch.optim classes without a closure or step hooks of others: "
            f"{why}."
            " Compile with shardc.backend(..., optimizer_step_chunks='never') (or a larger "
            "peak_memory_budget_bytes), or step without a closure.")
    if not stepping.hooked:  # put the groups back before (de)serializing, whatever happened
        stepping.hooked = True
        stepping.handles = [optimizer.register_state_dict_pre_hook(_restore),
                            optimizer.register_load_state_dict_pre_hook(_restore_before_load)]
    groups = optimizer.param_groups
    stepping.saved = [g["params"] for g in groups]  # before anything narrows them
    try:
        stepping.inner = True
        for chunk in chunks[:-1]:
            _narrow(groups, chunk)
            optimizer.step()
    except BaseException:
        stepping.inner = False
        _restore(optimizer)
        raise
    stepping.inner = False
    _narrow(groups, chunks[-1])  # the user's call steps the last chunk


def _narrow(groups: list[dict], chunk: list[list]) -> None:
    for group, params in zip(groups, chunk):
        group["params"] = params


def _post_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    stepping = _STEPPING.get(optimizer)
    if stepping is None or stepping.inner:
        return
    _restore(optimizer)


def _restore_before_load(optimizer: torch.optim.Optimizer, state_dict: dict):
    _restore(optimizer)
    return None


def _restore(optimizer: torch.optim.Optimizer) -> None:
    """Put every group's parameter list back (a no-op outside a chunked step)."""
    stepping = _STEPPING.get(optimizer)
    if stepping is None or stepping.saved is None:
        return
    saved, stepping.saved = stepping.saved, None
    _narrow(optimizer.param_groups, saved)
