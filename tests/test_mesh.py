"""2-D meshes: HSDP and FSDP+TP parity with the unsharded reference (4 gloo ranks), checkpoint
round trips between every pair of layouts, and the errors for meshes shardc cannot use."""

from __future__ import annotations

import pytest
import torch
from dist_utils import prestart as prestart_run
from dist_utils import run_prestarted, run_ranks
from mesh_workers import LAYOUTS, checkpoint_round_trips, hsdp_scenarios, tp_reference, tp_scenarios
from parity import assert_parity, assert_recomputed_in_backward, reference

from shardc.planning.cost_model import ClusterSpec

# Compiled on the 2x2 mesh and on 4x1 (shard groups of one rank: the gathers and reduce-scatters
# are elided); the all-tp mesh eagerly, to keep the tests fast.
HSDP = [((2, 2), "eager"), ((2, 2), "fx"), ((4, 1), "eager")]
# Slow (suite time; run with -m slow): their own 4-rank spawn, with the "fx" run they are
# compared with bit for bit. Their features stay in the default suite on 1-D meshes (optimizer-
# only offload at worlds 1-4 and the DTensor reads at worlds 1-3 in tests/test_parity.py; the pooled
# all-reduce in every compiled HSDP run above); only their HSDP combinations are slow-only.
HSDP_MORE = [((2, 2), "fx"),
             # Compiled on 4x1 (one-rank shard groups: gathers and reduce-scatters elided, the
             # gradients packed into the replicate all-reduce's pool buffer). Slow since s35
             # (suite time: one of the HSDP group's four 4-rank compiles): HSDP compiled stays
             # in the default tier on 2x2 (parity, the replicate all-reduce in the pool, its
             # lane) and eagerly on 4x1; elided one-rank collectives at world 1
             # (tests/test_parity.py, tests/test_parity_inductor.py).
             ((4, 1), "fx"),
             ((4, 1), "fx-nopool"),
             ((2, 2), "fx-optoffload"),  # optimizer-only offload over HSDP
             ((2, 2), "fx-offload-overlap"),  # CPU offload + shardc.step_in_backward over HSDP
             ((2, 2), "fx-dtensorin"),  # the DTensor reads over HSDP (plain_inputs=False)
             # CPU offload (simulated on the CPU mesh) over HSDP. Slow since s33 (suite time:
             # 18 rank-CPU s of the 4-rank HSDP group): compiled CPU offload over ranks stays in
             # tests/test_parity.py ("offload" at 3, "bf16_offload" at 2), with its copies
             # planned; the replicate all-reduce in every compiled HSDP run above.
             ((2, 2), "fx-offload")]
# "fx-traced": compiled with the tensor-parallel collectives kept where traced (the results must
# be bitwise those of "fx", which moves them).
TP = [((2, 2), "eager"), ((2, 2), "fx"), ((1, 4), "eager")]
# Slow since s35 (suite time: one of the FSDP+TP group's four 4-rank compiles), in their own
# spawn with the "fx" run "fx-traced" is compared with bit for bit: FSDP+TP compiled with the
# tensor-parallel collectives moved (the default) stays in the default tier ("fx" above, at
# parity, its collectives planned), only keeping them where traced is slow-only.
TP_MORE = [((2, 2), "fx"), ((2, 2), "fx-traced")]
# ("pp", "dp") meshes whose dp slice shardc shards over (in the HSDP spawn): eager in the
# default tier; compiled (its own 4-rank spawn) in the slow tier since suite36 (20 rank-CPU s of
# the HSDP group): shardc.shard over a slice stays in the default tier here (eager, 2-rank dp
# groups) and compiled in tests/test_real_models.py's submesh (world 2, 1-rank dp slices);
# compiled collectives over a mesh's sub-groups in HSDP "fx" above.
SLICES = [((2, 2), "eager")]
SLICES_MORE = [((2, 2), "fx")]
# Repeated blocks compiled once (shardc.sharding.blocks) on 2-D meshes: the BlockStack under
# HSDP (in the HSDP spawn), TPBlocks under FSDP+TP (in the FSDP+TP spawn).
# "fx-aoff": the same with every block's saved activations offloaded (activation_offload=("*",),
# simulated on the CPU mesh): bitwise equal to "fx" (_check_offloaded_activations).
# (Under HSDP "fx-aoff" runs in the slow test_hsdp_blocks_offloaded_activations, its own spawn
# with the "fx" run it is compared with: suite time.)
# Slow since s35 (suite time: one 4-rank compile of the HSDP group): the BlockStack under HSDP
# ("fx", now only in the slow spawn of HSDP_BLOCKS_MORE, read by test_hsdp_blocks_compiled_once
# and test_hsdp_blocks_offloaded_activations). Bodies on a 2-D mesh stay in the default tier
# under FSDP+TP (TP_BLOCKS), HSDP compiled in test_hsdp_parity_and_plan, bodies over ranks in
# tests/test_parity.py ("blocks" at 2).
HSDP_BLOCKS_MORE = [((2, 2), "fx"), ((2, 2), "fx-aoff")]
TP_BLOCKS = [((2, 2), "fx")]
# "fx-aoff" under FSDP+TP: slow since s35 (suite time: one 4-rank compile), with TP_MORE.
# Forced activation offload over real collectives stays in the default tier under FP8
# (tests/test_fp8.py, world 2, at parity), and as the planner's choice
# (tests/test_real_models.py's peak_budget_offload, world 2); with compile-once bodies at
# world 1 (tests/test_parity.py's "offload_activations": the llama's two layers are one body).
TP_BLOCKS_MORE = [((2, 2), "fx"), ((2, 2), "fx-aoff")]
STACK = tuple(f"blocks.{i}" for i in range(4))


