"""Planning from a per-block template (``shardc.template``): the same plan as a full trace."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardc.models.llama import Transformer
from shardc.tools.cli import parse_model_spec
from shardc.tools.planner import PlanSetup, plan_model_step
from shardc.tools.template import (
    TemplateRefused,
    check_blocks_identical,
    comparable_plan,
    plan_from_template,
)

# Grouped-query attention and a head that differs from the blocks; 8 blocks: 5 traced, 3 added.
SPEC = "llama-tiny:n_layers=8,n_kv_heads=2,dim=32,vocab_size=96"


def test_template_plan_equals_the_full_trace():
    cfg = parse_model_spec(SPEC)
    # The template extrapolates inline blocks' per-parameter reads (packed blocks, the default,
    # are traced whole: tests/test_planner.py).
    per_parameter = PlanSetup(pack_blocks=False)
    planned = plan_model_step(cfg, 8, 1, 32, {}, setup=per_parameter)
    whole = plan_model_step(cfg, 8, 1, 32, {}, template=False, setup=per_parameter)
    template, full = planned.plan, whole.plan
    # The optimizer's work (the whole step's optimizer term): every block's shards, also those
    # the template did not trace.
    assert planned.optimizer == whole.optimizer
    assert planned.optimizer.n_params == 2 + 8 * 9 + 1
    assert any("planned from a template" in note for note in template.notes), template.notes
    assert not any("template" in note for note in full.notes)
    # The repeated blocks carry their own parameter names, in the right buckets.
    names = [b.name for b in template.buckets]
    assert names == ["tok_embeddings.weight"] + [f"layers.{i}" for i in range(8)] + \
        ["norm.weight..output.weight"]
    for i in range(8):
        assert all(p.startswith(f"layers.{i}.") for p in template.buckets[i + 1].params)
    # Everything else: collectives (ids, buckets, parameters, bytes, issue and wait positions,
    # predicted times, pool offsets), each compute op, memory timelines and predictions, exactly.
    assert comparable_plan(template) == comparable_plan(full)


def _meta_llama() -> Transformer:
    with torch.device("meta"):
        return Transformer(parse_model_spec("llama-tiny:n_layers=6"))


def test_blocks_that_differ_are_refused():
    model = _meta_llama()
    check_blocks_identical(model, list(model.layers))  # identical: no error
    with torch.device("meta"):
        model.layers[3].feed_forward.w1 = nn.Linear(64, 96, bias=False)
    with pytest.raises(TemplateRefused, match="block 3 differs"):
        check_blocks_identical(model, list(model.layers))

    model = _meta_llama()
    model.layers[2].attention.n_heads = 8  # same parameters, another head count
    with pytest.raises(TemplateRefused, match="block 2 differs"):
        check_blocks_identical(model, list(model.layers))

    model = _meta_llama()
    model.layers[4].ffn_norm.weight = model.layers[1].ffn_norm.weight
    with pytest.raises(TemplateRefused, match="share parameters"):
        check_blocks_identical(model, list(model.layers))


class _Alternating(nn.Module):
    """Identical blocks applied differently: every other block's output goes through a ReLU, so
    the traced graph repeats every two blocks, not every block."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i % 2:
                x = torch.relu(x)
        return x


def test_graphs_that_do_not_repeat_are_refused():
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from shardc.tools.fake_world import fake_world

    with fake_world(4):
        with torch.device("meta"):
            model = _Alternating()
        # A CPU mesh: torch 2.14's DTensor cannot propagate ops on a meta one.
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        x = torch.zeros(2, 16)
        options = dict(inductor=False, check_plan_consistency=False)
        try:
            with pytest.raises(TemplateRefused, match="do not repeat"):
                plan_from_template(model, mesh, lambda m: m(x), options)
        finally:
            torch._dynamo.reset()
