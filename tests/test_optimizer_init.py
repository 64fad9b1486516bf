"""``shardc.checkpoint.init_optimizer_state``: the named step that gives an optimizer that never
stepped its zero state before a load (single process, plain modules; the FP8-shard case runs in
``tests/gpu/test_te_fp8_params.py``, the distributed round trips in ``tests/test_checkpoint.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from shardc.checkpoint import OptimizerState, init_optimizer_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2, bias=False))


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not isinstance(y, dict) or not _same(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.dtype != y.dtype or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("lr", [1e-2, torch.tensor(1e-2)], ids=["float_lr", "tensor_lr"])
def test_init_gives_zero_state_and_changes_nothing_else(lr):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    before = _params(model)
    assert init_optimizer_state(opt) is True
    assert _same(_params(model), before), "the lr-0 step must not move the parameters"
    assert all(p.grad is None for p in model.parameters())
    assert opt.param_groups[0]["lr"] is lr, "the learning rate must be restored (same object)"
    states = list(opt.state.values())
    assert len(states) == 3
    for state in states:
        assert float(state["step"]) == 1.0
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    # A second call finds the state and touches nothing.
    snapshot = {k: v.clone() for k, v in states[0].items()}
    assert init_optimizer_state(opt) is False
    assert _same(dict(list(opt.state.values())[0]), snapshot)


def test_init_matches_torchs_own_initialization():
    """The state dict after the named step equals the one torch's ``get_optimizer_state_dict``
    makes with its internal initialization: no behaviour change for plain parameters."""
    ours_model, torch_model = _model(), _model()
    ours = torch.optim.AdamW(ours_model.parameters(), lr=1e-2)
    theirs = torch.optim.AdamW(torch_model.parameters(), lr=1e-2)
    init_optimizer_state(ours)
    assert _same(get_optimizer_state_dict(ours_model, ours),
                 get_optimizer_state_dict(torch_model, theirs))
    assert _same(_params(ours_model), _params(torch_model))


def test_init_skips_optimizers_with_gradients():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(1, 5)).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    assert init_optimizer_state(opt) is False
    assert not opt.state
    assert _same({k: p.grad for k, p in model.named_parameters()}, grads)


def test_optimizer_state_initializes_on_first_state_dict_not_when_built():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wrapper = OptimizerState(model, opt)
    assert not opt.state, "building the wrapper must not step the optimizer"
    sd = wrapper.state_dict()
    assert len(opt.state) == 3
    assert set(sd["state"]) == {"0.weight", "0.bias", "2.weight"}
