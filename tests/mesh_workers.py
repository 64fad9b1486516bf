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
from mesh_models import TPBlocks, TPNet, loss_fn, parallelize, parallelize_blocks
from parity import GLOBAL_BATCH, activation_copies, backward_ops, batches, build
from parity import train as llama_train
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import shardc
from shardc.checkpoint import ModelState, OptimizerState
from shardc.planning.profile import resolve_profile
from shardc.runtime.collectives import group_ranks

TP_STEPS, TP_LR = 3, 1e-2


def _forward(model: nn.Module, mode: str, cluster: dict | None = None):
    """``eager``, ``fx`` (compiled, planned FX graphs), ``fx-traced`` (the same, with the
    collectives found in the graph kept where they were traced) or ``fx-nopool`` (buffers
    allocated per collective, as Inductor's default is); ``fx-offload``: ``fx`` of a model
    sharded with CPU offload, ``fx-optoffload`` with optimizer-only offload, ``fx-dtensorin`` with
    ``plain_inputs=False`` and ``fx-packed`` with ``pack_blocks=True`` (:func:`hsdp_run`);
    ``fx-aoff``: ``fx`` with every block's saved activations offloaded to the host
    (``activation_offload=("*",)``)."""
    if mode == "eager":
        return model
    aoff = {"activation_offload": ("*",)} if mode == "fx-aoff" else {}
    return torch.compile(model, backend=shardc.backend(
        inductor=False, move_found_collectives=mode != "fx-traced",
        comm_pool=mode != "fx-nopool", cluster=cluster or CLUSTER, **aoff))


# The default profile times this tiny model's kernels at their launch cost, longer than its
# collectives take; a slow inter-node link keeps each HSDP all-reduce running while the shard
# group's next collectives start, which the plan tests check the two lanes allow.
CLUSTER = {"inter": {"bus_bandwidth": 1e9, "latency_s": 200e-6}}
# HSDP: nodes of 2 ranks, so each replicate group crosses nodes (its all-reduce at the inter
# link) on the 2x2 and 4x1 meshes, as a replica filling a node would.
HSDP_CLUSTER = {**CLUSTER, "node_size": 2}


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


def _tensor_bytes(nodes) -> int:
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in nodes
               if isinstance(n.meta.get("val"), torch.Tensor))


def _found_facts(plan, graphs: dict) -> list[dict]:
    """Each collective of the plan found in the traced graph, with what the lowered graph says
    of its nodes: their process group, the bytes of the tensors they send and receive, and
    where the issue, the waits and the waits' readers sit in the graph."""
    facts = []
    for c in plan.collectives:
        if c.origin == "shardc":
            continue
        gm = graphs[c.graph]
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        by_name = {n.name: n for n in gm.graph.nodes}
        issue, waits = by_name[c.nodes[0]], [by_name[n] for n in c.nodes[1:]]
        ops = plan.graphs[c.graph]
        pos = {op.name: i for i, op in enumerate(ops)}
        readers = [u for w in waits for u in w.users]
        # Readers that are compute ops of the schedule; the others are shardc's nodes (e.g. the
        # reduce-scatter of a gradient the collective summed) or the graph's output.
        read_at = [pos[u.name] for u in readers if u.name in pos]
        # The schedule's first op at or after the wait position that is still in the lowered
        # graph (lowering erases views that change nothing or that nothing reads any more).
        after_wait = [by_name[op.name] for op in ops[c.wait_pos:] if op.name in by_name]
        facts.append({
            "id": c.id, "kind": c.kind, "group": c.group, "group_size": c.group_size,
            "stream": c.stream, "bytes": c.bytes, "buffer_bytes": c.buffer_bytes,
            "dtype": c.dtype, "reason": c.reason, "tensors": c.tensors,
            "positions": (c.issue_pos, c.wait_pos, c.first_use_pos, c.last_use_pos, len(ops)),
            # the group it runs on (its last argument) has the ranks of the plan's tp group
            "on_tp_ranks": group_ranks(str(issue.args[-1])) == group_ranks(plan.tp_group_name),
            "node_dtype": str(issue.args[0].meta["val"].dtype).removeprefix("torch."),
            "sent": _tensor_bytes(issue.all_input_nodes), "received": _tensor_bytes(waits),
            "issue_before_waits": all(order[issue] < order[w] for w in waits),
            "waits_before_readers": all(order[w] < order[u] for w in waits for u in w.users),
            # first_use_pos is the first reader: an op of the schedule, or a node before it
            "first_reader_is_planned_op": all(p >= c.first_use_pos for p in read_at) and (
                c.first_use_pos in read_at or len(read_at) < len(readers)),
            "wait_before_op_at_wait_pos": not after_wait or all(
                order[w] < order[after_wait[0]] for w in waits),
        })
    return facts


