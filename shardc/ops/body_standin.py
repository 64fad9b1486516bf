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

Under dynamic shapes a call's operands include the region's size symbols (``SymInt``s, passed
as ``sizes``) and its outputs' sizes are expressions in them: the recorded metadata keeps the
expressions (sympy), and the fake kernel evaluates them on the ``sizes`` it is given, so the
outputs carry the tracing call's own symbols.
"""

from __future__ import annotations

import functools
import hashlib
import operator
from dataclasses import dataclass

import sympy
import torch

__all__ = ["BODY_BWD_OP", "BODY_FWD_OP", "OutputMeta", "Recorded", "output_metas",
           "record_outputs", "recorded", "size_expr"]

# A size or stride: an int, or a polynomial (sympy) in the call's size symbols.
Size = int | sympy.Expr


def size_expr(value: object) -> Size | None:
    """An int or ``SymInt`` as an int or its sympy expression; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return int(expr) if expr.is_number else expr
    return None


def _is_polynomial(expr: Size) -> bool:
    """Whether ``_evaluate`` can compute ``expr``: integers and symbols under + and *, and
    powers with a positive integer exponent (no division, modulo, min or max)."""
    if isinstance(expr, int) or expr.is_Integer or expr.is_Symbol:
        return True
    if expr.is_Add or expr.is_Mul:
        return all(_is_polynomial(a) for a in expr.args)
    if expr.is_Pow:
        exp = expr.args[1]
        return bool(exp.is_Integer and exp > 0 and _is_polynomial(expr.args[0]))
    return False


def _evaluate(expr: Size, env: dict[sympy.Symbol, object]) -> object:
    """``expr`` (:func:`_is_polynomial`) with each symbol replaced by its value in ``env``
    (ints or ``SymInt``s: the result is a ``SymInt`` of the tracing call's symbols)."""
    if isinstance(expr, int):
        return expr
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return env[expr]
    values = [_evaluate(a, env) for a in expr.args]
    if expr.is_Add or expr.is_Mul:
        return functools.reduce(operator.add if expr.is_Add else operator.mul, values)
    return values[0] ** int(expr.args[1])


@dataclass(frozen=True)
class OutputMeta:
    """What the fake kernel of ``shardc::body_fwd`` returns for one output of a body."""

    shape: tuple[Size, ...]
    stride: tuple[Size, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, value: torch.Tensor) -> OutputMeta:
        return cls(tuple(size_expr(d) for d in value.shape),
                   tuple(size_expr(d) for d in value.stride()), value.dtype, value.device,
                   value.requires_grad)

    def symbols(self) -> set[sympy.Symbol]:
        return {s for d in (*self.shape, *self.stride) if not isinstance(d, int)
                for s in d.free_symbols}

    def polynomial(self) -> bool:
        return all(_is_polynomial(d) for d in (*self.shape, *self.stride))

    def empty(self, env: dict[sympy.Symbol, object] | None = None) -> torch.Tensor:
        env = env or {}
        return torch.empty_strided([_evaluate(d, env) for d in self.shape],
                                   [_evaluate(d, env) for d in self.stride],
                                   dtype=self.dtype, device=self.device)


@dataclass(frozen=True)
class Recorded:
    """What one key stands for: the body's outputs, the symbol each ``sizes`` operand of a call
    is (in the order the call passes them), and where those operands stand among the body's
    (the call passes its tensors and its sizes apart)."""

    outputs: tuple[OutputMeta, ...]
    size_symbols: tuple[sympy.Symbol, ...] = ()
    size_positions: tuple[int, ...] = ()

    def operand_position(self, tensor: int) -> int:
        """Where a call's ``tensor``-th tensor operand stands among the body's operands."""
        position = tensor
        for size in self.size_positions:  # ascending
            if size <= position:
                position += 1
        return position

    def operands(self, tensors: list, sizes: list) -> list:
        """The body's operands in order, from a call's ``tensors`` (its ``operands``) and
        ``sizes``."""
        merged: list = []
        tensors_left, sizes_left = iter(tensors), iter(sizes)
        for i in range(len(tensors) + len(sizes)):
            merged.append(next(sizes_left) if i in self.size_positions else next(tensors_left))
        return merged


# key -> what it stands for. Keys name the body and digest the record, so one key always means
# the same outputs (the same in every process: AOTAutograd's cache key holds it).
_RECORDED: dict[str, Recorded] = {}


def record_outputs(identifier: str, outputs: tuple[OutputMeta, ...],
                   size_symbols: tuple[sympy.Symbol, ...] = (),
                   size_positions: tuple[int, ...] = ()) -> str:
    """Record a body's output metadata (sizes in ``size_symbols``, the symbols of the calls'
    ``sizes`` operands, which stand at ``size_positions`` among the body's operands); returns
    the key ``shardc::body_fwd`` calls name."""
    recorded = Recorded(outputs, size_symbols, size_positions)
    digest = hashlib.sha1(repr(recorded).encode()).hexdigest()[:16]
    key = f"{identifier}/{digest}"
    _RECORDED[key] = recorded
    return key


def recorded(key: str) -> Recorded:
    """What ``key`` (:func:`record_outputs`) stands for."""
    recorded = _RECORDED.get(key)
    if recorded is None:
        raise RuntimeError(f"shardc::body_fwd: no recorded outputs for {key!r}")
    return recorded


def output_metas(key: str) -> tuple[OutputMeta, ...]:
    return recorded(key).outputs


_NEVER = ("shardc::{} ran: it stands for a block body call while AOTAutograd traces the region, "
          "and shardc's partitioner turns it back into the body's call before compiling "
          "(compile with backend='shardc', or opaque_body_calls=False)")


@torch.library.custom_op("shardc::body_fwd", mutates_args=())
def body_fwd(key: str, call: int, operands: list[torch.Tensor],
             sizes: list[int]) -> list[torch.Tensor]:
    raise RuntimeError(_NEVER.format("body_fwd"))


@body_fwd.register_fake
def _body_fwd_fake(key: str, call: int, operands: list[torch.Tensor],
                   sizes: list[int]) -> list[torch.Tensor]:
    record = recorded(key)
    env = dict(zip(record.size_symbols, sizes, strict=True))
    return [meta.empty(env) for meta in record.outputs]


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
    key, call, operands, sizes = inputs
    metas = output_metas(key)
    ctx.key, ctx.call, ctx.num_sizes = key, call, len(sizes)
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
    # torch's custom-op autograd wants the inputs' structure back: a list of sizes is one
    # leaf (its gradient None), an empty one an empty list of tensors.
    return None, None, full, (None if ctx.num_sizes else [])


body_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, grads):
    raise RuntimeError("shardc::body_bwd: double backward through a block body stand-in is not "
                       "supported (opaque_body_calls=False)")


body_bwd.register_autograd(_no_double_backward)

BODY_FWD_OP = torch.ops.shardc.body_fwd.default
BODY_BWD_OP = torch.ops.shardc.body_bwd.default
