"""Warm restarts: a second process reuses Inductor's compiled graphs and still runs shardc.

AOTAutograd's cache hands back a compiled forward and backward without running the partition
function, so on a hit shardc would plan nothing: no plan to explain or dump, no cross-rank check
(issue 9). ``shardc.backend`` turns that cache off for its regions. Inductor's FX graph cache
stays on and must hit in a new process (issue 18): the partitioner is keyed by its ``uuid()``
(options, rank, world, source) and the meshes' per-process ``hash()`` memo is kept out of the key.

Two fresh process groups (world 2, gloo) compile the same models with one cache directory and
AOTAutograd's cache switched on: an unsharded control model, which the backend compiles like the
default backend, hits AOTAutograd's cache in the second one (the cache is warm and used); the
sharded model misses AOTAutograd's cache, is planned again (same plan hash, the cross-rank plan
check runs), hits Inductor's cache for every graph, and trains like the unsharded reference. The
second group then compiles the model with another ``prefetch_depth``, which must miss.
"""

from __future__ import annotations

import logging

import torch
import torch._dynamo
import torch.nn.functional as F
from dist_utils import run_ranks
from parity import assert_parity, reference, sharded_run
from torch import nn

import shardc
from shardc._torch import process_group_store
from shardc.runtime.collectives import resolve_group


def _cache_counts() -> dict:
    counters = torch._dynamo.utils.counters
    return {"fx_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
            "aot_hit": counters["aot_autograd"]["autograd_cache_hit"]}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _restart(rank: int, world: int, change_option: bool) -> dict:
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    out: dict = {}
    logger, lines = logging.getLogger("shardc"), _Lines()
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    with torch._functorch.config.patch(enable_autograd_cache=True):
        counters.clear()
        torch.manual_seed(0)
        control = torch.compile(nn.Linear(6, 3), backend=shardc.backend(inductor=True))
        F.mse_loss(control(torch.randn(4, 6)), torch.randn(4, 3)).backward()
        out["control_aot_hits"] = counters["aot_autograd"]["autograd_cache_hit"]
        counters.clear()
        run = sharded_run(rank, world, "repeated", "inductor", keep_model=True)
        out["sharded"] = _cache_counts()
    logger.removeHandler(lines)
    (region,) = shardc.shard_state(run["model"]).regions
    plan = region.plan
    store = process_group_store(resolve_group(plan.group_name))
    out["check_published"] = store.check(
        [f"shardc/plan/{region.check_index}/{r}" for r in range(world)])
    out.update(plan_hash=plan.hash(), losses=run["losses"], params=run["params"],
               progress=lines.lines)
    if change_option:
        counters.clear()
        sharded_run(rank, world, "repeated", "inductor", prefetch_depth=2)
        out["changed"] = _cache_counts()
    return out


def test_warm_restart_hits_inductor_cache_and_still_plans(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # cold, then warm
    cold = run_ranks(_restart, 2, False)
    warm = run_ranks(_restart, 2, True)
    ref = reference("repeated")
    for rank, (c, w) in enumerate(zip(cold, warm)):
        graphs = c["sharded"]["fx_miss"]
        assert graphs >= 2 and c["sharded"]["fx_hit"] == 0, c["sharded"]  # forward, backward
        assert w["control_aot_hits"] > 0, f"the second process did not use the cache: {w}"
        # A warm AOTAutograd cache must not skip shardc's partitioner (issue 9): no AOT hit, and
        # the plan is made again, the same, and checked across ranks.
        assert w["sharded"]["aot_hit"] == 0, w["sharded"]
        assert w["plan_hash"] == c["plan_hash"]
        assert w["check_published"] and c["check_published"]
        # Inductor's graphs come from the cache, every one of them (issue 18).
        assert w["sharded"]["fx_hit"] == graphs and w["sharded"]["fx_miss"] == 0, (
            f"rank {rank}: the second process missed Inductor's FX graph cache: {w['sharded']}")
        assert_parity(c, ref)
        assert_parity(w, ref)
        # A plan-affecting option is part of the key.
        assert w["changed"]["fx_hit"] == 0 and w["changed"]["fx_miss"] >= 2, w["changed"]
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
