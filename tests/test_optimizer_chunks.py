"""The optimizer step in chunks (``shardc.runtime.chunked_step``, ``shardc.planning.
optimizer_chunks``, docs/memory_budget.md "The optimizer step in chunks").

* the runtime alone (one process, plain tensors): bitwise the same parameters and state as one
  call, every implementation; an LR scheduler; the refusals (a user's step hook among them);
  the groups put back after a raising chunk; not applied beside ``step_in_backward``;
* a sharded, compiled model (gloo, worlds 1 and 2, the parity model: a 37-row embedding, uneven
  shards) trained with ``optimizer_step_chunks='always'`` against ``'never'``: AdamW with
  ``foreach=True`` and torch's default (per tensor on a CPU mesh: torch's default picks
  ``foreach`` only where every tensor is on a foreach device, CUDA), an LR scheduler; the
  parameters and the optimizer's state bitwise equal;
* the budget (world 2): a budget a byte below the unchunked optimizer step's predicted peak
  (found from a first compile) makes the planner step in chunks, not offload the optimizer's
  state (available: ``optimizer_offload='simulate'``), within the budget, at parity with the
  unsharded reference, the same plan hash on both ranks.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from dist_utils import run_ranks
from parity import LR, assert_parity, batches, build, train, train_rank_slice

# What torch.optim runs where foreach is unset (private; read only to say what the CPU runs).
from torch.optim.optimizer import _default_to_fused_or_foreach  # noqa: E402

import shardc
from shardc.models.llama import LlamaConfig, Transformer, llama_loss
from shardc.planning import optimizer_chunks
from shardc.planning.plan import OptimizerChunksDecision, Plan
from shardc.planning.profile import ClusterProfile
from shardc.runtime import chunked_step


@pytest.fixture(autouse=True)
def _fresh_registry():
    """Each test adopts its own parameters (the registry is process-wide)."""
    saved = dict(chunked_step._CHUNK)
    chunked_step._CHUNK.clear()
    yield
    chunked_step._CHUNK.clear()
    chunked_step._CHUNK.update(saved)


def test_a_chunk_key_goes_with_its_last_parameter():
    """The registry keeps nothing of parameters that are gone (recompiles, dropped models):
    a chunk's key and order go with its last parameter; keys adopted later still order after
    those alive."""
    import gc

    keep, drop = _params()[:2], _params()[2:]
    chunked_step.adopt([(("kept", 0), keep), (("dropped", 0), drop)])
    assert {("kept", 0), ("dropped", 0)} <= set(chunked_step._ORDER)
    del drop[1:]
    gc.collect()
    assert ("dropped", 0) in chunked_step._ORDER  # one parameter still holds it
    drop.clear()
    gc.collect()
    assert ("dropped", 0) not in chunked_step._ORDER
    later = _params()[:1]
    chunked_step.adopt([(("later", 0), later)])
    assert chunked_step.chunk_of(later[0])[0] > chunked_step.chunk_of(keep[0])[0]


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s)) for s in [(5, 3), (7,), (4, 4), (2,), (3, 3)]]


@pytest.fixture
def narrowed(monkeypatch) -> list[list[int]]:
    """The group sizes of every narrowing of a chunked step, in order (a spy on
    ``chunked_step._narrow``: what each chunk's call steps)."""
    seen: list[list[int]] = []
    real = chunked_step._narrow

    def spy(groups, chunk):
        seen.append([len(params) for params in chunk])
        real(groups, chunk)

    monkeypatch.setattr(chunked_step, "_narrow", spy)
    return seen


def _run(chunk: bool, opt_cls=torch.optim.AdamW, steps: int = 3, **kwargs) -> tuple:
    """Train 5 plain parameters in two groups (one with its own lr) with an LR scheduler;
    with ``chunk`` in 3 chunks (two adopted, one of the rest). Returns the parameters, the
    optimizer's state dict, the lrs and the optimizer."""
    ps = _params()
    opt = opt_cls([{"params": ps[:3]}, {"params": ps[3:], "lr": 0.1}], lr=0.01, **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    if chunk:
        chunked_step.adopt([("a", [ps[0], ps[3]]), ("b", [ps[1]])])
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        sched.step()
    return ps, opt.state_dict(), sched.get_last_lr(), opt


@pytest.mark.parametrize("opt_cls,kwargs", [
    (torch.optim.AdamW, {"foreach": True}), (torch.optim.AdamW, {}),
    (torch.optim.AdamW, {"foreach": False}), (torch.optim.AdamW, {"fused": True}),
    (torch.optim.Adam, {"foreach": True, "weight_decay": 0.1}),
    (torch.optim.SGD, {"foreach": True, "momentum": 0.9}),
])
def test_chunks_step_bitwise_like_one_call(opt_cls, kwargs, narrowed):
    """Each implementation, chunked or not: the same bits; each step is three calls, each
    with the groups narrowed to its chunk; the scheduler's lrs are the same and it warns
    nothing; outside step() the groups hold every parameter, in their order."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no scheduler warning ("step() before optimizer.step()")
        plain, plain_state, plain_lrs, _ = _run(False, opt_cls, **kwargs)
        assert narrowed == []
        chunked_step._CHUNK.clear()
        ps, state, lrs, opt = _run(True, opt_cls, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(plain, ps))
    torch.testing.assert_close(state, plain_state, rtol=0, atol=0)
    # Per step: chunk a, chunk b, the rest (the groups' sizes), then the groups put back.
    assert narrowed == [[1, 1], [1, 0], [1, 1], [3, 2]] * 3
    assert lrs == plain_lrs
    assert [list(g["params"]) for g in opt.param_groups] == [ps[:3], ps[3:]]
    assert [[len(g) for g in c] for c in chunked_step.chunks_of(opt)] == [[1, 1], [1, 0], [1, 1]]


def test_refused_where_it_could_be_inexact():
    """A subclass of an elementwise class (it may step otherwise) and a closure are refused,
    naming the class and the way out; the groups are untouched."""
    class MyAdamW(torch.optim.AdamW):
        pass

    ps = _params()
    chunked_step.adopt([("a", ps[:2])])
    opt = MyAdamW(ps, lr=0.01)
    for p in ps:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="MyAdamW is not exactly one of .*"
                       "optimizer_step_chunks='never'"):
        opt.step()
    assert opt.param_groups[0]["params"] == ps and not opt.state
    opt = torch.optim.AdamW(ps, lr=0.01)
    with pytest.raises(RuntimeError,
                       match=r"step\(closure\) would evaluate the closure once per chunk"):
        opt.step(lambda: torch.tensor(0.0))
    assert opt.param_groups[0]["params"] == ps and not opt.state


def _clip_hook(optimizer, args, kwargs):
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)


@pytest.mark.parametrize("where", ["optimizer", "process"])
def test_refused_with_a_step_hook_that_is_not_shardcs(where):
    """A step hook of the user's (here a clip by the global norm, which would clip again at
    every chunk), the optimizer's own or process-wide, is refused at the step, naming it and
    the way out; the groups are untouched. Removed, the step runs in chunks."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    ps = _params()
    chunked_step.adopt([("a", ps[:2])])
    opt = torch.optim.AdamW(ps, lr=0.01)
    handle = (opt.register_step_pre_hook(_clip_hook) if where == "optimizer"
              else register_optimizer_step_pre_hook(_clip_hook))
    for p in ps:
        p.grad = torch.ones_like(p)
    try:
        assert chunked_step.foreign_hooks(opt) == ["_clip_hook"]
        with pytest.raises(RuntimeError, match="step hooks _clip_hook are not shardc's.*once "
                           "per chunk.*optimizer_step_chunks='never'"):
            opt.step()
        assert opt.param_groups[0]["params"] == ps and not opt.state
    finally:
        handle.remove()
    opt.step()
    assert set(opt.state) == set(ps)


def test_a_raising_chunk_puts_the_groups_back():
    """The second chunk's step raising (a sparse gradient, which AdamW refuses): the error
    propagates, the groups hold every parameter again, and the next step and state_dict()
    work."""
    ps = _params()
    chunked_step.adopt([("a", ps[:2]), ("b", ps[2:4])])
    opt = torch.optim.AdamW(ps, lr=0.01, foreach=True)
    for p in ps:
        p.grad = torch.ones_like(p)
    ps[2].grad = ps[2].grad.to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert opt.param_groups[0]["params"] == ps
    ps[2].grad = torch.ones_like(ps[2])
    opt.step()
    assert set(opt.state_dict()["state"]) == {0, 1, 2, 3, 4}
    assert opt.param_groups[0]["params"] == ps


def test_not_applied_beside_step_in_backward(caplog, narrowed):
    """An optimizer another shardc step change holds (here marked as step_in_backward's) steps
    in one call, with one warning."""
    ps = _params()
    chunked_step.adopt([("a", ps[:2])])
    opt = torch.optim.AdamW(ps, lr=0.01)
    opt._shardc_step_in_backward = object()
    for p in ps:
        p.grad = torch.ones_like(p)
    with caplog.at_level("WARNING", logger="shardc"):
        opt.step()
        opt.step()
    assert narrowed == [] and set(opt.state) == set(ps)
    assert sum("not applied" in r.message for r in caplog.records) == 1


def test_planner_pieces():
    """Chunks from buckets (a parameter in two buckets in the first, the rest last), the
    lever's availability, its price (extra calls only), and the record's hash and round trip."""
    class B:
        def __init__(self, params):
            self.params = params

    parts = optimizer_chunks.chunks([B(["a", "b"]), B(["b", "c"]), B(["b"])], ["a", "b", "c",
                                                                               "d"])
    assert parts == [("a", "b"), ("c",), ("d",)]
    assert optimizer_chunks.largest_chunk_bytes(parts, {"a": 1, "b": 2, "c": 5, "d": 1}.get) == 5
    why = optimizer_chunks.why_not
    assert why("auto", "auto", 1.0, False, (), 3) == ""
    assert "never" in why("never", "auto", 1.0, False, (), 3)
    assert "on the host" in why("auto", "auto", 1.0, True, (), 3)
    assert "part of" in why("auto", "auto", 1.0, False, {"a"}, 3)
    assert "fused" in why("auto", "fused", 1.0, False, (), 3)
    assert "per tensor" in why("auto", "per_tensor", 1.0, False, (), 3)
    assert "one chunk" in why("auto", "foreach", 1.0, False, (), 1)
    profile = ClusterProfile("", "", "", "", "", kernel_gpu_s=2e-6, kernel_launch_s=6e-6,
                             optimizer_fixed_s=1e-4)
    assert optimizer_chunks.price(1, profile) == 0.0
    # Two more calls, each 10 more foreach launches; the call's fixed host work is not charged
    # again (it overlaps the previous chunk's kernels).
    assert optimizer_chunks.price(3, profile) == pytest.approx(2 * 10 * 6e-6)
    d = optimizer_chunks.decision(n_chunks=3, chunk_bytes=10, saved_bytes=20, seconds=1e-3,
                                  peak_bytes=100, floor_bytes=120, exact=False)
    assert isinstance(d, OptimizerChunksDecision) and d.chunked and d.predicted_ms == 1.0
    assert d.signature() == ("optimizer_chunks", 3)
    assert "in 3 chunks" in d.reason and "optimizer step's peak with one call" in d.reason
    with pytest.raises(ValueError, match="optimizer_step_chunks must be"):
        shardc.ShardcOptions(optimizer_step_chunks="sometimes")


# -- sharded and compiled -----------------------------------------------------------------


def _local_state(opt: torch.optim.Optimizer) -> dict:
    """The optimizer's state dict with each DTensor as its local tensor (a rank's bits)."""
    sd = opt.state_dict()
    return {k: {n: (v.to_local() if hasattr(v, "to_local") else v) for n, v in s.items()}
            for k, s in sd["state"].items()}, sd["param_groups"]


def _train_sharded(rank: int, world: int, chunks: str, foreach: bool | None,
                   steps: int = 3) -> dict:
    torch._dynamo.reset()
    model = build("llama")
    shardc.shard(model)
    forward = torch.compile(model, backend=shardc.backend(inductor=False,
                                                          optimizer_step_chunks=chunks))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=foreach)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    narrows = []  # a spy: chunked_step narrows once per chunk, then puts the groups back
    real_narrow = chunked_step._narrow
    chunked_step._narrow = lambda groups, chunk: (narrows.append(1), real_narrow(groups, chunk))
    tokens, targets = batches(steps)
    per = tokens.shape[1] // world
    rows = slice(rank * per, (rank + 1) * per)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            loss = llama_loss(forward(tokens[step, rows]), targets[step, rows])
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    chunked_step._narrow = real_narrow
    # The calls that stepped: one per chunk a step (each step narrows once per chunk and once
    # more to put the groups back), or one a step without chunks (no narrowing).
    calls = len(narrows) - steps if narrows else steps
    params = [p.to_local().detach().clone() for p in model.parameters()]
    # What torch.optim runs for these parameters where foreach is unset (CPU: per tensor).
    _, default_foreach = _default_to_fused_or_foreach(
        list(model.parameters()), differentiable=False, use_fused=False)
    return {"params": params, "state": _local_state(opt), "calls": calls,
            "chunks": len(chunked_step.chunks_of(opt)), "lrs": sched.get_last_lr(),
            "default_foreach": default_foreach,
            "warnings": sorted({str(w.message) for w in caught
                                if "lr_scheduler" in str(w.message)
                                or "optimizer" in str(w.message)})}


