"""What a benchmark mode hands the training loop (:class:`Setup`), and helpers the modes share.

Contract: a mode's setup function turns a freshly built model into a :class:`Setup`: a
``loss(tokens, targets)`` callable whose ``backward()`` leaves gradients on ``params`` (what the
optimizer steps), objects to keep alive until the mode ends, a description (``info``, copied into
the report), and optionally a callback run after the first step (its dict joins the results).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardc.models.llama import llama_loss


@dataclass
class Setup:
    """What a mode hands the training loop."""

    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens, targets) -> loss
    params: list[nn.Parameter]
    keep: list[Any] = field(default_factory=list)  # objects to drop after the mode
    info: dict[str, Any] = field(default_factory=dict)
    after_first_step: Callable[[], dict[str, Any]] | None = None
    # Called on the optimizer the loop builds (AdamW over ``params``) before the first step.
    prepare_optimizer: Callable[[torch.optim.Optimizer], Any] | None = None
    # Compiled with mode="reduce-overhead": a replayed CUDA graph allocates nothing, so the loop
    # reads the step's allocated peak from the warm-up steps that record the graphs too.
    cudagraphs: bool = False


def model_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return llama_loss(model(tokens), targets)


def compiled_loss(model: nn.Module, loss_in_graph: bool, **compile_kwargs) -> Callable:
    """The model's forward and its loss compiled as one region (``loss_in_graph``, from
    ``--loss-in-graph``, the default) or the compiled model with the loss computed eagerly after
    it. Every whole-model compiled mode follows it."""
    if loss_in_graph:
        return torch.compile(functools.partial(model_loss, model), **compile_kwargs)
    return functools.partial(model_loss, torch.compile(model, **compile_kwargs))


def swap_param_reads(module: nn.Module, read: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Make every ``module.<param>`` attribute read return ``read(param)`` (class swap, in place).

    ``module.parameters()`` and the state dict still see the stored parameters (they go through
    ``_parameters``), so the optimizer steps the masters.
    """
    for sub in module.modules():
        names = [n for n, p in sub._parameters.items() if p is not None]
        if not names:
            continue
        props = {
            n: property(lambda self, n=n: read(self._parameters[n])) for n in names
        }
        cls = type(sub)
        sub.__class__ = type(f"Bench{cls.__name__}", (cls,), props)
