"""Activation checkpointing around SDPA's CUDA kernels through shardc (``pytest -m gpu``).

transformers' Qwen2ForCausalLM (small random config, ``attn_implementation="sdpa"``) in bf16 with
``model.gradient_checkpointing_enable()`` (every decoder layer checkpointed), sharded over a
one-rank NCCL group and compiled through shardc with and without Inductor, trains like the same
unsharded model run eagerly, within bf16 rounding. ``sdpa_kernel`` allows one SDPA backend at a
time (flash, then memory-efficient), so a kernel that cannot take the inputs raises instead of
quietly falling back; the compiled backward graph must recompute that kernel. The CPU tests of
the same model: tests/test_real_models.py::test_hf_decoder_gradient_checkpointing_sdpa*.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from real_models import backward_targets, build_hf_decoder
from torch.nn.attention import SDPBackend, sdpa_kernel

import shardc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                       reason="the transformers package is not installed"),
]

# Head dim 32, as many key/value heads as query heads: eligible for the flash kernel.
CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
KERNELS = {
    "flash": (SDPBackend.FLASH_ATTENTION, "aten._scaled_dot_product_flash_attention.default"),
    "efficient": (SDPBackend.EFFICIENT_ATTENTION,
                  "aten._scaled_dot_product_efficient_attention.default"),
}
STEPS, BATCH, SEQ, LR = 3, 4, 64, 0.05
LOSS_TOL, GRAD_TOL = 1e-2, 3e-2  # relative 2-norm errors: bf16 rounding, fused or not


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _train(model, forward, backend: SDPBackend) -> dict:
    """STEPS of SGD; the losses and the first step's gradients (full tensors)."""
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, CONFIG["vocab_size"], (STEPS, BATCH, SEQ + 1), generator=g).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    with sdpa_kernel(backend):  # the only SDPA backend allowed: ineligible inputs raise
        for step in range(STEPS):
            logits = forward(input_ids=data[step, :, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), data[step, :, 1:].flatten())
            loss.backward()
            if step == 0:
                grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                         .detach().clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    return {"losses": torch.stack(losses), "grads": grads}


@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_gradient_checkpointing_hf_decoder_on_sdpa_kernels(nccl, kernel, inductor):
    backend, op_name = KERNELS[kernel]
    torch._dynamo.reset()
    # Built twice from the same seed: the same weights. HF passes SDPA no mask and
    # is_causal=True here, which the flash kernel takes.
    reference = build_hf_decoder(CONFIG).to("cuda", torch.bfloat16)
    model = build_hf_decoder(CONFIG).to("cuda", torch.bfloat16)
    ref = _train(reference, reference, backend)

    shardc.shard(model)
    compiled = torch.compile(model, backend=shardc.backend(inductor=inductor))
    got = _train(model, compiled, backend)

    assert shardc.explain_all(compiled), "shardc planned no region (eager fallback?)"
    recomputed = [t for t in backward_targets(model) if t == op_name]
    assert len(recomputed) == CONFIG["num_hidden_layers"], (
        f"the backward should recompute {op_name} once per checkpointed layer, "
        f"got {len(recomputed)}")
    loss_err = _rel_err(got["losses"], ref["losses"])
    assert loss_err <= LOSS_TOL, f"losses {got['losses']} vs {ref['losses']}"
    assert got["grads"].keys() == ref["grads"].keys()
    for name, expected in ref["grads"].items():
        err = _rel_err(got["grads"][name], expected)
        assert err <= GRAD_TOL, f"gradient of {name}: rel err {err:.2e} > {GRAD_TOL}"
