"""Names of parameter objects, held weakly, with an optimizer step pre-hook that checks them.

Both checks that run before an optimizer steps (an optimizer holding parameters
``shardc.shard`` replaced, :mod:`shardc.runtime.replaced_params`; offloaded parameters that no
longer fit CPU offload, :mod:`shardc.runtime.offload_check`) record parameters by identity and
name. :class:`WeakParamNames` is that record: nothing in it keeps a parameter alive (an entry
goes with its parameter), and its hook (``register_optimizer_step_pre_hook``, public torch API)
is registered once per process, when the first parameter is recorded.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["WeakParamNames"]


class WeakParamNames:
    """``id(parameter)`` -> (weak reference, qualified name); ``check`` runs before every
    optimizer step once something was recorded."""

    def __init__(self, check: Callable[[torch.optim.Optimizer, tuple, dict], None]) -> None:
        self._entries: dict[int, tuple[weakref.ref, str]] = {}
        self._check = check
        self._hook = None

    def remember(self, param: torch.Tensor, fqn: str) -> None:
        key = id(param)

        def forget(_ref, key=key) -> None:
            self._entries.pop(key, None)

        self._entries[key] = (weakref.ref(param, forget), fqn)
        if self._hook is None:
            self._hook = register_optimizer_step_pre_hook(self._check)

    def name(self, param: torch.Tensor) -> str | None:
        """``param``'s recorded name, if it was recorded and is still alive."""
        entry = self._entries.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries
