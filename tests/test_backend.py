"""The backend's graphs and plans: collective counts, reshard, invariants, rank consistency."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._dynamo
from dist_utils import run_ranks
from log_lines import LogLines
from parity import GLOBAL_BATCH, assert_parity, batches, build, train
from torch import nn

import shardc
from shardc.passes.reshard import gather_derived
from shardc.runtime.plan_check import PlanMismatchError

funcol = torch.ops._c10d_functional


_OUT_VARIANT = {
    funcol.all_gather_into_tensor.default: funcol.all_gather_into_tensor_out.default,
    funcol.reduce_scatter_tensor.default: funcol.reduce_scatter_tensor_out.default,
}


def _count(gm, target, *, allocating_only: bool = False) -> int:
    """Nodes calling ``target`` (or its in-place ``_out`` variant that writes into the pool)."""
    targets = {target} if allocating_only else {target, _OUT_VARIANT.get(target)}
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def _compiled_variant(rank, world, **options):
    torch._dynamo.reset()
    model = build("variant")
    shardc.shard(model, reshard_after_forward=options.pop("reshard_after_forward", True))
    compiled = torch.compile(model, backend=shardc.backend(inductor=False, **options))
    tokens, targets = batches(2)
    per = GLOBAL_BATCH // world
    train(model, compiled, tokens[:, rank * per:(rank + 1) * per],
          targets[:, rank * per:(rank + 1) * per])
    return model, compiled


def _structure(rank: int, world: int) -> dict:
    facts = {}
    logger, lines = logging.getLogger("shardc"), LogLines()
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        model, compiled = _compiled_variant(rank, world, bucket_by="param")
    finally:
        logger.removeHandler(lines)
    facts["progress"] = lines.lines
    (region,) = shardc.shard_state(model).regions
    plan = shardc.explain(compiled)
    fw, bw = region.forward, region.backward
    facts["fw_all_gathers"] = _count(fw, funcol.all_gather_into_tensor.default)
    facts["bw_all_gathers"] = _count(bw, funcol.all_gather_into_tensor.default)
    facts["bw_reduce_scatters"] = _count(bw, funcol.reduce_scatter_tensor.default)
    facts["waits"] = _count(fw, funcol.wait_tensor.default) + _count(bw, funcol.wait_tensor.default)
    facts["plan"] = plan.to_dict()
    facts["hash"] = plan.hash()
    # No gathered parameter (nor a view of one) is an output of the forward graph.
    saved = set(fw.graph.find_nodes(op="output")[0].all_input_nodes)
    gathered = set()
    for wait in fw.graph.nodes:
        if wait.op == "call_function" and wait.target is funcol.wait_tensor.default:
            for node in gather_derived(wait):
                gathered.add(node)
                for user in node.users:
                    gathered.update(gather_derived(user))
    facts["saved_gathered"] = sorted(n.name for n in saved & gathered)
    # The static pool: no collective allocates its buffer, and the pool is one tensor shared by
    # the forward and backward graphs that stays the same across steps.
    facts["allocating_collectives"] = sum(
        _count(g, t, allocating_only=True) for g in (fw, bw) for t in _OUT_VARIANT)
    pool_fw, pool_bw = fw._shardc_comm_pool, bw._shardc_comm_pool
    facts["pool_shared"] = pool_fw is pool_bw
    facts["pool_bytes"] = (pool_fw.numel(), plan.predicted["pool_bytes"])
    pointer = pool_fw.data_ptr()
    tokens, targets = batches(2)
    per = GLOBAL_BATCH // world
    train(model, compiled, tokens[:, rank * per:(rank + 1) * per],
          targets[:, rank * per:(rank + 1) * per])
    facts["pool_stable"] = fw._shardc_comm_pool.data_ptr() == pointer
    # The same model without resharding keeps gathered params: no all-gather in backward.
    model2, _ = _compiled_variant(rank, world, bucket_by="param", reshard_after_forward=False)
    facts["no_reshard_bw_all_gathers"] = _count(
        shardc.shard_state(model2).regions[0].backward, funcol.all_gather_into_tensor.default
    )
    # Module buckets: one flat all-gather per bucket. Compiled with mode="reduce-overhead",
    # which the FX backend ignores (it says so: _cudagraph_fallbacks, which reads this run).
    model3, compiled3, seen, losses3 = _compiled_reduce_overhead(rank, world)
    plan3 = shardc.explain(compiled3)
    facts["module_buckets"] = [b.name for b in plan3.buckets]
    facts["module_fw_all_gathers"] = _count(
        shardc.shard_state(model3).regions[0].forward, funcol.all_gather_into_tensor.default
    )
    # A memory budget the planner must respect.
    budget = 2 * max(c.buffer_bytes for c in plan3.collectives)
    _, compiled4 = _compiled_variant(rank, world, memory_budget_bytes=budget, prefetch_depth=3)
    facts["budget"] = budget
    facts["budget_plan"] = shardc.explain(compiled4).to_dict()
    facts["cudagraphs"] = _cudagraph_fallbacks(model3, compiled3, seen, losses3)
    return facts


def _compiled_reduce_overhead(rank: int, world: int) -> tuple:
    """The variant model (module buckets, the default options) compiled with
    mode="reduce-overhead" and inductor=False, through a spy that keeps what Dynamo handed the
    backend; trained like :func:`_compiled_variant`'s: (model, compiled, [(gm, example
    inputs)], losses)."""
    torch._dynamo.reset()
    model = build("variant")
    shardc.shard(model)
    seen = []

    def spy(gm, example_inputs, **kw):
        seen.append((gm, example_inputs))
        return shardc.backend(inductor=False)(gm, example_inputs, **kw)

    compiled = torch.compile(model, backend=spy, mode="reduce-overhead")
    tokens, targets = batches(2)
    per = GLOBAL_BATCH // world
    losses = train(model, compiled, tokens[:, rank * per:(rank + 1) * per],
                   targets[:, rank * per:(rank + 1) * per])
    return model, compiled, seen, losses


def _cudagraph_fallbacks(model, compiled, seen: list, losses: list) -> dict:
    """mode="reduce-overhead" on gloo/CPU (``_compiled_reduce_overhead``'s run): what the
    backend decides (without compiling with Inductor, slow on CPU) and, with inductor=False,
    that it says the mode is ignored."""
    from shardc.compile.backend import _mode_patches, sharded_gathers
    from shardc.compile.cudagraphs import blockers
    from shardc.compile.options import ShardcOptions
    from shardc.ops.gather_args import GatherArgs

    gm, example_inputs = seen[0]
    state = shardc.shard_state(model)
    patches, note = _mode_patches(gm, example_inputs, ShardcOptions(), "reduce-overhead", state)
    gathers = [GatherArgs.of(n) for n in sharded_gathers(gm)]
    no_sync = [dataclasses.replace(g, grad_sync=1) for g in gathers]
    return {"fx_notes": shardc.explain(compiled).notes, "losses_finite": all(
                bool(torch.isfinite(x)) for x in losses),
            "inductor_patches": patches, "inductor_note": note,
            "no_sync_reasons": blockers(no_sync, example_inputs, fp8=False),
            "offload_reasons": blockers(gathers, example_inputs, fp8=False, offload=True)}


def _structure_and_graph_break(rank: int, world: int, dump_dir: str) -> tuple[dict, dict]:
    """Both world-2 runs of this file in one spawned group: the variant model's structure,
    then the graph-break model (its own model and regions, after a Dynamo reset)."""
    facts = _structure(rank, world)
    try:
        return facts, _graph_break(rank, world, dump_dir)
    finally:
        os.environ.pop("SHARDC_DUMP", None)


@pytest.fixture(scope="module")
def structure_and_graph_break(tmp_path_factory) -> tuple[list[dict], dict, object]:
    """(each rank's structure facts, rank 0's graph-break run, its dump directory)."""
    dump_dir = tmp_path_factory.mktemp("graph_break")
    runs = run_ranks(_structure_and_graph_break, 2, str(dump_dir))
    return [facts for facts, _ in runs], runs[0][1], dump_dir


@pytest.fixture(scope="module")
def structure(structure_and_graph_break):
    return structure_and_graph_break[0]


def test_collective_counts_per_parameter(structure):
    facts = structure[0]
    # VariantModel: tied embedding/output (one param), 9 block params, norm, tiny, unused.
    used = {"lm.tok_embeddings.weight", "lm.norm.weight", "tiny"} | {
        f"lm.layers.0.{p}" for p in (
            "attention_norm.weight", "attention.wq.weight", "attention.wk.weight",
            "attention.wv.weight", "attention.wo.weight", "ffn_norm.weight",
            "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")
    }
    frozen = {f"lm.layers.0.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
    colls = facts["plan"]["collectives"]
    fw_gathered = [p for c in colls if c["graph"] == "forward" and c["kind"] == "all_gather"
                   for p in c["params"]]
    reduced = [p for c in colls if c["kind"] == "reduce_scatter" for p in c["params"]]
    assert sorted(fw_gathered) == sorted(used), "each used parameter gathered once in forward"
    assert sorted(reduced) == sorted(used - frozen), "each trainable used parameter reduced once"
    assert facts["fw_all_gathers"] == len(used)
    assert facts["bw_reduce_scatters"] == len(used - frozen)
    bw_gathered = [p for c in colls if c["graph"] == "backward" and c["kind"] == "all_gather"
                   for p in c["params"]]
    assert len(bw_gathered) == len(set(bw_gathered)) and set(bw_gathered) <= used
    assert facts["bw_all_gathers"] == len(bw_gathered) > 0, "resharded params are re-gathered"
    assert facts["waits"] == len(colls), "every collective is waited exactly once"
    # A 1-D mesh: only shardc's own collectives, all on the shard group's lane; no tp records.
    assert {(c["origin"], c["group"], c["stream"]) for c in colls} == {("shardc", "shard", "comm")}
    assert facts["plan"]["tp_size"] == 1 and facts["plan"]["mesh"] == ""


def test_static_pool_steady_state_allocates_no_comm_buffers(structure):
    for facts in structure:
        assert facts["allocating_collectives"] == 0
        assert facts["pool_shared"] and facts["pool_stable"]
        assert facts["pool_bytes"][0] == facts["pool_bytes"][1] > 0


def test_gathered_params_not_saved_for_backward(structure):
    assert structure[0]["saved_gathered"] == []
    assert structure[0]["no_reshard_bw_all_gathers"] == 0


def test_module_buckets(structure):
    facts = structure[0]
    assert "lm.layers.0" in facts["module_buckets"]
    assert facts["module_fw_all_gathers"] == len(facts["module_buckets"])


def _assert_plan_invariants(plan: dict, budget: int = 0) -> None:
    by_graph = {}
    for c in plan["collectives"]:
        by_graph.setdefault(c["graph"], []).append(c)
    for graph, colls in by_graph.items():
        gathered = [c["bucket"] for c in colls if c["kind"] == "all_gather"]
        assert len(gathered) == len(set(gathered)), f"{graph}: a bucket gathered twice"
        for c in colls:
            assert c["issue_pos"] <= c["wait_pos"], c["id"]
            if c["kind"] == "all_gather":
                assert c["wait_pos"] <= c["first_use_pos"], f"{c['id']} waited after first use"
        if budget:
            live = plan["memory_timeline"][graph]
            assert max(live) <= budget, f"{graph}: {max(live)} B in flight > budget {budget} B"


def test_reduce_overhead_falls_back_loudly_on_gloo(structure):
    """CUDA graphs cannot record gloo's CPU-side collectives: with mode="reduce-overhead" the
    backend turns them off for the region and says why (warning and plan note); with
    inductor=False the mode is named as ignored in the plan; training is unaffected."""
    for rank in structure:
        got = rank["cudagraphs"]
        assert got["losses_finite"]
        assert any("mode='reduce-overhead' ignored" in n for n in got["fx_notes"]), got
        assert got["inductor_patches"]["triton.cudagraphs"] is False
        note = got["inductor_note"]
        assert "compiled without them" in note and "gloo process group" in note, note
        assert "runs on the CPU" in note, note
        assert any("no_sync" in r for r in got["no_sync_reasons"]), got["no_sync_reasons"]
        assert any("CPU offload" in r for r in got["offload_reasons"]), got["offload_reasons"]


def test_plan_invariants(structure):
    for facts in structure:
        _assert_plan_invariants(facts["plan"])
        _assert_plan_invariants(facts["budget_plan"], facts["budget"])


def test_plan_hash_identical_across_ranks(structure):
    assert structure[0]["hash"] == structure[1]["hash"]


def _mismatch(rank: int, world: int) -> str:
    torch._dynamo.reset()
    model = build("llama")
    shardc.shard(model)
    # Rank-dependent planning: the kind of bug the check exists for.
    compiled = torch.compile(
        model, backend=shardc.backend(inductor=False, bucket_by="param" if rank else "module")
    )
    tokens, _ = batches(1)
    try:
        compiled(tokens[0, :2])
    except PlanMismatchError as exc:
        return str(exc)
    return "no error"


# Slow (suite time, s33: 18 rank-CPU s, a two-rank group compiling the Llama): the plan check
# across ranks (PlanMismatchError on every rank, "differs from rank 0's", naming the bucket)
# stays in tests/test_real_models.py's rank_dependent (worlds 2 and 3), which plans a different
# graph on one rank rather than different options.
@pytest.mark.slow
def test_different_plan_on_one_rank_fails_on_every_rank():
    messages = run_ranks(_mismatch, 2)
    for message in messages:
        assert "rank 1's plan" in message and "differs from rank 0's" in message, message
        assert "bucket" in message


class _Breaks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 7)
        self.b = nn.Linear(7, 5)

    def forward(self, x):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h)


def _graph_break(rank: int, world: int, dump_dir: str) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Breaks()
    shardc.shard(model)
    os.environ["SHARDC_DUMP"] = dump_dir  # every compiled region dumps its plan
    compiled = torch.compile(model, backend=shardc.backend(inductor=False))
    x = torch.randn(3, 8, 6)
    y = torch.randn(3, 8, 5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        loss = torch.nn.functional.mse_loss(compiled(x[step]), y[step])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"regions": len(shardc.explain_all(compiled)),
            "params": {n: p.full_tensor() for n, p in model.named_parameters()}}


def test_graph_break_gives_two_planned_regions(structure_and_graph_break):
    _, out, tmp_path = structure_and_graph_break
    for region in (0, 1):
        for rank in (0, 1):
            for suffix in ("plan.txt", "plan.json", "trace.json"):
                assert (tmp_path / f"region{region}.rank{rank}.{suffix}").exists()
    torch.manual_seed(0)
    ref = _Breaks()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    x = torch.randn(3, 8, 6)
    y = torch.randn(3, 8, 5)
    for step in range(3):
        loss = torch.nn.functional.mse_loss(ref(x[step]), y[step])
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert out["regions"] == 2
    # every rank sees the whole batch here: the reference is the same data on one process
    assert_parity({"losses": torch.zeros(1), "params": out["params"]},
                  {"losses": torch.zeros(1), "params": dict(ref.named_parameters())})


# Mixed precision at world 1 (the planned graphs' gathers and reductions elided, the bf16 casts
# and fp32 reductions kept: at parity with the eager custom ops within 1e-5) and at world 2
# (bf16 all-gathers, fp32 reduce-scatters, fp32 masters, parity within bf16 tolerance):
# tests/test_parity.py's "bf16" runs ("bf16_eager" beside it at world 1). This file's own
# spawns of the same runs were duplicates (world 2: suite10; world 1: suite36).


def test_compile_progress_one_line_per_stage(structure):
    """Each stage of the region's compilation logs one line with its seconds (FX backend: no
    Inductor stages; ``tests/test_autograd_cache.py`` sees those)."""
    stages = ["Dynamo trace", "AOTAutograd joint graph", "joint passes + partition", "planning",
              "lowering", "peak prediction", "compiled (backend total)"]
    for facts in structure:
        found = [line.split(": ")[2] for line in facts["progress"]
                 if re.fullmatch(r"shardc: region 0: [^:]+: \d+\.\d\d s", line)]
        assert found == stages, facts["progress"]


def test_compile_progress_stage_and_env_switch(caplog, monkeypatch):
    from shardc.compile import progress

    with caplog.at_level(logging.INFO, logger="shardc"), progress.stage(3, "planning"):
        pass
    assert re.fullmatch(r"shardc: region 3: planning: \d+\.\d\d s", caplog.records[-1].getMessage())
    logger = logging.getLogger("shardc")
    monkeypatch.setattr(logger, "level", logger.level)  # both restored after the test
    monkeypatch.setattr(logger, "handlers", list(logger.handlers))
    progress.configure_from_env({"SHARDC_LOG": "debug"})
    assert logger.level == logging.DEBUG
    with pytest.raises(ValueError, match="SHARDC_LOG='loud'.*'debug', 'info'"):
        progress.configure_from_env({"SHARDC_LOG": "loud"})


def test_unsharded_model_compiles_like_default(caplog):
    torch._dynamo.reset()
    model = nn.Linear(4, 3)
    with caplog.at_level(logging.INFO, logger="shardc"):
        out = torch.compile(model, backend=shardc.backend(inductor=False))(torch.ones(2, 4))
    torch.testing.assert_close(out, model(torch.ones(2, 4)))
    assert any("reads no sharded parameter" in r.getMessage() for r in caplog.records)


def test_backend_name_works_without_importing_shardc():
    script = textwrap.dedent("""
        import torch
        model = torch.nn.Linear(4, 3)
        out = torch.compile(model, backend="shardc", options={"inductor": False})(torch.ones(2, 4))
        torch.testing.assert_close(out, model(torch.ones(2, 4)))
        import sys
        assert "shardc" in sys.modules, "the entry point should have loaded shardc"
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_unknown_backend_option_is_named():
    with pytest.raises(TypeError, match="prefetch_dpeth"):
        shardc.backend(prefetch_dpeth=2)
