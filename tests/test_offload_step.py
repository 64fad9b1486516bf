"""The whole step's model with CPU offload (``shardc.planning.step``): the host optimizer step at
the profile's fused CPU AdamW rate, optimizer-only offload's copies at its host link, the
``step_in_backward`` worker stepping buckets as their gradients arrive, and the profile's host
rates (format 5; older profiles read with the defaults). Synthetic plans and profiles only: no
tracing, no process group."""

from __future__ import annotations

import dataclasses

import pytest

from shardc.planning import optimizer_offload
from shardc.planning.estimate import host_optimizer_seconds, optimizer_step_seconds
from shardc.planning.optimizer_kind import DEFAULT_PER_TENSOR_HOST_SLOWDOWN
from shardc.planning.plan import (
    PLAN_VERSION,
    Collective,
    CollectiveKind,
    MemoryBudget,
    OptimizerDecision,
    Plan,
)
from shardc.planning.profile import (
    DEFAULT_HOST_ADAMW_PARAMS_PER_S,
    DEFAULT_HOST_COPY_LATENCY_S,
    DEFAULT_HOST_LINK_BYTES_PER_S,
    HOST_FIELDS,
    HOST_LINK_FIELDS,
    ClusterProfile,
    HostLink,
    ProfileError,
    load_profile,
)
from shardc.planning.schedule import _duration
from shardc.planning.step import OptimizerSpec, predict_step

RATE = 2e9  # parameters/s of the synthetic host's fused CPU AdamW
LATENCY = DEFAULT_HOST_COPY_LATENCY_S  # the synthetic profile's (the format default, 10 us)


def _profile(**changes) -> ClusterProfile:
    base = ClusterProfile(
        name="synthetic", device="test", source="measured", command="pytest", date="today",
        memory=((1 << 20, 1e12), (1 << 30, 1e12)), kernel_gpu_s=0.0, kernel_launch_s=0.0,
        optimizer_per_param_s=20e-6, optimizer_fixed_s=1e-3, zero_grad_per_param_s=2e-6,
        zero_grad_fixed_s=0.1e-3, host_adamw_params_per_s=RATE,
        device_to_host_bytes_per_s=20e9, host_to_device_bytes_per_s=40e9)
    return dataclasses.replace(base, **changes)


def _plan(graphs_s: float = 40e-3, backward_s: float = 30e-3, queued: float = 2e-3,
          handoff: float = 5e-3) -> Plan:
    plan = Plan(PLAN_VERSION, 0, 1, {}, [], [])
    p = plan.predicted
    p.step_time_s, p.forward_time_s, p.backward_time_s = graphs_s, graphs_s - backward_s, \
        backward_s
    p.backward_queued_s, p.grad_handoff_s = queued, handoff
    return plan


def _d2h(bucket: int, end_s: float, elements: int, tensors: int) -> Collective:
    return Collective(
        id=f"backward.d2h_copy.{bucket}", kind=CollectiveKind.D2H_COPY, graph="backward",
        bucket=bucket, params=[f"p{bucket}.{i}" for i in range(tensors)], bytes=4 * elements,
        buffer_bytes=4 * elements, dtype="float32", stream="copy", issue_pos=0, wait_pos=1,
        first_use_pos=1, last_use_pos=1, predicted_start_s=end_s - 1e-3, predicted_end_s=end_s,
        group="copy", group_size=1)


def test_older_profiles_read_with_the_host_rate_defaults_and_bad_rates_are_refused():
    data = load_profile("h100").to_dict()  # the h100 preset as a version-4 profile
    for name in HOST_FIELDS + HOST_LINK_FIELDS + ("host_copy_latency_s",):
        data.pop(name)
    data["version"] = 4
    v4 = ClusterProfile.from_dict(data)
    assert v4.host_to_device_bytes_per_s == v4.device_to_host_bytes_per_s \
        == DEFAULT_HOST_LINK_BYTES_PER_S == 25e9
    assert v4.host_copy_latency_s == DEFAULT_HOST_COPY_LATENCY_S == 10e-6
    assert v4.host_adamw_params_per_s == DEFAULT_HOST_ADAMW_PARAMS_PER_S
    p = _profile()
    assert ClusterProfile.from_json(p.to_json()) == p
    for name in HOST_FIELDS + HOST_LINK_FIELDS:
        with pytest.raises(ProfileError, match=name):
            dataclasses.replace(p, **{name: 0.0})


