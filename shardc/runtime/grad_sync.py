"""Gradient accumulation without synchronization (``shardc.set_requires_gradient_sync``).

While sync is off, the backward keeps each parameter's full (unreduced) gradient in a per-model
store and gives the shard a zero gradient; the first backward after sync is turned back on adds
the stored sums to its gradients before reduce-scattering them. So micro-batches cost no
communication until the last one, at the memory cost of one unsharded gradient per parameter
(as with FSDP2's no-sync). The mode is chosen when a forward reads the parameters, so compiled
models specialize on it (Dynamo guards on the flags and recompiles once per mode).
"""

from __future__ import annotations

import itertools
import weakref

import torch

REDUCE, STASH, REDUCE_STASHED = 0, 1, 2

_STORES: weakref.WeakValueDictionary[str, UnsyncedGrads] = weakref.WeakValueDictionary()
_IDS = itertools.count()

# Store key -> its mode, kept equal to ``store.mode()`` while the store lives: what the
# parameter reads consult (:func:`sync_mode`, or this dict itself where Dynamo traces the read;
# read-only outside this module). Every read of a model reaches this one dict
# through one source, so Dynamo guards the mode once per model, where reading the store that
# each read's closure holds made it guard that the 147 closures of a 16-layer model hold the
# same object (146 ``a is b`` checks in Python at every call, docs/overhead.md).
SYNC_MODES: dict[str, int] = {}
# Keys of stores that died, dropped from SYNC_MODES when the next store is made. A store dies
# at any garbage collection, and Dynamo may be iterating SYNC_MODES then (it wraps the dict
# item by item where it traces a read): removed at once, the dict would change size under it
# ("dictionary changed size during iteration", seen where a compile's retry made garbage).
_DEAD_KEYS: list[str] = []


def _drop_dead_keys() -> None:
    while _DEAD_KEYS:
        SYNC_MODES.pop(_DEAD_KEYS.pop(), None)


class UnsyncedGrads:
    """Per sharded model: the sync flag and the stored full gradients."""

    def __init__(self) -> None:
        self.key = f"grads{next(_IDS)}"
        self._requires_sync = True
        self._pending = False  # stored gradients wait for the next synchronized backward
        self.grads: dict[str, torch.Tensor] = {}
        _STORES[self.key] = self
        _drop_dead_keys()
        SYNC_MODES[self.key] = REDUCE
        weakref.finalize(self, _DEAD_KEYS.append, self.key)

    @property
    def requires_sync(self) -> bool:
        return self._requires_sync

    @requires_sync.setter
    def requires_sync(self, flag: bool) -> None:
        self._requires_sync = flag
        SYNC_MODES[self.key] = self.mode()

    @property
    def pending(self) -> bool:
        return self._pending

    @pending.setter
    def pending(self, flag: bool) -> None:
        self._pending = flag
        SYNC_MODES[self.key] = self.mode()

    def mode(self) -> int:
        if not self._requires_sync:
            return STASH
        return REDUCE_STASHED if self._pending else REDUCE

    def set_requires_sync(self, flag: bool) -> None:
        self.requires_sync = bool(flag)
        self.pending = bool(flag) and bool(self.grads)


def sync_mode(key: str) -> int:
    """The mode of the store ``key`` (``UnsyncedGrads.mode()``), as parameter reads consult it
    (see :data:`SYNC_MODES`); the store must be alive (a read keeps its store alive)."""
    return SYNC_MODES[key]


def _store(key: str) -> UnsyncedGrads:
    store = _STORES.get(key)
    if store is None:
        raise RuntimeError(f"shardc: the gradient store {key!r} of a sharded model is gone")
    return store


@torch.library.custom_op("shardc::stash_grad", mutates_args=())
def stash_grad(grad: torch.Tensor, key: str, fqn: str, shard_like: torch.Tensor) -> torch.Tensor:
    """Add ``grad`` (full) to the store; returns a zero gradient shaped like ``shard_like``."""
    store = _store(key)
    held = store.grads.get(fqn)
    store.grads[fqn] = grad.detach().clone() if held is None else held + grad
    return torch.zeros_like(shard_like)


@stash_grad.register_fake
def _stash_grad_fake(grad, key, fqn, shard_like):
    return torch.empty_like(shard_like)


@torch.library.custom_op("shardc::take_stashed_grad", mutates_args=())
def take_stashed_grad(grad: torch.Tensor, key: str, fqn: str) -> torch.Tensor:
    """``grad`` plus the stored sum for ``fqn`` (removed from the store)."""
    store = _store(key)
    held = store.grads.pop(fqn, None)
    if not store.grads:
        store.pending = False
    return grad.clone() if held is None else grad + held.to(grad.dtype)


@take_stashed_grad.register_fake
def _take_stashed_grad_fake(grad, key, fqn):
    return torch.empty_like(grad)
