"""Workers of the 2-D mesh tests (HSDP, FSDP+TP, checkpoints across layouts); run on 4 gloo ranks.

Parity: the unsharded reference trains on the global batch of 12 in one process; each data-parallel
rank trains on its contiguous slice (HSDP: every rank is data-parallel; FSDP+TP: the ranks of one
tp group share their dp rank's slice).
"""

from __future__ import annotations

import copy
import os

import torch
import torch._dynamo
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ckpt_workers import diff, full, full_state
from mesh_models import TPNet, loss_fn, parallelize
from parity import GLOBAL_BATCH, batches, build
from parity import train as llama_train
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import shardc
from shardc.checkpoint import ModelState, OptimizerState
from shardc.passes.cost_model import ClusterSpec

TP_STEPS, TP_LR = 3, 1e-2


def _forward(model: nn.Module, mode: str):
    if mode == "eager":
        return model
    return torch.compile(model, backend=shardc.backend(inductor=False))


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def describe_placements(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each parameter's placements, e.g. ``("_StridedShard(0, sf=2)", "Shard(0)")``."""
    def one(p) -> str:
        if hasattr(p, "split_factor"):
            return f"{type(p).__name__}({p.dim}, sf={p.split_factor})"
        return f"{type(p).__name__}({getattr(p, 'dim', '')})"
    return {n: tuple(one(x) for x in p.placements) for n, p in model.named_parameters()}


def _mean_over_world(losses: list[torch.Tensor]) -> torch.Tensor:
    out = torch.stack(losses)
    dist.all_reduce(out)
    return out / dist.get_world_size()


def _plan_summary(model: nn.Module) -> list[dict]:
    plans = [r.plan for r in shardc.shard_state(model).regions]
    spec = ClusterSpec()
    return [{"kinds": sorted({c.kind for c in p.collectives}), "mesh": p.mesh,
             "replicate_size": p.replicate_size,
             "all_reduce_groups": {c.group for c in p.collectives if c.kind == "all_reduce"},
             # (predicted duration, the inter-node cost of the all-reduce) per all-reduce
             "all_reduce_times": [
                 (c.predicted_end_s - c.predicted_start_s,
                  spec.collective_seconds("all_reduce", c.buffer_bytes, p.replicate_size,
                                          "inter"))
                 for c in p.collectives if c.kind == "all_reduce"]}
            for p in plans if p is not None]


# ------------------------------------------------------------------------------------------ HSDP


def hsdp_run(rank: int, world: int, shape: tuple[int, int], mode: str) -> dict:
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = shardc.shard(build("llama1"), mesh)
    tokens, targets = batches()
    per = GLOBAL_BATCH // world
    rows = slice(rank * per, (rank + 1) * per)
    losses = llama_train(model, _forward(model, mode), tokens[:, rows], targets[:, rows])
    placements = describe_placements(model)
    return {"losses": _mean_over_world(losses), "params": _gathered(model),
            "placements": placements, "plans": _plan_summary(model)}


def slice_run(rank: int, world: int, shape: tuple[int, int], mode: str) -> dict:
    """Shard over ``mesh["dp"]`` of a ``("pp", "dp")`` mesh over every rank: data parallel
    inside pipeline stages (each stage here holds the whole model). Each dp group trains on the
    whole global batch, split over its ranks, so every group equals the unsharded reference."""
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp"))
    model = shardc.shard(build("llama1"), mesh["dp"])
    tokens, targets = batches()
    dp, dp_rank = shape[1], mesh["dp"].get_local_rank()
    per = GLOBAL_BATCH // dp
    rows = slice(dp_rank * per, (dp_rank + 1) * per)
    losses = llama_train(model, _forward(model, mode), tokens[:, rows], targets[:, rows])
    return {"losses": _mean_over_world(losses), "params": _gathered(model),
            "placements": describe_placements(model), "plans": _plan_summary(model)}


def hsdp_scenarios(rank: int, world: int, scenarios: list, slices: list = ()) -> list[dict]:
    """HSDP runs, then ``slice_run`` runs (one spawn for both)."""
    return [hsdp_run(rank, world, shape, mode) for shape, mode in scenarios] + [
        slice_run(rank, world, shape, mode) for shape, mode in slices]


# --------------------------------------------------------------------------------------- FSDP+TP


def tp_build(seed: int = 0) -> TPNet:
    torch.manual_seed(seed)
    return TPNet()


def tp_train(model: nn.Module, forward, tokens, targets) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=TP_LR)
    losses = []
    for step in range(tokens.shape[0]):
        loss = loss_fn(forward(tokens[step]), targets[step])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def tp_reference() -> dict:
    model = tp_build()
    tokens, targets = batches(TP_STEPS)
    losses = tp_train(model, model, tokens, targets)
    return {"losses": torch.stack(losses), "params": copy.deepcopy(dict(model.named_parameters())),
            "init": dict(tp_build().named_parameters())}


