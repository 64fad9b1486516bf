"""``Stateful`` wrappers of a model and its optimizer: what ``dcp.save`` / ``dcp.load`` and
:class:`~shardc.checkpoint.CheckpointManager` take.

Contract: each wrapper holds references only; ``state_dict()`` returns DCP's state dict of the
object now (keyed by parameter name, DTensor values sharded as the parameters are), and
``load_state_dict(sd)`` puts ``sd`` into the object in place. They follow the recipe DCP
recommends (``torch.distributed.checkpoint.state_dict``'s ``get_*`` / ``set_*`` functions), so a
checkpoint of a shardc model reshards to any world size and interoperates with FSDP2's.

Saving and loading call the same ``state_dict()``: DCP asks a ``Stateful`` for its state dict
both to write it and to learn what to load into (``dcp.load`` has no other hook before a load).
That is why :class:`OptimizerState` runs :func:`~shardc.checkpoint.init_optimizer_state` there:
an optimizer that never stepped has no state to load into. Building the wrapper touches nothing,
so a training loop can build its ``state`` dict before the first step without changing training.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from shardc.checkpoint.extra_state import extra_state_from_bytes, extra_state_to_bytes
from shardc.checkpoint.optimizer_init import init_optimizer_state

__all__ = ["ModelState", "OptimizerState"]


class ModelState(Stateful):
    """``Stateful`` for a model through ``get_model_state_dict`` / ``set_model_state_dict``.

    Works for shardc models (eager or ``torch.compile`` wrappers: the ``_orig_mod.`` prefix is
    stripped), FSDP2 models and plain modules. ``options`` are DCP's ``StateDictOptions``.
    Serialized module extra states (TransformerEngine's FP8 metadata) are stored as bytes, so a
    fresh model loads them whatever their size (:func:`~shardc.checkpoint.extra_state_to_bytes`).
    """

    def __init__(self, model: nn.Module, options: StateDictOptions | None = None) -> None:
        self.model, self.options = model, options

    def state_dict(self) -> dict[str, Any]:
        return extra_state_to_bytes(get_model_state_dict(self.model, options=self.options))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, extra_state_from_bytes(state_dict), options=self.options)


class OptimizerState(Stateful):
    """``Stateful`` for an optimizer of ``model``, keyed by parameter name (FQN).

    AdamW's ``exp_avg`` / ``exp_avg_sq`` of a shardc parameter are DTensors with the parameter's
    placements; ``step`` is the plain scalar tensor torch keeps (identical on every rank; DCP
    stores one copy).

    An optimizer that never stepped is first given its zero state by
    :func:`~shardc.checkpoint.init_optimizer_state` (one step at learning rate 0; parameters do
    not change) in :meth:`state_dict` and :meth:`load_state_dict`, so a fresh optimizer can be the
    target of a load. This happens on the first of these calls, load or not, exactly where torch's
    ``get_optimizer_state_dict`` would do it; never when the wrapper is built.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        options: StateDictOptions | None = None,
    ) -> None:
        self.model, self.optimizer, self.options = model, optimizer, options

    def state_dict(self) -> dict[str, Any]:
        init_optimizer_state(self.optimizer)
        return get_optimizer_state_dict(self.model, self.optimizer, options=self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        init_optimizer_state(self.optimizer)
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self.options)
