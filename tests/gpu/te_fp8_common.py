"""Shared pieces of the tests of TransformerEngine FP8 parameters (``te.quantized_model_init``):
models, batches, a training step with TE's ``FusedAdam`` (master weights), and comparisons that
read FP8 parameters as their dequantized values. Imported only where TE imports."""

from __future__ import annotations

import contextlib

import torch
import transformer_engine.pytorch as te
from torch.distributed.tensor import DTensor

import shardc
from shardc.sharding import te_params

D, FFN, HEADS = 256, 512, 4
KINDS = ["Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer"]


def build(kind: str, *, bias: bool = False, seed: int = 0, fp8_params: bool = True,
          recipe=None) -> torch.nn.Module:
    """A TE module on the GPU, its GEMM weights FP8 parameters when ``fp8_params``."""
    torch.manual_seed(seed)
    with te.quantized_model_init(enabled=fp8_params, recipe=recipe):
        if kind == "Linear":
            return te.Linear(D, D, bias=bias).cuda()
        if kind == "LayerNormLinear":
            return te.LayerNormLinear(D, D, bias=bias).cuda()
        if kind == "LayerNormMLP":
            return te.LayerNormMLP(D, FFN, bias=bias).cuda()
        return te.TransformerLayer(D, FFN, HEADS, bias=bias, hidden_dropout=0.0,
                                   attention_dropout=0.0, fuse_qkv_params=True).cuda()


def batch(step: int, rank: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(100 + step + 1000 * rank)
    return torch.randn(32, 2, D, device="cuda", generator=g)  # (seq, batch, hidden)


def optimizer(model: torch.nn.Module):
    """TE's Adam with float32 master weights: the optimizer FP8 parameters need."""
    return te.optimizers.FusedAdam(model.parameters(), lr=1e-3, master_weights=True,
                                   master_weight_dtype=torch.float32)


def step(model, forward, opt, autocast, x: torch.Tensor) -> float:
    with autocast():
        y = forward(x)
    loss = y.float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def ref_autocast(recipe):
    return lambda: te.autocast(enabled=True, recipe=recipe)


def shardc_autocast(model, recipe):
    return lambda: shardc.te_autocast(model, recipe)


def value(p: torch.Tensor) -> torch.Tensor:
    """The full value of a parameter (sharded or not, FP8 or not), dequantized, float32, as a
    copy: at world 1 ``full_tensor()`` and ``.float()`` of a float32 tensor return the
    parameter's own storage, which the next optimizer step would change."""
    if isinstance(p, DTensor):
        p = te_params.dequantized_value(p.detach()).full_tensor()
    elif te_params.is_quantized(p):
        p = p.dequantize(dtype=torch.float32)
    return p.detach().float().clone()


def values(model) -> dict[str, torch.Tensor]:
    return {n: value(p) for n, p in model.named_parameters()}


def master_weights(model, opt) -> dict[str, torch.Tensor]:
    """``FusedAdam``'s float32 master weights by parameter name (full tensors)."""
    out = {}
    for name, p in model.named_parameters():
        state = opt.get_unscaled_state(p, "master_param") if opt.state.get(p) else None
        if state is None:
            continue
        if isinstance(p, DTensor):
            state = DTensor.from_local(state, p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride()).full_tensor()
        out[name] = state.detach().float().clone()
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def fp8_names(model) -> list[str]:
    return [n for n, p in model.named_parameters()
            if te_params.is_quantized(p._local_tensor if isinstance(p, DTensor) else p)]


def drop_stale_transposes(model) -> None:
    """Mark the cached FP8 transposes of ``model``'s (unsharded) FP8 parameters stale.

    Under delayed scaling TE's ``FusedAdam`` writes the new FP8 bytes of a parameter in place
    and leaves the transpose TE cached at initialization as it was, so unsharded TE computes
    its input gradient (which needs the transpose on Hopper) with the initial weight from the
    second step on (scripts/te_probe_fp8_params.py measures it). shardc rebuilds a gathered weight
    every step, so its transpose is made from the current bytes. The reference drops its cache
    after each step to compute with the current weight too (no effect under current scaling,
    whose write-back re-quantizes the whole tensor)."""
    for p in model.parameters():
        if te_params.is_quantized(p):
            p._reset_caches()


@contextlib.contextmanager
def recorded_fp8_param_gathers():
    """Inside: every tensor shardc's FP8-parameter gather moves, as ``(dtype, numel)`` in
    order (the FP8 bytes as ``torch.uint8``; the scale checks as ``torch.float32``). Wraps our
    own module's function and restores it on exit."""
    moved: list[tuple[torch.dtype, int]] = []
    real = te_params.all_gather_rows

    def record(t, *args):
        moved.append((t.dtype, t.numel()))
        return real(t, *args)

    te_params.all_gather_rows = record
    try:
        yield moved
    finally:
        te_params.all_gather_rows = real
