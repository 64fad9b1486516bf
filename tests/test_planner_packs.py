"""The planner plans packed blocks where ``shardc.shard`` packed them, read from the sharded
model (``packed_blocks.packed_block_names``), not guessed from the setup: a block ``shard``
cannot pack (here: a frozen bias, ``packed_blocks.eligible_reason``) is planned as the
per-parameter reads it runs, from a template where the model has enough blocks."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import shardc
from shardc.sharding.packed_blocks import packed_block_names
from shardc.tools import planner
from shardc.tools.fake_world import fake_world
from shardc.tools.model_spec import ModelSpec
from shardc.tools.planner import PlanSetup, plan_model_step
from shardc.tools.template import TEMPLATE_BLOCKS, comparable_plan

DIM, VOCAB = 16, 32


class _Block(nn.Module):
    def __init__(self, frozen_bias: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.lin.bias.requires_grad_(not frozen_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x).relu()


class _Net(nn.Module):
    def __init__(self, depth: int, frozen_bias: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(_Block(frozen_bias) for _ in range(depth))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.layers:
            h = block(h)
        return self.head(h)


def _spec(depth: int, frozen_bias: bool) -> ModelSpec:
    def build() -> nn.Module:
        with torch.device("meta"):
            return _Net(depth, frozen_bias)

    def loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())

    return ModelSpec(name=f"net-{depth}{'-frozen' if frozen_bias else ''}", build=build,
                     loss=loss, default_seq=8)


def _packed_by_shard(spec: ModelSpec, **shard_kwargs) -> tuple[str, ...]:
    """The blocks ``shardc.shard`` packs of ``spec``'s model at a fake world of 2."""
    with fake_world(2):
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        model = spec.build()
        shardc.shard(model, mesh, **shard_kwargs)
        return packed_block_names(model)


def test_packed_block_names_says_what_shard_did():
    """Packed where asked and eligible; nothing where ``pack_blocks=False`` or where a block's
    parameter is frozen (shard logs the reason and reads them one by one)."""
    assert _packed_by_shard(_spec(2, False)) == ("layers.0", "layers.1")
    assert _packed_by_shard(_spec(2, False), pack_blocks=False) == ()
    assert _packed_by_shard(_spec(2, True)) == ()  # asked (the default), not packed


@pytest.mark.parametrize("frozen,setup,packed", [
    (False, {}, ("layers.0", "layers.1")),
    (False, {"pack_blocks": False}, ()),
    (False, {"offload": "params"}, ()),
    (False, {"fp8": True}, ()),
    # Packing asked for (the default) and not possible: PlanSetup.packs_blocks, the mirror of
    # shard's rules this replaced, planned it packed.
    (True, {}, ()),
])
def test_the_planner_compiles_blocks_once_where_shard_packed(monkeypatch, frozen, setup, packed):
    """The planner's step is compiled with ``compile_blocks_once`` (the packed bodies) exactly
    where the model it traces had blocks packed by ``shard`` (no budget: nothing else turns it
    on)."""
    traced = []
    real = planner.trace_step

    def recording(*args, **kwargs) -> None:
        real(*args, **kwargs)
        bound = inspect.signature(real).bind(*args, **kwargs).arguments
        # After the trace: the model as shard left it, and the options it was compiled with.
        traced.append((packed_block_names(bound["model"]), bound["options"]["compile_blocks_once"]))

    monkeypatch.setattr(planner, "trace_step", recording)
    plan_model_step(_spec(2, frozen), 2, 2, 8, {}, setup=PlanSetup(**setup))
    assert traced == [(packed, bool(packed))]


def test_blocks_shard_could_not_pack_are_planned_as_per_parameter_reads():
    """``pack_blocks=True`` (the default) on blocks ``shard`` cannot pack shards them exactly as
    ``pack_blocks=False`` does, so the plans are the same: from the template (inline blocks,
    extrapolated), not traced whole through compiled-once bodies as packed blocks are."""
    spec = _spec(TEMPLATE_BLOCKS + 1, frozen_bias=True)
    asked = plan_model_step(spec, 2, 2, 8, {}, setup=PlanSetup())
    per_parameter = plan_model_step(spec, 2, 2, 8, {}, setup=PlanSetup(pack_blocks=False))
    assert any("planned from a template" in note for note in asked.plan.notes), asked.plan.notes
    assert not asked.plan.bodies
    assert comparable_plan(asked.plan) == comparable_plan(per_parameter.plan)
    assert asked.plan.hash() == per_parameter.plan.hash()
    assert asked.optimizer == per_parameter.optimizer