def _assert_parity(run: dict, ref: dict, where: str) -> None:
    """:func:`assert_parity`, its failure naming the rank, mesh and mode."""
    try:
        assert_parity(run, ref)
    except AssertionError as exc:
        raise AssertionError(f"{where}: {exc}") from exc


def _hsdp_call() -> tuple:
    return (hsdp_scenarios, 4, HSDP, SLICES)


def _tp_call() -> tuple:
    return (tp_scenarios, 4, TP, TP_BLOCKS)


def prestart(items) -> None:
    """Queue the 4-rank groups of the selected tests below (tests/conftest.py,
    dist_utils.prestart): in the whole suite they run in the background beside earlier tests."""
    if any("hsdp_runs" in item.fixturenames for item in items):
        prestart_run("test_mesh::hsdp_runs", _hsdp_call())
    if any(item.name == "test_fsdp_tp_parity_placements_and_global_values" for item in items):
        prestart_run("test_mesh::fsdp_tp", _tp_call())


@pytest.fixture(scope="module")
def hsdp_runs() -> list[list[dict]]:
    """Per rank: the HSDP runs, then the SLICES runs."""
    return run_prestarted("test_mesh::hsdp_runs", *_hsdp_call())


@pytest.fixture(scope="module")
def llama1_reference() -> dict:
    return reference("llama1")


def test_hsdp_parity_and_plan(hsdp_runs, llama1_reference):
    _check_hsdp(HSDP, [per_rank[:len(HSDP)] for per_rank in hsdp_runs], llama1_reference)


@pytest.mark.slow
def test_hsdp_parity_and_plan_more(llama1_reference):
    """HSDP without the pool, with optimizer-only offload, with the DTensor reads (see
    HSDP_MORE)."""
    _check_hsdp(HSDP_MORE, run_ranks(hsdp_scenarios, 4, HSDP_MORE), llama1_reference)