def test_offloaded_step_runs_on_the_host_at_the_profiles_adamw_rate():
    prof, plan = _profile(), _plan()
    n, tensors = 500e6, 200  # 2 GB of fp32 masters
    spec = OptimizerSpec(4 * n, tensors, temp_factor=0.0, name="AdamW (fused)",
                         offload="params")
    step = predict_step([plan], prof, spec)
    compute = n / RATE  # 0.25 s
    assert step.optimizer_host_s == pytest.approx(compute)
    assert host_optimizer_seconds(4 * n, prof, temp_factor=0.0) == pytest.approx(compute)
    # graphs, then the hand-off beyond the queued device work, the optimizer's Python, the
    # host compute and zero_grad: the device has nothing to run meanwhile.
    python = prof.optimizer_fixed_s + prof.optimizer_per_param_s * tensors
    zero_grad = prof.zero_grad_fixed_s + prof.zero_grad_per_param_s * tensors
    expected = 40e-3 + (5e-3 - 2e-3) + python + compute + zero_grad
    assert step.step_s == pytest.approx(expected, rel=1e-12)
    assert step.optimizer_device_s == 0.0 and "on the host" in step.optimizer
    assert sum(step.by_category.values()) == pytest.approx(step.after_s, rel=1e-12)
    opt = {ph.name: ph for ph in step.phases}["optimizer"]
    assert opt.runs_on == "host" and opt.bound == "host"
    assert sum(ph.seconds for ph in step.phases) == pytest.approx(step.step_s, rel=1e-12)
    # twice the parameters per rank: twice the host compute; a host twice as fast: half
    twice = predict_step([plan], prof, dataclasses.replace(spec, param_bytes=8 * n))
    assert twice.step_s - step.step_s == pytest.approx(compute, rel=1e-9)
    fast = predict_step([plan], dataclasses.replace(prof, host_adamw_params_per_s=2 * RATE),
                        spec)
    assert step.step_s - fast.step_s == pytest.approx(compute / 2, rel=1e-9)
    # AdamW with foreach and fused unset on host tensors: torch runs the per-tensor CPU
    # kernels (foreach=True on the CPU loops over the same ones), at the profile's per-tensor
    # rate, else the fused rate over DEFAULT_PER_TENSOR_HOST_SLOWDOWN (profiles before 7)
    for impl in ("auto", "per_tensor", "foreach"):
        slow = predict_step([plan], prof, dataclasses.replace(spec, temp_factor=1.0, impl=impl))
        assert slow.optimizer_host_s == pytest.approx(compute * DEFAULT_PER_TENSOR_HOST_SLOWDOWN)
        assert ("torch.optim runs it per tensor" in slow.optimizer) == (impl != "foreach")
    measured = dataclasses.replace(prof, host_adamw_per_tensor_params_per_s=RATE / 4)
    slow = predict_step([plan], measured, dataclasses.replace(spec, temp_factor=1.0))
    assert slow.optimizer_host_s == pytest.approx(compute * 4)
    # fused=True whatever the temporaries' factor says
    fused = predict_step([plan], prof, dataclasses.replace(spec, temp_factor=1.0, impl="fused"))
    assert fused.optimizer_host_s == pytest.approx(compute)


def test_optimizer_only_offload_adds_its_copies_at_the_host_link():
    prof, plan = _profile(), _plan()
    spec = OptimizerSpec(4e9, 100, temp_factor=0.0, offload="optimizer")
    step = predict_step([plan], prof, spec)
    plain = predict_step([plan], prof, dataclasses.replace(spec, offload="params"))
    # shards and gradients to the host (20 GB/s), shards back (40 GB/s): three copies of the
    # shards' bytes, each at its direction's rate
    copies = 3 * LATENCY + 4e9 / 20e9 + 4e9 / 20e9 + 4e9 / 40e9
    assert copies == pytest.approx(3 * LATENCY + 0.5)
    assert step.step_s - plain.step_s == pytest.approx(copies, rel=1e-9)
    assert step.by_category["offload_copies"] == pytest.approx(copies)


