"""Opaque stand-ins for the later calls of a block body while AOTAutograd traces a region
(``opaque_body_calls``; docs/design.md, "Body calls AOTAutograd does not re-trace").

AOTAutograd re-traces a body at every ``invoke_subgraph`` call it meets, whatever torch caches
after: the HOP's autograd entry (``torch/_ops.py``, ``maybe_run_autograd``) builds the body's
schema (``gen_schema``, a ``make_fx`` trace of the body) for a mutation check before it looks
up the cached autograd function, and the fake kernel runs the body on fake tensors. So before
AOTAutograd, every call of a body after its first one in Dynamo's graph becomes
``shardc::body_fwd(key, call, operands)``: an op whose fake kernel returns the outputs'
metadata recorded from Dynamo's own values for that call (:func:`record_outputs`), and whose
registered autograd formula saves the operands and calls ``shardc::body_bwd(key, call,
operands, tangents, grads_for)``, whose fake kernel returns a gradient laid out like each
operand it differentiates. The region's partitioner turns each pair back into the partitioned
``invoke_subgraph`` calls torch builds for a body call (``shardc.passes.body_standin``), so
nothing after sees them. Neither op ever runs: their eager kernels raise.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

__all__ = ["BODY_BWD_OP", "BODY_FWD_OP", "OutputMeta", "output_metas", "record_outputs"]


@dataclass(frozen=True)
class OutputMeta:
    """What the fake kernel of ``shardc::body_fwd`` returns for one output of a body."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, value: torch.Tensor) -> OutputMeta:
        return cls(tuple(value.shape), tuple(value.stride()), value.dtype, value.device,
                   value.requires_grad)

    def empty(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


# key -> the body's outputs' metadata. Keys name the body and digest the metadata, so one key
# always means the same outputs (the same in every process: AOTAutograd's cache key holds it).
_OUTPUTS: dict[str, tuple[OutputMeta, ...]] = {}


def record_outputs(identifier: str, outputs: tuple[OutputMeta, ...]) -> str:
    """Record a body's output metadata; returns the key ``shardc::body_fwd`` calls name."""
    digest = hashlib.sha1(repr(outputs).encode()).hexdigest()[:16]
    key = f"{identifier}/{digest}"
    _OUTPUTS[key] = outputs
    return key


def output_metas(key: str) -> tuple[OutputMeta, ...]:
    outputs = _OUTPUTS.get(key)
    if outputs is None:
        raise RuntimeError(f"shardc::body_fwd: no recorded outputs for {key!r}")
    return outputs


_NEVER = ("shardc::{} ran: it stands for a block body call while AOTAutograd traces the region, "
          "and shardc's partitioner turns it back into the body's call before compiling "
          "(compile with backend='shardc', or opaque_body_calls=False)")


@torch.library.custom_op("shardc::body_fwd", mutates_args=())
def body_fwd(key: str, call: int, operands: list[torch.Tensor]) -> list[torch.Tensor]:
    raise RuntimeError(_NEVER.format("body_fwd"))


@body_fwd.register_fake
def _body_fwd_fake(key: str, call: int, operands: list[torch.Tensor]) -> list[torch.Tensor]:
    return [meta.empty() for meta in output_metas(key)]


@torch.library.custom_op("shardc::body_bwd", mutates_args=())
def body_bwd(key: str, call: int, operands: list[torch.Tensor], tangents: list[torch.Tensor],
             grads_for: list[int]) -> list[torch.Tensor]:
    raise RuntimeError(_NEVER.format("body_bwd"))


@body_bwd.register_fake
def _body_bwd_fake(key: str, call: int, operands: list[torch.Tensor],
                   tangents: list[torch.Tensor], grads_for: list[int]) -> list[torch.Tensor]:
    # The gradient of an operand laid out as the operand: the partitioner checks it against the
    # body's partitioned backward and the region compiles without stand-ins where it differs.
    return [torch.empty_strided(operands[i].shape, operands[i].stride(),
                                dtype=operands[i].dtype, device=operands[i].device)
            for i in grads_for]


def _setup_context(ctx, inputs, output) -> None:
    key, call, operands = inputs
    metas = output_metas(key)
    ctx.key, ctx.call = key, call
    # As invoke_subgraph's autograd function: outputs Dynamo saw not requiring grad get none,
    # and the backward takes the gradients of the others only, in order.
    ctx.differentiable = [m.requires_grad for m in metas]
    ctx.save_for_backward(*operands)
    frozen = [o for o, d in zip(output, ctx.differentiable) if not d]
    if frozen:
        ctx.mark_non_differentiable(*frozen)


def _backward(ctx, grads):
    operands = list(ctx.saved_tensors)
    tangents = [g for g, d in zip(grads, ctx.differentiable) if d]
    grads_for = [i for i, needed in enumerate(ctx.needs_input_grad[2]) if needed]
    computed = body_bwd(ctx.key, ctx.call, operands, tangents, grads_for)
    full: list[torch.Tensor | None] = [None] * len(operands)
    for i, grad in zip(grads_for, computed):
        full[i] = grad
    return None, None, full


body_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, grads):
    raise RuntimeError("shardc::body_bwd: double backward through a block body stand-in is not "
                       "supported (opaque_body_calls=False)")


body_bwd.register_autograd(_no_double_backward)

BODY_FWD_OP = torch.ops.shardc.body_fwd.default
BODY_BWD_OP = torch.ops.shardc.body_bwd.default