def _check_hsdp(layouts: list, results: list[list[dict]], ref: dict) -> None:
    """Parity of every run of ``layouts`` (per rank: ``results``) with the unsharded reference,
    the plans' replicate all-reduces, lanes and pool, and the offload/plain runs' bits equal to
    the plain "fx" run's where both are in ``layouts``."""
    for rank, per_rank in enumerate(results):
        for (shape, mode), run in zip(layouts, per_rank):
            _assert_parity(run, ref, f"rank {rank}, HSDP {shape} {mode}")
    for (shape, mode), run in zip(layouts, results[0]):
        assert set(run["placements"].values()) == {("Replicate()", "Shard(0)")}
        if mode == "eager":
            continue
        assert run["plans"], f"HSDP {shape}: no planned region"
        for plan in run["plans"]:
            if shape[0] > 1:  # one bucketed all-reduce per bucket over the replicate group
                assert "all_reduce" in plan["kinds"] and plan["replicate_size"] == shape[0]
                assert plan["all_reduce_groups"] == {"replicate"}
                assert plan["mesh"] == f"HSDP: replicate {shape[0]} x shard {shape[1]}"
                for predicted, inter_node in plan["all_reduce_times"]:
                    assert predicted == pytest.approx(inter_node) and predicted > 0
                if shape[1] == 1:
                    # One-rank shard groups: no gather, no reduce-scatter is lowered (the plan
                    # lists them elided); the gradients are packed into the buffer the
                    # replicate all-reduce runs in (the pool's, or its own without the pool).
                    assert plan["elided"] == ["all_gather", "reduce_scatter"]
                    expected = (["_c10d_functional.all_reduce.default",
                                 "_c10d_functional.wait_tensor.default"] if mode == "fx-nopool"
                                else ["_c10d_functional.all_reduce_.default",
                                      "_c10d_functional.wait_tensor.default",
                                      "shardc.pool_pack.default", "shardc.pool_unpack.default"])
                    assert plan["lowered_ops"] == expected, plan["lowered_ops"]
                else:
                    assert plan["elided"] == []
                    _assert_own_lanes(plan)
                if mode == "fx-nopool":  # each all-reduce allocates its own buffer
                    assert plan["allocating_all_reduces"] == len(plan["all_reduce_offsets"]) > 0
                else:
                    assert plan["allocating_all_reduces"] == 0 and plan["all_reduce_offsets"]
                    assert None not in plan["all_reduce_offsets"]  # in the static pool
            else:
                assert "all_reduce" not in plan["kinds"] and plan["mesh"] == ""
            assert plan["found"] == [] and plan["tp_size"] == 1
    # CPU offload over HSDP (all, and optimizer only) and the DTensor reads: the same bits as
    # the default's plain reads; the copies
    # planned where the shards are offloaded, none for optimizer-only offload.
    modes = [m for m in ("fx-offload", "fx-optoffload", "fx-offload-overlap", "fx-dtensorin")
             if ((2, 2), m) in layouts]
    assert not modes or ((2, 2), "fx") in layouts
    for per_rank in results if modes else ():
        fx = per_rank[layouts.index(((2, 2), "fx"))]
        for mode in modes:
            offloaded = per_rank[layouts.index(((2, 2), mode))]
            assert torch.equal(offloaded["losses"], fx["losses"]), mode
            assert all(torch.equal(offloaded["params"][n], v)
                       for n, v in fx["params"].items()), mode
    if ((2, 2), "fx-offload") in layouts:
        for plan in results[0][layouts.index(((2, 2), "fx-offload"))]["plans"]:
            assert ("backward", "d2h_copy") in plan["copies"] and ("forward", "h2d_copy") in \
                plan["copies"]
    if ((2, 2), "fx-optoffload") in layouts:
        for plan in results[0][layouts.index(((2, 2), "fx-optoffload"))]["plans"]:
            assert plan["copies"] == [], plan["copies"]
    if ((2, 2), "fx-offload-overlap") in layouts:
        # Bitwise the plain step's (above), so no bucket was stepped before its gradient was
        # all-reduced over the replicas too; and the graph's signals stepped every parameter
        # during the backward on every rank.
        for per_rank in results:
            counts = per_rank[layouts.index(((2, 2), "fx-offload-overlap"))]["overlap"]
            assert counts["early"] == counts["signalled"] > 0 and counts["late"] == 0, counts


def _assert_own_lanes(plan: dict) -> None:
    """HSDP: the replicate all-reduces run on their own lane, after their reduce-scatter, and in
    parallel with the shard group's later collectives (one lane per process group)."""
    assert plan["streams"] == {("shardc", "shard"): "comm", ("shardc", "replicate"): "replicate"}
    overlapped = False
    for start, end, reduced, later in plan["all_reduce_lanes"]:
        assert start >= reduced - 1e-12  # it reduces its reduce-scatter's output
        overlapped |= any(s < end for s in later)
    assert overlapped, plan["all_reduce_lanes"]


def test_slice_of_a_mesh_over_the_world_shards_over_its_ranks(hsdp_runs, llama1_reference):
    """``shardc.shard(model, mesh["dp"])`` of a 2x2 ``("pp", "dp")`` mesh: the slice does not
    cover the world but its mesh does, so shardc accepts it; each pp group of 2 ranks shards over
    its own dp ranks and trains at parity with the unsharded reference (eager; compiled:
    slow)."""
    _check_slices(SLICES, [per_rank[len(HSDP):] for per_rank in hsdp_runs], llama1_reference)


@pytest.mark.slow
def test_slice_of_a_mesh_over_the_world_compiled(llama1_reference):
    """The same compiled (FX): planned, each region reduce-scatters over the dp slice."""
    _check_slices(SLICES_MORE, run_ranks(hsdp_scenarios, 4, [], SLICES_MORE), llama1_reference)


