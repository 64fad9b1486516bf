"""A plan's host memory must fit the host (``shardc.compile.host_memory``): offloaded saved
activations and the peak budget's share of the optimizer in pinned host memory are checked
against the host's available memory for every local rank when the plan is made, and refused
with what it needs, what the host has and what to change, instead of failing mid-step. Under a
peak budget the host is a constraint of the search: the planner recomputes what the host cannot
take, against a capacity every rank agreed on, and refuses only where no plan fits both."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
from dist_utils import run_ranks
from parity import batches, build, llama_loss

import shardc
from shardc.compile import host_memory
from shardc.planning.budget import MemoryBudgetError
from shardc.planning.plan import Plan
from shardc.sharding import offload

GIB = 1 << 30


def _plan(host_bytes: float) -> SimpleNamespace:
    return SimpleNamespace(predicted=SimpleNamespace(host_bytes=host_bytes), group_name="")


def test_refused_when_the_local_ranks_need_more_than_the_host_has(monkeypatch):
    monkeypatch.setattr(offload, "host_available_bytes", lambda: 100 * GIB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    # 8 ranks x 13 GiB (10 of activations, 2 of the budget's optimizer share, 1 of CPU
    # offload's state) > 100 GiB.
    with pytest.raises(MemoryBudgetError) as err:
        host_memory.refuse_overcommit(_plan(13 * GIB), 10 * GIB, 2 * GIB)
    text = str(err.value)
    for part in ("13.00 GiB per rank", "saved activations 10.00 GiB",
                 "optimizer masters, gradients and state 2.00 GiB",
                 "CPU offload's shards, gradients and state 1.00 GiB",
                 "8 local rank(s) need 104.00 GiB", "a host has 100.00 GiB available",
                 "activation_offload='never'", "check_host_memory=False"):
        assert part in text, (part, text)
    # It fits with fewer ranks per host; the check can be turned off; nothing of shardc's own
    # on the host (CPU offload alone, checked at shard time) is not checked here.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    host_memory.refuse_overcommit(_plan(13 * GIB), 10 * GIB, 2 * GIB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    host_memory.refuse_overcommit(_plan(13 * GIB), 10 * GIB, 2 * GIB, check=False)
    host_memory.refuse_overcommit(_plan(200 * GIB), 0, 0)
    # A host that does not say what it has: nothing to check against.
    monkeypatch.setattr(offload, "host_available_bytes", lambda: None)
    host_memory.refuse_overcommit(_plan(13 * GIB), 10 * GIB, 2 * GIB)


def _train_with_offloaded_activations(rank: int, world: int, check: bool,
                                      short: tuple[int, ...] = (0,)) -> str:
    """One step of a Llama whose blocks' saved activations go to the host, where the ranks in
    ``short`` say their host has 1 KiB available (the others: plenty): the error's text, or
    "trained"."""
    available = 1024 if rank in short else 1 << 40
    offload.host_available_bytes = lambda: available  # this spawned process only
    torch._dynamo.reset()
    model = build("llama")
    shardc.shard(model)
    forward = torch.compile(model, backend=shardc.backend(
        inductor=False, activation_offload=("*",), check_host_memory=check))
    tokens, targets = batches()
    try:
        llama_loss(forward(tokens[0]), targets[0]).backward()
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        return f"{type(exc).__name__}: {exc}"
    return "trained"


# Slow (28 s): the refusal and its message are test_every_rank_refuses_when_one_host_is_short's
# too (two ranks); training with offloaded activations is test_budget_combos' and
# test_real_models'.
@pytest.mark.slow
def test_a_plan_offloading_more_than_the_host_has_is_refused_at_compile_time():
    (refused,) = run_ranks(_train_with_offloaded_activations, 1, True)
    assert "MemoryBudgetError" in refused and "saved activations" in refused, refused
    assert "1 local rank(s)" in refused and "has 0.00 GiB available" in refused, refused
    (trained,) = run_ranks(_train_with_offloaded_activations, 1, False)
    assert trained == "trained"


def test_every_rank_refuses_when_one_host_is_short():
    """Two ranks, only rank 1's host short: both refuse at compile time (the ranks agree on the
    outcome), instead of rank 0 waiting at its first collective for a rank that stopped."""
    refused = run_ranks(_train_with_offloaded_activations, 2, True, (1,))
    for text in refused:
        assert "MemoryBudgetError" in text and "a host has 0.00 GiB available" in text, refused


# The host as a constraint of the peak-budget search (shardc.compile.budget_search): where the
# host cannot take a block's offloaded activations the planner recomputes the block instead, and
# the plan says why; the capacity the search uses is agreed across the ranks before it.

def test_the_capacity_is_per_local_rank_and_exchanged_only_where_a_host_lever_may_be_chosen(
        monkeypatch):
    """``agree_capacity`` (one rank: its own reading): the host's available memory over its
    local ranks, None where the host does not say; ``host_levers_possible``: only under a
    budget, with the check on and a host lever allowed (the options alone decide)."""
    from shardc.compile.options import ShardcOptions

    monkeypatch.setattr(offload, "host_available_bytes", lambda: 100 * GIB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    capacity = host_memory.agree_capacity("", None)
    assert capacity == host_memory.HostCapacity(100 * GIB // 8, 100 * GIB, 8)
    assert capacity.fits(12 * GIB) and not capacity.fits(13 * GIB)
    assert capacity.full(13 * GIB) == ("host full: would need 104.00 GiB (8 local rank(s) x "
                                       "13.00 GiB), host has 100.00 GiB")
    monkeypatch.setattr(offload, "host_available_bytes", lambda: None)
    assert host_memory.agree_capacity("", None) is None
    budget = {"peak_memory_budget_bytes": 1 << 30}
    assert host_memory.host_levers_possible(ShardcOptions(**budget))
    assert not host_memory.host_levers_possible(ShardcOptions())
    assert not host_memory.host_levers_possible(ShardcOptions(**budget, check_host_memory=False))
    assert not host_memory.host_levers_possible(ShardcOptions(
        **budget, activation_offload="never", optimizer_offload="never"))


# A Llama whose saved activations make the step's peak, so that a budget below the fixed
# policy's peak needs a block freed (prefer: offload, where the host can take it).
_PLAN_CFG = dict(vocab_size=37, dim=48, n_layers=4, n_heads=4, ffn_dim=90, max_seq_len=16)


def _planned(budget_bytes: int | None, **options):
    """Rank 0's plan of one step of the Llama above at a fake world of 2 (FX, no margin, no
    prefetch), under ``budget_bytes`` (None: the fixed policy's plan)."""
    from shardc.models.llama import LlamaConfig
    from shardc.tools.planner import PlanSetup, plan_model

    opts = {"fused_loss": False, "prefetch": False, **options}
    if budget_bytes is not None:
        opts.update(peak_memory_budget_bytes=budget_bytes, peak_memory_margin=0.0,
                    optimizer_offload="never", activation_offload="prefer")
    torch._dynamo.reset()  # another test's shapes would make these dynamic
    return plan_model(LlamaConfig(**_PLAN_CFG), 2, 12, 12, opts, template=False,
                      setup=PlanSetup(inductor=False))[0]


def _roomy(monkeypatch) -> tuple[int, object]:
    """The budget a byte below the fixed policy's peak and the plan under it on a roomy host."""
    monkeypatch.setattr(offload, "host_available_bytes", lambda: 1 << 40)
    budget_bytes = int(_planned(None).predicted.peak_bytes) - 1
    roomy = _planned(budget_bytes)
    assert roomy.budget.offloaded and not roomy.budget.recomputed, roomy.budget
    assert not any("host full" in d.reason for d in roomy.budget.blocks)
    return budget_bytes, roomy


# Slow (34 s; suite time): test_a_full_host_makes_the_planner_recompute_and_training_matches_
# the_reference[3] covers the full host's recompute, and
# test_checkpoints_the_host_cannot_take_are_not_offloaded a host that takes part of it (all
# slow since s29, for the suite's time; the default suite keeps the refusals below).
@pytest.mark.slow
def test_the_planner_recomputes_where_the_host_cannot_take_the_offload(monkeypatch):
    """A budget a byte below the fixed policy's peak: with a roomy host the planner offloads
    blocks (activation_offload='prefer'); with a host of 1 KiB it recomputes instead, nothing on
    the host, each such block's reason saying "host full"."""
    budget_bytes, roomy = _roomy(monkeypatch)
    monkeypatch.setattr(offload, "host_available_bytes", lambda: 1024)
    full = _planned(budget_bytes)
    record = full.budget
    assert record.recomputed and not record.offloaded and not record.checkpoint_offloaded
    assert not full.predicted.host_bytes and full.predicted.peak_bytes <= budget_bytes
    assert full.hash() != roomy.hash()
    reasons = [d.reason for d in record.blocks if d.recomputed]
    assert all("not offloaded" in r and "host full: would need" in r
               and "host has 0.00 MiB" in r for r in reasons), reasons
    assert record.host.startswith("host memory: 0.00 MiB per rank") and record.host in full.notes
    assert Plan.from_json(full.to_json()).budget == record  # the record round-trips


@pytest.mark.slow
def test_a_roomy_host_changes_nothing_and_a_small_one_takes_what_fits(monkeypatch):
    """The plan on a roomy host is the one made with the host check off; with room for about
    one block's offload the planner offloads what fits and recomputes the rest. Slow: two more
    budget searches beside the test above's (the suite's time)."""
    budget_bytes, roomy = _roomy(monkeypatch)
    unchecked = _planned(budget_bytes, check_host_memory=False)
    assert unchecked.hash() == roomy.hash() and unchecked.budget.host == roomy.budget.host == ""
    one_block = roomy.predicted.host_bytes / len(roomy.budget.offloaded)
    # Room for one block's offloaded activations (and a little more), not two.
    monkeypatch.setattr(offload, "host_available_bytes", lambda: int(one_block * 1.3))
    some = _planned(budget_bytes)
    assert len(some.budget.offloaded) == 1 and some.budget.recomputed, some.budget
    assert 0 < some.predicted.host_bytes <= one_block * 1.3


def _train_under_host(rank: int, world: int, capacities: tuple[int, ...]) -> dict:
    """Train the parity Llama under a budget a byte below the fixed policy's peak (the ranks'
    largest), activation_offload='prefer', where rank ``r``'s host says it has
    ``capacities[r]`` bytes available: the parity run's losses, parameters and plans."""
    import torch.distributed as dist
    from parity import sharded_run

    offload.host_available_bytes = lambda: capacities[rank]  # this spawned process only
    options = dict(comm_pool=False, prefetch=False)
    fixed = sharded_run(rank, world, "llama", "fx", **options)["plans"][0]
    peak = torch.tensor([int(fixed.predicted.peak_bytes)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    torch._dynamo.reset()
    return sharded_run(rank, world, "llama", "fx", peak_memory_budget_bytes=int(peak) - 1,
                       peak_memory_margin=0.0, activation_offload="prefer",
                       optimizer_offload="never", **options)


def _check_recomputed_not_offloaded(run: dict) -> None:
    """The budget was met by recomputing, nothing offloaded, and the plan says why."""
    (plan,) = [p for p in run["plans"] if p is not None]
    record = plan.budget
    assert record.recomputed and not record.offloaded and not record.checkpoint_offloaded
    assert run["activation_copies"]["d2h"] == 0 and not plan.predicted.host_bytes
    assert any("host full" in d.reason for d in record.blocks), record.blocks


# Slow (64 s at world 3 on the 2-core CI machine): test_ranks_with_different_host_capacities_
# make_the_same_plan trains at world 2 with a full host on one rank (both recompute, nothing
# offloaded) against the same reference; uneven shards are every parity test's case.
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_full_host_makes_the_planner_recompute_and_training_matches_the_reference(world):
    """Ranks whose hosts have 1 KiB available (world 3: uneven shards): the planner
    recomputes instead of offloading, and training matches the unsharded reference."""
    from parity import assert_parity, reference

    runs = run_ranks(_train_under_host, world, (1024,) * world)
    for run in runs:
        _check_recomputed_not_offloaded(run)
        assert_parity(run, reference("llama"))


# Slow (suite time, s29): 73 s on the loaded 2-core machine; every rank refuses alike in
# test_every_rank_refuses_when_one_host_is_short.
@pytest.mark.slow
def test_ranks_with_different_host_capacities_make_the_same_plan():
    """Rank 0's host has plenty, rank 1's 1 KiB: the ranks agree on the least before the
    search, so both recompute and their plans are the same (the same hash; the plan check at
    the first call compares them too); no rank is left waiting."""
    from parity import assert_parity, reference

    runs = run_ranks(_train_under_host, 2, (1 << 40, 1024))
    plans = [[p for p in run["plans"] if p is not None][0] for run in runs]
    assert plans[0].hash() == plans[1].hash()
    assert plans[0].budget.host == plans[1].budget.host != ""
    for run in runs:
        _check_recomputed_not_offloaded(run)
    assert_parity(runs[0], reference("llama"))


def test_refused_when_no_plan_fits_both_the_budget_and_the_host(monkeypatch):
    """A budget below every device configuration's peak needs the optimizer's state on the
    host (optimizer_offload='simulate': the lever on a CPU mesh); with a host of 1 KiB even the
    smallest share does not fit: refused at planning, naming the device levers' minimum, what
    the host would need and what it has; with a roomy host the same budget is met."""
    import re

    from shardc.models.llama import LlamaConfig
    from shardc.tools.planner import PlanSetup, plan_model

    cfg = LlamaConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, max_seq_len=8)

    def plan(budget_bytes: int, mode: str):
        torch._dynamo.reset()  # another test's shapes would make these dynamic
        return plan_model(cfg, 2, 1, 8, {"peak_memory_budget_bytes": budget_bytes,
                                         "peak_memory_margin": 0.0, "optimizer_offload": mode,
                                         "fused_loss": False},
                          template=False, setup=PlanSetup(inductor=False))[0]

    monkeypatch.setattr(offload, "host_available_bytes", lambda: 1 << 40)
    with pytest.raises(Exception, match="feasible minimum") as refused:
        plan(1, "never")
    floor = int(re.search(r"feasible minimum (\d+) B", str(refused.value)).group(1))
    assert plan(floor - 1, "simulate").budget.optimizer_on_host

    monkeypatch.setattr(offload, "host_available_bytes", lambda: 1024)
    with pytest.raises(Exception, match="no plan fits both the peak budget and the host") \
            as full:
        plan(floor - 1, "simulate")
    text = str(full.value)
    for part in (f"the device levers alone reach {floor} B", "the optimizer's state on the host "
                 "needs", "host full: would need", "host has 0.00 MiB",
                 "check_host_memory=False"):
        assert part in text, (part, text)


@pytest.mark.slow  # suite time (s29): 112 s on the loaded 2-core machine
def test_checkpoints_the_host_cannot_take_are_not_offloaded(monkeypatch):
    """Many tokens through four narrow blocks (tests/real_models.py's checkpoint scenario,
    planned at a fake world of 2): a byte below what recomputing every block reaches, a roomy
    host takes some blocks' checkpoints; a host of 1 KiB takes none, and recomputing alone
    cannot meet the budget: refused, naming the device minimum and saying the host could not
    take the offloads."""
    import re

    from shardc.models.llama import LlamaConfig
    from shardc.tools.planner import PlanSetup, plan_model

    cfg = LlamaConfig(vocab_size=37, dim=32, n_layers=4, n_heads=2, ffn_dim=16, max_seq_len=8)

    def plan(budget_bytes: int, **options):
        torch._dynamo.reset()  # another test's shapes would make these dynamic
        return plan_model(cfg, 2, 96, 4, {"peak_memory_budget_bytes": budget_bytes,
                                          "peak_memory_margin": 0.0, "fused_loss": False,
                                          "optimizer_offload": "never", "prefetch": False,
                                          **options},
                          template=False, setup=PlanSetup(inductor=False))[0]

    monkeypatch.setattr(offload, "host_available_bytes", lambda: 1 << 40)
    with pytest.raises(Exception, match="feasible minimum") as refused:
        plan(1, activation_offload="never")
    recomputed = int(re.search(r"feasible minimum (\d+) B", str(refused.value)).group(1))
    roomy = plan(recomputed - 1)
    assert roomy.budget.checkpoint_offloaded and roomy.predicted.host_bytes, roomy.budget

    monkeypatch.setattr(offload, "host_available_bytes", lambda: 1024)
    with pytest.raises(Exception, match="feasible minimum") as full:
        plan(recomputed - 1)
    text = str(full.value)
    assert f"feasible minimum {recomputed} B" in text, text
    assert "The host could not take every offload: host full: would need" in text, text
    assert "host has 0.00 MiB" in text and "check_host_memory=False" in text, text


def _optimizer_lever_under_host(rank: int, world: int, capacities: tuple[int, ...]) -> str:
    """Train the parity Llama under a budget a byte below the device levers' minimum (so only
    the optimizer's state on the host could meet it; ``optimizer_offload='simulate'``: the
    lever on a CPU mesh), where rank ``r``'s host says it has ``capacities[r]`` bytes: the
    error's text, or "trained"."""
    import re

    from parity import sharded_run

    offload.host_available_bytes = lambda: capacities[rank]  # this spawned process only
    options = dict(comm_pool=False, prefetch=False, peak_memory_margin=0.0, fused_loss=False)
    try:  # the device levers' minimum, as the refusal names it (the ranks' largest)
        sharded_run(rank, world, "llama", "fx", peak_memory_budget_bytes=1,
                    optimizer_offload="never", **options)
        return "no refusal at a 1-byte budget"
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        floor = int(re.search(r"feasible minimum (\d+) B", str(exc)).group(1))
    torch._dynamo.reset()
    try:
        sharded_run(rank, world, "llama", "fx", peak_memory_budget_bytes=floor - 1,
                    optimizer_offload="simulate", **options)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "trained"


# Slow (26 s): the ranks agree on the least capacity before the search (agree_capacity, the
# same for every host lever) in test_ranks_with_different_host_capacities_make_the_same_plan,
# and the refusal's text is test_refused_when_no_plan_fits_both_the_budget_and_the_host's.
@pytest.mark.slow
def test_every_rank_refuses_alike_where_only_one_host_cannot_take_the_optimizer_share():
    """Two ranks, rank 0's host roomy and rank 1's at 1 KiB, a budget only the optimizer's
    state on the host could meet: the ranks agree on the least capacity before the search,
    so both refuse at planning with the same message (none trains on while the other stops,
    none waits at a collective)."""
    texts = run_ranks(_optimizer_lever_under_host, 2, (1 << 40, 1024))
    assert texts[0] == texts[1], texts
    assert "HostFullError" in texts[0] and "no plan fits both the peak budget and the host" \
        in texts[0], texts[0]
