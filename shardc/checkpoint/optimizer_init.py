"""Materialize the state of an optimizer that never stepped, so that it can be loaded into.

torch optimizers create their state (AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``) lazily, in
the first ``step()``. A load needs that state to exist first: DCP loads in place, so the target's
state dict must already hold every tensor the checkpoint has, with its shape and placements.

Contract of :func:`init_optimizer_state`: if ``optimizer`` has no state and no parameter of it
has a gradient, it runs one ``step()`` at learning rate 0 on zero gradients, then restores each
group's learning rate and sets the gradients back to ``None``. Parameters do not change; the
optimizer gets its zero state (AdamW: zero moments and ``step=1``). Otherwise it does nothing.
It is the initialization ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` and
``set_optimizer_state_dict`` run internally (``_init_optim_state``), done here as a named step
for one reason: torch makes the zero gradients with ``zeros_like(param)``, which for a parameter
whose local shard is a TransformerEngine FP8 tensor (``te.quantized_model_init``) is an FP8
tensor that the optimizer cannot step with. The backward gives such parameters plain gradients,
and so does this. After it, torch's own initialization finds the state and does nothing.

Where it runs: :class:`shardc.checkpoint.OptimizerState` calls it before it asks torch for the
optimizer's state dict and before it loads one (see there for why that is the point).
"""

from __future__ import annotations

import torch

from shardc.sharding import te_params

__all__ = ["init_optimizer_state"]


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Give an optimizer that never stepped its (zero) state by one step at learning rate 0.

    Returns whether it stepped (``False``: the optimizer had state, or some parameter has a
    gradient, e.g. a load in the middle of an accumulation; then nothing is touched).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        return False
    for p in params:
        if p.requires_grad:
            p.grad = te_params.zero_grad_like(p)
    saved_lrs = []
    for group in optimizer.param_groups:
        if "lr" in group:
            saved_lrs.append(group["lr"])
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = saved_lrs.pop(0)
    optimizer.zero_grad(set_to_none=True)
    return True