def _check_slices(slices: list, results: list[list[dict]], llama1_reference: dict) -> None:
    for rank, per_rank in enumerate(results):
        for (shape, mode), run in zip(slices, per_rank):
            _assert_parity(run, llama1_reference, f"rank {rank}, pp/dp slice {shape} {mode}")
            assert set(run["placements"].values()) == {("Shard(0)",)}
            if mode != "eager":
                assert run["plans"] and all("reduce_scatter" in p["kinds"] for p in run["plans"])


@pytest.fixture(scope="module")
def hsdp_blocks_runs() -> list[list[dict]]:
    """Per rank: the HSDP_BLOCKS_MORE runs (slow tests only)."""
    return run_ranks(hsdp_scenarios, 4, [], [], HSDP_BLOCKS_MORE)


@pytest.mark.slow  # suite time (s35): where its features stay covered: HSDP_BLOCKS_MORE above
def test_hsdp_blocks_compiled_once(hsdp_blocks_runs):
    """The BlockStack (four identical blocks with checkpointing inside, one odd block) under
    HSDP 2x2: at parity, one body partitioned once for the four blocks, the odd one inline, and
    the replicate all-reduces still planned in the outer graph."""
    fx = HSDP_BLOCKS_MORE.index(((2, 2), "fx"))
    _check_hsdp_blocks([HSDP_BLOCKS_MORE[fx]], [[per_rank[fx]] for per_rank in hsdp_blocks_runs])


@pytest.mark.slow
def test_hsdp_blocks_offloaded_activations(hsdp_blocks_runs):
    """The same with every block's saved activations offloaded ("fx-aoff"), bitwise equal to
    "fx"."""
    _check_hsdp_blocks(HSDP_BLOCKS_MORE, hsdp_blocks_runs)


@pytest.mark.slow  # one 4-rank compile; packed blocks over one mesh dimension: test_parity.py
def test_hsdp_packed_blocks():
    """pack_blocks=True under HSDP 2x2: each block's packed gradient reduce-scattered over the
    shard group and all-reduced over the replicate group, at parity."""
    layouts = [((2, 2), "fx-packed")]
    _check_hsdp_blocks(layouts, run_ranks(hsdp_scenarios, 4, [], [], layouts))


def _check_hsdp_blocks(layouts: list, results: list[list[dict]]) -> None:
    ref = reference("blocks")
    for rank, per_rank in enumerate(results):
        for (shape, mode), run in zip(layouts, per_rank):
            _assert_parity(run, ref, f"rank {rank}, HSDP blocks {shape} {mode}")
            assert run["plans"], f"rank {rank}: no planned region"
            for plan in run["plans"]:
                assert plan["bodies"] == [(STACK, 1)], plan["bodies"]
                assert list(plan["inline"]) == ["blocks.4"], plan["inline"]
                assert "all_reduce" in plan["kinds"] and plan["all_reduce_groups"] == {"replicate"}
        if any(mode == "fx-aoff" for _, mode in layouts):
            _check_offloaded_activations(per_rank, layouts, f"rank {rank}, HSDP",
                                         [*STACK, "blocks.4"])


@pytest.mark.slow
def test_hsdp_peak_budget_frees_blocks_activations():
    """Issue 22's peak budget under HSDP 2x2 (the BlockStack, FX, no pool, no prefetch): a
    budget a byte below the fixed policy's predicted peak (the ranks' largest) makes the
    planner free blocks' activations (its blocks checkpoint inside, so it offloads them:
    recompute is excluded); training matches the unsharded reference, the predicted peak is
    within the budget, the offloaded values' copies are in the graphs, and the plans (budget
    decisions included) hash the same on every rank. Marked slow: two compiles and the search's
    trials on four ranks (~17 CPU s a rank, ~35 s wall on two cores), over the suite's share
    for a variant of the HSDP spawn."""
    ref = reference("blocks")
    runs = [per_rank[0] for per_rank in run_ranks(hsdp_scenarios, 4, [], [],
                                                   [((2, 2), "fx-budget")])]
    _check_budget_runs(runs, ref, "HSDP blocks")
    for rank, run in enumerate(runs):
        record = run["budget"]
        assert record.kept == [] and record.prefetch.depth == 0, rank
        for plan in run["plans"]:
            assert "all_reduce" in plan["kinds"] and plan["all_reduce_groups"] == {"replicate"}


