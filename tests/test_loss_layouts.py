"""Losses that hand the last block of a stack compiled once per block (body calls, the sunk
residual) its output's gradient, or keep its output, in ways the middle blocks never see: each
trains like the unsharded model under Inductor, shardc's default. Found by
``docs/bench/standin_s65/loss_layouts.py`` (s65), which runs nine such losses under FX and
Inductor; the four here failed:

- ``(y * y.detach()).sum()`` keeps the region's final add (of the last pair) materialized, and
  Inductor computed it in place in the last call's input sum while the call's saved view of that
  sum was still to be read: the last block's ``up.weight`` gradient was 3.6 off, silently
  (``aliased_saved_values.read_body_views_through_their_base``).
- ``(y * torch.ones(1, 1, 8)).sum()``: Inductor's joint passes reduce the gradient to an expanded
  one (strides 0) while the body's backward was traced for a dense one; the compile failed
  ("subgraph args must have consistent values";
  ``shardc.passes.body_operand_layouts``). Plain ``torch.compile`` with
  ``nested_compile_region`` fails the same way on torch 2.11 and 2.13.
- ``x.sum()``: the last call's stand-in gets an expanded gradient, copied into the first call's
  layout since s64; the half of the sunk pair the backward does not read was left expanded, and
  Inductor's fake-tensor update refused the two layouts of one subgraph operand (the compile
  failed; ``shardc.passes.body_standin._tangents_as_first``, fixed in s65; the operand-layout
  pass below now covers it too).
- Checkpointed blocks (``checkpoint(block, x)``) with ``x.mean()``: the backward recomputes the
  last block's forward, pruned to what its backward reads, which includes a view of the body's
  input (the first linear layer's input); Inductor took that output for a buffer of its own and
  the input's buffer for dead, and the last block's ``up.weight`` gradient was 0.09 off,
  silently (sink or not). The caller now reads such an output as the view of its operand
  (``read_body_views_through_their_base``).

And two found in s71: ``x.sum(1)`` of the last block's output (Conv1d blocks, but any block
type does it), whose expanded gradient the traced backward call received, so that the other
calls' gradients were copied into a layout no other values fit (both backends failed); and
blocks that return an expand (``expanded_blocks``): the body's forward traced for an expanded
input, which its placeholder is now made dense for, and Inductor constrained the copied operand
back to the expand's layout from the call's ``eager_input_vals`` (the compile failed).
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import one_rank_mesh, run_ranks


class _Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 12), torch.nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class _Pooling(_Residual):
    """A block whose output is an expand (strides 0): the next block's input, for which the
    body's forward is traced."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.mean(1, keepdim=True)
        return (m + self.down(torch.tanh(self.up(m)))).expand_as(x)


class _Stack(torch.nn.Module):
    def __init__(self, loss: str) -> None:
        super().__init__()
        # sum_pooled: three blocks, so the first body call traced in the backward (the last
        # block's) is the one whose gradient is expanded.
        block = _Pooling if loss == "expanded_blocks" else _Residual
        self.blocks = torch.nn.ModuleList(
            block() for _ in range(3 if loss in ("sum_pooled", "expanded_blocks") else 4))
        self.loss = loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.loss == "checkpointed_mean":
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.loss == "keeps_the_sum":
            return (x * x.detach()).sum()
        if self.loss == "checkpointed_mean":
            return x.mean()
        if self.loss == "bare_sum":
            return x.sum()
        if self.loss == "sum_pooled":
            return x.sum(1).square().sum()
        return (x * torch.ones(1, 1, 8)).sum()


def _step(mesh, loss: str, inductor: bool = True) -> tuple:
    """One step of the stack sharded on ``mesh`` under shardc's default backend and of the
    unsharded stack, on the same data (every rank's): the compiled loss, gradients and body
    counts, and the reference's loss and parameters."""
    import shardc

    torch.manual_seed(0)
    model, reference = _Stack(loss), _Stack(loss)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 5, 8)
    shardc.shard(model, mesh)
    torch._dynamo.reset()
    try:
        out = torch.compile(model, backend=shardc.backend(inductor=inductor))(x)
        out.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        bodies = [len(p.bodies) for p in shardc.explain_all(model)]
    finally:
        torch._dynamo.reset()
    return out, grads, bodies, reference, x


def _check(out, grads, bodies, reference, x) -> None:
    """The compiled step's loss and gradients equal the reference's on ``x``."""
    # Blocks 1-3 call compiled bodies (block 0 is inline): one on torch 2.13+, where the sunk
    # first call shares the keyed trace; two on torch 2.11's trace-once path.
    assert len(bodies) == 1 and bodies[0] >= 1, bodies
    expected = reference(x)
    expected.backward()
    torch.testing.assert_close(out, expected)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, msg=name)


@pytest.mark.parametrize("loss", ["keeps_the_sum", "expanded_gradient", "checkpointed_mean",
                                  "bare_sum", "sum_pooled", "expanded_blocks"])
def test_the_last_block_trains_like_the_unsharded_model(loss):
    with one_rank_mesh() as mesh:
        result = _step(mesh, loss)
    _check(*result)


def test_a_sum_over_the_last_blocks_output_trains_under_fx_too():
    """``x.sum(1)`` of the last block's output hands its body call an expanded gradient (stride
    0), and that call's backward is the one traced: the other calls' gradients were copied into
    its layout (``prims.copy_strided``), which no other values fit ("more than one element of
    the written-to tensor refers to a single memory location"; under Inductor its lowering's
    stride constraint failed). Now the placeholder is made dense and every call's gradient
    copied into that (``passes.body_operand_layouts``). Found by s71's probes with Conv1d
    blocks; any block type does it."""
    with one_rank_mesh() as mesh:
        result = _step(mesh, "sum_pooled", inductor=False)
    _check(*result)


def _on_ranks(rank: int, world: int, loss: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    _check(*_step(init_device_mesh("cpu", (world,)), loss))


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["keeps_the_sum", "checkpointed_mean"])
def test_the_last_block_trains_like_the_unsharded_model_at_three_uneven_ranks(loss):
    """The two silent faults over real collectives: three ranks, the 8-wide weights uneven."""
    run_ranks(_on_ranks, 3, loss)