def test_step_in_backward_steps_each_bucket_once_its_gradients_are_on_the_host():
    prof = _profile()
    # backward 300 ms; three buckets of 100M parameters (50 ms each at 2e9/s, 10 tensors)
    plan = _plan(graphs_s=400e-3, backward_s=300e-3)
    plan.copies = [_d2h(0, 100e-3, 100_000_000, 10), _d2h(1, 120e-3, 100_000_000, 10),
                   _d2h(2, 290e-3, 100_000_000, 10)]
    spec = OptimizerSpec(4 * 300e6, 30, temp_factor=0.0, offload="params", overlap=True)
    step = predict_step([plan], prof, spec)
    bucket = 100e6 / RATE + 10 * prof.optimizer_per_param_s
    worker = 100e-3 + bucket  # bucket 0
    worker += bucket  # bucket 1 arrived while bucket 0 stepped
    worker = max(worker, 290e-3) + bucket  # bucket 2 after its arrival
    behind = worker - 300e-3
    zero_grad = prof.zero_grad_fixed_s + prof.zero_grad_per_param_s * 30
    # optimizer.step() waits for the worker (beside the main thread's hand-off), then its own
    # Python; nothing is left for it to step.
    expected = 400e-3 - 2e-3 + max(5e-3, 2e-3 + behind) + prof.optimizer_fixed_s + zero_grad
    assert step.step_s == pytest.approx(expected, rel=1e-12)
    plain = predict_step([plan], prof, dataclasses.replace(spec, overlap=False))
    assert step.step_s < plain.step_s
    assert step.optimizer_host_s == plain.optimizer_host_s == pytest.approx(300e6 / RATE)
    # Gradients that all arrive at the backward's end: nothing to overlap, the plain step.
    for c in plan.copies:
        c.predicted_end_s = 300e-3
    late = predict_step([plan], prof, spec)
    assert late.step_s == pytest.approx(plain.step_s - (5e-3 - 2e-3), rel=1e-9)
    # (only the hand-off hides: the worker runs beside it)
    with pytest.raises(ValueError, match="offload='params'"):
        OptimizerSpec(1.0, 1, overlap=True)


def test_device_optimizer_term_is_the_step_models_and_scales_with_parameters_per_rank():
    prof, plan = _profile(), _plan()
    spec = OptimizerSpec(8e9, 100)
    step = predict_step([plan], prof, spec)
    half = predict_step([plan], prof, dataclasses.replace(spec, param_bytes=4e9))
    assert step.optimizer_device_s == optimizer_step_seconds(8e9, 100, prof)
    # flat memory bandwidth, no per-kernel time: the device term halves with the bytes
    assert half.optimizer_device_s == pytest.approx(step.optimizer_device_s / 2, rel=1e-12)
    assert step.optimizer == "AdamW (foreach) on the device"
    assert sum(ph.seconds for ph in step.phases) == pytest.approx(step.step_s, rel=1e-12)


def test_offload_copies_run_at_the_profiles_host_link():
    c = _d2h(0, 0.0, 250_000_000, 1)  # 1 GB
    fast = _profile(device_to_host_bytes_per_s=50e9, host_to_device_bytes_per_s=10e9)
    assert _duration(c, fast) == pytest.approx(LATENCY + 0.02)
    back = dataclasses.replace(c, kind=CollectiveKind.H2D_COPY)
    assert _duration(back, fast) == pytest.approx(LATENCY + 0.1)
    # the h100 preset's measured link (docs/bench/predict/s58_h100/h100_s58.json): 1 GB to
    # the host at 55.96 GB/s plus 16.3 us, back at 56.12 GB/s
    h100 = load_profile("h100")
    assert _duration(c, h100) == pytest.approx(16.29e-6 + 1e9 / 55.955e9, rel=1e-3)
    assert _duration(back, h100) == pytest.approx(16.29e-6 + 1e9 / 56.120e9, rel=1e-3)