@pytest.mark.slow
def test_fsdp_tp_peak_budget_frees_blocks_activations():
    """Issue 22's peak budget under FSDP+TP 2x2 (TPBlocks: two tensor-parallel blocks inline,
    two plain ones compiled once; FX, no pool, no prefetch): a budget a byte below the fixed
    policy's predicted peak (the ranks' largest) makes the planner free blocks' activations
    (recompute or offload: its choice); training matches the unsharded reference, the
    predicted peak is within the budget, and the plans (budget decisions included) hash the
    same on every rank. Slow for the same reason as the HSDP one above (two compiles and the
    search's trials on four ranks)."""
    ref = tp_reference("blocks")
    runs = [per_rank[0] for per_rank in run_ranks(tp_scenarios, 4, [],
                                                   [((2, 2), "fx-budget")])]
    _check_budget_runs(runs, ref, "FSDP+TP blocks")
    for run in runs:
        for plan in run["plans"]:
            assert "reduce_scatter" in plan["kinds"], plan["kinds"]


@pytest.mark.slow
def test_hsdp_peak_budget_frees_blocks_activations_under_inductor():
    """The same under Inductor at world 2, on a (2, 1) (replicate, shard) mesh: the replicate
    all-reduce over both ranks is what HSDP adds to FSDP (a shard group of one rank elides
    the gathers and reduce-scatters, which the FSDP Inductor tests cover); a 2x2 mesh would
    cost four ranks' Inductor compiles."""
    ref = reference("blocks")
    runs = [per_rank[0] for per_rank in run_ranks(hsdp_scenarios, 2, [], [],
                                                   [((2, 1), "inductor-budget")])]
    _check_budget_runs(runs, ref, "HSDP (2, 1) blocks under Inductor")
    for run in runs:
        for plan in run["plans"]:
            assert "all_reduce" in plan["kinds"] and plan["all_reduce_groups"] == {"replicate"}
            # the replicate all-reduce is in the graphs Inductor compiles
            assert "_c10d_functional.all_reduce.default" in plan["lowered_ops"], plan


@pytest.mark.slow
def test_fsdp_tp_peak_budget_frees_blocks_activations_under_inductor():
    """The same under Inductor at world 2, on a (1, 2) (dp, tp) mesh: the tensor-parallel
    blocks' collectives run over both ranks (the dp group of one rank elides FSDP's, which the
    FSDP Inductor tests cover); a 2x2 mesh would cost four ranks' Inductor compiles."""
    ref = tp_reference("blocks")
    runs = [per_rank[0] for per_rank in run_ranks(tp_scenarios, 2, [],
                                                   [((1, 2), "inductor-budget")])]
    _check_budget_runs(runs, ref, "FSDP+TP (1, 2) blocks under Inductor")
    for run in runs:
        for plan in run["plans"]:
            # the tensor-parallel all-reduces are in the graphs Inductor compiles
            assert plan["all_reduce_groups"] == {"tp"}, plan["all_reduce_groups"]
            assert "_c10d_functional.all_reduce.default" in plan["lowered_ops"], plan


def _check_budget_runs(runs: list[dict], ref: dict, where: str) -> None:
    """A 2-D mesh's ``fx-budget`` runs (one per rank): parity with ``ref``, the budget a byte
    below the fixed policy's peak, blocks freed (offloaded or recomputed, each decision with
    its reason), the predicted peak within the budget, the offloaded values' copies in the
    graphs, and one plan hash on every rank."""
    for rank, run in enumerate(runs):
        _assert_parity(run, ref, f"rank {rank}, {where} under a peak budget")
        record = run["budget"]
        assert record.budget_bytes == run["fixed_peak"] - 1, (rank, record.budget_bytes)
        assert record.offloaded or record.recomputed, (rank, record.blocks)
        assert record.peak_bytes <= record.budget_bytes and run["peak"] <= record.budget_bytes
        for d in record.blocks:
            assert d.reason.startswith(("offloaded", "recomputed", "saved")), d
        if "backward_ops" in run:
            assert_recomputed_in_backward(record, run["bodies"], run["backward_ops"])
        copies = run["activation_copies"]
        if record.offloaded:
            assert copies["d2h"] == copies["h2d"] == copies["saved_on_host"] > 0, (rank, copies)
            assert copies["misplaced"] == 0 and copies["forward_waits"] == 0, (rank, copies)
    assert len({run["hash"] for run in runs}) == 1, [run["hash"] for run in runs]


