"""TransformerEngine helpers (GPU only; ``transformer_engine`` is imported lazily, never at
``import shardc``, because its torch extension cannot be imported on machines without CUDA).

shardc shards TE modules like any module: their high-precision parameters become dim-0 DTensor
shards read through the gather property (TE's modules read weights with ``getattr``), so
optimizers and DCP see high-precision shards. TE then casts the gathered weight to FP8 itself
inside ``te.fp8_autocast``. What TE needs from the sharding is that its amax reductions run over
the sharding group: :func:`te_autocast` passes the model's group as ``fp8_group``.
See docs/fp8.md for what is and is not verified.
"""

from __future__ import annotations

import contextlib

from torch import nn


def te_fp8_recipe(**kwargs):
    """TE's delayed-scaling recipe (E4M3 forward, E5M2 backward) with ``kwargs`` overrides."""
    from transformer_engine.common import recipe

    kwargs.setdefault("fp8_format", recipe.Format.HYBRID)
    return recipe.DelayedScaling(**kwargs)


def te_autocast(model: nn.Module, recipe=None, enabled: bool = True):
    """``te.fp8_autocast`` whose amax reductions run over ``model``'s sharding group."""
    import transformer_engine.pytorch as te

    from shardc.runtime.sharding import shard_state

    state = shard_state(getattr(model, "_orig_mod", model))
    if state is None:
        raise ValueError("shardc.te_autocast: the model was not sharded with shardc.shard")
    if not enabled:
        return contextlib.nullcontext()
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe or te_fp8_recipe(),
                           fp8_group=state.mesh.get_group())
