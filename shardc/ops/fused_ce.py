"""The fused, chunked output projection + cross-entropy (issue 22's loss lever) as a custom op.

``shardc::fused_linear_cross_entropy(h, weight, target, chunk, ignore_index, reduction,
upcast)`` computes ``cross_entropy((h @ weight.T)[.float()], target)`` a chunk of ``chunk``
tokens at a time, so the logits ``[tokens, vocab]`` (and their fp32 copy and gradient) never
exist whole. It computes the gradients in the forward ("gradient in the forward", as
Liger-Kernel's fused linear cross-entropy does): it returns ``(loss, grad_h, grad_weight)``
with the gradients *unscaled* (for an incoming loss gradient of 1); the backward only
multiplies them by the loss's incoming gradient. :mod:`shardc.passes.fused_loss` puts it into a
joint graph in place of ``mm -> [_to_copy] -> _log_softmax -> nll_loss_forward`` and their
backward; :func:`linear_cross_entropy` is the same with autograd, for eager use and the tests.

Numerics, as autograd computes the unfused graph: each chunk's logits in the input dtype; the
log-sum-exp, loss and gradient of the logits in fp32 when ``upcast`` (the graph's
``.float()``), in the input dtype otherwise; the logits' gradient cast back to the input dtype
before the two matmuls (``grad_h = g @ W``, ``grad_W += g.T @ h``); ``grad_W`` accumulated in
fp32 over the chunks (a separate accumulator unless the weight is fp32) and cast at the end.
The loop order is fixed: results are deterministic.
"""

from __future__ import annotations

import math

import torch

_LIB = "shardc"
# aten's reduction enum, as nll_loss_forward takes it.
MEAN, SUM = 1, 2


def _loss_dtype(h: torch.Tensor, upcast: bool) -> torch.dtype:
    """The loss's dtype: that of the log-probabilities the unfused graph reduces."""
    return torch.float32 if upcast else h.dtype


def _check(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk: int,
           reduction: int) -> None:
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(
            f"shardc::fused_linear_cross_entropy: h must be [tokens, D] and weight [V, D], got "
            f"{tuple(h.shape)} and {tuple(weight.shape)}")
    if target.dim() != 1 or target.shape[0] != h.shape[0]:
        raise ValueError(
            f"shardc::fused_linear_cross_entropy: target must be [tokens] ({h.shape[0]}), got "
            f"{tuple(target.shape)}")
    if chunk < 1:
        raise ValueError(f"shardc::fused_linear_cross_entropy: chunk (tokens per chunk) must "
                         f"be >= 1, got {chunk}")
    if reduction not in (MEAN, SUM):
        raise ValueError("shardc::fused_linear_cross_entropy: reduction must be 1 (mean) or 2 "
                         f"(sum), got {reduction}")


