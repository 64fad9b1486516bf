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
from shardc.planning.host_speed import host_speed_factor, require_host_probe, with_host_speed
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
