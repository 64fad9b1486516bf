"""Training parity against the unsharded single-process reference, world sizes 1-4 over gloo."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from dist_utils import run_ranks
from parity import assert_parity, reference, sharded_run

WORLD_SIZES = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def references():
    refs = {kind: reference(kind) for kind in ("llama", "variant", "repeated")}
    refs["variant-sgd"] = reference("variant", optim="sgd")
    return refs


def _scenarios(rank: int, world: int, scenarios: list) -> list[dict]:
    results = []
    for kind, mode, options in scenarios:
        torch._dynamo.reset()
        out = sharded_run(rank, world, kind, mode, **options)
        if mode != "eager":
            assert out["plans"] and all(p is not None for p in out["plans"]), (
                f"{kind}/{mode}/{options}: the shardc backend planned no region"
            )
        out["plan_collectives"] = [c for p in out["plans"] for c in p.collectives]
        out["comm_bytes"] = {(p.predicted.pool_bytes, p.predicted.peak_comm_buffer_bytes)
                             for p in out["plans"]}
        out["plans"] = len(out["plans"])
        results.append(out)
    return results


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_parity_eager_and_fx(world, references):
    scenarios = [
        ("llama", "eager", {}),
        ("llama", "fx", {}),
        ("llama", "fx", {"prefetch": False}),
        ("variant", "fx", {}),
        ("repeated", "fx", {}),  # one module instance applied twice per forward
        # The optimizer steps the local shards (shardc.optim.local_shard_step).
        ("llama", "fx", {"local_step": True}),
        ("variant", "fx", {"local_step": True, "optim": "sgd"}),
    ]
    if world == 3:
        scenarios.append(("llama", "fx", {"reshard_after_forward": False, "bucket_by": "param"}))
    if world in (2, 4):
        # Poisoned pool buffers: any planning error that overlapped live buffers gives NaNs.
        scenarios.append(("llama", "fx", {"debug_pool": True, "prefetch_depth": 2}))
    if world == 2:
        scenarios.append(("llama", "fx", {"local_step": True, "optim": "adamw-fused"}))
    results = run_ranks(_scenarios, world, scenarios)[0]
    for (kind, mode, options), run in zip(scenarios, results):
        if mode != "eager":
            # One rank communicates nothing: no collective is lowered (the plan lists them,
            # elided); from two ranks on, every planned one is.
            elided = {p.elided for p in run["plan_collectives"]}
            if world == 1:
                assert run["collective_ops"] == 0, (kind, options, run["collective_ops"])
                assert elided == {True}, (kind, options)
                # ... and plans no communication buffer: no pool, none in the timeline.
                assert run["comm_bytes"] == {(0, 0)}, (kind, options, run["comm_bytes"])
            else:
                assert run["collective_ops"] > 0 and elided == {False}, (kind, options)
        ref = references[f"{kind}-sgd" if options.get("optim") == "sgd" else kind]
        try:
            assert_parity(run, ref)
        except AssertionError as exc:
            raise AssertionError(f"world {world}, {kind}/{mode}/{options}: {exc}") from exc
    # Prefetch changes when collectives run, never what they compute: bitwise equal.
    on, off = results[1], results[2]
    assert torch.equal(on["losses"], off["losses"])
    for name in on["params"]:
        assert torch.equal(on["params"][name], off["params"][name]), name
    variant = results[3]
    assert variant["grads_none"]["unused"], "an unused parameter must get no gradient"
    frozen = references["variant"]["params"]["lm.layers.0.attention.wq.weight"]
    assert torch.equal(variant["params"]["lm.layers.0.attention.wq.weight"], frozen)
    # The local-shard step runs the same kernels on the same shards as the DTensor step.
    local = results[5]
    assert torch.equal(on["losses"], local["losses"])
    for name in on["params"]:
        assert torch.equal(on["params"][name], local["params"][name]), name
    assert results[6]["grads_none"]["unused"]
