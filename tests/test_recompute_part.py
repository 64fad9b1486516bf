"""Which saved values of a block body are cheap to recompute (shardc.passes.recompute_part).

The parity of the lever (the planner choosing it, training against the unsharded reference) is
tests/test_real_models.py::test_peak_budget_recomputes_single_saved_values_with_parity."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from shardc.passes.recompute_part import cheap_outputs


def _body(x, norm_w, w_gate, w_up, w_down):
    """A feed-forward half of a Llama block, returning what its backward would read."""
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)  # a reduction: saved
    normed = x * rstd * norm_w  # elementwise on saved values: cheap
    gate, up = normed @ w_gate.t(), normed @ w_up.t()  # matrix products: saved
    act = F.silu(gate)  # elementwise: cheap
    prod = act * up  # elementwise on a cheap value and a saved one: cheap
    out = x + prod @ w_down.t()
    return out, rstd, normed, gate, up, act, prod, gate.t(), prod.t()


def _graph():
    args = (torch.randn(6, 8), torch.randn(8), torch.randn(12, 8), torch.randn(12, 8),
            torch.randn(8, 12))
    return make_fx(_body)(*args)


def test_cheap_outputs_are_elementwise_work_on_the_other_saved_values():
    gm = _graph()
    cheap = cheap_outputs(gm, range(1, 9))
    # normed, act, prod: elementwise; rstd (a mean), gate and up (matrix products) are not; a
    # view of a saved value (gate.t()) frees nothing, a view of a cheap one (prod.t()) is
    # recomputed through it.
    assert sorted(cheap) == [2, 5, 6, 8], sorted(cheap)
    outs = list(gm.graph.output_node().args[0])
    # prod's cone runs through act (cheap, recomputed with it) and stops at up (saved).
    assert outs[5] in cheap[6] and outs[4] not in cheap[6]
    # normed's stops at the input x and at the saved rstd.
    assert outs[1] not in cheap[2]
    assert all(n.op == "call_function" for cone in cheap.values() for n in cone)


def test_a_value_whose_saved_inputs_are_not_read_is_not_cheap():
    """Without rstd among the values the backward reads, normed's cone would run through the
    mean: it is no longer cheap (the cone stops only at values that stay saved)."""
    gm = _graph()
    cheap = cheap_outputs(gm, [2, 3, 4, 5, 6])
    assert 2 not in cheap and 6 in cheap, sorted(cheap)