def test_activation_offload_lever_prices_copies_at_the_given_link():
    from shardc.compile.budget_search import free_candidates
    from shardc.passes.recompute import Block

    block = Block("layers.0", "inline", 0, (), saved_bytes=1 << 30, input_bytes=1 << 28)
    estimates = {"layers.0": (3 << 28, 1 << 30, 40e-3)}  # freed, saved, forward seconds
    # 1 GiB each way: 21 ms at 50 GB/s hides under the 40 ms forward (free); 215 ms at 5 GB/s
    # does not, and recomputing (40 ms for 0.75 GiB) is cheaper per byte.
    fast = free_candidates([block], estimates, "auto", HostLink(50e9, 50e9, LATENCY))[0]
    slow = free_candidates([block], estimates, "auto", HostLink(5e9, 5e9, LATENCY))[0]
    assert fast.offload and fast.copy_s == pytest.approx(LATENCY + (1 << 30) / 50e9)
    assert not slow.offload and slow.copy_s == pytest.approx(LATENCY + (1 << 30) / 5e9)


def test_the_offload_decision_and_the_step_prediction_price_the_copies_alike():
    """Optimizer-only offload's copies have one price (``optimizer_offload.copy_seconds``):
    the budget planner's decision (``optimizer_offload.price``, recorded as ``d2h_ms`` and
    ``h2d_ms``) and the whole-step prediction (``predict_step``'s ``offload_copies``) agree to
    the float, each way at its rate with a latency per copy (shards and gradients: two copies
    to the host, shards: one back)."""
    plan = _plan()
    for latency in (0.0, 1e-3):
        prof = _profile(host_copy_latency_s=latency)
        for param_bytes in (4e6, 4e9):
            d2h, _, h2d = optimizer_offload.price(int(param_bytes), int(param_bytes), 1, prof)
            assert d2h == pytest.approx(2 * latency + 2 * param_bytes / 20e9, rel=1e-12)
            assert h2d == pytest.approx(latency + param_bytes / 40e9, rel=1e-12)
            spec = OptimizerSpec(param_bytes, 10, temp_factor=0.0, offload="optimizer")
            step = predict_step([plan], prof, spec)
            plain = predict_step([plan], prof, dataclasses.replace(spec, offload="params"))
            assert step.by_category["offload_copies"] == pytest.approx(d2h + h2d, rel=1e-12)
            assert step.step_s - plain.step_s == pytest.approx(d2h + h2d, rel=1e-9)
            record = optimizer_offload.decision(
                freed_bytes=0, host_bytes=0, n_params=int(param_bytes) // 4,
                param_bytes=int(param_bytes), grad_bytes=int(param_bytes), profile=prof,
                floor_bytes=1, peak_bytes=0)
            assert (record.d2h_ms + record.h2d_ms) * 1e-3 == pytest.approx(
                step.by_category["offload_copies"], rel=1e-12)
            # the host step too, for the fused AdamW the decision assumes (another optimizer's
            # host step the decision does not scale: see optimizer_offload.price)
            assert record.step_ms * 1e-3 == pytest.approx(step.optimizer_host_s, rel=1e-12)
    # no bytes, no copy (and no latency)
    assert optimizer_offload.copy_seconds(0, 0, _profile(host_copy_latency_s=1e-3)) == (0.0, 0.0)


def test_the_host_link_and_its_defaults_have_one_source_the_profile():
    """Every host<->device copy is priced by the cluster profile's host link
    (``HostLink.copy_seconds``, through ``ClusterProfile.host_copy_seconds`` or
    ``offload.link_of``): the copy lane, the activation-offload lever and optimizer-only
    offload's copies. The link's defaults are the profile format's (its fields' defaults);
    no other module keeps a default link or its own copy formula."""
    import inspect
    import pathlib

    import shardc
    from shardc.planning import copies
    from shardc.planning.offload import choose_lever, link_of

    assert not hasattr(copies, "copy_seconds") and not hasattr(copies, "HOST_LINK_BYTES_PER_S")
    default = ClusterProfile(name="d", device="d", source="estimate", command="", date="")
    assert default.host_link == HostLink(DEFAULT_HOST_LINK_BYTES_PER_S,
                                         DEFAULT_HOST_LINK_BYTES_PER_S,
                                         DEFAULT_HOST_COPY_LATENCY_S)
    with pytest.raises(TypeError):
        HostLink()  # no defaults of its own
    assert "link" in inspect.signature(choose_lever).parameters
    assert inspect.signature(choose_lever).parameters["link"].default is inspect.Parameter.empty
    # Each user prices a copy as the profile does (a skewed link tells the directions apart).
    prof = _profile(device_to_host_bytes_per_s=7e9, host_to_device_bytes_per_s=70e9,
                    host_copy_latency_s=3e-4)
    n = 1 << 28
    c = _d2h(0, 0.0, n // 4, 1)
    assert _duration(c, prof) == prof.host_copy_seconds(n, to_device=False)
    back = dataclasses.replace(c, kind=CollectiveKind.H2D_COPY)
    assert _duration(back, prof) == prof.host_copy_seconds(n, to_device=True)
    lever = choose_lever(forward_s=1.0, recompute_bytes=n, offload_bytes=n, can_recompute=True,
                         link=link_of(prof))
    assert lever.copy_s == prof.host_copy_seconds(n, to_device=False)
    assert optimizer_offload.copy_seconds(n, n, prof) == (
        2 * prof.host_copy_seconds(n, to_device=False), prof.host_copy_seconds(n, to_device=True))
    # The defaults are named in the profile module alone.
    root = pathlib.Path(shardc.__file__).parent
    users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                   if p.name != "profile.py" and ("DEFAULT_HOST_LINK" in p.read_text()
                                                  or "DEFAULT_HOST_COPY" in p.read_text()))
    assert users == [], users


