"""The host-speed probe (issue 19): a fixed host workload timed at calibration (profile format 9,
``host_probe_s``) and at run time; the ratio rescales exactly the profile's host-seconds terms
(``shardc.planning.host_speed.with_host_speed``), and ``predict_step.py --refine-host``
predicts with the rescaled profile beside the unchanged prediction."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks

from shardc.planning.estimate import optimizer_step_seconds
from shardc.planning.host_speed import (
    host_adamw_field,
    host_speed_factor,
    require_host_probe,
    with_host_adamw_rate,
    with_host_speed,
)
from shardc.planning.plan import PLAN_VERSION, Plan
from shardc.planning.profile import (
    FIXED_FIELDS,
    FP8_HOST_FIELDS,
    HOST_SECONDS_FIELDS,
    PER_PARAM_FIELDS,
    PROFILE_VERSION,
    READABLE_PROFILE_VERSIONS,
    ClusterProfile,
    MatmulPoint,
    ProfileError,
    load_profile,
    resolve_profile,
)
from shardc.planning.step import OptimizerSpec, predict_step
from shardc.tools import host_adamw_probe, host_probe
from shardc.tools.host_adamw_probe import refine_host_adamw
from shardc.tools.host_probe import agreed_host_probe, measure_host_probe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _profile(**changes) -> ClusterProfile:
    """A profile whose host-seconds terms are distinct and non-zero (and a probe)."""
    base = ClusterProfile(
        name="probed", device="test", source="measured", command="pytest", date="today",
        matmul=(MatmulPoint("bfloat16", 1024, 1024, 1024, 100e12),),
        memory=((1 << 20, 1e12), (1 << 30, 3e12)), kernel_gpu_s=2e-6, host_probe_s=2e-3,
        notes=("calibrated",))
    host = {name: (k + 1) * 1e-6 for k, name in enumerate(HOST_SECONDS_FIELDS)}
    return dataclasses.replace(base, **{**host, **changes})


def test_the_host_seconds_fields_are_every_host_term_once():
    assert set(HOST_SECONDS_FIELDS) == {"kernel_launch_s", "compiled_launch_s", "graph_call_s",
                                        "collective_launch_s", *PER_PARAM_FIELDS,
                                        *FIXED_FIELDS, *FP8_HOST_FIELDS}
    assert len(set(HOST_SECONDS_FIELDS)) == len(HOST_SECONDS_FIELDS)


def test_with_host_speed_scales_exactly_the_host_seconds_fields():
    p = _profile()
    refined = with_host_speed(p, 3e-3)  # the host 1.5x slower than at calibration
    assert host_speed_factor(p, 3e-3) == pytest.approx(1.5)
    for f in dataclasses.fields(ClusterProfile):
        before, after = getattr(p, f.name), getattr(refined, f.name)
        if f.name in HOST_SECONDS_FIELDS:
            assert before > 0 and after == pytest.approx(1.5 * before, rel=1e-12), f.name
        elif f.name == "host_probe_s":
            assert after == 3e-3
        elif f.name == "name":
            assert after == "probed+host x1.500"
        elif f.name == "notes":
            assert after[:-1] == p.notes and "x1.5000" in after[-1]
            assert "3.000 ms" in after[-1] and "2.000 ms" in after[-1]
        else:  # the device, the links, the host link and the host AdamW rates
            assert after == before, f.name
    # not measured (None: the eager launch's) stays not measured; the same probe: same terms
    assert with_host_speed(_profile(compiled_launch_s=None), 1e-3).compiled_launch_s is None
    same = with_host_speed(p, p.host_probe_s)
    assert all(getattr(same, n) == getattr(p, n) for n in HOST_SECONDS_FIELDS)


def _plan(graphs_s: float, queued: float, handoff: float) -> Plan:
    plan = Plan(PLAN_VERSION, 0, 1, {}, [], [])
    plan.predicted.step_time_s = graphs_s
    plan.predicted.backward_queued_s, plan.predicted.grad_handoff_s = queued, handoff
    return plan


def test_a_host_bound_step_grows_with_the_factor_and_a_device_bound_one_does_not():
    p = _profile(kernel_gpu_s=0.0, optimizer_fixed_s=1.8e-3, optimizer_per_param_s=20e-6,
                 zero_grad_fixed_s=0.1e-3, zero_grad_per_param_s=2e-6)
    slower = with_host_speed(p, 2 * p.host_probe_s)
    # Host-bound: nothing queued after the backward and a small optimizer (its device time
    # ~tens of us): the part after the graphs is the host's work, doubled.
    small = OptimizerSpec(param_bytes=4e6, n_params=100)
    plans = [_plan(20e-3, queued=0.0, handoff=0.0)]
    base, refined = predict_step(plans, p, small), predict_step(plans, slower, small)
    host = 1.8e-3 + 100 * 20e-6 + 0.1e-3 + 100 * 2e-6
    assert base.after_s == pytest.approx(host, rel=1e-9)
    assert refined.after_s == pytest.approx(2 * host, rel=1e-9)
    assert refined.graphs_s == base.graphs_s  # the plans' graphs, priced at compile time
    # Device-bound: the backward leaves more device work queued than the host's work, and a
    # large optimizer: the step hardly changes (zero_grad's host work after the optimizer's
    # last kernel launch still shows: 70 us of 87 ms).
    large = OptimizerSpec(param_bytes=4e9, n_params=100)
    queued = [_plan(60e-3, queued=20e-3, handoff=0.0)]
    assert optimizer_step_seconds(4e9, 100, p) > 2 * host
    device_bound = predict_step(queued, p, large).step_s
    assert predict_step(queued, slower, large).step_s == pytest.approx(device_bound, rel=1e-3)


def test_format_9_keeps_the_probe_and_older_profiles_read_without_one():
    assert PROFILE_VERSION == 10 and 9 in READABLE_PROFILE_VERSIONS
    p = _profile()
    again = ClusterProfile.from_json(p.to_json())
    assert again == p and again.host_probe_s == 2e-3 and again.version == PROFILE_VERSION
    data = load_profile("h100").to_dict()
    data.pop("host_probe_s")
    data["version"] = 8
    v8 = ClusterProfile.from_dict(data)
    assert v8.version == 8 and v8.host_probe_s == 0.0
    for bad in (-1e-3, math.nan, math.inf, "1"):
        with pytest.raises(ProfileError, match="host_probe_s is"):
            dataclasses.replace(p, host_probe_s=bad)


def test_a_profile_without_a_probe_is_refused_naming_it():
    old = _profile(name="old-h200", host_probe_s=0.0)
    for call in (lambda: require_host_probe(old), lambda: with_host_speed(old, 1e-3)):
        with pytest.raises(ProfileError, match="'old-h200' has no host probe") as info:
            call()
        assert "python -m shardc calibrate" in str(info.value)
    for bad in (0.0, -1e-3, math.nan, math.inf, True):
        with pytest.raises(ProfileError, match="positive finite number of seconds"):
            with_host_speed(_profile(), bad)


def test_the_probe_runs_on_the_cpu():
    seconds = measure_host_probe(torch.device("cpu"), reps=3)
    assert isinstance(seconds, float) and math.isfinite(seconds) and 0 < seconds < 1.0
    # no process group: the local value
    assert 0 < agreed_host_probe(torch.device("cpu")) < 1.0
    with pytest.raises(ValueError, match="reps must be >= 1"):
        measure_host_probe(torch.device("cpu"), reps=0)


def _probe_on_ranks(rank: int, world: int) -> dict:
    import torch

    from shardc.tools import host_probe

    local = host_probe.measure_host_probe(torch.device("cpu"), reps=3)
    return {"local": local, "agreed": host_probe.agreed_host_probe(torch.device("cpu"))}


def test_every_rank_agrees_on_the_slowest_probe():
    runs = run_ranks(_probe_on_ranks, 2)
    agreed = {run["agreed"] for run in runs}
    assert len(agreed) == 1 and agreed.pop() > 0, runs


def test_predict_step_refine_host_flag_and_its_refusal():
    import predict_step

    assert predict_step._args([]).refine_host is False
    assert predict_step._args(["--refine-host"]).refine_host is True
    with pytest.raises(SystemExit, match="--refine-host: .*'old' has no host probe"):
        predict_step.refine_host_setup(_profile(name="old", host_probe_s=0.0),
                                       torch.device("cpu"))
    probe = predict_step.refine_host_setup(_profile(), torch.device("cpu"))
    assert probe["calibrated_s"] == 2e-3 and probe["run_s"] > 0
    assert probe["factor"] == pytest.approx(probe["run_s"] / 2e-3)


def test_the_rescaled_profile_reaches_the_backend_as_the_cluster_option():
    """``--refine-host`` passes the rescaled profile to the backend as a full profile dict
    (``ShardcOptions.cluster``): it resolves to the same profile, so the compiled graphs are
    planned at the host's speed too."""
    refined = with_host_speed(_profile(), 3e-3)
    assert resolve_profile(refined.to_dict()) == refined