def _graph_collectives(graphs: dict, shard_group: str) -> int:
    """Functional collectives in the lowered graphs over another group than shardc's (the group
    name is a collective's last argument)."""
    return sum(1 for gm in graphs.values() for n in gm.graph.nodes
               if n.op == "call_function" and getattr(n.target, "namespace", "") ==
               "_c10d_functional" and n.target is not torch.ops._c10d_functional.wait_tensor.default
               and str(n.args[-1]) != shard_group)


def _all_reduce_lanes(plan) -> list[tuple[float, float, float, list[float]]]:
    """HSDP, per all-reduce: (its predicted start, its end, its reduce-scatter's end, the starts
    of the shard group's collectives issued after it in its graph)."""
    by_id = {c.id: c for c in plan.collectives}
    out = []
    for i, c in enumerate(plan.collectives):
        if c.kind == "all_reduce" and c.origin == "shardc":
            rs = by_id[c.id.replace(".all_reduce.", ".reduce_scatter.")]
            later = [d.predicted_start_s for d in plan.collectives[i + 1:]
                     if d.graph == c.graph and d.group == "shard"]
            out.append((c.predicted_start_s, c.predicted_end_s, rs.predicted_end_s, later))
    return out


def _plan_summary(model: nn.Module) -> list[dict]:
    state = shardc.shard_state(model)
    spec = resolve_profile(CLUSTER)
    out = []
    for region in state.regions:
        p = region.plan
        if p is None:
            continue
        graphs = {"forward": region.forward, "backward": region.backward}
        out.append({
            "kinds": sorted({c.kind for c in p.collectives}), "mesh": p.mesh,
            "copies": sorted({(c.graph, str(c.kind)) for c in p.copies}),
            "replicate_size": p.replicate_size, "tp_size": p.tp_size,
            "tp_group_name": p.tp_group_name,
            "all_reduce_groups": {c.group for c in p.collectives if c.kind == "all_reduce"},
            "streams": {(c.origin, c.group): c.stream for c in p.collectives},
            # (predicted duration, the inter-node cost of the all-reduce) per all-reduce
            "all_reduce_times": [
                (c.predicted_end_s - c.predicted_start_s,
                 spec.collective_seconds("all_reduce", c.buffer_bytes, p.replicate_size,
                                         "inter"))
                for c in p.collectives if c.kind == "all_reduce" and c.origin == "shardc"],
            "all_reduce_lanes": _all_reduce_lanes(p),
            # HSDP with the static pool: all-reduces run in place in it, none allocates
            "all_reduce_offsets": [c.buffer_offset for c in p.collectives
                                   if c.kind == "all_reduce" and c.origin == "shardc"],
            "allocating_all_reduces": sum(
                n.target is torch.ops._c10d_functional.all_reduce.default
                for gm in graphs.values() for n in gm.graph.nodes),
            "found": _found_facts(p, graphs),
            "graph_collectives": _graph_collectives(graphs, p.group_name),
            # One-rank groups: the kinds of shardc's collectives the plan lists as elided, and
            # the communication ops left in the lowered graphs.
            "elided": sorted({str(c.kind) for c in p.collectives if c.elided}),
            "lowered_ops": sorted({str(n.target) for gm in graphs.values()
                                   for n in gm.graph.nodes if n.op == "call_function"
                                   and getattr(n.target, "namespace", "") in
                                   ("_c10d_functional", "shardc")}),
            "exposed": (p.predicted["exposed_comm_s"], sum(c.exposed_s for c in p.collectives)),
            # Block bodies (shardc.sharding.blocks): (blocks, partitions) per body, and the
            # blocks compiled inline with their reasons.
            "bodies": [(tuple(b.blocks), b.partitions) for b in p.bodies],
            "inline": {b.module: b.reason for b in p.inline_blocks},
            "notes": list(p.notes),
        })
    return out


