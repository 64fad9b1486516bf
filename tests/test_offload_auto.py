"""``OffloadPolicy(params="auto")``: the peak budget's last lever moves the parameter shards to
the host (issue 22, :mod:`shardc.sharding.auto_offload`).

One spawned world-2 gloo group (uneven shards: a llama whose 37- and 449-row weights outweigh
its activations), CPU offload
simulated on the CPU mesh (every copy a real separate tensor), FX, no margin, no prefetch:

- a budget of 1 byte is refused with the shards on the device, then, with them on the host,
  refused again, naming the (smaller) minimum with everything on the host: both minima;
- a budget at the host minimum trains with the shards moved to the host (the plan's copies, the
  recorded note, every parameter registered as offloaded, the same plan on both ranks), like
  the unsharded reference; then an eval forward (a second region, planned with the shards on
  the host) and an eager forward (uncompiled reads copy the host shards too);
- a budget at the device minimum leaves them on the device: no copies in the plan, nothing
  offloaded, the same losses and parameters as the reference; and (slow) under a roomy budget
  the plan the model sharded without offload makes (the same hash).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from dist_utils import run_ranks
from parity import (
    GLOBAL_BATCH,
    assert_parity,
    batches,
    build,
    llama_loss,
    reference,
    sharded_run,
)

import shardc
from shardc.runtime import offload_check

MODEL = "llama-wide-ffn"  # its parameters outweigh its activations (tests/parity.py)
AUTO = shardc.OffloadPolicy(params="auto", simulate_on_cpu=True, check_host_memory=False)
# The default-tier group's compiles without prefetch (suite time, s37): the budget search then
# tries one prefetch depth, not two, per configuration (the depth lever is tested by
# tests/test_real_models.py::test_peak_budget_keeps_some_buckets_gathered_with_parity and
# test_peak_budget_recomputes_some_blocks_with_parity); the shards' move does not depend on it.
# Nor on sinking: under the default "auto" every budgeted compile here recomputes the blocks and
# is compiled again unsunk (tests/test_sink_residual.py), so False compiles once to the same
# graph (the group 101 -> 80 s on the 2-core machine, s61).
NO_PREFETCH = {"prefetch": False, "sink_block_residual": False}


def _budget_refusal(error: BaseException):
    """The budget refusal (it carries ``minimum_bytes``) inside Dynamo's wrapping of ``error``."""
    cause = error
    while cause is not None and getattr(cause, "minimum_bytes", None) is None:
        cause = cause.__cause__ or getattr(cause, "inner_exception", None)
    assert cause is not None, f"not a budget refusal: {error!r}"
    return cause


def _refusal_minima(rank: int, world: int) -> tuple[int, int]:
    """(the feasible minimum with the shards on the device, the one with them on the host),
    from a budget of one byte."""
    model = build(MODEL)
    shardc.shard(model, offload=AUTO)
    forward = torch.compile(model, backend=shardc.backend(peak_memory_budget_bytes=1,
                                                          peak_memory_margin=0, **NO_PREFETCH))
    tokens, targets = batches(1)
    with pytest.raises(Exception) as refused:  # noqa: PT011 - Dynamo wraps the backend's error
        llama_loss(forward(tokens[0]), targets[0]).backward()
    state = shardc.shard_state(model)
    cause = _budget_refusal(refused.value)
    assert state.auto_offload.placed and "OffloadPolicy" not in str(cause), str(cause)
    return state.auto_offload.device_minimum_bytes, int(cause.minimum_bytes)


