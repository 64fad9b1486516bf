"""Baseline modes built on torch alone: FSDP2 (eager or with compiled blocks) and the bound.

Contract: see :class:`setup.Setup`. The bound has no parameter communication at all; it is the
step time perfect overlap would reach.
"""

from __future__ import annotations

import functools

import torch

from shardc.models.llama import Transformer
from train.setup import Setup, compiled_loss, model_loss, swap_param_reads


def setup_fsdp2(model: Transformer, mesh, compile_blocks: bool) -> Setup:
    """FSDP2: ``fully_shard`` per block and the root; blocks optionally ``torch.compile``d."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(list(model.layers)):
        if compile_blocks:
            block = torch.compile(block)
            model.layers.register_module(str(i), block)
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    info = {"mp_policy": "param_dtype=bf16, reduce_dtype=fp32",
            "compile": "torch.compile(block) per block, Inductor" if compile_blocks else "eager"}
    info["loss"] = "eager, after the model"
    return Setup(functools.partial(model_loss, model), list(model.parameters()), [model], info)


def setup_bound(model: Transformer, loss_in_graph: bool) -> Setup:
    """Replicated fp32 parameters read as bf16, compiled by Inductor; no communication."""
    params = list(model.parameters())
    swap_param_reads(model, lambda p: p.to(torch.bfloat16))
    compiled = compiled_loss(model, loss_in_graph)
    return Setup(compiled, params, [model, compiled],
                 {"compute": "fp32 master, bf16 cast in the parameter read, Inductor",
                  "communication": "none (no gradient all-reduce)"})