@torch.library.custom_op(f"{_LIB}::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               chunk: int, ignore_index: int, reduction: int, upcast: bool
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, grad_h, grad_weight)`` of ``cross_entropy(h @ weight.T, target)`` computed
    ``chunk`` tokens at a time; the gradients are for a loss gradient of 1 (see the module)."""
    _check(h, weight, target, chunk, reduction)
    tokens = h.shape[0]
    valid = target != ignore_index
    count = valid.sum()
    soft_dtype = torch.float32 if upcast else h.dtype
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for start in range(0, tokens, chunk):
        rows = slice(start, min(start + chunk, tokens))
        loss += _chunk(h[rows], weight, target[rows], valid[rows], count, soft_dtype,
                       reduction, grad_h[rows], grad_w)
    if reduction == MEAN:
        loss = loss / count
    return (loss.to(_loss_dtype(h, upcast)), grad_h,
            grad_w if weight.dtype == torch.float32 else grad_w.to(weight.dtype))


def _chunk(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, valid: torch.Tensor,
           count: torch.Tensor, soft_dtype: torch.dtype, reduction: int, grad_h: torch.Tensor,
           grad_w: torch.Tensor) -> torch.Tensor:
    """One chunk: writes its rows of ``grad_h``, adds to ``grad_w`` (fp32), returns its loss
    sum (fp32). Few passes over the chunk's ``[rows, V]`` values, each a single eager kernel:
    the log-softmax reads the logits in their dtype and writes the log-probabilities in
    ``soft_dtype`` (the graph's ``.float()`` folded in), turned into the softmax in place, the
    one-hot subtracted, scaled in place, then cast back."""
    logp = torch.log_softmax(torch.mm(h, weight.t()), dim=1, dtype=soft_dtype)
    safe = torch.where(valid, target, 0).unsqueeze(1)
    picked = logp.gather(1, safe).squeeze(1)
    loss = torch.where(valid, -picked, 0).sum(dtype=torch.float32)
    grad = logp.exp_()  # the softmax, in soft_dtype
    grad.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=grad.dtype))
    scale = valid.to(grad.dtype)
    if reduction == MEAN:
        scale = scale / count.to(grad.dtype)
    grad.mul_(scale.unsqueeze(1))
    g = grad.to(h.dtype)  # the cast back, as autograd's before the two matmuls
    torch.mm(g, weight, out=grad_h)
    if grad_w.dtype == g.dtype:
        grad_w.addmm_(g.t(), h)
    else:
        grad_w.add_(torch.mm(g.t(), h))
    return loss


@fused_linear_cross_entropy.register_fake
def _fake(h, weight, target, chunk, ignore_index, reduction, upcast):
    return (h.new_empty((), dtype=_loss_dtype(h, upcast)), torch.empty_like(h),
            torch.empty_like(weight))


def _setup(ctx, inputs, output) -> None:
    _, grad_h, grad_w = output
    ctx.save_for_backward(grad_h, grad_w)
    ctx.mark_non_differentiable(grad_h, grad_w)


def _backward(ctx, grad_loss, _grad_h, _grad_w):
    grad_h, grad_w = ctx.saved_tensors
    return grad_h * grad_loss, grad_w * grad_loss, None, None, None, None, None


fused_linear_cross_entropy.register_autograd(_backward, setup_context=_setup)

FUSED_CE_OP = torch.ops.shardc.fused_linear_cross_entropy.default

# The planner's chunk: at least this many chunks (where there are that many tokens), each
# chunk's fp32 logits at most CHUNK_BYTES.
MIN_CHUNKS = 8
CHUNK_BYTES = 256 << 20


def tokens_per_chunk(tokens: int, vocab: int) -> int:
    """The planner's tokens per chunk for ``tokens`` x ``vocab`` logits: deterministic, at
    least :data:`MIN_CHUNKS` chunks and each chunk's fp32 logits within :data:`CHUNK_BYTES`."""
    by_count = math.ceil(tokens / MIN_CHUNKS)
    by_bytes = CHUNK_BYTES // max(4 * vocab, 1)
    return max(1, min(tokens, by_count, by_bytes))


def workspace_bytes(tokens: int, hidden: int, vocab: int, chunk: int, dtype: torch.dtype,
                    weight_dtype: torch.dtype, upcast: bool) -> int:
    """Bytes the op holds besides its inputs and outputs, at its largest: one chunk's logits
    (input dtype) beside their log-probabilities (softmax dtype), which later hold the
    gradient beside its cast back; and where the weight is not fp32 its fp32 accumulator and
    the chunk's ``g.T @ h`` product."""
    rows = min(chunk, tokens)
    item = torch.empty((), dtype=dtype).element_size()
    soft = 4 if upcast else item
    per_chunk = rows * vocab * (item + soft)
    if weight_dtype == torch.float32:
        return per_chunk
    return per_chunk + vocab * hidden * (4 + item)


def elementwise_bytes(tokens: int, hidden: int, vocab: int, chunk: int, item: int, soft: int,
                      weight_item: int) -> int:
    """Bytes the op's kernels other than its matmuls move over all chunks: per ``[rows, V]``
    value the logits written by the matmul (``item``) and read by the log-softmax, which writes
    the log-probabilities (``soft``); their exponential in place (read and write), the scaling
    in place (read and write), the cast back (read ``soft``, write ``item``, where the dtypes
    differ) and the two matmuls' reads of it; per chunk, where the weight is not fp32, its
    gradient's product written and added to the fp32 accumulator (read and write)."""
    per_value = 2 * item + soft + 4 * soft + (soft + item if soft != item else 0) + 2 * item
    chunks = -(-tokens // max(1, min(chunk, tokens)))
    accumulate = 0 if weight_item == 4 else chunks * vocab * hidden * (2 * weight_item + 8)
    return tokens * vocab * per_value + accumulate


def flops(tokens: int, hidden: int, vocab: int) -> float:
    """The op's matmul FLOPs: the logits, ``grad_h`` and ``grad_W`` (2 * T * D * V each)."""
    return 6.0 * tokens * hidden * vocab


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                         chunk: int | None = None, ignore_index: int = -100,
                         reduction: str = "mean", upcast: bool = True) -> torch.Tensor:
    """``F.cross_entropy((h @ weight.T)[.float()], target)`` through the fused op, with
    autograd (``h``: ``[tokens, D]``, ``weight``: ``[V, D]``); ``chunk``: tokens per chunk
    (default: :func:`tokens_per_chunk`)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got "
                         f"{reduction!r}")
    chunk = chunk or tokens_per_chunk(h.shape[0], weight.shape[0])
    code = MEAN if reduction == "mean" else SUM
    return fused_linear_cross_entropy(h, weight, target, chunk, ignore_index, code, upcast)[0]