# ------------------------------------------------------------------------------------------ HSDP


def hsdp_run(rank: int, world: int, shape: tuple[int, int], mode: str,
             kind: str = "llama1") -> dict:
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    offload = {"fx-offload": shardc.OffloadPolicy(simulate_on_cpu=True),
               "fx-offload-overlap": shardc.OffloadPolicy(simulate_on_cpu=True),
               "fx-optoffload": shardc.OffloadPolicy(params=False, simulate_on_cpu=True),
               }.get(mode)
    # "fx-offload-overlap": CPU offload with shardc.step_in_backward (each bucket's host step
    # during the backward, once its gradients are reduced over both mesh dimensions)
    overlap = {} if mode == "fx-offload-overlap" else None
    # "fx-dtensorin": the DTensor reads (plain_inputs=False); every other mode reads plain
    # local shards where shard does by default (since s53; not under offload).
    dtensor_reads = {"plain_inputs": False} if mode == "fx-dtensorin" else {}
    model = shardc.shard(build(kind), mesh, offload=offload, pack_blocks=mode == "fx-packed",
                         **dtensor_reads)
    tokens, targets = batches()
    per = GLOBAL_BATCH // world
    rows = slice(rank * per, (rank + 1) * per)
    losses = llama_train(model, _forward(model, mode, HSDP_CLUSTER), tokens[:, rows],
                         targets[:, rows], overlap=overlap)
    placements = describe_placements(model)
    return {"losses": _mean_over_world(losses), "params": _gathered(model),
            "placements": placements, "plans": _plan_summary(model),
            "activation_copies": activation_copies(shardc.shard_state(model)),
            "overlap": overlap}


def _budget_backend(inductor: bool = False, **options):
    """The budget scenario's backend: FX (or Inductor), no static pool (Inductor's default;
    FX's pool would be one buffer the budget cannot free), no prefetch (so that prefetching
    less cannot meet the budget in place of freeing activations), no margin (the budget sits at
    the levers' exact threshold)."""
    return shardc.backend(inductor=inductor, comm_pool=False, prefetch=False,
                          cluster=HSDP_CLUSTER, peak_memory_margin=0.0, **options)


def _budget_run(make, train, tokens, targets, rows: slice, inductor: bool) -> dict:
    """Issue 22's peak budget on a mesh: a first compile of ``make()`` without a budget (one
    forward: the plan is made at compile time) gives the fixed policy's predicted peak, the
    ranks' largest; a fresh ``make()`` compiled under a budget a byte below it must free
    blocks' activations (offload or recompute: the planner's choice) and is trained
    (``train(model, forward, tokens, targets)`` on ``rows``). :func:`_budget_result`, plus the
    ops recompute adds to the backward graphs (parity.backward_ops), fixed and budgeted."""
    torch._dynamo.reset()
    probe = make()
    fixed = torch.compile(probe, backend=_budget_backend(inductor))
    fixed(tokens[0, rows])
    low = torch.tensor([int(shardc.explain_all(fixed)[0].predicted.peak_bytes)])
    dist.all_reduce(low, op=dist.ReduceOp.MAX)
    fixed_ops = backward_ops(shardc.shard_state(probe))
    del probe, fixed
    torch._dynamo.reset()
    model = make()
    compiled = torch.compile(model, backend=_budget_backend(
        inductor, peak_memory_budget_bytes=int(low) - 1))
    losses = train(model, compiled, tokens[:, rows], targets[:, rows])
    out = _budget_result(model, compiled, losses, int(low))
    out["backward_ops"] = (fixed_ops, backward_ops(shardc.shard_state(model)))
    return out