def test_with_host_adamw_rate_replaces_the_rate_that_prices_the_implementation():
    """The run-time AdamW rate replaces the one field that prices the implementation stepping
    host tensors (per tensor for torch's default and foreach, fused for fused) and nothing
    else; a profile without a per-tensor rate (0: priced at the fused one over the default
    slowdown) gets the measured one."""
    p = _profile(host_adamw_params_per_s=4e9, host_adamw_per_tensor_params_per_s=0.6e9)
    assert host_adamw_field("per_tensor") == host_adamw_field("foreach") == (
        "host_adamw_per_tensor_params_per_s")
    assert host_adamw_field("fused") == "host_adamw_params_per_s"
    for ran, field, before in (("per_tensor", "host_adamw_per_tensor_params_per_s", 0.6e9),
                               ("foreach", "host_adamw_per_tensor_params_per_s", 0.6e9),
                               ("fused", "host_adamw_params_per_s", 4e9)):
        probed = with_host_adamw_rate(p, 0.75e9, ran)
        assert probed.host_adamw_rate(ran) == 0.75e9
        for f in dataclasses.fields(ClusterProfile):
            after = getattr(probed, f.name)
            if f.name == field:
                assert after == 0.75e9
            elif f.name == "name":
                assert after == f"probed+adamw {ran} 0.75e9"
            elif f.name == "notes":
                assert after[:-1] == p.notes and field in after[-1]
                assert f"x{0.75e9 / before:.3f}" in after[-1]
            else:
                assert after == getattr(p, f.name), (ran, f.name)
    unmeasured = _profile(host_adamw_params_per_s=3e9)  # per tensor: 3e9 / 6
    assert unmeasured.host_adamw_rate("per_tensor") == pytest.approx(0.5e9)
    assert with_host_adamw_rate(unmeasured, 0.7e9).host_adamw_rate("per_tensor") == 0.7e9
    assert resolve_profile(probed.to_dict()) == probed  # a full profile: the backend takes it
    for bad in (0.0, -1.0, math.nan, math.inf, True, "1e9"):
        with pytest.raises(ProfileError, match="positive finite number"):
            with_host_adamw_rate(p, bad)
    with pytest.raises(ProfileError, match="'adam' is not one of"):
        with_host_adamw_rate(p, 1e9, "adam")


