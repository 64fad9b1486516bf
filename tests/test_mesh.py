"""2-D meshes: HSDP and FSDP+TP parity with the unsharded reference (4 gloo ranks), checkpoint
round trips between every pair of layouts, and the errors for meshes shardc cannot use."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from mesh_workers import LAYOUTS, checkpoint_round_trips, hsdp_scenarios, tp_reference, tp_scenarios
from parity import assert_parity, reference

from shardc.passes.cost_model import ClusterSpec

# Compiled on the 2x2 mesh; the degenerate meshes (all replicate, all tp) eagerly, to keep the
# tests fast (the compiled 1x4 / 4x1 runs pass too: benchmarks or -k runs can add them).
HSDP = [((2, 2), "eager"), ((2, 2), "fx"), ((4, 1), "eager")]
TP = [((2, 2), "eager"), ((2, 2), "fx"), ((1, 4), "eager")]
# ("pp", "dp") meshes whose dp slice shardc shards over (in the HSDP spawn).
SLICES = [((2, 2), "fx")]


def _assert_parity(run: dict, ref: dict, where: str) -> None:
    """:func:`assert_parity`, its failure naming the rank, mesh and mode."""
    try:
        assert_parity(run, ref)
    except AssertionError as exc:
        raise AssertionError(f"{where}: {exc}") from exc


@pytest.fixture(scope="module")
def hsdp_runs() -> list[list[dict]]:
    """Per rank: the HSDP runs, then the SLICES runs."""
    return run_ranks(hsdp_scenarios, 4, HSDP, SLICES)


@pytest.fixture(scope="module")
def llama1_reference() -> dict:
    return reference("llama1")


def test_hsdp_parity_and_plan(hsdp_runs, llama1_reference):
    ref = llama1_reference
    results = [per_rank[:len(HSDP)] for per_rank in hsdp_runs]
    for rank, per_rank in enumerate(results):
        for (shape, mode), run in zip(HSDP, per_rank):
            _assert_parity(run, ref, f"rank {rank}, HSDP {shape} {mode}")
    for (shape, mode), run in zip(HSDP, results[0]):
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
            else:
                assert "all_reduce" not in plan["kinds"] and plan["mesh"] == ""


def test_slice_of_a_mesh_over_the_world_shards_over_its_ranks(hsdp_runs, llama1_reference):
    """``shardc.shard(model, mesh["dp"])`` of a 2x2 ``("pp", "dp")`` mesh: the slice does not
    cover the world but its mesh does, so shardc accepts it; each pp group of 2 ranks shards over
    its own dp ranks and trains at parity with the unsharded reference."""
    for rank, per_rank in enumerate(hsdp_runs):
        for (shape, mode), run in zip(SLICES, per_rank[len(HSDP):]):
            _assert_parity(run, llama1_reference, f"rank {rank}, pp/dp slice {shape} {mode}")
            assert set(run["placements"].values()) == {("Shard(0)",)}
            if mode != "eager":
                assert run["plans"] and all("reduce_scatter" in p["kinds"] for p in run["plans"])


def test_fsdp_tp_parity_placements_and_global_values():
    ref = tp_reference()
    results = run_ranks(tp_scenarios, 4, TP)
    for rank, per_rank in enumerate(results):
        for (shape, mode), run in zip(TP, per_rank):
            _assert_parity(run, ref, f"rank {rank}, FSDP+TP {shape} {mode}")
            for name, value in ref["init"].items():  # sharded in global coordinates
                assert torch.equal(run["init"][name], value.detach()), (shape, name)
            if mode != "eager":
                assert run["plans"] and all("reduce_scatter" in p["kinds"] for p in run["plans"])
    placements = results[0][0]["placements"]  # (2, 2)
    strided = "_StridedShard(0, sf=2)"
    assert placements["proj.weight"] == (strided, "Shard(0)")
    assert placements["proj.bias"] == (strided, "Shard(0)")
    assert placements["experts"] == (strided, "Shard(0)")
    assert placements["w13"] == ("Shard(0)", "Shard(1)")  # dp splits gate from up
    assert placements["w2.weight"] == ("Shard(0)", "Shard(1)")
    assert placements["norm.weight"] == ("Shard(0)", "Replicate()")
    assert placements["embed.weight"] == ("Shard(0)", "Replicate()")


def test_cost_model_times_the_replicate_level_at_inter_node_numbers():
    spec = ClusterSpec(bus_bandwidth=100e9, latency_s=1e-6, inter_node_bandwidth=10e9,
                       inter_node_latency_s=5e-6)
    nbytes, world = 1_000_000, 4
    assert spec.collective_seconds("all_reduce", nbytes, world) == pytest.approx(
        2 * (3 * 1e-6 + 0.75 * nbytes / 100e9))
    assert spec.collective_seconds("all_reduce", nbytes, world, "inter") == pytest.approx(
        2 * (3 * 5e-6 + 0.75 * nbytes / 10e9))


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