def _check_offloaded_activations(runs: list[dict], scenarios: list, where: str,
                                 blocks: list[str]) -> None:
    """``fx-aoff`` (issue 22's activation offload forced on every block) equals ``fx`` bit for
    bit, its saved values went to the host and came back (parity.activation_copies), and the
    plan's note names every one of ``blocks`` as offloaded."""
    by_mode = {mode: run for (_, mode), run in zip(scenarios, runs)}
    run, plain = by_mode["fx-aoff"], by_mode["fx"]
    notes = [n for plan in run["plans"] for n in plan["notes"] if "activation offload" in n]
    assert notes and all(f"{blocks}" in n for n in notes), (where, notes)
    copies = run["activation_copies"]
    assert copies["d2h"] > 0 and copies["d2h"] == copies["h2d"] == copies["host"], (where, copies)
    assert copies["saved_on_host"] == copies["d2h"] == copies["release_waits"], (where, copies)
    assert copies["misplaced"] == 0 and copies["forward_waits"] == 0, (where, copies)
    assert plain["activation_copies"]["d2h"] == 0, where
    assert torch.equal(run["losses"], plain["losses"]), where
    for name, value in plain["params"].items():
        assert torch.equal(run["params"][name], value), (where, name)


def _check_tp_blocks(layouts: list, results: list[list[dict]]) -> None:
    """TPBlocks under FSDP+TP 2x2 (``layouts``, per rank: ``results``): at parity; the two plain
    blocks share one body, the two tensor-parallel ones compile inline with their reason in the
    plan; "fx-aoff" (where it is in ``layouts``) bitwise equal to "fx"."""
    ref = tp_reference("blocks")
    for rank, per_rank in enumerate(results):
        for (shape, mode), run in zip(layouts, per_rank):
            _assert_parity(run, ref, f"rank {rank}, FSDP+TP blocks {shape} {mode}")
            assert run["plans"], f"rank {rank}: no planned region"
            for plan in run["plans"]:
                assert plan["bodies"] == [(("blocks.2", "blocks.3"), 1)], plan["bodies"]
                assert sorted(plan["inline"]) == ["blocks.0", "blocks.1"], plan["inline"]
                assert all("tensor-parallel" in r or "hooks" in r
                           for r in plan["inline"].values()), plan["inline"]
        if any(mode == "fx-aoff" for _, mode in layouts):
            _check_offloaded_activations(per_rank, layouts, f"rank {rank}, FSDP+TP",
                                         [f"blocks.{i}" for i in range(4)])


def test_fsdp_tp_parity_placements_and_global_values():
    ref = tp_reference()
    results = run_prestarted("test_mesh::fsdp_tp", *_tp_call())
    _check_tp_blocks(TP_BLOCKS, [per_rank[len(TP):] for per_rank in results])
    _check_tp(TP, [per_rank[:len(TP)] for per_rank in results], ref)
    placements = results[0][0]["placements"]  # (2, 2)
    strided = "_StridedShard(0, sf=2)"
    assert placements["proj.weight"] == (strided, "Shard(0)")
    assert placements["proj.bias"] == (strided, "Shard(0)")
    assert placements["experts"] == (strided, "Shard(0)")
    assert placements["w13"] == ("Shard(0)", "Shard(1)")  # dp splits gate from up
    assert placements["w2.weight"] == ("Shard(0)", "Shard(1)")
    assert placements["norm.weight"] == ("Shard(0)", "Replicate()")
    assert placements["embed.weight"] == ("Shard(0)", "Replicate()")


def _check_tp(layouts: list, results: list[list[dict]], ref: dict) -> None:
    """FSDP+TP runs of TPNet (``layouts``, per rank: ``results``): parity, initial values in
    global coordinates, the tensor-parallel collectives planned; "fx-traced" (where it is in
    ``layouts``) bitwise equal to "fx"."""
    for rank, per_rank in enumerate(results):
        for (shape, mode), run in zip(layouts, per_rank):
            _assert_parity(run, ref, f"rank {rank}, FSDP+TP {shape} {mode}")
            for name, value in ref["init"].items():  # sharded in global coordinates
                assert torch.equal(run["init"][name], value.detach()), (shape, name)
            if mode != "eager":
                assert run["plans"] and all("reduce_scatter" in p["kinds"] for p in run["plans"])
                for plan in run["plans"]:
                    _assert_tp_collectives_planned(plan, moved=mode == "fx")
        if ((2, 2), "fx-traced") not in layouts:
            continue
        # Moving the tensor-parallel collectives' issues and waits changes no bit.
        moved, traced = (per_rank[layouts.index(((2, 2), mode))] for mode in ("fx", "fx-traced"))
        assert torch.equal(moved["losses"], traced["losses"]), rank
        for name, value in moved["params"].items():
            assert torch.equal(value, traced["params"][name]), (rank, name)