def _budgeted(plan: Plan, host_params: list[str] | None, host_share: float) -> Plan:
    """``plan`` with a peak budget whose last lever put the optimizer of ``host_params`` (None:
    every parameter) on the host, ``host_share`` of its 4e9 shard bytes."""
    decision = OptimizerDecision(True, 0, 0, 0, 0.0, 0.0, 0.0, "test", host_params,
                                 [0] if host_params else [])
    plan.budget = MemoryBudget(budget_bytes=1, minimum_bytes=1, peak_bytes=1, optimizer=decision)
    plan.predicted.param_bytes = 4e9
    plan.predicted.optimizer_host_param_bytes = 4e9 * host_share if host_params else None
    return plan


def test_the_step_prices_the_budgets_optimizer_offload_whole_or_partial():
    """The peak budget's last lever runs as optimizer-only offload (every parameter) or as a
    mixed step (some parameters on the host, the rest on the device): the whole-step
    prediction prices what runs, not the device step the user's optimizer would take."""
    prof = _profile()
    spec = OptimizerSpec(4e9, 100, temp_factor=0.0)
    device = predict_step([_plan()], prof, spec)
    whole = predict_step([_budgeted(_plan(), None, 1.0)], prof, spec)
    offload = predict_step([_plan()], prof, dataclasses.replace(spec, offload="optimizer"))
    assert whole.step_s == pytest.approx(offload.step_s)
    assert whole.by_category == pytest.approx(offload.by_category)
    assert "optimizer-only offload" in whole.optimizer
    quarter = predict_step([_budgeted(_plan(), ["p0"], 0.25)], prof, spec)
    # a quarter of the bytes (and of the tensors) on the host: its copies and host step, then
    # the other three quarters' device step
    host = predict_step([_plan()], prof, dataclasses.replace(spec, param_bytes=1e9, n_params=25,
                                                            offload="optimizer"))
    rest = optimizer_step_seconds(3e9, 75, prof, temp_factor=0.0)
    assert quarter.by_category["offload_copies"] == pytest.approx(
        host.by_category["offload_copies"])
    assert quarter.optimizer_host_s == pytest.approx(host.optimizer_host_s)
    assert quarter.optimizer_device_s == pytest.approx(rest)
    # after the other 75 tensors' host work; zero_grad's host work hides under that device step
    zero_grad_of_host_only = 25 * prof.zero_grad_per_param_s + prof.zero_grad_fixed_s
    assert quarter.step_s == pytest.approx(
        host.step_s - zero_grad_of_host_only + 75 * prof.optimizer_per_param_s + rest)
    assert device.step_s < quarter.step_s < whole.step_s
    assert "25% of the shards" in quarter.optimizer
    # the user's own offload is priced as asked (the budget does not decide it then)
    assert predict_step([_budgeted(_plan(), ["p0"], 0.25)], prof,
                        dataclasses.replace(spec, offload="params")).step_s == pytest.approx(
        predict_step([_plan()], prof, dataclasses.replace(spec, offload="params")).step_s)
