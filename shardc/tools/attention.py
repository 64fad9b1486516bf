"""Attention traced as the kernel a GPU runs, when planning on the meta device.

``F.scaled_dot_product_attention`` picks its kernel by device. On CUDA it is one fused kernel
(flash or memory-efficient) that saves its output and a log-sum-exp row per query for the
backward. On the meta device torch has no fused choice and decomposes it into two matmuls and a
softmax over a materialized ``seq x seq`` score matrix, which a plan made without GPUs would then
count as memory (and time) that no GPU spends: 351 GiB for Llama-8B at sequence 8192.

:class:`AttentionAsKernel` is a ``TorchFunctionMode`` (a public torch API, traced through by
Dynamo) that, while active, computes ``F.scaled_dot_product_attention`` with the kernel CUDA's
dispatcher would pick on a recent GPU: flash attention for fp16/bf16 inputs without
a mask and a head size it takes, the memory-efficient kernel otherwise. Every other function is left
alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from shardc import _torch

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _flash_applies(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether CUDA's dispatcher picks flash attention (sm80+): half precision, no mask, a head
    size that is a multiple of 8 up to 256."""
    head = q.shape[-1]
    return q.dtype in _FLASH_DTYPES and mask is None and head % 8 == 0 and head <= 256


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as the additive bias the memory-efficient kernel takes."""
    if mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.full((), float("-inf"), dtype=dtype, device=mask.device))


def sdpa_as_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                   is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``'s result computed with the fused kernel CUDA picks."""
    if _flash_applies(query, attn_mask):
        # Flash attention reads grouped key/value heads as they are (no repeated copies).
        return _torch.flash_attention(query, key, value, dropout_p, is_causal, False,
                                      scale=scale)[0]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
    bias = None if attn_mask is None else _additive_mask(attn_mask, query.dtype)
    return _torch.efficient_attention(query, key, value, bias, True, dropout_p, is_causal,
                                      scale=scale)[0]


class AttentionAsKernel(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` runs as :func:`sdpa_as_kernel` (one fused
    op in a traced graph, forward and backward), on any device: planning traces on the meta
    device or on CPU shards that are never written, where the CPU's own choice (its flash kernel,
    or the decomposition for grouped heads and some masks) is not what a GPU runs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return sdpa_as_kernel(*args, **kwargs)
        return func(*args, **kwargs)