def tp_run(rank: int, world: int, shape: tuple[int, int], mode: str) -> dict:
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    model = shardc.shard(parallelize(tp_build(), mesh["tp"]), mesh)
    init = _gathered(model)
    placements = describe_placements(model)
    tokens, targets = batches(TP_STEPS)
    dp, dp_rank = shape[0], mesh["dp"].get_local_rank()
    per = GLOBAL_BATCH // dp
    rows = slice(dp_rank * per, (dp_rank + 1) * per)
    losses = tp_train(model, _forward(model, mode), tokens[:, rows], targets[:, rows])
    return {"losses": _mean_over_world(losses), "params": _gathered(model), "init": init,
            "placements": placements, "plans": _plan_summary(model)}


def tp_scenarios(rank: int, world: int, scenarios: list) -> list[dict]:
    return [tp_run(rank, world, shape, mode) for shape, mode in scenarios]


# ---------------------------------------------------------------------------------- checkpoints

LAYOUTS = ("unsharded", "fsdp", "hsdp", "fsdp+tp")


def layout_model(layout: str, seed: int) -> nn.Module:
    """A TPNet in ``layout`` on the 4 ranks (unsharded: a full copy on every rank)."""
    model = tp_build(seed)
    if layout == "fsdp":
        return shardc.shard(model, init_device_mesh("cpu", (4,)))
    if layout == "hsdp":
        return shardc.shard(model, init_device_mesh("cpu", (2, 2),
                                                    mesh_dim_names=("replicate", "shard")))
    if layout == "fsdp+tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return shardc.shard(parallelize(model, mesh["tp"]), mesh)
    return model


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": ModelState(model), "optim": OptimizerState(model, opt)}


def checkpoint_round_trips(rank: int, world: int, root: str) -> dict:
    """Save each layout after one training step; load every save into every other layout (a
    fresh model of another seed, an optimizer that never stepped); returns the differences."""
    tokens, targets = batches(1)
    # The DCP-saved global tensors of an FSDP+TP model are the unsharded model's tensors.
    dcp.save({"model": ModelState(layout_model("fsdp+tp", seed=0))},
             checkpoint_id=os.path.join(root, "init"))
    plain = tp_build(seed=2)
    dcp.load({"model": ModelState(plain)}, checkpoint_id=os.path.join(root, "init"))
    problems = {"fsdp+tp init -> unsharded": diff(full(plain.state_dict()),
                                                 full(tp_build(seed=0).state_dict()))}
    saved = {}
    for layout in LAYOUTS:
        model = layout_model(layout, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=TP_LR, weight_decay=0.1)
        dp_rank = rank if layout in ("fsdp", "hsdp") else (rank // 2 if layout == "fsdp+tp" else 0)
        per = GLOBAL_BATCH // (world if layout in ("fsdp", "hsdp") else
                               (2 if layout == "fsdp+tp" else 1))
        rows = slice(dp_rank * per, (dp_rank + 1) * per)
        loss_fn(model(tokens[0, rows]), targets[0, rows]).backward()
        opt.step()
        opt.zero_grad()
        dcp.save(_state(model, opt), checkpoint_id=os.path.join(root, layout))
        saved[layout] = full_state(model, opt)
    for target in LAYOUTS:
        for source in LAYOUTS:
            if source == target:
                continue
            model = layout_model(target, seed=1)
            opt = torch.optim.AdamW(model.parameters(), lr=TP_LR, weight_decay=0.1)
            dcp.load(_state(model, opt), checkpoint_id=os.path.join(root, source))
            problems[f"{source} -> {target}"] = diff(full_state(model, opt), saved[source])
    return problems
