"""Training parity against the unsharded single-process reference, world sizes 1-4 over gloo."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from dist_utils import run_ranks
from parity import assert_parity, reference, sharded_run

import shardc

# CPU offload on a CPU mesh: the testing mode in which every copy is a real separate tensor.
OFFLOAD = shardc.OffloadPolicy(simulate_on_cpu=True)
BF16 = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

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
        out["copies"] = sum(len(p.copies) for p in out["plans"] if p is not None)
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
    # CPU offload (issue 21): host shards, host gradients, AdamW on the host; eager and planned.
    offloaded = len(scenarios)
    scenarios += [("llama", "eager", {"offload": OFFLOAD}), ("llama", "fx", {"offload": OFFLOAD})]
    if world in (3, 4):  # tied weights, a frozen layer, an unused and (world 4) an empty shard
        scenarios.append(("variant", "fx", {"offload": OFFLOAD}))
    if world == 2:  # kept gathered for the backward (no second copy); mixed precision: the
        # same bits with and without offload
        scenarios += [("llama", "fx", {"offload": OFFLOAD, "reshard_after_forward": False}),
                      ("llama", "fx", {"mp_policy": BF16}),
                      ("llama", "fx", {"mp_policy": BF16, "offload": OFFLOAD})]
    results = run_ranks(_scenarios, world, scenarios)[0]
    for (kind, mode, options), run in zip(scenarios, results):
        ref = references[f"{kind}-sgd" if options.get("optim") == "sgd" else kind]
        try:
            assert_parity(run, ref, tol=2e-2 if "mp_policy" in options else 1e-5)
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
    _check_offloaded(world, results, offloaded, scenarios)


def _bitwise(a: dict, b: dict, what: str) -> None:
    assert torch.equal(a["losses"], b["losses"]), what
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), f"{what}: {name}"


def _check_offloaded(world: int, results: list, first: int, scenarios: list) -> None:
    """Offload moves bytes, never changes them: the offloaded runs equal the runs without
    offload bit for bit (eager vs eager is not run: the compiled run stands for both), and the
    compiled ones planned their copies."""
    eager, fx = results[first], results[first + 1]
    _bitwise(fx, results[1], f"world {world}: offloaded FX vs FX")
    assert fx["copies"] > 0, f"world {world}: the offloaded region planned no copy"
    assert eager["copies"] == 0 and eager["plans"] == 0
    if world == 2:
        _bitwise(results[-1], results[-2], "world 2: bf16 offloaded FX vs bf16 FX")
        assert results[-1]["copies"] > 0
