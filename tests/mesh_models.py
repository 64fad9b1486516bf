"""A small model parallelized with torch's tensor-parallel API, for the FSDP+TP tests.

:class:`TPNet` runs unchanged as the unsharded reference (``tp_mesh`` None: every helper is the
identity) and, after :func:`parallelize`, as a tensor-parallel model on a ``tp`` mesh:

- ``norm``: an RMSNorm under ``SequenceParallel`` (input and output sharded on the sequence dim);
- ``w13``: a fused SwiGLU gate/up projection stored as ONE 3-D parameter ``(2, ffn, dim)``, tp
  sharded on the ffn dim (``Shard(1)``), so shardc's dp shard splits gate from up (dim 0);
- ``w2``: ``RowwiseParallel`` down projection;
- ``proj``: ``ColwiseParallel`` with a bias (dp splits each tp shard: ``_StridedShard``);
- ``experts``: a grouped 3-D expert weight ``(E, dim, out)``, tp sharded on the expert dim;
- ``embed``, ``router``, ``out``, ``head``: plain parameters (FSDP on dp only).

Sizes divide neither 2 nor 3 (but the 4 experts, since DTensor cannot flatten an uneven expert
shard in the einsum), so tp and dp shards are uneven.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

VOCAB, DIM, FFN, EXPERTS, PROJ = 37, 16, 11, 4, 9


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.RMSNorm(DIM)
        self.w13 = nn.Parameter(torch.randn(2, FFN, DIM) * 0.2)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.proj = nn.Linear(DIM, PROJ)
        self.experts = nn.Parameter(torch.randn(EXPERTS, PROJ, DIM) * 0.2)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.tp_mesh = None

    def _dt(self, x: torch.Tensor, placement) -> torch.Tensor:
        """A replicated local tensor as a DTensor with ``placement`` (slicing, no communication)."""
        if self.tp_mesh is None:
            return x
        return DTensor.from_local(x, self.tp_mesh, [Replicate()]).redistribute(
            self.tp_mesh, [placement])

    def _rep(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor):
            return x
        x = x.redistribute(self.tp_mesh, [Replicate()])
        local = x.to_local()
        if local.is_contiguous():
            return x
        # torch 2.11: the redistribute of an uneven Shard(1) to Replicate leaves the local
        # tensor a narrowed view of the padded gather (strides of 10 rows for 9), which the
        # DTensor's contiguous() keeps (its global strides look contiguous) and its einsum
        # cannot view. torch's, not shardc's: these are the model's own activations.
        return DTensor.from_local(local.contiguous(), self.tp_mesh, [Replicate()],
                                  run_check=False)

    def _full(self, x: torch.Tensor) -> torch.Tensor:
        return self._rep(x).to_local() if isinstance(x, DTensor) else x

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        x = self._rep(self.norm(self._dt(h, Shard(1))))
        # One matmul per half of the 3-D parameter (an einsum over it would flatten its sharded
        # ffn dim with another, which torch 2.11's DTensor refuses).
        gate, up = (x @ self.w13[k].mT for k in range(2))
        y = self.w2(F.silu(gate) * up)
        h = h + self._full(y)
        p = self.proj(self._dt(h, Replicate()))
        gates = torch.softmax(self.router(h), dim=-1)
        mixed = torch.einsum("bsp,epd->bsed", self._rep(p), self.experts)
        h = h + self._full((mixed * self._dt(gates, Replicate()).unsqueeze(-1)).sum(2))
        return self.head(h)


def parallelize(model: TPNet, tp_mesh) -> TPNet:
    """Tensor-parallelize ``model`` on ``tp_mesh`` with torch's API (and two 3-D parameters
    distributed by hand: the fused gate/up on the ffn dim, the experts on the expert dim)."""
    parallelize_module(model, tp_mesh, {
        "norm": SequenceParallel(use_local_output=False),
        "w2": RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate(),
                              use_local_output=False),
        "proj": ColwiseParallel(use_local_output=False),
    })
    model.w13 = nn.Parameter(distribute_tensor(model.w13.data, tp_mesh, [Shard(1)]))
    model.experts = nn.Parameter(distribute_tensor(model.experts.data, tp_mesh, [Shard(0)]))
    model.tp_mesh = tp_mesh
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class Mlp(nn.Module):
    """A residual MLP block: the repeated block of :class:`TPBlocks`. Its hidden width is even:
    torch's ``ColwiseParallel`` -> ``RowwiseParallel`` with local outputs between them assumes
    even tp shards (``DTensor.from_local`` without the shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * PROJ)
        self.down = nn.Linear(2 * PROJ, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.silu(self.up(h)))


class TPBlocks(nn.Module):
    """Four identical MLP blocks in an ``nn.ModuleList``; :func:`parallelize_blocks` makes the
    first two tensor-parallel (they keep the inlined compile) and leaves the last two plain
    (they share one compiled body)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Mlp() for _ in range(4)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def parallelize_blocks(model: TPBlocks, tp_mesh) -> TPBlocks:
    for block in list(model.blocks)[:2]:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model
