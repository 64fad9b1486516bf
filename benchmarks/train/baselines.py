"""Baseline modes built on torch alone: FSDP2 (eager, with compiled blocks, with activation
checkpointing or CPU offload) and the bound.

Contract: see :class:`setup.Setup`. The bound has no parameter communication at all; it is the
step time perfect overlap would reach.

The FSDP2 variants are the memory-saving configurations issue 22 compares shardc's peak budget
with (each block compiled by Inductor, as torchtitan does):

* ``checkpoint="full"``: every block's forward runs again in the backward
  (``torch.utils.checkpoint.checkpoint``, non-reentrant; only the block's inputs are saved);
* ``checkpoint="selective"``: per op, through the public
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts``: the outputs of the matmuls
  (``mm``/``addmm``/``bmm`` and the attention kernels, which are matmuls too) are saved, every
  other op is recomputed in the backward;
* ``offload=True``: ``fully_shard(..., offload_policy=CPUOffloadPolicy())``: parameter shards,
  gradients and the optimizer step on the host (pinned memory), copied to the device per block.

torch's ``activation_memory_budget`` (a partitioner option, ``torch._functorch.config``) is set
around the compiles by :func:`train.modes.mode_context`, not here.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from shardc.models.llama import Transformer
from train.setup import Setup, compiled_loss, model_loss, swap_param_reads

CHECKPOINTS = (None, "full", "selective")


@functools.cache
def _saved_ops() -> frozenset:
    """The ops whose outputs selective checkpointing saves: the matmuls and the attention
    kernels (those this torch has)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return (CheckpointPolicy.MUST_SAVE if op in _saved_ops()
            else CheckpointPolicy.PREFER_RECOMPUTE)


class CheckpointedBlock(nn.Module):
    """A block whose forward is recomputed in the backward: all of it (``"full"``) or all but
    its matmul outputs (``"selective"``)."""

    def __init__(self, block: nn.Module, kind: str) -> None:
        super().__init__()
        if kind not in ("full", "selective"):
            raise ValueError(f"checkpoint kind must be 'full' or 'selective', got {kind!r}")
        self.block = block
        self.kind = kind

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if self.kind == "full":
            return checkpoint(self.block, *args, use_reentrant=False)
        context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=context)


def setup_fsdp2(model: Transformer, mesh, compile_blocks: bool,
                activation_checkpoint: str | None = None, offload: bool = False) -> Setup:
    """FSDP2: ``fully_shard`` per block and the root; blocks optionally checkpointed (``"full"``
    or ``"selective"``, before compiling, as torchtitan does), ``torch.compile``d, and their
    state offloaded to the host (``CPUOffloadPolicy``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kind = activation_checkpoint
    if kind not in CHECKPOINTS:
        raise ValueError(f"activation_checkpoint must be one of {CHECKPOINTS}, got {kind!r}")
    device = next(model.parameters()).device
    if offload and device.type == "cpu":
        raise ValueError("fsdp2-compile-offload: CPUOffloadPolicy moves state from an "
                         "accelerator to the host; the model is on the CPU already (run it "
                         "on CUDA)")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    extra = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    for i, block in enumerate(list(model.layers)):
        if kind:
            block = CheckpointedBlock(block, kind)
        if compile_blocks:
            block = torch.compile(block)
        if kind or compile_blocks:
            model.layers.register_module(str(i), block)
        fully_shard(block, mesh=mesh, mp_policy=mp, **extra)
    fully_shard(model, mesh=mesh, mp_policy=mp, **extra)
    info = {"mp_policy": "param_dtype=bf16, reduce_dtype=fp32",
            "compile": "torch.compile(block) per block, Inductor" if compile_blocks else "eager"}
    if kind == "full":
        info["checkpoint"] = "full: torch.utils.checkpoint per block (non-reentrant)"
    elif kind == "selective":
        info["checkpoint"] = ("selective per op (create_selective_checkpoint_contexts): matmul "
                              "and attention outputs saved, the rest recomputed")
    if offload:
        info["offload"] = ("CPUOffloadPolicy: parameter shards, gradients and the optimizer "
                           "step on the host")
    info["loss"] = "eager, after the model"
    return Setup(functools.partial(model_loss, model), list(model.parameters()), [model], info)


def setup_bound(model: Transformer, loss_in_graph: bool, cudagraphs: bool = False) -> Setup:
    """Replicated fp32 parameters read as bf16, compiled by Inductor; no communication.
    ``cudagraphs``: under ``mode="reduce-overhead"``, the bound for modes that replay CUDA
    graphs (without it a host-bound step is slower than its device work)."""
    params = list(model.parameters())
    swap_param_reads(model, lambda p: p.to(torch.bfloat16))
    compiled = compiled_loss(model, loss_in_graph,
                             **({"mode": "reduce-overhead"} if cudagraphs else {}))
    compute = "fp32 master, bf16 cast in the parameter read, Inductor"
    return Setup(compiled, params, [model, compiled],
                 {"compute": compute + (", CUDA graphs" if cudagraphs else ""),
                  "communication": "none (no gradient all-reduce)"}, cudagraphs=cudagraphs)
