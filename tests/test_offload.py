"""CPU offload (issue 21): refusals, where things live, the optimizer check, the plan's copies.

Training parity with offload (worlds 1-4, eager and compiled, mixed precision) is in
tests/test_parity.py, accumulation without sync and clipping in tests/test_real_models.py,
checkpoints in tests/test_checkpoint.py; the GPU tests (pinning, the copy stream, FSDP2
interop with pinned memory) in tests/gpu/test_offload_gpu.py. These checks share one spawned
2-rank group.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from dist_utils import prestart as prestart_run
from dist_utils import run_prestarted
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import shardc
import shardc.sharding.shard as shard_mod
from shardc.models.llama import LlamaConfig, Transformer, llama_loss
from shardc.planning.plan import Plan
from shardc.runtime import offload_check, offload_optimizer
from shardc.sharding import offload as offload_mod
from shardc.tools.render import chrome_trace

CFG = LlamaConfig(vocab_size=37, dim=24, n_layers=2, n_heads=4, ffn_dim=45, max_seq_len=16)
SIM = shardc.OffloadPolicy(simulate_on_cpu=True)
OPT_SIM = shardc.OffloadPolicy(params=False, simulate_on_cpu=True)  # optimizer only


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return "NO ERROR"


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CFG)


def _refusals(mesh) -> dict:
    out = {
        "cpu_mesh": _error(lambda: shardc.shard(_model(), mesh, offload=shardc.OffloadPolicy())),
        "params_only": _error(lambda: shardc.shard(
            _model(), mesh, offload=shardc.OffloadPolicy(optimizer=False, simulate_on_cpu=True))),
        "optimizer_only_cpu_mesh": _error(lambda: shardc.shard(
            _model(), mesh, offload=shardc.OffloadPolicy(params=False))),
        "not_a_policy": _error(lambda: shardc.shard(_model(), mesh, offload=True)),
        "fp8": _error(lambda: shardc.shard(_model(), mesh, offload=SIM,
                                           fp8=shardc.Float8Policy())),
    }
    # An optimizer built before shard holds the replaced (device) parameters: named at its step.
    early = _model()
    early_opt = torch.optim.AdamW(early.parameters(), lr=1e-2)
    shardc.shard(early, mesh, offload=SIM)
    toks = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    llama_loss(early(toks), toks).backward()
    out["early_optimizer"] = _error(early_opt.step)
    probe = offload_mod.host_available_bytes
    allocated = []
    real_to_host = offload_mod.to_host
    offload_mod.host_available_bytes = lambda: 1000  # shardc's own probe, not torch
    try:
        shard_mod.to_host = lambda *a: allocated.append(1) or real_to_host(*a)
        model = _model()
        out["no_host_memory"] = _error(lambda: shardc.shard(model, mesh, offload=SIM))
        out["no_host_memory_untouched"] = not any(isinstance(p, DTensor)
                                                  for p in model.parameters())
        out["no_host_memory_allocated"] = len(allocated)
    finally:
        offload_mod.host_available_bytes = probe
        shard_mod.to_host = real_to_host
    return out


def _plain_inputs_ignored(rank: int, mesh) -> dict:
    """``plain_inputs=True`` with CPU offload: what shardc.shard keeps (no plain leaves, the
    offload policy) and one eager step's gradients (DTensors on the host)."""
    model = shardc.shard(_model(), mesh, offload=SIM, plain_inputs=True)
    state = shardc.shard_state(model)
    gen = torch.Generator().manual_seed(rank)
    _backward(model, gen)
    return {"plain": state.plain, "offload": state.offload,
            "grads": sorted({(type(p.grad).__name__, p.grad.to_local().device.type)
                             for p in model.parameters()})}