def _parity_worker(rank: int, world: int, foreach: bool | None) -> dict:
    steps = 3
    plain = _train_sharded(rank, world, "never", foreach, steps)
    chunked = _train_sharded(rank, world, "always", foreach, steps)
    torch.testing.assert_close(chunked["state"], plain["state"], rtol=0, atol=0)
    return {"same_params": all(torch.equal(a, b)
                               for a, b in zip(plain["params"], chunked["params"])),
            "chunks": chunked["chunks"], "calls": (plain["calls"], chunked["calls"]),
            "lrs": (plain["lrs"], chunked["lrs"]), "steps": steps,
            "warnings": (plain["warnings"], chunked["warnings"]),
            "default_foreach": plain["default_foreach"]}


# Two of the four combinations in the default suite (its time); the other two are slow.
# World 1 is slow too (suite time, s29): chunked steps over real collectives stay at 2.
@pytest.mark.parametrize("world,foreach", [
    (2, True), pytest.param(1, None, marks=pytest.mark.slow),
    pytest.param(1, True, marks=pytest.mark.slow), pytest.param(2, None, marks=pytest.mark.slow),
])
def test_sharded_training_in_chunks_is_bitwise_the_same(world, foreach):
    """A sharded, compiled model trained with the step in chunks (``'always'``) and without:
    the parameters and the optimizer's state bitwise equal on every rank; the optimizer was
    called once per chunk (at least 2 chunks: the parity model's buckets), the scheduler's
    lrs and warnings are the same. torch's default AdamW runs per tensor on a CPU mesh (checked
    here), so ``foreach=True`` is the case whose temporaries the chunks bound."""
    for out in run_ranks(_parity_worker, world, foreach):
        assert out["same_params"]
        assert out["chunks"] >= 2, out
        assert out["calls"] == (out["steps"], out["steps"] * out["chunks"]), out
        assert out["lrs"][0] == out["lrs"][1]
        assert out["warnings"][0] == out["warnings"][1], out["warnings"]
        assert out["default_foreach"] is False  # CPU tensors: torch's default is per tensor


