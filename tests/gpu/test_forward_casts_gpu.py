"""``MixedPrecisionPolicy``'s forward casts on a GPU (one rank, NCCL): float32 features into a
bf16 policy train under Inductor, with and without CUDA graphs (``mode="reduce-overhead"``), like
the model computing in bf16 the way shardc does (tests/test_forward_casts.py checks the same on
CPU at worlds 1-4 against the same reference)."""

from __future__ import annotations

import pytest
import torch
from parity import max_rel_err
from test_forward_casts import BF16, LR, STEPS, _inputs, batches, bf16_reference, build, loss_of

import shardc

pytestmark = pytest.mark.gpu

# Inductor fuses the bf16 pointwise ops (emulate_precision_casts rounds their intermediates as
# eager does); the rest is the GPU's bf16 matrix products and reductions in another order.
LOSS_TOL, PARAM_TOL = 1e-3, 2e-2


def _on(tree, device: str):
    return torch.utils._pytree.tree_map(
        lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def _sharded(data: dict, mode: str | None) -> tuple[dict, dict]:
    torch._dynamo.reset()
    model = build().cuda()
    shardc.shard(model, mp_policy=shardc.MixedPrecisionPolicy(**BF16,
                                                              output_dtype=torch.float32))
    forward = torch.compile(model, backend="shardc", mode=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, dtypes = [], set()
    for step in range(STEPS):
        args, kwargs = _on(_inputs(data, step, slice(None)), "cuda")
        out = forward(*args, **kwargs)
        dtypes |= {out["out"].dtype, out["aux"][0].dtype}
        loss = loss_of(out, data["target"][step].cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    plans = shardc.explain_all(forward)
    return ({"losses": torch.stack(losses).cpu(),
             "params": {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()}},
            {"dtypes": dtypes, "plans": len(plans),
             "notes": [n for p in plans for n in p.notes if "CUDA graphs" in n]})


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_float_inputs_train_like_the_bf16_reference_on_a_gpu(nccl, mode):
    data = batches()
    ref = bf16_reference(1, torch.float32, device="cuda")
    with torch._inductor.config.patch(emulate_precision_casts=True):
        got, facts = _sharded(data, mode)
    assert facts["dtypes"] == {torch.float32} and facts["plans"] >= 1, facts
    assert not facts["notes"], facts["notes"]  # CUDA graphs not refused
    err = max_rel_err(got["losses"], ref["losses"])
    print(f"mode={mode}: losses rel err {err:.2e}")
    assert err <= LOSS_TOL, err
    worst = max((max_rel_err(got["params"][n], v), n) for n, v in ref["params"].items())
    print(f"mode={mode}: worst parameter {worst[1]} rel err {worst[0]:.2e}")
    assert worst[0] <= PARAM_TOL, worst