def test_an_offloaded_host_step_follows_the_probed_rate():
    """CPU offload's host step is the master elements over the rate: half the rate, twice the
    host step, the graphs unchanged."""
    p = _profile(kernel_gpu_s=0.0, host_adamw_per_tensor_params_per_s=0.5e9)
    spec = OptimizerSpec(param_bytes=4e9, n_params=100, offload="params")  # 1e9 masters
    plans = [_plan(20e-3, queued=0.0, handoff=0.0)]
    base = predict_step(plans, p, spec)
    slower = predict_step(plans, with_host_adamw_rate(p, 0.25e9, "per_tensor"), spec)
    assert base.graphs_s == slower.graphs_s
    assert slower.optimizer_host_s - base.optimizer_host_s == pytest.approx(2.0, rel=1e-6)
    assert slower.steady_s - base.steady_s == pytest.approx(2.0, rel=1e-6)


def test_refine_host_adamw_times_the_implementation_and_agrees_on_the_slowest(monkeypatch):
    """``refine_host_adamw``: calibration's measurement of the implementation that runs (per
    tensor unless fused), on the given threads and the run's sizes, the smallest rate over the
    ranks (here two stand-in ranks: an all-reduce MIN), in place of the profile's."""
    import torch.distributed as dist

    from shardc.tools import calibrate

    calls = []

    def fake_measure(tensors, numel, reps=3, threads=None, per_tensor=False):
        calls.append((tensors, numel, threads, per_tensor))
        return 0.8e9 if per_tensor else 5e9

    monkeypatch.setattr(calibrate, "measure_host_adamw", fake_measure)
    p = _profile(host_adamw_params_per_s=4e9, host_adamw_per_tensor_params_per_s=0.6e9)
    probed, info = refine_host_adamw(p, torch.device("cpu"), threads=3)
    assert calls == [(*calibrate.CPU_HOST_ADAMW, 3, True)]
    assert probed.host_adamw_per_tensor_params_per_s == 0.8e9
    assert probed.host_adamw_params_per_s == 4e9
    assert {k: info[k] for k in ("ran", "field", "probed_params_per_s",
                                 "profile_params_per_s", "threads", "tensors", "numel")} == {
        "ran": "per_tensor", "field": "host_adamw_per_tensor_params_per_s",
        "probed_params_per_s": 0.8e9, "profile_params_per_s": 0.6e9, "threads": 3,
        "tensors": calibrate.CPU_HOST_ADAMW[0], "numel": calibrate.CPU_HOST_ADAMW[1]}
    assert info["ratio"] == pytest.approx(0.8 / 0.6) and info["probe_s"] >= 0
    # A CUDA device's host: the run's probe size (calibration's tensors, half as many).
    assert host_adamw_probe.RUN_HOST_ADAMW == (8, 1 << 24)
    assert calibrate.GPU_HOST_ADAMW[1] == host_adamw_probe.RUN_HOST_ADAMW[1]
    calls.clear()
    fused, info = refine_host_adamw(p, torch.device("cpu"), "fused", threads=1, size=(2, 8))
    assert calls == [(2, 8, 1, False)] and fused.host_adamw_params_per_s == 5e9
    assert info["field"] == "host_adamw_params_per_s" and info["ratio"] == pytest.approx(1.25)
    with pytest.raises(ValueError, match="ran must be one of"):
        refine_host_adamw(p, torch.device("cpu"), "auto")
    # Two ranks: the slower host (the smaller rate) is every rank's; seconds agree on the max.
    reduced = []

    def fake_all_reduce(tensor, op=None, group=None):
        reduced.append(op)
        other = 0.5e9 if op == dist.ReduceOp.MIN else 9.0
        values = [float(tensor.item()), other]
        tensor.fill_(min(values) if op == dist.ReduceOp.MIN else max(values))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    probed, info = refine_host_adamw(p, torch.device("cpu"), threads=3)
    assert info["probed_params_per_s"] == 0.5e9 == probed.host_adamw_per_tensor_params_per_s
    assert host_probe.agree_on_slowest(2.0, torch.device("cpu"), larger_is_slower=True) == 9.0
    assert reduced == [dist.ReduceOp.MIN, dist.ReduceOp.MAX]


def test_the_host_adamw_probe_runs_on_the_cpu():
    """The real measurement at the CPU size (no process group: the local value), one thread."""
    rate = host_adamw_probe.agreed_host_adamw(torch.device("cpu"), threads=1)
    assert math.isfinite(rate) and rate > 0