@pytest.mark.slow  # suite time (s35): where its features stay covered: TP_MORE, TP_BLOCKS_MORE
def test_fsdp_tp_traced_collectives_and_offloaded_activations():
    """FSDP+TP 2x2 compiled with the tensor-parallel collectives kept where traced
    ("fx-traced", bitwise "fx"), and TPBlocks with every block's saved activations offloaded
    ("fx-aoff", bitwise "fx"), in one spawn."""
    results = run_ranks(tp_scenarios, 4, TP_MORE, TP_BLOCKS_MORE)
    _check_tp(TP_MORE, [per_rank[:len(TP_MORE)] for per_rank in results], tp_reference())
    _check_tp_blocks(TP_BLOCKS_MORE, [per_rank[len(TP_MORE):] for per_rank in results])


# Of a collective found in the graph: (what it sends, what it receives) in its plan record's
# (bytes, buffer_bytes), over tp = 2 ranks.
_SENT_RECEIVED = {"all_gather": ("bytes", "buffer_bytes"), "all_reduce": ("bytes", "bytes"),
                  "reduce_scatter": ("buffer_bytes", "bytes")}


def _assert_tp_collectives_planned(plan: dict, moved: bool) -> None:
    """Every collective DTensor issues over the tp group has a plan record of the right kind,
    group, bytes and dtype, at positions consistent with the lowered graph."""
    found = plan["found"]
    assert plan["mesh"] == "FSDP+TP: dp 2 x tp 2" and plan["tp_size"] == 2
    assert len(found) == plan["graph_collectives"] > 0  # every tp collective, none else
    # The kinds are DTensor's choice: torch 2.13+ also reduce-scatters (a partial sum to a
    # sequence shard), 2.11 all-reduces there.
    kinds = {f["kind"] for f in found}
    assert {"all_gather", "all_reduce"} <= kinds <= {"all_gather", "all_reduce", "reduce_scatter"}
    assert {f["id"].split(".")[0] for f in found} == {"forward", "backward"}
    for f in found:
        assert f["group"] == "tp" and f["stream"] == "tp" and f["group_size"] == 2, f
        assert f["on_tp_ranks"] and f["dtype"] == f["node_dtype"], f
        sent, received = _SENT_RECEIVED[f["kind"]]
        assert (f[sent], f[received]) == (f["sent"], f["received"]) and f["sent"] > 0, f
        ratio = {"all_gather": 2, "all_reduce": 1, "reduce_scatter": 0.5}[f["kind"]]
        assert f["received"] == f["sent"] * ratio, f
        assert len(f["tensors"]) == 2 and "DTensor" in f["reason"] and "tp group" in f["reason"]
        issue, wait, first, last, end = f["positions"]
        assert 0 <= issue <= wait <= first <= last <= end, f
        assert f["issue_before_waits"] and f["waits_before_readers"], f
        assert f["first_reader_is_planned_op"] and f["wait_before_op_at_wait_pos"], f
        if not moved:
            assert "issued where traced (move_found_collectives=False)" in f["reason"], f
    # The reasons say where they came from: module, source line, the tensor-parallel hook.
    reasons = " ".join(f["reason"] for f in found)
    assert "w2 (Linear)" in reasons and "mesh_models.py:" in reasons
    assert "tensor-parallel style hook _prepare_output_fn" in reasons
    if moved:  # this model has compute to overlap: some issues move earlier, some waits later
        assert any(f["positions"][1] > f["positions"][0] for f in found)
        assert any("earlier than traced" in f["reason"] for f in found)
    assert plan["exposed"][0] == pytest.approx(plan["exposed"][1])  # tp stalls counted


