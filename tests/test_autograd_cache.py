"""A warm compile cache must not skip shardc's partitioner (issue 9).

AOTAutograd's cache hands back a compiled forward and backward without running the partition
function, so on a hit shardc would plan nothing: no plan to explain or dump, no cross-rank check.
``shardc.backend`` turns that cache off for its regions (Inductor's own graph cache still
applies). Two fresh processes compile the same models with one cache directory and the cache
switched on: an unsharded control model, which the backend compiles like the default backend,
hits AOTAutograd's cache in the second process (the cache is warm and used), and the sharded model
is planned again there.
"""

from __future__ import annotations

import torch
import torch._dynamo
import torch.nn.functional as F
from dist_utils import run_ranks
from torch import nn

import shardc


def _step(model: nn.Module) -> None:
    compiled = torch.compile(model, backend=shardc.backend(inductor=True))
    F.mse_loss(compiled(torch.randn(4, 6)), torch.randn(4, 3)).backward()
    return compiled


def _compile_both(rank: int, world: int) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    counters = torch._dynamo.utils.counters
    with torch._functorch.config.patch(enable_autograd_cache=True):
        counters.clear()
        _step(nn.Sequential(nn.Linear(6, 3)))  # not sharded: the default path, cached
        control_hits = counters["aot_autograd"]["autograd_cache_hit"]
        sharded = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        shardc.shard(sharded)
        counters.clear()
        compiled = _step(sharded)
        hits = counters["aot_autograd"]["autograd_cache_hit"]
    return {"control_cache_hits": control_hits, "cache_hits": hits,
            "plans": len(shardc.explain_all(compiled))}


def test_warm_autograd_cache_does_not_skip_planning(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # cold, then warm
    cold = run_ranks(_compile_both, 1)[0]
    warm = run_ranks(_compile_both, 1)[0]
    assert cold["plans"] == 1, cold
    assert warm["control_cache_hits"] > 0, f"the second process did not use the cache: {warm}"
    assert warm["cache_hits"] == 0 and warm["plans"] == 1, (
        f"a warm AOTAutograd cache skipped shardc's planning: {warm}")


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