def _train(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out = _refusals(mesh)
    out["plain_inputs"] = _plain_inputs_ignored(rank, mesh)
    model = shardc.shard(_model(), mesh, offload=SIM)
    state = shardc.shard_state(model)
    out["policy"] = state.offload
    out["local_devices"] = sorted({p.to_local().device.type for p in model.parameters()})
    out["infos"] = sorted({i.offload_device for i in state.params.values()})
    initial = [p.to_local().detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend=shardc.backend(inductor=False))
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        toks = torch.randint(0, CFG.vocab_size, (2, 8), generator=gen)
        llama_loss(compiled(toks), torch.roll(toks, -1, 1)).backward()
        out["grad_devices"] = sorted({p.grad.to_local().device.type for p in model.parameters()})
        out["grad_dtensor"] = all(isinstance(p.grad, DTensor) for p in model.parameters())
        opt.step()
        opt.zero_grad()
    out["state_dtensor_host"] = all(
        isinstance(v, DTensor) and v.to_local().device.type == "cpu"
        and tuple(v.shape) == tuple(p.shape)
        for p, s in opt.state.items() for k, v in s.items() if k != "step")
    plan = shardc.explain(compiled)
    # The budget check's run without a budget is this one (same model, options, optimizer and
    # batches): its compile is not repeated there.
    resharded = _budget_record([p.full_tensor() for p in model.parameters()], plan)
    out["plan_json"] = plan.to_json()
    out["plan_text"] = plan.table()
    out["trace_lanes"] = sorted({e["args"]["name"] for e in chrome_trace(plan)["traceEvents"]
                                 if e.get("name") == "thread_name"})
    # A parameter group mixing offloaded parameters with one on another device is refused.
    param = next(iter(model.parameters()))
    out["mixed_group"] = _error(lambda: offload_check.check_group(
        [param, torch.empty(2, device="meta")]))
    # ... and so is such a group at an optimizer's step (the step pre-hook).
    mixed = torch.optim.SGD([param, torch.zeros(2, device="meta", requires_grad=True)], lr=0.1)
    out["mixed_step"] = _error(mixed.step)
    out["optimizer_only"] = _optimizer_only(rank, mesh)
    out["budget"] = _budget_keeps(rank, mesh, resharded)
    # This compiled model trains again, from its initial shards, for step_in_backward.
    out["overlap"] = _step_in_backward(rank, mesh, model, compiled, initial)
    return out


def _overlap_train(rank: int, model, forward, initial: list, overlap: bool,
                   steps: int = 3) -> dict:
    """AdamW (fused CPU kernel) with an LR schedule that changes lr at every step, with or
    without ``shardc.step_in_backward``, from the local shards ``initial`` (a new optimizer):
    parameters, optimizer state dict and counts."""
    with torch.no_grad():
        for p, local in zip(model.parameters(), initial, strict=True):
            p.to_local().copy_(local)
            p.grad = None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    handle = shardc.step_in_backward(model, opt) if overlap else None
    # What the worker thread's optimizer calls step: the types of their parameters.
    worker_types: set[str] = set()
    opt.register_step_pre_hook(lambda o, *_: worker_types.update(
        type(p).__name__ for g in o.param_groups for p in g["params"])
        if threading.current_thread().name == "shardc-step-in-backward" else None)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        toks = torch.randint(0, CFG.vocab_size, (2, 8), generator=gen)
        llama_loss(forward(toks), torch.roll(toks, -1, 1)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    out = {"params": [p.full_tensor() for p in model.parameters()],
           "state_dict": opt.state_dict(), "n": len(list(model.parameters())),
           # DCP's view (keyed by parameter name, global DTensors).
           "dcp": get_optimizer_state_dict(model, opt), "opt": opt}
    if handle is not None:
        out.update(early=handle.early, signalled=handle.signalled, late=handle.late,
                   worker_types=worker_types)
    if forward is not model:
        nodes = list(shardc.shard_state(model).regions[0].backward.graph.nodes)
        ready = [i for i, n in enumerate(nodes) if "offload_grads_ready" in str(n.target)]
        scatters = [i for i, n in enumerate(nodes) if "reduce_scatter" in str(n.target)]
        out["ready_nodes"] = len(ready)
        out["first_ready_before_last_scatter"] = bool(ready) and ready[0] < scatters[-1]
    return out


def _state_equal(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    for k, sa in a["state"].items():
        sb = b["state"][k]
        for name, v in sa.items():
            w = sb[name]
            v = v.full_tensor() if isinstance(v, DTensor) else v
            w = w.full_tensor() if isinstance(w, DTensor) else w
            if not torch.equal(v, w):
                return False
    return True


def _step_in_backward(rank: int, mesh, model, compiled, initial: list) -> dict:
    """shardc.step_in_backward: the same training as the plain offload step (compiled and
    eager), the early steps taken, the state dict, and what it refuses. Compiled: ``model``
    (sharded with offload) and its compiled forward ``compiled`` (``_train``'s: the graphs
    depend on neither the optimizer nor step_in_backward), put back to its local shards
    ``initial`` and trained twice, plain then overlapped; eager: a fresh model, likewise."""
    out = {}
    for mode in ("fx", "eager"):
        if mode == "eager":
            model = shardc.shard(_model(), mesh, offload=SIM)
            initial = [p.to_local().detach().clone() for p in model.parameters()]
        forward = model if mode == "eager" else compiled
        plain = _overlap_train(rank, model, forward, initial, False)
        over = _overlap_train(rank, model, forward, initial, True)
        if mode == "fx":
            assert len(shardc.shard_state(model).regions) == 1, "recompiled"
        out[mode] = {k: over[k] for k in ("early", "signalled", "late", "n", "worker_types")}
        out[mode]["bitwise"] = all(torch.equal(a, b) for a, b in
                                   zip(plain["params"], over["params"], strict=True))
        out[mode]["state_dict_equal"] = _state_equal(plain["state_dict"], over["state_dict"])
        # DCP's view (keyed by parameter name, global DTensors): the same.
        out[mode]["dcp_equal"] = _state_equal(plain["dcp"], over["dcp"])
        if mode == "fx":
            out[mode]["ready_nodes"] = over["ready_nodes"]
            out[mode]["interleaved"] = over["first_ready_before_last_scatter"]
            # Loading a state dict (the plain run's) into the overlapped optimizer.
            over["opt"].load_state_dict(plain["state_dict"])
            out[mode]["loaded"] = _state_equal(over["opt"].state_dict(), plain["state_dict"])
    out["refusals"] = _overlap_refusals(rank, mesh)
    return out


def _backward(model, gen) -> None:
    toks = torch.randint(0, CFG.vocab_size, (2, 8), generator=gen)
    llama_loss(model(toks), torch.roll(toks, -1, 1)).backward()


def _overlap_refusals(rank: int, mesh) -> dict:
    """Eager (cheap): what step_in_backward refuses, and no_sync accumulation stepping late."""
    out = {}
    plain_model = shardc.shard(_model(), mesh)
    out["not_offloaded"] = _error(lambda: shardc.step_in_backward(
        plain_model, torch.optim.AdamW(plain_model.parameters())))
    model = shardc.shard(_model(), mesh, offload=SIM)
    out["lbfgs"] = _error(lambda: shardc.step_in_backward(
        model, torch.optim.LBFGS(model.parameters())))
    out["capturable"] = _error(lambda: shardc.step_in_backward(
        model, torch.optim.Adam(model.parameters(), capturable=True)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = shardc.step_in_backward(model, opt)
    out["twice"] = _error(lambda: shardc.step_in_backward(model, opt))
    gen = torch.Generator().manual_seed(rank)
    _backward(model, gen)
    out["closure"] = _error(lambda: opt.step(lambda: None))
    opt.zero_grad()
    # Clipping by global norm between backward and step: detected at the step.
    _backward(model, gen)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    out["clipped"] = _error(opt.step)
    opt.zero_grad()
    # Two synchronizing backwards before one step.
    _backward(model, gen)
    _backward(model, gen)
    out["second_backward"] = _error(opt.step)
    opt.zero_grad()
    handle.remove()
    # no_sync accumulation: nothing is stepped early (the .grad exists when the last, synced,
    # backward arrives); optimizer.step() steps it all, as without overlap.
    runs = {}
    for overlap in (False, True):
        model = shardc.shard(_model(), mesh, offload=SIM)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        handle = shardc.step_in_backward(model, opt) if overlap else None
        gen = torch.Generator().manual_seed(rank)
        for _ in range(2):
            with shardc.no_sync(model):
                _backward(model, gen)
            _backward(model, gen)
            opt.step()
            opt.zero_grad()
        runs[overlap] = [p.full_tensor() for p in model.parameters()]
        if handle is not None:
            out["no_sync_counts"] = (handle.early, handle.late)
    out["no_sync_bitwise"] = all(torch.equal(a, b) for a, b in zip(runs[False], runs[True]))
    return out


def _budget_record(params: list, plan) -> dict:
    return {"params": params,
            "backward_h2d": sum(c.kind == "h2d_copy" and c.graph == "backward"
                                for c in plan.copies),
            "reasons": [d.reason for d in plan.budget.decisions] if plan.budget else []}


def _budget_keeps(rank: int, mesh, resharded: dict) -> dict:
    """A peak budget with room keeps buckets gathered, which under offload also removes the
    backward's host->device copies: the same training (bitwise), fewer copies. ``resharded``:
    the same training without a budget (``_train``'s compiled run, the same two steps)."""
    model = shardc.shard(_model(), mesh, offload=SIM)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend=shardc.backend(inductor=False,
                                                           peak_memory_budget_bytes=10**9))
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        _step(compiled, opt, gen)
        opt.zero_grad()
    budget = _budget_record([p.full_tensor() for p in model.parameters()],
                            shardc.explain(compiled))
    return {"resharded": resharded, "budget": budget}


def _step(model, opt, gen) -> None:
    toks = torch.randint(0, CFG.vocab_size, (2, 8), generator=gen)
    llama_loss(model(toks), torch.roll(toks, -1, 1)).backward()
    opt.step()


def _optimizer_only(rank: int, mesh) -> dict:
    """OffloadPolicy(params=False, optimizer=True): where things live, what the optimizer
    shows outside its step, a step that raises, and the refusals at the step."""
    model = shardc.shard(_model(), mesh, offload=OPT_SIM)
    state = shardc.shard_state(model)
    params = list(model.parameters())
    out = {"policy": state.offload, "infos": sorted({i.offload_device
                                                     for i in state.params.values()})}
    opt = torch.optim.AdamW(params, lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    out["masters_before"] = sum(offload_optimizer.host_master(p) is not None for p in params)
    _step(model, opt, gen)
    out["grads_stay"] = all(isinstance(p.grad, DTensor) for p in params)
    opt.zero_grad()
    ids = {id(p) for p in params}
    out["groups_hold_params"] = {id(p) for p in opt.param_groups[0]["params"]} == ids
    out["state_keyed_by_params"] = {id(p) for p in opt.state} == ids
    out["state_global_host"] = all(
        isinstance(v, DTensor) and v.to_local().device.type == "cpu"
        and tuple(v.shape) == tuple(p.shape) and v.placements == p.placements
        for p, s in opt.state.items() for k, v in s.items() if k != "step")
    masters = [offload_optimizer.host_master(p) for p in params]
    out["masters_separate"] = all(
        m is not None and m is not p and torch.equal(m.to_local(), p.to_local())
        and (p.to_local().numel() == 0 or m.to_local().untyped_storage().data_ptr()
             != p.to_local().untyped_storage().data_ptr())
        for p, m in zip(params, masters))
    # A step that raises (its closure) leaves the masters in the groups: state_dict() puts the
    # parameters back first, and the next step works.
    toks = torch.randint(0, CFG.vocab_size, (2, 8), generator=gen)
    llama_loss(model(toks), toks).backward()

    def closure():
        raise RuntimeError("closure failed")

    out["raised"] = _error(lambda: opt.step(closure))
    out["during_failed_step"] = any(p is m for p, m in zip(opt.param_groups[0]["params"],
                                                           masters))
    sd = opt.state_dict()
    out["restored"] = ({id(p) for p in opt.param_groups[0]["params"]} == ids
                       and {id(p) for p in opt.state} == ids and len(sd["state"]) == len(ids))
    opt.step()
    out["stepped_after"] = {id(p) for p in opt.state} == ids
    opt.zero_grad()
    # Refusals, named at the step.
    _step_error = lambda o: _error(o.step)  # noqa: E731
    capturable = torch.optim.Adam(params, lr=1e-2, capturable=True)
    for p in params:
        p.grad = torch.zeros_like(p)
    out["capturable"] = _step_error(capturable)
    first = params[0]
    first.grad = distribute_tensor(torch.zeros(first.shape), mesh, [Replicate()])
    out["replicated_grad"] = _step_error(torch.optim.SGD([first], lr=0.1))
    first.grad = None
    out["mixed"] = _step_error(torch.optim.SGD(
        [first, torch.zeros(2, device="meta", requires_grad=True)], lr=0.1))
    return out


def prestart(items) -> None:
    """Queue ``runs``' group if a selected test reads it (tests/conftest.py,
    dist_utils.prestart): in the whole suite it runs in the background beside earlier tests."""
    if any("runs" in item.fixturenames for item in items):
        prestart_run("test_offload::runs", (_train, 2))


@pytest.fixture(scope="module")
def runs():
    return run_prestarted("test_offload::runs", _train, 2)


def test_offload_on_a_cpu_mesh_is_refused_unless_simulating(runs):
    msg = runs[0]["cpu_mesh"]
    assert msg.startswith("ValueError") and "means nothing" in msg and "simulate_on_cpu" in msg


def test_partial_policies_and_bad_arguments_are_refused(runs):
    out = runs[0]
    msg = out["params_only"]
    assert msg.startswith("NotImplementedError") and "OffloadPolicy()" in msg, msg
    assert "OffloadPolicy(params=False, optimizer=True)" in msg and "16" in msg, msg
    assert out["optimizer_only_cpu_mesh"].startswith("ValueError")
    assert "simulate_on_cpu" in out["optimizer_only_cpu_mesh"]
    assert out["not_a_policy"].startswith("TypeError")
    assert out["fp8"].startswith("NotImplementedError") and "FP8" in out["fp8"]


def test_optimizer_built_before_shard_is_named_at_its_step(runs):
    msg = runs[0]["early_optimizer"]
    assert msg.startswith("RuntimeError") and "built before shardc.shard" in msg, msg
    assert "Build the optimizer after shardc.shard" in msg and "tok_embeddings.weight" in msg, msg


def test_host_without_enough_memory_is_refused_before_allocating(runs):
    for out in runs:
        msg = out["no_host_memory"]
        assert msg.startswith("MemoryError"), msg
        assert "GiB of host memory" in msg and "available" in msg
        assert out["no_host_memory_untouched"] and out["no_host_memory_allocated"] == 0


def test_shards_gradients_and_optimizer_state_live_on_the_host(runs):
    for out in runs:
        assert out["policy"] == SIM
        assert out["local_devices"] == ["cpu"] and out["grad_devices"] == ["cpu"]
        assert out["infos"] == ["cpu"]
        assert out["grad_dtensor"] and out["state_dtensor_host"]


def test_the_plan_records_copies_on_their_lane(runs):
    plan = Plan.from_json(runs[0]["plan_json"])
    assert plan.version == 5
    kinds = {(c.graph, str(c.kind)) for c in plan.copies}
    assert ("forward", "h2d_copy") in kinds and ("backward", "d2h_copy") in kinds
    assert ("backward", "h2d_copy") in kinds  # resharded: gathered (so copied) again
    assert all(c.stream == "copy" for c in plan.copies)
    for c in plan.copies:
        if str(c.kind) == "h2d_copy":
            gather = next(g for g in plan.collectives if g.graph == c.graph
                          and g.bucket == c.bucket and str(g.kind) == "all_gather")
            assert c.issue_pos <= c.wait_pos == gather.issue_pos
    # The compute stream waits for a bucket's gradient copies where the next bucket's are
    # issued (the lowering releases the gradients there), the last bucket's at the end.
    d2h = sorted((c for c in plan.copies if str(c.kind) == "d2h_copy"),
                 key=lambda c: (c.issue_pos, c.bucket))
    assert len(d2h) >= 2
    for c, following in zip(d2h, d2h[1:]):
        assert c.issue_pos <= c.wait_pos == following.issue_pos, (c.id, following.id)
    assert d2h[-1].wait_pos == max(c.wait_pos for c in d2h) >= d2h[-1].issue_pos
    assert "where the next bucket's copies are issued" in d2h[0].reason
    assert plan.predicted.host_bytes > 0 and plan.predicted.device_copy_bytes > 0
    assert json.loads(runs[0]["plan_json"])["copies"]
    assert "offload copies" in runs[0]["plan_text"]
    assert "copy: host<->device" in runs[0]["trace_lanes"]


def test_optimizer_groups_and_gradients_are_checked(runs):
    out = runs[0]
    assert out["mixed_group"].startswith("RuntimeError") and "own optimizer" in out["mixed_group"]
    assert "not a DTensor with a host shard" not in out["mixed_group"]
    assert out["mixed_step"] == out["mixed_group"]



def test_optimizer_only_offload_steps_host_copies_and_shows_device_parameters(runs):
    """OffloadPolicy(params=False, optimizer=True): no copy in the graphs (the shards stay on
    the device), host masters made at the first step, separate from the shards and equal to
    them after it; outside the step the optimizer holds the parameters, its state is keyed by
    them, in global DTensor coordinates, with host local tensors."""
    for rank_out in runs:
        out = rank_out["optimizer_only"]
        assert out["policy"] == OPT_SIM and out["infos"] == [""]
        assert out["masters_before"] == 0
        assert out["grads_stay"] and out["groups_hold_params"]
        assert out["state_keyed_by_params"] and out["state_global_host"]
        assert out["masters_separate"]


def test_optimizer_only_offload_recovers_from_a_step_that_raises(runs):
    for rank_out in runs:
        out = rank_out["optimizer_only"]
        assert out["raised"] == "RuntimeError: closure failed"
        assert out["during_failed_step"], "the failed step should have left the masters in"
        assert out["restored"] and out["stepped_after"]


def test_optimizer_only_offload_refusals_name_the_parameter(runs):
    out = runs[0]["optimizer_only"]
    assert out["capturable"].startswith("RuntimeError") and "capturable=True" in \
        out["capturable"] and "tok_embeddings.weight" in out["capturable"], out["capturable"]
    msg = out["replicated_grad"]
    assert msg.startswith("RuntimeError") and "gradient of parameter" in msg, msg
    assert "tok_embeddings.weight" in msg and "Replicate" in msg, msg
    # A group mixing a host-stepped parameter with one stepped where it is (here on the meta
    # device, without a gradient) steps: the peak budget's partial offload needs such groups.
    assert out["mixed"] == "NO ERROR", out["mixed"]


def test_step_in_backward_trains_like_the_plain_offload_step(runs):
    """shardc.step_in_backward, fused CPU AdamW with an LR schedule changing lr every step, 3
    steps: parameters and optimizer state bitwise equal to the plain offload step's, compiled
    (every parameter handed over by the backward graph's per-bucket signals, interleaved with
    the reduce-scatters) and eager (every parameter stepped from its post-accumulate hook); the
    worker's optimizer calls see plain tensors."""
    for rank_out in runs:
        fx, eager = rank_out["overlap"]["fx"], rank_out["overlap"]["eager"]
        for mode in (fx, eager):
            assert mode["bitwise"] and mode["state_dict_equal"] and mode["dcp_equal"], mode
            assert mode["early"] == 3 * mode["n"] and mode["late"] == 0, mode
            # The worker steps plain local shards, not DTensors (whose Python dispatch would
            # hold the GIL from the thread running the backward).
            assert mode["worker_types"] == {"Tensor"}, mode["worker_types"]
        assert fx["signalled"] == 3 * fx["n"] and eager["signalled"] == 0
        assert fx["ready_nodes"] > 1 and fx["interleaved"]
        assert fx["loaded"]


def test_plain_inputs_is_ignored_under_offload(runs):
    """``shardc.shard(..., plain_inputs=True, offload=...)`` keeps the DTensor reads: no plain
    leaves, the offload policy as given, the gradients host DTensors after an eager step. (The
    offloaded run it then is, compiled with step_in_backward: tests/test_parity.py's
    "offload_overlap"; the same run sharded with plain_inputs, bitwise: "plain_offload_overlap",
    slow since suite36.)"""
    for rank_out in runs:
        got = rank_out["plain_inputs"]
        assert got["plain"] is None and got["offload"] == SIM, got
        assert got["grads"] == [("DTensor", "cpu")], got


def test_step_in_backward_refusals(runs):
    out = runs[0]["overlap"]["refusals"]
    assert out["not_offloaded"].startswith("ValueError") and "OffloadPolicy()" in \
        out["not_offloaded"]
    assert out["lbfgs"].startswith("TypeError") and "LBFGS" in out["lbfgs"]
    assert out["capturable"].startswith("RuntimeError") and "capturable=True" in \
        out["capturable"] and "tok_embeddings.weight" in out["capturable"]
    assert out["twice"].startswith("ValueError")
    assert out["closure"].startswith("RuntimeError") and "closure" in out["closure"]
    assert out["clipped"].startswith("RuntimeError") and "clip_grad_norm_" in out["clipped"]
    assert "second gradient" in out["second_backward"], out["second_backward"]


def test_step_in_backward_leaves_no_sync_accumulation_to_the_step(runs):
    for rank_out in runs:
        out = rank_out["overlap"]["refusals"]
        assert out["no_sync_bitwise"]
        assert out["no_sync_counts"][0] == 0 and out["no_sync_counts"][1] > 0


def test_a_peak_budget_keeps_offloaded_buckets_gathered_and_saves_their_copies(runs):
    out = runs[0]["budget"]
    assert out["resharded"]["backward_h2d"] > 0 and out["budget"]["backward_h2d"] == 0
    kept = [r for r in out["budget"]["reasons"] if r.startswith("kept gathered")]
    assert kept and all("host->device copy (CPU offload)" in r for r in kept), kept
    for a, b in zip(out["resharded"]["params"], out["budget"]["params"], strict=True):
        assert torch.equal(a, b)
