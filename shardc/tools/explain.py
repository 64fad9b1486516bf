"""``shardc.explain``: the plans shardc made for a model's compiled regions."""

from __future__ import annotations

from torch import nn

from shardc.planning.plan import Plan
from shardc.sharding.scope import shard_state, unwrap_compiled


def explain_all(model: nn.Module) -> list[Plan]:
    """Plans of every compiled region of ``model`` (a sharded module or its compiled wrapper), in
    compilation order. Empty before the first compiled call."""
    state = shard_state(unwrap_compiled(model))
    if state is None:
        raise ValueError(
            "shardc.explain: this module was not sharded with shardc.shard; shard it and compile "
            "it with backend='shardc' first."
        )
    return [r.plan for r in state.regions if r.plan is not None]


def explain(model: nn.Module, region: int | None = None) -> Plan:
    """The :class:`Plan` of one compiled region of ``model``.

    With ``region=None`` the model must have exactly one planned region (call it once first);
    otherwise pass the region's index (see :func:`explain_all`).
    """
    plans = explain_all(model)
    if not plans:
        raise ValueError(
            "shardc.explain: no plan yet; the backend plans a region at its first compiled call. "
            "Run one forward (and backward) step of the compiled model first."
        )
    if region is None:
        if len(plans) > 1:
            raise ValueError(
                f"shardc.explain: the model has {len(plans)} compiled regions (graph breaks); "
                "pass region=<index> or use shardc.explain_all(model)."
            )
        return plans[0]
    if not 0 <= region < len(plans):
        raise IndexError(f"shardc.explain: region {region} out of range 0..{len(plans) - 1}")
    return plans[region]
