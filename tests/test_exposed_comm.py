"""Exposed communication: what the compute stream's waits for collectives add to the predicted
time (``shardc.planning.schedule._Timeline``, ``shardc.planning.step.step_exposed_comm``), the
counterpart of the benchmarks' measured "waited for" figure. A wait that the stream would have
spent waiting for the host anyway adds nothing."""

from __future__ import annotations

import dataclasses

import pytest
from test_cluster_profile import _profile  # the same small synthetic profile

from shardc.planning.plan import PLAN_VERSION, Collective, Plan
from shardc.planning.schedule import _Timeline
from shardc.planning.step import OptimizerSpec, predict_step, step_exposed_comm


def _collective(name: str = "c", stream: str = "shard") -> Collective:
    return Collective(id=name, kind="reduce_scatter", graph="backward", bucket=0, params=[],
                      bytes=0, buffer_bytes=0, dtype="float32", stream=stream, issue_pos=0,
                      wait_pos=1, first_use_pos=1, last_use_pos=1)


def _exposed(line: _Timeline, c: Collective) -> float:
    return line.owed.get(id(c), 0.0)


def _host_bound():
    """A profile whose kernels cost the host 1 ms each to launch (the device's are tiny)."""
    return _profile(kernel_launch_s=1e-3, compiled_launch_s=1e-3, collective_launch_s=0.0,
                    graph_call_s=0.0, kernel_gpu_s=0.0, overlap_slowdown=1.0)


def test_a_wait_the_host_would_have_made_anyway_adds_nothing():
    """Host-bound: a 0.5 ms collective issued after the first kernel and waited at once
    stalls the stream (nothing else is launched yet), but the next kernel's launch comes
    1 ms after the first's: without the stall the stream would have idled for the host as long. The
    stall is recorded, nothing is exposed, and the stream's time is unchanged."""
    line = _Timeline(_host_bound())
    line.kernel(1e-6)
    c = _collective()
    line.issue(c, 0.5e-3)
    line.wait(c)
    assert c.stall_s == pytest.approx(0.5e-3)
    assert _exposed(line, c) == pytest.approx(c.stall_s)  # owed until the host shows up
    for _ in range(3):
        line.kernel(1e-6)
    assert _exposed(line, c) == 0.0 and line.delay_s == 0.0
    assert line.t == pytest.approx(4e-3 + 1e-6)  # four launches, the last kernel's 1 us
    assert line.by_category["exposed_comm"] == pytest.approx(c.stall_s)


def test_a_collective_the_compute_waits_for_is_exposed_by_its_wait():
    """Device-bound: the stream waits 1 ms for a collective and its kernels after the wait
    run back to back (the host far ahead): the whole wait is on the graph's time."""
    p = _profile(kernel_launch_s=1e-6, compiled_launch_s=1e-6, collective_launch_s=0.0,
                 graph_call_s=0.0, overlap_slowdown=1.0)
    line = _Timeline(p)
    line.kernel(1e-3)
    c = _collective()
    line.issue(c, 2e-3)  # from 1 ms to 3 ms, waited at once
    line.wait(c)
    for _ in range(5):
        line.kernel(1e-3)
    assert c.stall_s == pytest.approx(2e-3)
    assert _exposed(line, c) == pytest.approx(2e-3) == pytest.approx(line.delay_s)
    assert line.t == pytest.approx(1e-6 + 1e-3 + 2e-3 + 5e-3)


def test_a_later_host_wait_absorbs_the_stalls_in_proportion():
    """Two stalls (2 ms and 3 ms) in a device-bound stretch, then a host gap: the host
    launches the next kernel at 3 ms, where the stall-free shadow would wait for it, while the
    stream is busy until 6 ms. 2 of the 5 ms are absorbed, each collective keeps 3/5 of its
    stall."""
    p = _profile(kernel_launch_s=1e-6, compiled_launch_s=1e-6, collective_launch_s=0.0,
                 graph_call_s=0.0, overlap_slowdown=1.0)
    line = _Timeline(p)
    a, b = _collective("a"), _collective("b", "tp")
    line.kernel(1e-3)
    line.issue(a, 2e-3)
    line.wait(a)  # a runs from 1 ms to 3 ms: the stream waits 2 ms
    line.issue(b, 3e-3)
    line.wait(b)  # stalls 3 ms more
    assert (a.stall_s, b.stall_s) == pytest.approx((2e-3, 3e-3))
    # The host is at 1 us; the stream at 6 ms + 1 us, its shadow at 1 ms + 1 us. The host now
    # does 3 ms of work before its next launch (at 3 ms + 2 us): the shadow would start that
    # kernel there, the stream at 6 ms + 1 us.
    line.host += 3e-3
    line.kernel(1e-6)
    assert line.delay_s == pytest.approx((6e-3 + 1e-6) - (3e-3 + 2e-6))
    scale = line.delay_s / 5e-3
    assert _exposed(line, a) == pytest.approx(2e-3 * scale)
    assert _exposed(line, b) == pytest.approx(3e-3 * scale)