def hsdp_budget_run(rank: int, world: int, shape: tuple[int, int], kind: str,
                    inductor: bool = False) -> dict:
    """``fx-budget`` / ``inductor-budget`` (issue 22's peak budget under HSDP):
    :func:`_budget_run` of ``kind`` on a (replicate, shard) mesh of ``shape``."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    tokens, targets = batches()
    per = GLOBAL_BATCH // world
    rows = slice(rank * per, (rank + 1) * per)
    return _budget_run(lambda: shardc.shard(build(kind), mesh), llama_train, tokens, targets,
                       rows, inductor)


def _budget_result(model: nn.Module, compiled, losses: list[torch.Tensor],
                   fixed_peak: int) -> dict:
    """What a budget run returns: its losses and parameters, plans, the first plan's budget
    record, hash and predicted peak, the fixed policy's peak, the activation copies."""
    plan = shardc.explain_all(compiled)[0]
    return {"losses": _mean_over_world(losses), "params": _gathered(model),
            "plans": _plan_summary(model), "budget": plan.budget, "hash": plan.hash(),
            "peak": int(plan.predicted.peak_bytes), "fixed_peak": fixed_peak,
            "bodies": [tuple(b.blocks) for b in plan.bodies],
            "activation_copies": activation_copies(shardc.shard_state(model))}


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


def hsdp_scenarios(rank: int, world: int, scenarios: list, slices: list = (),
                   blocks: list = ()) -> list[dict]:
    """HSDP runs, then ``slice_run`` runs, then HSDP runs of the BlockStack (repeated blocks
    compiled once; ``fx-budget`` / ``inductor-budget``: :func:`hsdp_budget_run`), all in one
    spawn."""
    return [hsdp_run(rank, world, shape, mode) for shape, mode in scenarios] + [
        slice_run(rank, world, shape, mode) for shape, mode in slices] + [
        hsdp_budget_run(rank, world, shape, "blocks", mode == "inductor-budget")
        if mode.endswith("-budget")
        else hsdp_run(rank, world, shape, mode, kind="blocks") for shape, mode in blocks]


# --------------------------------------------------------------------------------------- FSDP+TP


def tp_build(seed: int = 0, kind: str = "net") -> nn.Module:
    torch.manual_seed(seed)
    return TPBlocks() if kind == "blocks" else TPNet()


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


def tp_reference(kind: str = "net") -> dict:
    model = tp_build(kind=kind)
    tokens, targets = batches(TP_STEPS)
    losses = tp_train(model, model, tokens, targets)
    return {"losses": torch.stack(losses), "params": copy.deepcopy(dict(model.named_parameters())),
            "init": dict(tp_build(kind=kind).named_parameters())}


def tp_run(rank: int, world: int, shape: tuple[int, int], mode: str, kind: str = "net") -> dict:
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    tp = parallelize_blocks if kind == "blocks" else parallelize
    model = shardc.shard(tp(tp_build(kind=kind), mesh["tp"]), mesh)
    init = _gathered(model)
    placements = describe_placements(model)
    tokens, targets = batches(TP_STEPS)
    dp, dp_rank = shape[0], mesh["dp"].get_local_rank()
    per = GLOBAL_BATCH // dp
    rows = slice(dp_rank * per, (dp_rank + 1) * per)
    losses = tp_train(model, _forward(model, mode), tokens[:, rows], targets[:, rows])
    return {"losses": _mean_over_world(losses), "params": _gathered(model), "init": init,
            "placements": placements, "plans": _plan_summary(model),
            "activation_copies": activation_copies(shardc.shard_state(model))}


def tp_budget_run(rank: int, world: int, shape: tuple[int, int], inductor: bool = False) -> dict:
    """``fx-budget`` / ``inductor-budget`` under FSDP+TP (issue 22's peak budget on a (dp, tp)
    mesh of ``shape``): :func:`_budget_run` of TPBlocks."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    tokens, targets = batches(TP_STEPS)
    dp, dp_rank = shape[0], mesh["dp"].get_local_rank()
    per = GLOBAL_BATCH // dp
    rows = slice(dp_rank * per, (dp_rank + 1) * per)
    return _budget_run(
        lambda: shardc.shard(parallelize_blocks(tp_build(kind="blocks"), mesh["tp"]), mesh),
        tp_train, tokens, targets, rows, inductor)


def tp_scenarios(rank: int, world: int, scenarios: list, blocks: list = ()) -> list[dict]:
    """FSDP+TP runs of TPNet, then of TPBlocks (``blocks``; ``fx-budget`` /
    ``inductor-budget``: :func:`tp_budget_run`), in one spawn."""
    return [tp_run(rank, world, shape, mode) for shape, mode in scenarios] + [
        tp_budget_run(rank, world, shape, mode == "inductor-budget")
        if mode.endswith("-budget")
        else tp_run(rank, world, shape, mode, kind="blocks") for shape, mode in blocks]


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