# The budget scenario's backend options (tests/test_budget_combos.py's): no static pool, no
# prefetch; no margin (the budget sits at the lever's threshold); the optimizer's offload
# available on the CPU mesh, so that the test shows the chunks are tried first.
_BUDGET = dict(comm_pool=False, prefetch=False, peak_memory_margin=0.0,
               optimizer_offload="simulate")


def _largest(plans: list, field: str) -> int:
    value = torch.tensor([max(int(getattr(p.predicted, field)) for p in plans)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value)


# Parameters that outweigh the activations (a CPU test's batch is small): the optimizer step is
# the plan's peak, as for the GPU finding (docs/memory_budget.md). 37 rows: uneven shards.
_BIG = LlamaConfig(vocab_size=37, dim=64, n_layers=8, n_heads=4, ffn_dim=256, max_seq_len=16)


def _build_big() -> torch.nn.Module:
    torch.manual_seed(0)
    return Transformer(_BIG)


def _big_run(rank: int, world: int, **options) -> tuple[dict, torch.nn.Module]:
    """Train the big model sharded (parity's data and optimizer: torch's default AdamW)."""
    torch._dynamo.reset()
    model = _build_big()
    shardc.shard(model)
    forward = torch.compile(model, backend=shardc.backend(inductor=False, **options))
    losses = train_rank_slice(model, forward, rank, world)
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    plans = [r.plan for r in shardc.shard_state(model).regions]
    return {"losses": losses, "params": params, "plans": plans}, model


def _budget_worker(rank: int, world: int) -> dict:
    first, _ = _big_run(rank, world, **_BUDGET)
    step_peak = _largest(first["plans"], "optimizer_step_peak_bytes")
    budget = step_peak - 1
    run, model = _big_run(rank, world, peak_memory_budget_bytes=budget, **_BUDGET)
    adopted = [chunked_step.chunk_of(p) is not None for p in model.parameters()]
    plans = run["plans"]
    return {"run": run, "budget": budget, "step_peak": step_peak,
            "peak": _largest(plans, "peak_bytes"), "adopted": adopted,
            "first_peak": _largest(first["plans"], "peak_bytes"),
            "hashes": [p.hash() for p in plans],
            "round_trip": all(Plan.from_json(p.to_json()).budget == p.budget for p in plans)}


def _big_reference() -> dict:
    model = _build_big()
    tokens, targets = batches()
    losses = train(model, model, tokens, targets)
    return {"losses": torch.stack(losses), "params": dict(model.named_parameters())}


@pytest.mark.slow  # suite time (s29): a two-rank group of four plans (106 rank-CPU s)
def test_the_budget_steps_in_chunks_before_offloading():
    """A budget a byte below the unchunked optimizer step's predicted peak (the levers of the
    graphs, recompute here, meet it in the forward and the backward): the planner steps the
    optimizer in chunks (the buckets), keeps the state on the device (no optimizer offload,
    which was available), predicts a peak within the budget, trains at parity with the
    unsharded reference; both ranks hash their plans alike; the record round-trips."""
    ref = _big_reference()
    outs = run_ranks(_budget_worker, 2)
    for out in outs:
        assert out["budget"] < out["step_peak"]  # one call's step cannot meet it
        run = out["run"]
        assert_parity(run, ref)
        for plan in run["plans"]:
            b = plan.budget
            assert b is not None and b.optimizer is None, b.optimizer
            assert b.optimizer_chunked, b
            c = b.optimizer_chunks
            assert c.chunks >= 2 and c.saved_bytes > 0 and c.predicted_ms > 0, c
            assert "before any optimizer state goes to the host" in c.reason
            assert "the optimizer step's peak with one call" in c.reason
            assert b.peak_bytes <= out["budget"]
            assert plan.predicted.optimizer_chunk_bytes < plan.predicted.param_bytes
            assert "optimizer step: in" in plan.table()
            assert ("optimizer_chunks", c.chunks) in plan.budget_signature()
        assert out["peak"] <= out["budget"]
        assert all(out["adopted"])
        assert out["round_trip"]
    assert outs[0]["hashes"] == outs[1]["hashes"]


@pytest.mark.slow  # 15 s; the budget's choice of the chunks is in the default suite above
def test_the_feasible_minimum_counts_the_chunks():
    """The planner at a fake world of 2 (``plan_model``, FX), the optimizer's offload off: a
    1-byte budget is refused naming the device levers' feasible minimum, which with the step in
    chunks allowed (``'auto'``) is lower than with one call (``'never'``) where the optimizer
    step is the peak; at that lower minimum the plan steps in chunks, within it."""
    import re

    from shardc.tools.planner import PlanSetup, plan_model

    cfg = LlamaConfig(vocab_size=37, dim=64, n_layers=4, n_heads=4, ffn_dim=256, max_seq_len=8)

    def plan(budget_bytes: int, chunks: str) -> Plan:
        return plan_model(cfg, 2, 1, 8, {"peak_memory_budget_bytes": budget_bytes,
                                         "peak_memory_margin": 0.0, "optimizer_offload": "never",
                                         "optimizer_step_chunks": chunks, "fused_loss": False},
                          template=False, setup=PlanSetup(inductor=False, pack_blocks=False))[0]

    def minimum(chunks: str) -> int:
        with pytest.raises(Exception, match="feasible minimum") as refused:
            plan(1, chunks)
        return int(re.search(r"feasible minimum (\d+) B", str(refused.value)).group(1))

    one_call, chunked = minimum("never"), minimum("auto")
    assert chunked < one_call, (chunked, one_call)
    at = plan(chunked, "auto")
    assert at.budget.optimizer_chunked and at.budget.optimizer is None
    assert at.budget.peak_bytes <= chunked and at.predicted.peak_bytes <= chunked
    assert at.predicted.optimizer_temp_bytes == at.predicted.optimizer_chunk_bytes
    assert "the other levers' feasible minimum with one optimizer call" \
        in at.budget.optimizer_chunks.reason