def test_stalls_carry_from_the_forward_into_the_backward():
    """A graph starts with its region's earlier graph's unabsorbed stalls: its stall-free
    shadow starts that much earlier, so host work before its first kernel absorbs them."""
    p = _host_bound()
    c = _collective()
    owed = {id(c): 0.4e-3}
    line = _Timeline(p, entry_s=0.0, owed=owed)
    line.kernel(1e-6)  # the host reaches it 1 ms in: the 0.4 ms head start is lost
    assert line.delay_s == 0.0
    ahead = _Timeline(p, host_ahead_s=5e-3, owed=owed)  # the host far ahead: all of it stays
    ahead.kernel(1e-6)
    assert ahead.delay_s == pytest.approx(0.4e-3)
    assert owed == {id(c): 0.4e-3}  # the caller's record is not changed in place


def _plan(graphs_s: float, queued: float, handoff: float, exposed: float, stall: float) -> Plan:
    plan = Plan(PLAN_VERSION, 0, 2, {}, [], [])
    plan.predicted.step_time_s = graphs_s
    plan.predicted.backward_queued_s, plan.predicted.grad_handoff_s = queued, handoff
    plan.predicted.exposed_comm_s, plan.predicted.comm_stall_s = exposed, stall
    return plan


def test_the_steps_host_work_after_the_backward_absorbs_a_last_stall():
    """The backward ends with a 1 ms stall left (its last reduce-scatter), 1.2 ms of device
    work queued when the host returns; the host's 5 ms of hand-off and optimizer Python after
    it is the step's bottleneck. Without the stall the device would end 1 ms earlier and wait
    1 ms longer for the host: communication adds nothing to the step. With 20 ms queued the
    host hides under the device's work either way: all of the 1 ms is exposed."""
    p = dataclasses.replace(_profile(memory=((1, 2e12),), kernel_gpu_s=0.0,
                                     kernel_launch_s=0.0), optimizer_per_param_s=50e-6)
    spec = OptimizerSpec(param_bytes=4e6, n_params=100)  # 5 ms of host Python, 40 us device
    host_bound = predict_step([_plan(30e-3, 1.2e-3, 0.0, 1e-3, 1e-3)], p, spec)
    assert host_bound.exposed_comm_s == pytest.approx(0.0, abs=1e-12)
    device_bound = predict_step([_plan(30e-3, 20e-3, 0.0, 1e-3, 1e-3)], p, spec)
    assert device_bound.exposed_comm_s == pytest.approx(1e-3)
    # The step itself is what it was: the exposure is a reading of it, not a change.
    plain = predict_step([_plan(30e-3, 1.2e-3, 0.0, 0.0, 0.0)], p, spec)
    assert plain.step_s == pytest.approx(host_bound.step_s)


def test_cuda_graph_replays_expose_the_stalls():
    """A replay has no host gaps inside its graphs to absorb a stall: the plan's stalls, not
    its exposed communication, are what communication adds (its backward queued whole)."""
    p = _profile(memory=((1, 2e12),), kernel_gpu_s=0.0, kernel_launch_s=0.0)
    spec = OptimizerSpec(param_bytes=4e6, n_params=100)
    plan = _plan(30e-3, 1e-3, 0.0, 0.2e-3, 1.5e-3)
    plan.predicted.forward_time_s, plan.predicted.backward_time_s = 10e-3, 20e-3
    assert predict_step([plan], p, spec, cudagraphs=True).exposed_comm_s == pytest.approx(
        1.5e-3)
    assert predict_step([plan], p, spec).exposed_comm_s == pytest.approx(0.2e-3)
    assert step_exposed_comm([], False, 0.0, 0.0, lambda q: 0.0) == 0.0


def test_a_plans_exposure_records_add_up_and_host_gaps_absorb_them():
    """A planned two-rank region (a tiny Llama, Inductor's kernels): every collective's
    exposure is at most its stall and they add up to each graph's and the region's exposed
    communication. With a host that takes 1 ms per launch the graphs' time is the host's, and
    the step's exposed communication is nothing: no stall outlives the host work after it."""
    import json

    from shardc.models.llama import LlamaConfig
    from shardc.planning.profile import load_profile
    from shardc.tools.planner import PlanSetup, plan_model

    cfg = LlamaConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=8)
    base = load_profile("h200")
    slow_host = dataclasses.replace(base, compiled_launch_s=1e-3, kernel_launch_s=1e-3)
    for profile in (base, slow_host):
        plan = plan_model(cfg, 2, 1, 8, {"cluster": json.loads(profile.to_json())},
                          template=False, setup=PlanSetup(precision="bf16", inductor=True))[0]
        pred, colls = plan.predicted, plan.collectives
        assert all(0.0 <= c.exposed_s <= c.stall_s + 1e-15 for c in colls)
        assert pred.comm_stall_s == pytest.approx(sum(c.stall_s for c in colls))
        assert pred.exposed_comm_s == pytest.approx(sum(c.exposed_s for c in colls))
        assert pred.exposed_comm_s == pytest.approx(
            pred.forward_exposed_comm_s + pred.backward_exposed_comm_s)
        assert 0.0 < pred.exposed_comm_s <= pred.comm_stall_s
        spec = OptimizerSpec(param_bytes=pred.param_bytes, n_params=len(plan.buckets) * 4)
        step = predict_step([plan], profile, spec)
        assert 0.0 <= step.exposed_comm_s <= pred.exposed_comm_s
        if profile is slow_host:
            assert step.exposed_comm_s == pytest.approx(0.0, abs=1e-12)
