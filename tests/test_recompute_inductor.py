"""The peak budget's recompute lever under Inductor: blocks the planner chose to recompute run
their forward again inside Inductor's backward code, and training matches the unsharded model.

The other recompute tests run the FX backend (tests/test_budget.py, test_host_memory.py,
test_mesh.py, test_fp8.py); this one runs the code Inductor generates, at world 2 (the parity
Llama's embedding of 37 rows is uneven there).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from dist_utils import run_ranks
from parity import assert_parity, backward_ops, reference, sharded_run

import shardc


def _backward_body_calls(run: dict) -> int:
    """The block-body calls (``invoke_subgraph``) in the backward graph Inductor compiled for
    ``run``'s model (one region); the model and its compiled forward are then dropped from
    ``run``, which goes back to the test process."""
    state = shardc.shard_state(run.pop("model"))
    assert len(state.regions) == 1, state.regions
    del run["forward"]
    return backward_ops(state)["body_calls"]


def _train_recomputed(rank: int, world: int) -> dict:
    """Train the parity Llama under Inductor with a peak budget a byte below the fixed
    policy's predicted peak (the ranks' largest), recompute as the only lever: the run's
    losses, parameters and plans, and the fixed policy's run beside it."""
    import torch.distributed as dist

    options = dict(comm_pool=False, prefetch=False, keep_model=True)
    fixed = sharded_run(rank, world, "llama", "inductor", **options)
    fixed_calls = _backward_body_calls(fixed)
    peak = torch.tensor([int(fixed["plans"][0].predicted.peak_bytes)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    torch._dynamo.reset()
    run = sharded_run(rank, world, "llama", "inductor", peak_memory_budget_bytes=int(peak) - 1,
                      peak_memory_margin=0.0, activation_offload="never",
                      optimizer_offload="never", **options)
    run["backward_body_calls"] = (fixed_calls, _backward_body_calls(run))
    run["fixed"] = {"losses": fixed["losses"], "params": fixed["params"], "peak": int(peak)}
    return run


@pytest.fixture(scope="module")
def inductor_reference():
    torch._dynamo.reset()
    return reference("llama", compile_backend="inductor")


# Slow (suite time, s29): a two-rank Inductor group and an Inductor reference; planner recompute
# trains in real_models' peak_budget scenarios (FX)
@pytest.mark.slow
def test_blocks_recomputed_by_the_planner_train_like_the_reference_under_inductor(
        inductor_reference):
    runs = run_ranks(_train_recomputed, 2)
    hashes = set()
    for run in runs:
        (plan,) = [p for p in run["plans"] if p is not None]
        record = plan.budget
        assert record.recomputed, record.blocks  # the planner recomputed at least one block
        assert not record.offloaded and not record.checkpoint_offloaded
        assert plan.predicted.peak_bytes < run["fixed"]["peak"], (
            plan.predicted.peak_bytes, run["fixed"]["peak"])
        # Each recomputed block's forward body is called again in the backward's code.
        fixed_calls, calls = run["backward_body_calls"]
        assert calls == fixed_calls + len(record.recomputed), (calls, fixed_calls,
                                                               record.recomputed)
        hashes.add(plan.hash())
    assert len(hashes) == 1  # the same decisions on both ranks
    # Recomputing changes which values are saved, not what is computed: the same losses and
    # parameters as the unbudgeted run and as the unsharded model under Inductor.
    assert_parity(runs[0], runs[0]["fixed"])
    assert_parity(runs[0], inductor_reference)
