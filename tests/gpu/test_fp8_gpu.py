"""FP8 on a CUDA GPU (``pytest -m gpu``; run by ``scripts/gpu_fp8.sh`` on the device machine).

One process, a one-rank NCCL group: the planned all-gathers still run (world 1). Skipped with
the reason where there is no GPU with FP8 matmuls. TransformerEngine: ``test_te_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from gpu_marks import needs_fp8_gpu
from torch.utils._python_dispatch import TorchDispatchMode

import shardc
from shardc.models.llama import LlamaConfig, Transformer, llama_loss

pytestmark = pytest.mark.gpu

CFG = LlamaConfig(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512,
                  max_seq_len=64)


class _CountScaledMM(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _data(steps: int):
    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, CFG.vocab_size, (steps, 8, 1), generator=g)
    # A learnable sequence (x -> 5x + 3 mod V), so the loss falls.
    seq = [start]
    for _ in range(32):
        seq.append((seq[-1] * 5 + 3) % CFG.vocab_size)
    tokens = torch.cat(seq, dim=-1).cuda()
    return tokens[..., :-1], tokens[..., 1:]


def _train(mode: str, fp8: shardc.Float8Policy | None, steps: int = 20):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Transformer(CFG).cuda()
    mp = shardc.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    shardc.shard(model, mp_policy=mp, fp8=fp8)
    forward = model if mode == "eager" else torch.compile(model, backend=shardc.backend())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens, targets = _data(steps)
    losses, counter = [], _CountScaledMM()
    for step in range(steps):
        if step == 0 and mode == "eager":
            with counter:
                loss = llama_loss(forward(tokens[step]), targets[step])
                loss.backward()
        else:
            loss = llama_loss(forward(tokens[step]), targets[step])
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = shardc.shard_state(model)
    return losses, counter.count, state, model


@needs_fp8_gpu
@pytest.mark.parametrize("mode", ["eager", "inductor"])
def test_scaled_mm_path_trains_like_bf16(nccl, mode):
    bf16, _, _, _ = _train(mode, None)
    fp8, calls, state, model = _train(mode, shardc.Float8Policy())
    n_linear = sum(1 for i in state.params.values() if i.fp8 is not None)
    assert n_linear == CFG.n_layers * 7 + 1
    if mode == "eager":
        # Forward, input and weight gradient of every FP8 linear run on _scaled_mm.
        assert calls == 3 * n_linear, calls
    else:
        region = state.regions[0]
        mm = [n for gm in (region.forward, region.backward) for n in gm.graph.nodes
              if n.target is torch.ops.aten._scaled_mm.default]
        assert len(mm) == 3 * n_linear, len(mm)
        gathers = [c for c in region.plan.collectives if c.dtype == "float8_e4m3fn"]
        assert gathers, "no float8 all-gather planned"
    assert all(torch.isfinite(torch.tensor(fp8))), fp8
    assert fp8[-1] < fp8[0] * 0.7, f"FP8 training did not learn: {fp8}"
    rel = abs(fp8[-1] - bf16[-1]) / bf16[-1]
    assert rel < 0.1, f"final loss FP8 {fp8[-1]:.4f} vs bf16 {bf16[-1]:.4f}"
    assert {p.to_local().dtype for p in model.parameters()} == {torch.float32}


@needs_fp8_gpu
def test_dequant_path_when_shapes_not_multiple_of_16(nccl):
    torch.manual_seed(0)
    layer = torch.nn.Linear(40, 24).cuda()  # 40 is not a multiple of 16
    shardc.shard(layer, fp8=shardc.Float8Policy())
    counter = _CountScaledMM()
    x = torch.randn(16, 40, device="cuda")
    with counter:
        y = layer(x)
    assert counter.count == 0 and y.shape == (16, 24) and torch.isfinite(y).all()