def _summary(run: dict, world: int) -> dict:
    model = run.pop("model")
    forward = run.pop("forward")
    state = shardc.shard_state(model)
    plans = [p for p in run["plans"] if p is not None]
    tokens, _ = batches(1)
    # Eval mode and the eval forward's batch: the compiled call is the eval region
    # (sharded_run's eval=True), planned with the shards on the host, not a new compile.
    tokens = tokens[0, :GLOBAL_BATCH // world]
    model.eval()
    with torch.no_grad():
        eager = model(tokens) if state.auto_offload.placed else None
        compiled = forward(tokens) if eager is not None else None
    model.train()
    return {
        "losses": run["losses"], "params": run["params"], "eval": run["eval"],
        "placed": state.auto_offload.placed,
        "device_min_seen": state.auto_offload.device_minimum_bytes,
        "offload_set": state.offload is not None,
        "registered": sum(offload_check.offloaded_name(p) is not None
                          for p in model.parameters()),
        "h2d": [sum(c.kind == "h2d_copy" for c in p.copies) for p in plans],
        "d2h": [sum(c.kind == "d2h_copy" for c in p.copies) for p in plans],
        "notes": [n for p in plans for n in p.notes if "OffloadPolicy(params='auto')" in n],
        "hashes": [p.hash() for p in plans],
        "peaks": [p.predicted.peak_bytes for p in plans],
        "eager_vs_compiled": None if eager is None else (eager - compiled).abs().max().item(),
    }


def _group(rank: int, world: int) -> dict:
    torch._dynamo.reset()
    device_min, host_min = _refusal_minima(rank, world)
    out = {"device_min": device_min, "host_min": host_min}
    # The host minimum: below what the levers on the device reach (its plan has no shards,
    # gradients or optimizer state on the device), met with the shards on the host.
    budgets = {"at_host_min": host_min, "at_device_min": device_min}
    for name, budget in budgets.items():
        torch._dynamo.reset()
        run = sharded_run(rank, world, MODEL, "fx", offload=AUTO, keep_model=True,
                          peak_memory_budget_bytes=budget, peak_memory_margin=0,
                          eval=name == "at_host_min", **NO_PREFETCH)
        out[name] = {"budget": budget, **_summary(run, world)}
    torch._dynamo.reset()
    return out


def _unplaced_and_plain(rank: int, world: int) -> dict:
    """The plans of the model sharded with ``params="auto"`` and without offload, under one
    roomy budget (the shards stay on the device)."""
    hashes = {}
    for name, offload in (("auto", AUTO), ("plain", None)):
        torch._dynamo.reset()
        # Per-parameter reads for both: CPU offload, "auto" too, keeps them (no packed blocks).
        run = sharded_run(rank, world, MODEL, "fx", offload=offload, pack_blocks=False,
                          peak_memory_budget_bytes=1 << 40, peak_memory_margin=0)
        hashes[name] = [p.hash() for p in run["plans"] if p is not None]
    torch._dynamo.reset()
    return hashes


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(_group, 2)


def test_budget_below_every_other_lever_moves_the_shards_to_the_host(runs):
    first = runs[0]
    assert first["host_min"] < first["device_min"], first
    got = first["at_host_min"]
    assert got["placed"] and got["offload_set"], got
    assert got["registered"] == len(got["params"])
    # Planned as a model sharded with OffloadPolicy(): its copies on the plan's copy lane.
    assert all(n > 0 for n in got["h2d"]) and got["d2h"][0] > 0, got
    assert got["device_min_seen"] > got["budget"], got
    assert len(got["notes"]) == 1 and str(got["device_min_seen"]) in got["notes"][0], got["notes"]
    assert got["peaks"][0] <= got["budget"], (got["peaks"], got["budget"])
    assert_parity(got, reference(MODEL))
    # The eval region after the move: planned with the shards on the host, equal to the eager
    # reference's evaluation as the other scenarios check it; eager reads copy them too.
    assert got["eval"] is not None and torch.isfinite(got["eval"]).all()
    assert got["eager_vs_compiled"] < 1e-5, got["eager_vs_compiled"]
    # Decided alike on every rank.
    assert runs[1]["at_host_min"]["hashes"] == got["hashes"]
    assert runs[1]["at_host_min"]["placed"]


def test_budget_met_on_the_device_leaves_the_shards_there(runs):
    got = runs[0]["at_device_min"]
    assert not got["placed"] and not got["offload_set"] and got["registered"] == 0, got
    assert got["h2d"] == [0] and got["d2h"] == [0], got
    assert got["notes"] == [] and got["peaks"][0] <= got["budget"], got
    assert_parity(got, reference(MODEL))
    assert runs[1]["at_device_min"]["hashes"] == got["hashes"]


def test_auto_policy_is_checked():
    with pytest.raises(ValueError, match="params='sometimes'"):
        shardc.sharding.offload.check_policy(shardc.OffloadPolicy(params="sometimes"), "cuda")
    with pytest.raises(NotImplementedError, match="parameters only"):
        shardc.sharding.offload.check_policy(
            shardc.OffloadPolicy(params="auto", optimizer=False), "cuda")
    assert shardc.OffloadPolicy(params="auto").planner_decides
    assert not shardc.OffloadPolicy().planner_decides


# Slow (suite time: its own world-2 group, two compiles): the default test above checks the
# unplaced model's plan by its outcome (no copies, nothing offloaded, parity).
@pytest.mark.slow
def test_unplaced_model_makes_the_plan_made_without_offload():
    """Its offload copies dropped before planning, a model sharded with ``params="auto"`` whose
    shards stay on the device is planned exactly as without offload: the same plan hash."""
    for hashes in run_ranks(_unplaced_and_plain, 2):
        assert hashes["auto"] and hashes["auto"] == hashes["plain"], hashes


def _hsdp(rank: int, world: int) -> dict:
    """On a 2x2 HSDP mesh: the minima from a one-byte budget, then training at the host
    minimum (the shards moved by the planner)."""
    from mesh_workers import _gathered, _mean_over_world
    from parity import GLOBAL_BATCH
    from parity import train as llama_train
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    tokens, targets = batches()
    rows = slice(rank * (GLOBAL_BATCH // world), (rank + 1) * (GLOBAL_BATCH // world))
    torch._dynamo.reset()
    model = shardc.shard(build(MODEL), mesh, offload=AUTO)
    forward = torch.compile(model, backend=shardc.backend(peak_memory_budget_bytes=1,
                                                          peak_memory_margin=0))
    with pytest.raises(Exception) as refused:  # noqa: PT011 - Dynamo wraps the backend's error
        llama_loss(forward(tokens[0][rows]), targets[0][rows]).backward()
    host_min = int(_budget_refusal(refused.value).minimum_bytes)
    torch._dynamo.reset()
    model = shardc.shard(build(MODEL), mesh, offload=AUTO)
    forward = torch.compile(model, backend=shardc.backend(peak_memory_budget_bytes=host_min,
                                                          peak_memory_margin=0))
    losses = llama_train(model, forward, tokens[:, rows], targets[:, rows])
    state = shardc.shard_state(model)
    return {"placed": state.auto_offload.placed, "losses": _mean_over_world(losses),
            "params": _gathered(model), "hashes": [r.plan.hash() for r in state.regions]}


# Slow (suite time: a 4-rank group, three compiles; checked by hand first, s33): HSDP's
# replicate all-reduce with the shards moved; the default test above is 1-D.
@pytest.mark.slow
def test_hsdp_moves_the_shards_on_every_rank_with_parity():
    out = run_ranks(_hsdp, 4)
    assert all(r["placed"] for r in out), [r["placed"] for r in out]
    assert len({tuple(r["hashes"]) for r in out}) == 1
    assert_parity(out[0], reference(MODEL))
