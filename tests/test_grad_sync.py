"""Gradient accumulation with and without sync (``shardc.set_requires_gradient_sync``)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from dist_utils import run_ranks
from parity import GLOBAL_BATCH, batches, build, max_rel_err

import shardc
from shardc.models.llama import llama_loss

MICRO, STEPS = 3, 2


def _accumulate(model, forward, tokens, targets, rows, no_sync: bool | None) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(STEPS):
        for micro in range(MICRO):
            if no_sync is not None:  # sync only on the last micro-batch when no_sync
                shardc.set_requires_gradient_sync(model, micro == MICRO - 1 or not no_sync)
            batch = step * MICRO + micro
            loss = llama_loss(forward(tokens[batch][rows]), targets[batch][rows]) / MICRO
            loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _worker(rank: int, world: int) -> dict:
    tokens, targets = batches(STEPS * MICRO)
    reference = build("llama")
    expected = _accumulate(reference, reference, tokens, targets, slice(None), None)
    per = GLOBAL_BATCH // world
    rows = slice(rank * per, (rank + 1) * per)
    errors, reduce_scatters, buckets = {}, {}, {}
    # Compiled with sync on every micro-batch: left out (suite time), covered at this world
    # size by tests/test_real_models.py's accumulate_clip (world 3; accumulate at 2) and by
    # every parity run (one region that reduces every bucket).
    for mode, no_sync in (("eager", False), ("eager", True), ("fx", True)):
        torch._dynamo.reset()
        model = build("llama")
        shardc.shard(model)
        forward = model if mode == "eager" else torch.compile(
            model, backend=shardc.backend(inductor=False))
        got = _accumulate(model, forward, tokens, targets, rows, no_sync)
        errors[mode, no_sync] = max(max_rel_err(got[n], expected[n]) for n in expected)
        if mode == "fx":
            plans = shardc.explain_all(forward)
            reduce_scatters[no_sync] = sorted(
                sum(c.kind == "reduce_scatter" for c in plan.collectives) for plan in plans)
            buckets[no_sync] = [len({c.bucket for c in plan.collectives
                                     if c.kind == "all_gather"}) for plan in plans]
        assert not model._shardc_state.grad_sync.grads, "stored gradients were not consumed"
    return {"errors": errors, "reduce_scatters": reduce_scatters, "buckets": buckets}


# Slow since s35 (suite time: 64 rank-CPU s, a world-3 group of three llama trainings, one
# compiled). Where its features stay covered in the default tier: tests/test_real_models.py at
# world 2 (uneven shards), against the unsharded reference: accumulation without sync compiled
# (accumulate_no_sync, with this test's region check: no reduce-scatter without sync, one per
# bucket with it) and eager (accumulate_no_sync_eager), with sync (accumulate, accumulate_clip),
# with CPU offload, optimizer-only offload and plain inputs (offload_no_sync_clip and its eager
# variant, optim_offload_no_sync_clip, plain_no_sync_clip).
@pytest.mark.slow
def test_accumulation_with_and_without_sync_matches_reference():
    # World 3 (uneven) only: tests/test_real_models.py runs accumulation with and without sync
    # at 2 (no_sync with CPU offload at 2 and 3).
    for world in (3,):
        out = run_ranks(_worker, world)[0]
        for key, err in out["errors"].items():
            assert err <= 1e-5, f"world {world}, {key}: rel err {err:.2e}"
        # No-sync: a region with no reduce-scatter (micro-batches) and one that reduces what
        # was accumulated, one reduce-scatter per bucket (both regions gather every bucket).
        unsynced, buckets = out["reduce_scatters"][True], out["buckets"][True]
        assert len(buckets) == 2 and buckets[0] == buckets[1] > 0, buckets
        assert unsynced == [0, buckets[0]], (unsynced, buckets)


def test_set_requires_gradient_sync_rejects_unsharded_modules():
    with pytest.raises(ValueError, match="not sharded"):
        shardc.set_requires_gradient_sync(torch.nn.Linear(2, 2), False)


def test_a_dead_store_keeps_its_mode_until_the_next_store_is_made():
    """Dynamo iterates SYNC_MODES where it traces a read, and a store dies at any garbage
    collection: its key goes when the next store is made, never in between (the dict would
    change size under Dynamo's iteration)."""
    import gc

    from shardc.runtime.grad_sync import SYNC_MODES, UnsyncedGrads

    store = UnsyncedGrads()
    key, size = store.key, len(SYNC_MODES)
    del store
    gc.collect()
    assert key in SYNC_MODES and len(SYNC_MODES) == size
    other = UnsyncedGrads()
    assert key not in SYNC_MODES and SYNC_MODES[other.key] == 0
