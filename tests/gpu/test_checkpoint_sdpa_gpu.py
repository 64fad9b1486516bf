"""Activation checkpointing around SDPA's CUDA kernels through shardc (``pytest -m gpu``).

transformers' Qwen2ForCausalLM (small random config, ``attn_implementation="sdpa"``) in bf16 with
``model.gradient_checkpointing_enable()`` (every decoder layer checkpointed), sharded over a
one-rank NCCL group and compiled through shardc with and without Inductor, trains like the same
unsharded model run eagerly, within bf16 rounding. ``sdpa_kernel`` allows one SDPA backend at a
time, so a kernel that cannot take the inputs raises instead of quietly falling back; the
compiled backward graph must recompute that kernel. The CPU tests of the same model:
tests/test_real_models.py::test_hf_decoder_gradient_checkpointing_sdpa*.

Which kernel each model can reach: compiled, transformers builds an explicit causal mask (its
skip-the-mask shortcut is off while tracing, sharded or not), and the flash kernel takes no
mask, so the HF model runs on the memory-efficient kernel (seen on an H100, torch 2.11,
transformers 5.17: flash raised "Flash Attention does not support non-null attn_mask" in
Dynamo's fake-tensor run). The flash kernel is covered by shardc's own Llama
(``F.scaled_dot_product_attention(q, k, v, is_causal=True)``) with every block checkpointed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from real_models import backward_op_calls, build_hf_decoder
from torch.nn.attention import SDPBackend, sdpa_kernel

import shardc
from shardc.models.llama import LlamaConfig, Transformer

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
LLAMA = LlamaConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, max_seq_len=128)
STEPS, BATCH, SEQ, LR = 3, 4, 64, 0.05
LOSS_TOL, GRAD_TOL = 1e-2, 3e-2  # relative 2-norm errors: bf16 rounding, fused or not


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


class CheckpointedBlock(torch.nn.Module):
    """A Llama block recomputed in the backward (``torch.utils.checkpoint``, non-reentrant)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x, cos, sin):
        return torch.utils.checkpoint.checkpoint(self.block, x, cos, sin, use_reentrant=False)


def _build(model_kind: str) -> torch.nn.Module:
    """The model from a fixed seed (built twice: the same weights), bf16 on the GPU."""
    if model_kind == "hf":
        return build_hf_decoder(CONFIG).to("cuda", torch.bfloat16)
    torch.manual_seed(0)
    model = Transformer(LLAMA)
    model.init_weights()
    for i, block in enumerate(model.layers):
        model.layers[i] = CheckpointedBlock(block)
    return model.to("cuda", torch.bfloat16).train()


def _logits_fn(model_kind: str, forward):
    if model_kind == "hf":
        return lambda tokens: forward(input_ids=tokens, use_cache=False).logits
    return forward


def _train(model, forward, backend: SDPBackend) -> dict:
    """STEPS of SGD; the losses and the first step's gradients (full tensors)."""
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, CONFIG["vocab_size"], (STEPS, BATCH, SEQ + 1), generator=g).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    with sdpa_kernel(backend):  # the only SDPA backend allowed: ineligible inputs raise
        for step in range(STEPS):
            logits = forward(data[step, :, :-1])
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
@pytest.mark.parametrize(("model_kind", "kernel"), [("llama", "flash"), ("hf", "efficient")])
def test_gradient_checkpointing_on_sdpa_kernels(nccl, model_kind, kernel, inductor, caplog):
    backend, op_name = KERNELS[kernel]
    torch._dynamo.reset()
    reference = _build(model_kind)
    model = _build(model_kind)
    ref = _train(reference, _logits_fn(model_kind, reference), backend)

    shardc.shard(model)
    compiled = torch.compile(model, backend=shardc.backend(inductor=inductor))
    with caplog.at_level("INFO", logger="shardc"):
        got = _train(model, _logits_fn(model_kind, compiled), backend)

    assert shardc.explain_all(compiled), "shardc planned no region (eager fallback?)"
    # The second layer's call reaches AOTAutograd as a stand-in, which fits the partitioned
    # body: the region compiles once (before s50, the checkpointed flash kernel's generator
    # state made it compile twice under FX).
    refits = [r.getMessage() for r in caplog.records if "stand-ins do not fit" in r.getMessage()]
    assert not refits, refits
    layers = CONFIG["num_hidden_layers"] if model_kind == "hf" else LLAMA.n_layers
    # Counted per call: the checkpointed Llama blocks are one compile-once body, whose backward
    # subgraph holds the recomputed kernel once and is called once per layer.
    recomputed = backward_op_calls(model, op_name)
    assert recomputed == layers, (
        f"the backward should recompute {op_name} once per checkpointed layer, got {recomputed}")
    loss_err = _rel_err(got["losses"], ref["losses"])
    assert loss_err <= LOSS_TOL, f"losses {got['losses']} vs {ref['losses']}"
    assert got["grads"].keys() == ref["grads"].keys()
    for name, expected in ref["grads"].items():
        err = _rel_err(got["grads"][name], expected)
        assert err <= GRAD_TOL, f"gradient of {name}: rel err {err:.2e} > {GRAD_TOL}"


@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
def test_hf_decoder_through_a_dynamic_recompile_on_the_efficient_kernel(nccl, inductor):
    """The checkpointed transformers decoder at three sequence lengths (the second compiles a
    dynamic-shape region, the third reuses it), bf16 on the memory-efficient SDPA kernel, trains
    like the eager model; in both regions every decoder layer calls a shared body or is named
    in the plan's inline blocks with its reason (its layers differ in ``layer_idx``: in the
    dynamic region they call the member body, ``shardc.sharding.blocks``)."""
    backend = KERNELS["efficient"][0]
    torch._dynamo.reset()
    reference, model = _build("hf"), _build("hf")
    shardc.shard(model)
    compiled = torch.compile(model, backend=shardc.backend(inductor=inductor))
    g = torch.Generator().manual_seed(2)
    losses: dict[str, list] = {"ref": [], "got": []}
    for name, m, forward in (("ref", reference, reference), ("got", model, compiled)):
        opt = torch.optim.SGD(m.parameters(), lr=LR)
        with sdpa_kernel(backend):
            for seq in (SEQ, SEQ - 16, SEQ - 8):
                data = torch.randint(0, CONFIG["vocab_size"], (BATCH, seq + 1), generator=g)
                data = data.cuda()
                logits = forward(input_ids=data[:, :-1], use_cache=False).logits
                loss = F.cross_entropy(logits.flatten(0, 1).float(), data[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses[name].append(loss.detach())
        g.manual_seed(2)  # the same data for the compiled model
    err = _rel_err(torch.stack(losses["got"]), torch.stack(losses["ref"]))
    assert err <= LOSS_TOL, f"losses {losses['got']} vs {losses['ref']}"
    plans = shardc.explain_all(compiled)
    assert len(plans) == 2, [p.hash() for p in plans]  # static, then dynamic
    layers = {f"model.layers.{i}" for i in range(CONFIG["num_hidden_layers"])}
    for plan in plans:
        called = {b for body in plan.bodies for b in body.blocks}
        inline = {b.module: b.reason for b in plan.inline_blocks}
        assert called | set(inline) == layers and all(inline.values()), (called, inline)
