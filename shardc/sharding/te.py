"""TransformerEngine (TE) helpers (GPU only; ``transformer_engine`` is imported lazily, never at
``import shardc``, because its torch extension cannot be imported on machines without CUDA).

shardc shards TE modules like any module: their high-precision parameters become dim-0 DTensor
shards read through the gather property (TE's modules read their weights with ``getattr``), so
optimizers and DCP see high-precision shards, and TE casts the gathered weight to FP8 itself
inside its autocast. What TE needs from the sharding:

- its amax reductions run over the sharding group: :func:`te_autocast` passes the model's group;
- optionally, the weights travel in FP8: :func:`te_float8_policy` selects TE's GEMM weights for
  shardc's FP8 all-gather (lossless for TE's current-scaling recipe, see the function);
- checkpoints: TE keeps its FP8 metadata in ``_extra_state``, whose size changes once a module
  ran in FP8; ``shardc.checkpoint.ModelState`` stores it as bytes so DCP can load it into a
  fresh model.

Every use of TE's API is in this module, and in :mod:`shardc.runtime.te_params` for FP8
parameters (``te.quantized_model_init``). See docs/fp8.md for what is verified.
"""

from __future__ import annotations

from torch import nn

from shardc.sharding.fp8 import Float8Policy
from shardc.sharding.scope import shard_state, unwrap_compiled

# TE module parameters that are GEMM weights: ``weight`` (te.Linear, te.LayerNormLinear), the
# split ``query_weight`` / ``key_weight`` / ``value_weight`` (TransformerLayer's fused QKV),
# ``fc1_weight`` / ``fc2_weight`` (te.LayerNormMLP); never the norm's ``layer_norm_weight``.
TE_GEMM_WEIGHTS = (r"(?!layer_norm).*weight",)


def _te():
    import transformer_engine.pytorch as te

    return te


def te_fp8_recipe(scaling: str = "delayed", **kwargs):
    """A TE FP8 recipe in the HYBRID format (E4M3 forward, E5M2 backward), ``kwargs`` overriding.

    ``scaling="delayed"``: ``DelayedScaling`` (scales from an amax history, kept in the modules'
    ``_extra_state`` and so in checkpoints). ``scaling="current"``: ``Float8CurrentScaling``
    (each tensor scaled by its own amax; stateless).
    """
    from transformer_engine.common import recipe

    kwargs.setdefault("fp8_format", recipe.Format.HYBRID)
    if scaling == "delayed":
        return recipe.DelayedScaling(**kwargs)
    if scaling == "current":
        return recipe.Float8CurrentScaling(**kwargs)
    raise ValueError(
        f"shardc.te_fp8_recipe: scaling must be 'delayed' or 'current', got {scaling!r}"
    )


def te_autocast(model: nn.Module, recipe=None, enabled: bool = True):
    """TE's FP8 autocast whose amax reductions run over ``model``'s sharding group.

    Every rank of the group then uses the same scales (each rank sees its own activations and
    gradients, so their amaxes differ before the reduction). ``recipe`` defaults to
    :func:`te_fp8_recipe`.
    """
    state = shard_state(unwrap_compiled(model))
    if state is None:
        raise ValueError(
            "shardc.te_autocast: the model was not sharded with shardc.shard; shard it first "
            "(shardc.shard(model)) or use TE's own autocast."
        )
    if state.layout is not None and state.layout.kind != "fsdp":
        # On a 2-D mesh the data-parallel ranks span both dimensions, and no single group of
        # the mesh covers them; TE with HSDP or FSDP+TP is not wired up.
        raise NotImplementedError(
            f"shardc.te_autocast: the model is sharded over a {state.layout.kind.upper()} mesh; "
            "only 1-D meshes are supported. Use TE's autocast with the amax group you need."
        )
    te, group = _te(), state.mesh.get_group()
    recipe = recipe if recipe is not None else te_fp8_recipe()
    if hasattr(te, "autocast"):  # TE >= 2.8; fp8_autocast is deprecated there
        return te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group)
    return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=group)


def te_float8_policy(**kwargs) -> Float8Policy:
    """A :class:`shardc.Float8Policy` that gathers the GEMM weights of TE's ``Linear``,
    ``LayerNormLinear`` and ``LayerNormMLP`` (and so of ``TransformerLayer``) in FP8.

    shardc quantizes each shard with a per-tensor current scale, gathers 1 byte per element and
    hands TE the dequantized weight; TE quantizes it again for its GEMM. Under TE's
    current-scaling recipe (``te_fp8_recipe("current")``) that second quantization gets the same
    scale and reproduces the gathered FP8 values exactly, so the GEMM sees the weight it would
    see unsharded (up to the last bit of the scale). Under delayed scaling TE's scale differs
    and the weight is rounded twice. ``kwargs`` are further ``Float8Policy`` fields
    (``include``, ``exclude``, ``filter``, ``dtype``).
    """
    te = _te()
    kwargs.setdefault("modules", (te.Linear, te.LayerNormLinear, te.LayerNormMLP))
    kwargs.setdefault("weights", TE_GEMM_WEIGHTS)
    kwargs.setdefault("scaled_mm", False)  # TE runs its own FP8 GEMMs
    return Float8Policy(**kwargs)