def test_cost_model_times_the_replicate_level_at_inter_node_numbers():
    spec = ClusterSpec(bus_bandwidth=100e9, latency_s=1e-6, inter_node_bandwidth=10e9,
                       inter_node_latency_s=5e-6)
    nbytes, world = 1_000_000, 4
    assert spec.collective_seconds("all_reduce", nbytes, world) == pytest.approx(
        2 * (3 * 1e-6 + 0.75 * nbytes / 100e9))
    assert spec.collective_seconds("all_reduce", nbytes, world, "inter") == pytest.approx(
        2 * (3 * 5e-6 + 0.75 * nbytes / 10e9))


def test_replicate_all_reduce_runs_at_the_inter_link_only_when_replicas_span_nodes():
    """HSDP's replicate group is the outer mesh dimension: its ranks are a replica (shard x tp
    ranks) apart, so it crosses nodes only when the replicas do not fit in one node (2 x 1 on
    2 GPUs of one host: the intra-node link and its measured curves)."""
    from shardc.planning.plan import Collective
    from shardc.planning.profile import resolve_profile
    from shardc.planning.schedule import _duration

    prof = resolve_profile({"profile": "h200", "node_size": 8})

    def seconds(group: str, size: int, tp: int = 1, shard: int = 1) -> float:
        c = Collective("c", "all_reduce", "backward", 0, [], 1 << 26, 1 << 26, "float32",
                       group, 0, 1, 1, 1, group=group, group_size=size)
        return _duration(c, prof, tp, shard)

    intra = prof.collective_seconds("all_reduce", 1 << 26, 2, "intra")
    inter = prof.collective_seconds("all_reduce", 1 << 26, 2, "inter")
    assert inter > intra
    assert seconds("replicate", 2, shard=1) == intra  # 2 x 1: one node
    assert seconds("replicate", 2, shard=4) == intra  # 2 x 4: 8 ranks, one node
    assert seconds("replicate", 2, shard=8) == inter  # 2 x 8: a replica per node
    assert seconds("shard", 2, tp=4) == intra and seconds("shard", 2, tp=8) == inter
    assert seconds("tp", 2) == intra


def test_checkpoints_across_layouts_are_bitwise_equal(tmp_path):
    problems = run_ranks(checkpoint_round_trips, 4, str(tmp_path))
    expected = {f"{a} -> {b}" for a in LAYOUTS for b in LAYOUTS if a != b}
    for rank, per_rank in enumerate(problems):
        assert expected <= set(per_rank), sorted(per_rank)
        bad = {k: v[:3] for k, v in per_rank.items() if v}
        assert not bad, f"rank {rank}: {bad}"


def _errors(rank: int, world: int) -> dict[str, str]:
    from mesh_models import TPNet, parallelize
    from torch.distributed.device_mesh import init_device_mesh

    import shardc

    def error(fn) -> str:
        try:
            fn()
        except (ValueError, NotImplementedError) as exc:
            return str(exc)
        return "no error"

    def tp_model(tp_mesh):
        torch.manual_seed(0)
        return parallelize(TPNet(), tp_mesh)

    tp_mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    other = init_device_mesh("cpu", (1,), mesh_dim_names=("tp_other",))
    hsdp = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    return {
        "3d": error(lambda: shardc.shard(torch.nn.Linear(2, 2), init_device_mesh(
            "cpu", (1, 1, 1), mesh_dim_names=("a", "b", "c")))),
        "unnamed": error(lambda: shardc.shard(torch.nn.Linear(2, 2),
                                              init_device_mesh("cpu", (1, 1)))),
        "wrong_names": error(lambda: shardc.shard(torch.nn.Linear(2, 2), init_device_mesh(
            "cpu", (1, 1), mesh_dim_names=("tp", "dp")))),
        "not_submesh": error(lambda: shardc.shard(tp_model(other), tp_mesh)),
        "tp_on_hsdp": error(lambda: shardc.shard(tp_model(hsdp["shard"]), hsdp)),
        "tp_on_1d": error(lambda: shardc.shard(tp_model(other), other)),
    }


def test_bad_meshes_raise_clear_errors():
    errors = run_ranks(_errors, 1)[0]
    assert "3-D mesh" in errors["3d"] and "('replicate', 'shard')" in errors["3d"]
    assert "mesh_dim_names" in errors["unnamed"] and "got None" in errors["unnamed"]
    assert "got ('tp', 'dp')" in errors["wrong_names"]
    assert "'w13'" in errors["not_submesh"] and "not the 'tp' sub-mesh" in errors["not_submesh"]
    for key in ("tp_on_hsdp", "tp_on_1d"):
        assert "already a DTensor" in errors[key] and "('dp', 'tp')" in errors[key], errors[key]


