"""Warm restarts: a second process reuses the compiled artifacts and never skips shardc's passes.

AOTAutograd's cache hands back a compiled forward and backward without running the partition
function, so on a hit shardc would plan nothing: no plan to explain or dump, no cross-rank check
(issue 9); and without calling Inductor's inner compiler, so without shardc's wrappers around the
compiled graphs (the communication pool argument, named collective errors).
``shardc/compile/warm.py`` therefore uses that cache only for regions whose collectives are all
elided (one-rank groups), stores each such region's plan beside AOTAutograd's entry, restores it
on a hit, and compiles again whenever it cannot (issue 18). Inductor's FX graph cache is on for
every region and must hit in a new process: the partitioner is keyed by its ``uuid()`` (options,
rank, world, source) and the meshes' per-process ``hash()`` memo is kept out of the key.

Two fresh process groups (world 2, gloo) compile the same models with one cache directory:
an unsharded control model, which the backend compiles like the default backend, hits
AOTAutograd's cache in the second one (the cache is warm and used); the world-2 sharded model
keeps AOTAutograd's cache off, is planned again (same plan hash, the cross-rank plan check runs),
hits Inductor's cache for every graph, and trains like the unsharded reference; models sharded
over one rank each hit AOTAutograd's cache and restore their plan, or, without a stored plan,
compile again (see ``_one_rank_restart``). The second group then compiles the world-2 model with
another ``prefetch_depth``, which must miss.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from dist_utils import run_ranks
from log_lines import LogLines
from parity import assert_parity, batches, build, llama_loss, reference, sharded_run, train
from torch import fx, nn
from torch.distributed.device_mesh import init_device_mesh

import shardc
from shardc import _torch
from shardc._torch import process_group_store
from shardc.runtime.collectives import resolve_group


def _cache_counts() -> dict:
    counters = torch._dynamo.utils.counters
    return {"fx_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
            "aot_hit": counters["aot_autograd"]["autograd_cache_hit"]}


@contextlib.contextmanager
def _fx_cache_key_details():
    """Inductor's FX graph cache keys computed inside, each with the lines of what went into it
    (its debug log), so that a miss in a second process can say which part of the key moved.
    Kept to this handler (not propagated to torch's stderr handlers)."""
    logger, lines = logging.getLogger("torch._inductor.codecache"), LogLines(logging.DEBUG)
    level, propagate = logger.level, logger.propagate
    logger.addHandler(lines)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    details: list[list[str]] = []
    try:
        yield details
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
        logger.propagate = propagate
        details += [m.splitlines() for m in lines.lines if m.startswith("FX graph cache hash")]


def _key_difference(cold: list[list[str]], warm: list[list[str]]) -> str:
    """For a failure message: the lines of the warm process's FX graph keys found in no cold
    key, and the reverse."""
    def parts(keys: list[list[str]]) -> set[str]:
        return {line[:300] for key in keys for line in key[1:]}

    cold_parts, warm_parts = parts(cold), parts(warm)
    only_warm, only_cold = sorted(warm_parts - cold_parts), sorted(cold_parts - warm_parts)
    return (f"{len(cold)} cold / {len(warm)} warm keys; only in the warm keys: {only_warm[:12]}; "
            f"only in the cold keys: {only_cold[:12]}")


def _restart(rank: int, world: int, change_option: bool) -> dict:
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    out: dict = {}
    logger, lines = logging.getLogger("shardc"), LogLines()
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    with torch._functorch.config.patch(enable_autograd_cache=True):
        counters.clear()
        torch.manual_seed(0)
        control = torch.compile(nn.Linear(6, 3), backend=shardc.backend(inductor=True))
        F.mse_loss(control(torch.randn(4, 6)), torch.randn(4, 3)).backward()
        out["control_aot_hits"] = counters["aot_autograd"]["autograd_cache_hit"]
        counters.clear()
        with _fx_cache_key_details() as details:
            run = sharded_run(rank, world, "repeated", "inductor", keep_model=True)
        out["sharded"] = _cache_counts()
        out["sharded_key_details"] = details
    logger.removeHandler(lines)
    (region,) = shardc.shard_state(run["model"]).regions
    plan = region.plan
    store = process_group_store(resolve_group(plan.group_name))
    out["check_published"] = store.check(
        [f"shardc/plan/{region.check_index}/{r}" for r in range(world)])
    out.update(plan_hash=plan.hash(), losses=run["losses"], params=run["params"],
               progress=lines.lines)
    # Before anything else creates process groups or sharded models: the graphs of the one-rank
    # models must name the same groups and gradient stores in both processes.
    out["one_rank"] = _one_rank_restart(rank, world, warm=change_option)
    if change_option:
        counters.clear()
        sharded_run(rank, world, "repeated", "inductor", prefetch_depth=2)
        out["changed"] = _cache_counts()
    return out


def _one_rank_run(rank: int, world: int, **options) -> dict:
    """The model sharded over this rank alone (a one-rank slice of a (world, 1) mesh: every
    collective elided, so AOTAutograd's cache is on for it), trained on the whole batch."""
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ranks", "alone"))["alone"]
    model = shardc.shard(build("repeated"), mesh)
    forward = torch.compile(model, backend=shardc.backend(inductor=True, **options))
    counters = torch._dynamo.utils.counters
    counters.clear()
    tokens, targets = batches()
    losses = torch.stack(train(model, forward, tokens, targets))
    (region,) = shardc.shard_state(model).regions
    plan = region.plan
    # The first call ran the plan check with this plan (over one rank it has nothing to compare).
    return {"losses": losses, "counts": _cache_counts(), "plan": plan.hash(),
            "group": plan.group_name, "checked": region.checked and region.check_index is not None,
            "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}}


def _one_rank_restart(rank: int, world: int, warm: bool) -> dict:
    """Two one-rank models, A then B, in each process. Cold: both compiled, their plans stored.
    Warm: rank 0 hits A's entry and restores its plan; rank 1 first removes its stored plans, so
    it hits A's entry without a plan and must compile again (a miss). B gets another
    ``prefetch_depth`` in the warm process (the same groups and graphs otherwise): a miss."""
    logger, lines = logging.getLogger("shardc"), LogLines()
    logger.addHandler(lines)
    try:
        if warm and rank == 1:
            for path in _stored_plans(rank, world):
                path.unlink()
        out = {"a": _one_rank_run(rank, world),
               "b": _one_rank_run(rank, world, prefetch_depth=2 if warm else 1)}
        out["lines"] = list(lines.lines)
    finally:
        logger.removeHandler(lines)
    return out


def _stored_plans(rank: int, world: int) -> list:
    """This rank's stored plans (the partitioner's uuid names the rank and world)."""
    root = Path(_torch.inductor_cache_dir()) / "shardc" / "plans"
    return [p for p in root.glob("*.json")
            if f"rank({rank}, {world})" in json.loads(p.read_text())["partitioner"]]


# Slow (suite time, s29): two cold Inductor processes, 80 s on the loaded 2-core machine
@pytest.mark.slow
def test_warm_restart_hits_inductor_cache_and_still_plans(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # cold, then warm
    monkeypatch.setenv("SHARDC_AUTOGRAD_CACHE", "1")  # the suite turns it off (conftest.py)
    cold = run_ranks(_restart, 2, False)
    warm = run_ranks(_restart, 2, True)
    ref = reference("repeated")
    for rank, (c, w) in enumerate(zip(cold, warm)):
        graphs = c["sharded"]["fx_miss"]
        assert graphs >= 2 and c["sharded"]["fx_hit"] == 0, c["sharded"]  # forward, backward
        assert len(c["sharded_key_details"]) >= graphs  # what a miss below would be told by
        assert w["control_aot_hits"] > 0, f"the second process did not use the cache: {w}"
        # A warm AOTAutograd cache must not skip shardc's partitioner (issue 9): no AOT hit, and
        # the plan is made again, the same, and checked across ranks.
        assert w["sharded"]["aot_hit"] == 0, w["sharded"]
        assert w["plan_hash"] == c["plan_hash"]
        assert w["check_published"] and c["check_published"]
        # Inductor's graphs come from the cache, every one of them (issue 18).
        assert w["sharded"]["fx_hit"] == graphs and w["sharded"]["fx_miss"] == 0, (
            f"rank {rank}: the second process missed Inductor's FX graph cache: {w['sharded']}; "
            + _key_difference(c["sharded_key_details"], w["sharded_key_details"]))
        assert_parity(c, ref)
        assert_parity(w, ref)
        # A plan-affecting option is part of the key.
        assert w["changed"]["fx_hit"] == 0 and w["changed"]["fx_miss"] >= 2, w["changed"]
        # One-rank models (every collective elided): AOTAutograd's cache stores their entries
        # with the plans beside them. Rank 0's second process hits A's entry and restores the
        # same plan, which the plan check reads; rank 1's, whose stored plans were removed, hits
        # the entry but compiles again and plans anew. Both train like the reference.
        one_cold, one_warm = c["one_rank"], w["one_rank"]
        cold_a, warm_a = one_cold["a"], one_warm["a"]
        assert cold_a["counts"]["aot_hit"] == 0 and warm_a["counts"]["aot_hit"] == 1, (
            rank, cold_a["counts"], warm_a["counts"])
        assert warm_a["counts"]["fx_miss"] == 0, warm_a["counts"]
        assert warm_a["plan"] == cold_a["plan"] and warm_a["checked"] and cold_a["checked"]
        restored = [line for line in one_warm["lines"] if "AOTAutograd cache hit; plan" in line]
        unrestorable = [line for line in one_warm["lines"]
                        if "plan cannot be restored (no plan is stored" in line]
        assert (len(restored), len(unrestorable)) == ((1, 0) if rank == 0 else (0, 1)), (
            rank, one_warm["lines"])
        assert_parity(cold_a, ref)
        assert_parity(warm_a, ref)
        # B: the same groups as in the first process and another prefetch_depth, which is in
        # AOTAutograd's key (the partitioner's uuid): a miss, planned anew.
        cold_b, warm_b = one_cold["b"], one_warm["b"]
        assert warm_b["group"] == cold_b["group"] and warm_b["counts"]["aot_hit"] == 0, (
            warm_b["counts"], warm_b["group"], cold_b["group"])
        assert_parity(warm_b, ref)
    # Inductor's stages are in the compile-progress log (once the backward has run).
    stages = [line.split(": ")[2] for line in cold[0]["progress"] if "region 0:" in line]
    assert "Inductor forward" in stages and "Inductor backward" in stages, cold[0]["progress"]


def test_partitioner_pickles_to_its_uuid():
    """Inductor's FX graph cache pickles its config, shardc's partitioner included, into the key.
    The partitioner must pickle to what decides the compiled code (its uuid), not to its region's
    live state: that state changes while Inductor compiles (the forward graph is lowered in place
    before the backward's key is computed), which made a second process miss the cache."""
    import pickle

    from torch import fx

    from shardc.compile.backend import PartitionerKey, ShardcPartitioner
    from shardc.compile.options import ShardcOptions
    from shardc.compile.pipeline import RegionRecord

    fresh = ShardcPartitioner(ShardcOptions(prefetch_depth=2), RegionRecord(0))
    used = ShardcPartitioner(ShardcOptions(prefetch_depth=2), RegionRecord(0))
    used.region.forward = fx.symbolic_trace(nn.Linear(2, 2))
    used.region.checked = True
    assert pickle.dumps(fresh) == pickle.dumps(used)
    assert pickle.loads(pickle.dumps(used)) == PartitionerKey(used.uuid())
    other = ShardcPartitioner(ShardcOptions(prefetch_depth=1), RegionRecord(0))
    assert pickle.dumps(other) != pickle.dumps(fresh)  # a plan-affecting option changes the key


def _plan(params=("a.weight", "b.weight")):
    from shardc.planning.plan import PLAN_VERSION, Bucket, Plan

    bucket = Bucket(0, "bucket0", list(params), [4] * len(params), [4] * len(params),
                    [3] * len(params), "torch.float32", "torch.float32", 1)
    return Plan(PLAN_VERSION, 0, 1, {"prefetch_depth": 1}, [bucket], [], group_name="1")


def test_stored_plan_is_restored_only_when_every_check_passes(tmp_path, monkeypatch):
    """What a hit may restore (shardc/compile/warm.py): the plan stored under the hit's key by the
    same partitioner, unchanged, for the parameters this graph gathers; anything else is a reason
    to compile again, never a hit without a plan."""
    from shardc.compile import warm

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    plan, gathered = _plan(), {"a.weight", "b.weight"}
    assert warm.load_plan("k1", "uuid", gathered) == (None, "no plan is stored for the entry")
    path = warm.save_plan("k1", "uuid", plan)
    assert path == tmp_path / "shardc" / "plans" / "k1.json"
    restored, why = warm.load_plan("k1", "uuid", gathered)
    assert why == "" and restored.hash() == plan.hash() and restored.to_dict() == plan.to_dict()
    assert warm.load_plan(None, "uuid", gathered)[1] == "the cache key could not be read"
    assert "another partitioner" in warm.load_plan("k1", "other-uuid", gathered)[1]
    assert "parameters" in warm.load_plan("k1", "uuid", {"a.weight"})[1]
    record = json.loads(path.read_text())
    record["plan"]["collectives"] = [{"bogus": 1}]
    path.write_text(json.dumps(record))
    assert "cannot be read" in warm.load_plan("k1", "uuid", gathered)[1]
    record = json.loads(path.read_text())
    record["plan"]["collectives"] = []
    record["plan"]["hash"] = "0" * 16  # edited after it was stored
    path.write_text(json.dumps(record))
    assert warm.load_plan("k1", "uuid", gathered)[1] == "the stored plan does not match its hash"
    warm.save_plan("k2", "uuid", plan)
    (tmp_path / "shardc" / "plans" / "k2.json").rename(tmp_path / "shardc" / "plans" / "k3.json")
    assert "another format or entry" in warm.load_plan("k3", "uuid", gathered)[1]
    assert warm.plan_path("../escape") is None


def test_a_restored_plan_steps_the_optimizer_in_chunks_where_it_planned_to(tmp_path,
                                                                             monkeypatch):
    """A hit restores what the runtime reads beside the plan: a plan whose peak budget steps
    the optimizer in chunks (read back from its stored record) makes the region step in chunks
    again (the warm start on one H200 stepped in one call and peaked at the one-call step's
    temporaries, docs/memory_budget.md); a plan without the choice leaves the region as it was."""
    from shardc.compile import warm
    from shardc.compile.backend import restore_region
    from shardc.compile.pipeline import RegionRecord
    from shardc.planning.plan import MemoryBudget, OptimizerChunksDecision

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    plan = _plan()
    plan.budget = MemoryBudget(1000, 900, 950, 1, [], [])
    plan.budget.optimizer_chunks = OptimizerChunksDecision(True, 2, 16, 32, 0.1, "in chunks")
    warm.save_plan("k", "uuid", plan)
    restored, why = warm.load_plan("k", "uuid", {"a.weight", "b.weight"})
    assert why == "" and restored.budget.optimizer_chunks.chunked
    region = RegionRecord(0)
    assert not region.optimizer_step_chunks
    restore_region(region, restored)
    assert region.plan is restored and region.optimizer_step_chunks
    plain = RegionRecord(1)
    restore_region(plain, _plan())
    assert not plain.optimizer_step_chunks and plain.body_partitions == {}


def test_cache_lookup_outcome_needs_one_logged_key():
    """A hit is restorable only with exactly one lookup whose key torch logged; a miss is stored
    only then too."""
    from shardc.compile.warm import lookup_outcome

    assert lookup_outcome([("hit", "k")], 1) == ("hit", "k")
    assert lookup_outcome([], 1) == ("hit", None)  # torch's message changed: unknown key
    assert lookup_outcome([("hit", "k"), ("hit", "j")], 2) == ("hit", None)
    assert lookup_outcome([("miss", "k")], 1) == ("hit", None)  # the counters disagree
    assert lookup_outcome([("miss", "k")], 0) == ("miss", "k")
    assert lookup_outcome([], 0) == ("none", None)  # bypassed: nothing to store


def test_autograd_cache_lookups_read_torch_log_without_showing_it():
    """The key is read from AOTAutograd's log record; handlers see only what the logger's own
    level lets through."""
    logger = logging.getLogger(_torch._AOT_CACHE_LOGGER)
    shown = LogLines()
    logger.addHandler(shown)
    level = logger.level
    try:
        logger.setLevel(logging.WARNING)
        with _torch.autograd_cache_lookups() as seen:
            logger.info("AOTAutograd cache hit for key %s", "abc")
            logger.info("AOTAutograd cache miss for key %s", "def")
            logger.info("unrelated %s", "x")
        assert seen == [("hit", "abc"), ("miss", "def")] and shown.lines == []
        assert logger.level == logging.WARNING
        logger.setLevel(logging.INFO)
        with _torch.autograd_cache_lookups() as seen:
            logger.info("AOTAutograd cache hit for key %s", "abc")
        assert seen == [("hit", "abc")] and shown.lines == ["AOTAutograd cache hit for key abc"]
    finally:
        logger.removeHandler(shown)
        logger.setLevel(level)


def test_regions_whose_collectives_run_keep_the_cache_off():
    """Blockers decided before compiling, from Dynamo's graph (the same on every rank), and the
    check after planning that a hit would lose nothing but the plan."""
    from torch import fx

    from shardc.compile import warm
    from shardc.planning.plan import Plan

    graph = fx.symbolic_trace(nn.Linear(2, 2))
    assert warm.cache_blockers([], graph, fp8=False, offload=False, cudagraphs=False,
                               needs_partition=False) == []
    reasons = warm.cache_blockers([], graph, fp8=True, offload=True, cudagraphs=True,
                                  needs_partition=True)
    assert len(reasons) == 4
    plan = _plan()
    assert isinstance(plan, Plan)
    assert warm.restorable(graph, None, plan, None) is None
    assert warm.restorable(graph, None, None, None) == "no plan"
    assert "pool" in warm.restorable(graph, None, plan, torch.empty(1))
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0")))
    issuing = fx.GraphModule({}, g)
    assert warm.restorable(graph, issuing, plan, None) == "its graphs issue collectives"
    assert "tensor parallelism" in warm.cache_blockers([], issuing, fp8=False, offload=False,
                                                       cudagraphs=False, needs_partition=False)[0]


def _dynamo_to_local(*args, **kwargs):
    """A stand-in of what torch 2.11's Dynamo records for ``t.to_local(*args, **kwargs)`` (its
    ``TensorVariable.method_to_local``): a closure named ``prim_to_local`` over the arguments."""
    args_as_value, kwargs_as_value = args, kwargs

    def to_local_fn_with_prim_types(x):
        return x.to_local(*args_as_value, **kwargs_as_value)

    to_local_fn_with_prim_types.__name__ = "prim_to_local"
    return to_local_fn_with_prim_types


def test_dynamo_to_local_closures_become_plain_method_calls():
    """torch 2.11's AOTAutograd cache refuses Dynamo's ``prim_to_local`` closures (so it bypassed
    every shardc region there); without arguments they are made ``call_method('to_local')``
    with the same operand and metadata. Closures with arguments, and other functions, stay.
    (The real closures: tests/test_autograd_cache.py's restarts and
    scripts/check_warm_restart.py, run on torch 2.11.)"""
    from torch import fx

    from shardc.passes.to_local import plain_to_local_calls

    g = fx.Graph()
    x = g.placeholder("x")
    plain = g.call_function(_dynamo_to_local(), (x,))
    plain.meta["example_value"] = "kept"
    placed = g.call_function(_dynamo_to_local(grad_placements=("p",)), (x,))
    other = g.call_function(torch.neg, (x,))
    g.output((g.call_function(torch.add, (plain, placed)), other))
    gm = fx.GraphModule(nn.Module(), g)
    assert _torch.dynamo_to_local_closure(placed.target) == ((), {"grad_placements": ("p",)})
    assert _torch.dynamo_to_local_closure(torch.neg) is None
    assert plain_to_local_calls(gm) == 1
    (method,) = [n for n in gm.graph.nodes if n.op == "call_method"]
    assert method.target == "to_local" and method.args == (x,)
    assert method.meta["example_value"] == "kept"
    assert placed in gm.graph.nodes and other in gm.graph.nodes
    assert plain_to_local_calls(gm) == 0


def _backward_with_zeros_body() -> fx.GraphModule:
    """A backward graph module like those AOTAutograd's cache entry pickles: a subgraph module (a
    block body's backward) that starts from zeros made of constants only, as Inductor's
    decomposition of a slice's backward does (the rotary embedding's, in a Llama block)."""
    body = fx.Graph()
    grad = body.placeholder("grad")
    zeros = body.call_function(torch.ops.aten.full.default, ([4, 8], 0.0), {
        "dtype": torch.float32, "layout": torch.strided, "device": torch.device("cpu"),
        "pin_memory": False})
    body.output((body.call_function(torch.ops.aten.slice_scatter.default,
                                    (zeros, grad, 1, 1, 8, 2)),))
    root = nn.Module()
    root.body = fx.GraphModule(nn.Module(), body)
    top = fx.Graph()
    top.output(top.call_module("body", (top.placeholder("grad"),)))
    return fx.GraphModule(root, top)


def _tensors_held(module: nn.Module) -> list[str]:
    return [f"{name}.{attr}" for name, m in module.named_modules()
            for attr, value in vars(m).items() if isinstance(value, torch.Tensor)] + [
        name for name, _ in module.named_buffers()]


def test_loading_a_cached_backward_allocates_no_tensor():
    """AOTAutograd's cache entry holds the backward graph module pickled (``gm.__reduce__()``),
    and loading the entry (a hit) unpickles the modules under it at once. FX rebuilds each by
    tracing its code, which runs a call on constants (the ``full`` of zeros) for real and keeps
    the result: on a GPU a device tensor the size of a block's activation (10.07e9 B at batch
    600 of the 1b model, the rise measured on warm restarts), held as long as the region. The
    backward shardc hands over is rebuilt by shardc's tracer, which keeps the call a node."""
    from shardc.compile import warm

    grad = torch.randn(4, 4)
    plain = _backward_with_zeros_body()
    expected = plain(grad)
    _, (state, _) = plain.__reduce__()
    # FX's own tracer: the zeros become a tensor constant of the loaded body (why the fix).
    loaded = pickle.loads(pickle.dumps(state))["_modules"]["body"]
    assert _tensors_held(loaded) and not _full_calls(loaded)
    marked = _backward_with_zeros_body()
    assert warm.retrace_on_reload(marked) == 2  # the backward and its body
    fn, (state, imports) = marked.__reduce__()
    loaded = pickle.loads(pickle.dumps(state))["_modules"]["body"]
    assert _tensors_held(loaded) == [] and len(_full_calls(loaded)) == 1
    # The whole module, loaded (as compiled autograd would), computes the same, holding nothing.
    whole = pickle.loads(pickle.dumps(marked))
    assert _tensors_held(whole) == []
    torch.testing.assert_close(whole(grad), expected, rtol=0, atol=0)


def test_a_cached_backward_with_a_symbolic_size_in_a_list_loads():
    """Under dynamic shapes a body's backward makes its zeros with a size symbol in the list
    (``full([2, 2, s0, 8], 0)``: transformers' attention at s72's recompiled step). FX's tracer
    cannot run that op on a traced value nested in a list ("Expected List[int]"), so loading the
    entry failed (Inductor logged "fx graph cache unable to load compiled graph" and compiled
    again); shardc's tracer records the call as a node."""
    from shardc.compile import warm

    body = fx.Graph()
    size = body.placeholder("size")
    grad = body.placeholder("grad")
    zeros = body.call_function(torch.ops.aten.full.default, ([2, size, 8], 0.0), {
        "dtype": torch.float32, "layout": torch.strided, "device": torch.device("cpu"),
        "pin_memory": False})
    body.output((body.call_function(torch.ops.aten.slice_scatter.default,
                                    (zeros, grad, 2, 1, 8, 2)),))
    marked = fx.GraphModule(nn.Module(), body)
    assert warm.retrace_on_reload(marked) == 1
    loaded = pickle.loads(pickle.dumps(marked))
    assert len(_full_calls(loaded)) == 1 and _tensors_held(loaded) == []
    grad_in = torch.randn(2, 3, 4)
    torch.testing.assert_close(loaded(3, grad_in), marked(3, grad_in), rtol=0, atol=0)


def _full_calls(gm: fx.GraphModule) -> list[fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.full.default))


def _planned_backward_modules(rank: int, world: int) -> dict:
    """A one-rank Llama whose blocks are all recomputed with their checkpoints offloaded (compiled
    once: the backward calls their bodies): the graph modules of the planned backward, and which
    of them FX would rebuild with shardc's tracer."""
    from shardc.compile import warm

    torch._dynamo.reset()
    model = build("llama")
    shardc.shard(model)
    forward = torch.compile(model, backend=shardc.backend(
        inductor=False, activation_offload=("checkpoint:*",)))
    tokens, targets = batches()
    llama_loss(forward(tokens[0]), targets[0]).backward()
    (region,) = shardc.shard_state(model).regions
    modules = {name or "backward": m for name, m in region.backward.named_modules()
               if isinstance(m, fx.GraphModule)}
    _, (state, _) = region.backward.__reduce__()
    loaded = pickle.loads(pickle.dumps(state))["_modules"]
    return {"modules": sorted(modules),
            "marked": sorted(n for n, m in modules.items() if m._tracer_cls is warm.ReloadTracer),
            "tensors_loaded": {n: _tensors_held(m) for n, m in loaded.items()}}


def test_planned_backward_is_rebuilt_by_shardc_tracer():
    """The partitioner marks the whole backward it hands to AOTAutograd, the block bodies it
    calls included (their backward and their recomputed forward), and loading it holds no tensor.
    """
    (out,) = run_ranks(_planned_backward_modules, 1)
    assert len(out["modules"]) >= 3, out  # the backward, a body's backward, a recomputed forward
    assert out["marked"] == out["modules"], out
    assert all(t == [] for t in out["tensors_loaded"].values()), out
