"""Placeholders for repeated block bodies that Dynamo need not trace again (torch < 2.13, which
has no ``reuse_hash_fn``; ``shardc.sharding.blocks``, "trace once").

While Dynamo traces a compiled forward, the first call of a block body with a given *slot*
(one block group, one argument description, one pattern of identical arguments, in one Dynamo
(sub)graph) is traced as usual, an ``invoke_subgraph`` call, and its outputs pass through
``shardc::body_anchor``, which records in the graph which of the flat tensor arguments and which
of the call's outputs they were. Every later call with the same slot in the same graph is one
``shardc::body_call`` node. shardc's backend (:func:`shardc.passes.body.rewrite_trace_once_calls`)
turns each ``body_call`` into an ``invoke_subgraph`` call of the first call's subgraph and
removes the anchors, before anything else reads the graph. Neither op ever runs: their eager
kernels raise, and their backward too.
"""

from __future__ import annotations

import torch

__all__ = ["BODY_ANCHOR_OP", "BODY_CALL_OP", "record_outputs", "recorded_outputs"]

# slot -> the outputs' metadata (shape, stride, dtype, device type, device index) recorded from
# Dynamo's trace of the slot's first call: what ``body_call``'s fake implementation returns.
_OUTPUTS: dict[int, tuple[tuple, ...]] = {}


def record_outputs(slot: int, outputs: tuple[tuple, ...]) -> bool:
    """Record ``slot``'s output metadata; False if it was recorded before with other values."""
    return _OUTPUTS.setdefault(slot, outputs) == outputs


def recorded_outputs(slot: int) -> tuple[tuple, ...] | None:
    return _OUTPUTS.get(slot)


_NEVER = ("shardc::{} ran: it stands for a block body call that shardc's backend rewrites "
          "before compiling (compile with backend='shardc', or set SHARDC_TRACE_ONCE=0)")


@torch.library.custom_op("shardc::body_call", mutates_args=())
def body_call(slot: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    raise RuntimeError(_NEVER.format("body_call"))


@body_call.register_fake
def _body_call_fake(slot: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    outputs = _OUTPUTS.get(slot)
    if outputs is None:
        raise RuntimeError(f"shardc::body_call: no recorded outputs for slot {slot}")
    return [torch.empty_strided(shape, stride, dtype=dtype, device=torch.device(kind, index))
            for shape, stride, dtype, kind, index in outputs]


@torch.library.custom_op("shardc::body_anchor", mutates_args=())
def body_anchor(slot: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor]
                ) -> list[torch.Tensor]:
    raise RuntimeError(_NEVER.format("body_anchor"))


@body_anchor.register_fake
def _body_anchor_fake(slot: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor]
                      ) -> list[torch.Tensor]:
    return [torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device)
            for o in outputs]


def _no_backward(ctx, grads):
    raise RuntimeError("shardc: a block body placeholder reached autograd; shardc's backend "
                       "rewrites it before AOTAutograd (set SHARDC_TRACE_ONCE=0)")


# Registered so that the outputs require grad as the body's would (Dynamo's trace reads it).
body_call.register_autograd(_no_backward)
body_anchor.register_autograd(_no_backward)

BODY_CALL_OP = torch.ops.shardc.body_call.default
BODY_ANCHOR_OP = torch.ops.shardc.body_anchor.default
