"""The time model's parts on synthetic inputs: fits, the cluster profile format, fusion-aware
kernel grouping, the step timeline, and ``python -m shardc calibrate`` on the CPU."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from shardc.planning import fit
from shardc.planning.cost_model import ClusterSpec
from shardc.planning.estimate import kernel_seconds, optimizer_step_seconds
from shardc.planning.kernels import FUSABLE, MATMUL, group_kernels
from shardc.planning.plan import PLAN_VERSION, Collective, Plan
from shardc.planning.profile import (
    DEFAULT_HOST_LINK_BYTES_PER_S,
    FIXED_FIELDS,
    PER_PARAM_FIELDS,
    PRESETS,
    PROFILE_VERSION,
    ClusterProfile,
    CollectiveCurve,
    Link,
    MatmulPoint,
    ProfileError,
    load_profile,
    resolve_profile,
)
from shardc.planning.schedule import _Timeline
from shardc.planning.step import OptimizerSpec, after_backward_seconds, predict_step
from shardc.tools import calibrate as cal
from shardc.tools import host_cost

MIB = 1 << 20

# ------------------------------------------------------------------------------ fits


def test_alpha_beta_fit_recovers_latency_and_bandwidth():
    alpha, bw = 12e-6, 250e9
    sizes = [64 * 1024 * 4 ** i for i in range(8)]
    alpha_fit, bw_fit = fit.fit_alpha_beta(sizes, [alpha + s / bw for s in sizes])
    assert alpha_fit == pytest.approx(alpha, rel=1e-6)
    assert bw_fit == pytest.approx(bw, rel=1e-6)
    # One fit per size range: a small-message regime (protocol LL, high latency per byte) and a
    # large one are told apart.
    small = [(s, 5e-6 + s / 20e9) for s in sizes[:4]]
    large = [(s, 40e-6 + s / 300e9) for s in sizes[4:]]
    ranges = fit.fit_alpha_beta_ranges([s for s, _ in small + large],
                                       [t for _, t in small + large], [sizes[3]])
    assert [r[0] for r in ranges] == [sizes[3], float("inf")]
    assert ranges[0][1:] == pytest.approx((5e-6, 20e9), rel=1e-6)
    assert ranges[1][1:] == pytest.approx((40e-6, 300e9), rel=1e-6)
    with pytest.raises(ValueError, match="do not grow"):
        fit.fit_alpha_beta([1, 2, 3], [3.0, 2.0, 1.0])
    with pytest.raises(ValueError, match="two different sizes"):
        fit.fit_alpha_beta([5, 5], [1.0, 1.0])


def test_ring_link_fit_recovers_the_ring_model():
    """Curves made by the ring model at a known bandwidth and latency (what the planner uses for
    group sizes never measured) give that bandwidth and latency back."""
    truth = ClusterSpec(bus_bandwidth=370e9, latency_s=3e-6)
    sizes = [64 * 1024 * 4 ** i for i in range(8)]
    curves = [CollectiveCurve(kind, world, "intra",
                              tuple((s, truth.collective_seconds(kind, s, world)) for s in sizes))
              for kind in ("all_gather", "reduce_scatter", "all_reduce") for world in (2, 4, 8)]
    link = cal.fit_link(curves)
    assert link.bus_bandwidth == pytest.approx(370e9, rel=1e-6)
    assert link.latency_s == pytest.approx(3e-6, rel=1e-6)
    assert cal.fit_link([CollectiveCurve("all_gather", 2, "intra", ((1024, 1e-5),))]) is None


def test_interpolation():
    pts = [(1.0, 10.0), (3.0, 30.0), (5.0, 20.0)]
    assert fit.interp_linear(pts, 3.0) == 30.0
    assert fit.interp_linear(pts, 2.0) == pytest.approx(20.0)
    assert fit.interp_linear(pts, 7.0) == pytest.approx(10.0)  # along the last slope
    assert fit.interp_log([(1.0, 1.0), (100.0, 3.0)], 10.0) == pytest.approx(2.0)
    assert fit.interp_log([(1.0, 1.0), (100.0, 3.0)], 1e6) == 3.0  # clamped
    table = [((1024, 1024, 1024), 100.0), ((4096, 4096, 4096), 400.0)]
    assert fit.interp_nearest_log(table, (4096, 4096, 4096)) == 400.0
    mid = fit.interp_nearest_log(table, (2048, 2048, 2048))
    assert 100.0 < mid < 400.0 and mid == pytest.approx(250.0)  # equidistant in log space


# ------------------------------------------------------------------------------ the format


def _profile(**changes) -> ClusterProfile:
    base = ClusterProfile(
        name="synthetic", device="test", source="measured", command="pytest", date="today",
        matmul=(MatmulPoint("bfloat16", 1024, 1024, 1024, 100e12),
                MatmulPoint("bfloat16", 8192, 8192, 8192, 800e12)),
        memory=((1 << 20, 1e12), (1 << 30, 3e12)),
        collectives=(CollectiveCurve("all_gather", 2, "intra", ((1 << 20, 10e-6),
                                                                 (1 << 30, 4e-3))),),
        kernel_gpu_s=2e-6, kernel_launch_s=5e-6, overlap_slowdown=1.25)
    return dataclasses.replace(base, **changes)


def test_profile_round_trips_through_json():
    p = _profile()
    assert ClusterProfile.from_json(p.to_json()) == p
    for name in PRESETS:
        preset = load_profile(name)
        assert ClusterProfile.from_json(preset.to_json()) == preset
        assert preset.command and preset.date and preset.source  # provenance shipped with it
        # Rates an H100/H200 reaches, measured (h100.json: 445 TFLOP/s on this shape; h200.json,
        # its device terms calibrated on one H200: 669 TFLOP/s, 4.34 TB/s): a unit slip would be
        # 1000x off. The bandwidth's bound is the H200's datasheet peak (4.8 TB/s).
        assert 300e12 <= preset.matmul_rate(8192, 2048, 2048, "bfloat16") <= 990e12
        assert 2.5e12 <= preset.memory_bandwidth(1 << 30) <= 4.8e12


def test_the_h100_preset_is_its_calibration_with_the_fp8_terms_refitted():
    """The shipped h100 preset is what docs/bench/predict/s58_h100/write_h100.py writes from the
    one-H100 calibration (edit the script, not the preset): every measured field the
    calibration's, the FP8 host terms refitted through zero from its recorded residuals (the
    two-depth lines start below zero), below the slopes the calibration wrote."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "docs/bench/predict/s58_h100/write_h100.py"
    spec = importlib.util.spec_from_file_location("write_h100", path)
    write_h100 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(write_h100)
    calibration = ClusterProfile.from_json(write_h100.CALIBRATION.read_text())
    shipped = load_profile("h100")
    assert write_h100.preset(calibration) == shipped
    assert shipped.matmul == calibration.matmul and shipped.graph_call_s == calibration.graph_call_s
    assert shipped.fit_spread("optimizer_per_param_s") == calibration.fit_spread(
        "optimizer_per_param_s")
    assert 0 < shipped.fp8_forward_per_scaled_mm_s < calibration.fp8_forward_per_scaled_mm_s
    assert 0 < shipped.fp8_backward_per_scaled_mm_s < calibration.fp8_backward_per_scaled_mm_s


def test_the_h200_preset_is_its_two_calibrations_merged():
    """The shipped h200 preset is what docs/bench/predict/s56_preset/merge_h200.py writes from
    its two calibrations (edit the script, not the preset): the collective terms of the 2 x H200
    run, the rest of the one-H200 run, and both runs named in its provenance."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "docs/bench/predict/s56_preset/merge_h200.py"
    spec = importlib.util.spec_from_file_location("merge_h200", path)
    merge_h200 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge_h200)
    one, two = (ClusterProfile.from_json(p.read_text())
                for p in (merge_h200.ONE_GPU, merge_h200.TWO_GPU))
    shipped = load_profile("h200")
    assert merge_h200.merge(one, two) == shipped
    assert shipped.collectives == two.collectives and shipped.gpus == two.gpus > one.gpus
    assert shipped.collective_launch_s == two.collective_launch_s
    assert shipped.fit_spread("collective_launch_s") == two.fit_spread("collective_launch_s")
    assert shipped.graph_call_s == one.graph_call_s and shipped.matmul == one.matmul
    assert shipped.fit_spread("optimizer_per_param_s") == one.fit_spread("optimizer_per_param_s")
    assert one.command in shipped.command and two.command in shipped.command
    assert one.date in shipped.date and two.date in shipped.date


def test_profile_version_and_format_errors_are_clear(tmp_path):
    data = _profile().to_dict()
    with pytest.raises(ProfileError, match="version 99; this shardc reads versions 1, 2"):
        ClusterProfile.from_dict({**data, "version": 99})
    # A version-1 profile (before the compiled graphs' host cost): eager launches, no call cost.
    old = {k: v for k, v in data.items() if k not in ("compiled_launch_s", "graph_call_s")}
    v1 = ClusterProfile.from_dict({**old, "version": 1})
    assert v1.graph_launch_s() == v1.kernel_launch_s and v1.graph_call_s == 0.0
    with pytest.raises(ProfileError, match="not a cluster profile"):
        ClusterProfile.from_dict({k: v for k, v in data.items() if k != "format"})
    with pytest.raises(ProfileError, match="malformed"):
        ClusterProfile.from_dict({**data, "matmul": [{"dtype": "bfloat16"}]})
    with pytest.raises(ProfileError, match="neither a preset"):
        load_profile(str(tmp_path / "missing.json"))
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    assert load_profile(str(path)) == _profile()


def test_lookups_use_measured_points_and_the_ring_model_elsewhere():
    p = _profile()
    assert p.matmul_rate(8192, 8192, 8192, "bfloat16") == 800e12
    assert p.matmul_rate(8192, 8192, 8192, "float8_e4m3fn") == 1600e12  # no table: 2x bf16
    # The measured curve, interpolated linearly between its sizes.
    assert p.collective_seconds("all_gather", 1 << 30, 2) == pytest.approx(4e-3)
    mid = (1 << 20) + ((1 << 30) - (1 << 20)) // 2
    assert p.collective_seconds("all_gather", mid, 2) == pytest.approx((10e-6 + 4e-3) / 2,
                                                                       rel=1e-3)
    # Unmeasured group size or kind: the ring model at the link.
    ring = ClusterSpec(bus_bandwidth=p.intra.bus_bandwidth, latency_s=p.intra.latency_s)
    assert p.collective_seconds("all_gather", 1 << 30, 8) == pytest.approx(
        ring.collective_seconds("all_gather", 1 << 30, 8))
    # one rank: NCCL copies the buffer (read and write) at memory bandwidth
    assert p.collective_seconds("all_gather", 1 << 30, 1) == pytest.approx(
        2 * (1 << 30) / p.memory_bandwidth(2 * (1 << 30)) + p.kernel_gpu_s)


def test_groups_larger_than_a_node_run_at_the_inter_node_link():
    # the ring model only: a measured preset's curves would answer for their group sizes
    p = dataclasses.replace(load_profile("h100"), collectives=(), node_size=8)
    ring = p.ring_spec()
    nbytes = 256 << 20
    assert p.collective_seconds("all_gather", nbytes, 8) == pytest.approx(
        ring.collective_seconds("all_gather", nbytes, 8, "intra"))
    assert p.collective_seconds("all_gather", nbytes, 16) == pytest.approx(
        ring.collective_seconds("all_gather", nbytes, 16, "inter"))
    assert p.collective_seconds("all_gather", nbytes, 16) > 4 * p.collective_seconds(
        "all_gather", nbytes, 8)
    assert resolve_profile({"profile": "h100", "node_size": 16}).node_size == 16
    wide_node = dataclasses.replace(p, node_size=16)
    assert wide_node.collective_seconds("all_gather", nbytes, 16) == pytest.approx(
        ring.collective_seconds("all_gather", nbytes, 16, "intra"))


def test_cluster_option_resolution():
    assert resolve_profile(None).name == "h100"
    assert resolve_profile(None, "NVIDIA H200").name == "h200"
    assert resolve_profile({"profile": "h200", "overlap_slowdown": 1.0}).overlap_slowdown == 1.0
    # The analytical ClusterSpec keys (the CLI's flags) replace the tables by flat rates.
    flat = resolve_profile({"peak_flops": 100e12, "mem_bandwidth": 1e12, "bus_bandwidth": 50e9})
    assert flat.matmul_rate(4096, 1024, 512, "bfloat16") == 100e12
    assert flat.memory_bandwidth(12345) == 1e12
    assert flat.collective_seconds("all_gather", 1 << 20, 4) == pytest.approx(
        ClusterSpec(bus_bandwidth=50e9, latency_s=flat.intra.latency_s).collective_seconds(
            "all_gather", 1 << 20, 4))
    assert resolve_profile(_profile().to_dict()) == _profile()
    with pytest.raises(ProfileError, match="unknown cluster option"):
        resolve_profile({"warp_speed": 9})


# ------------------------------------------------------------------------------ kernels


def _block(x, g, w1, w2):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g  # rmsnorm: one kernel
    a = h @ w1
    b = F.silu(a) * a  # one kernel between the matmuls
    return x + b @ w2  # the residual add: a kernel after the second matmul


def _kernels(fn, *args):
    gm = make_fx(fn)(*args)
    compute = [n for n in gm.graph.nodes if n.op == "call_function"]
    return gm, group_kernels(gm.graph, compute)


def test_kernels_fuse_pointwise_chains_between_matmuls():
    x, g = torch.randn(64, 32), torch.randn(32)
    w1, w2 = torch.randn(32, 128), torch.randn(128, 32)
    _, kernels = _kernels(_block, x, g, w1, w2)
    assert [k.kind for k in kernels] == [FUSABLE, MATMUL, FUSABLE, MATMUL, FUSABLE]
    norm, _, act, _, residual = kernels
    # The norm reads x and g once and writes only h (read by the matmul); its intermediates
    # (x^2, the mean, rsqrt, ...) never reach memory.
    assert norm.read_bytes == x.nbytes + g.nbytes and norm.write_bytes == x.nbytes
    assert act.read_bytes == 64 * 128 * 4 and act.write_bytes == 64 * 128 * 4
    # The residual add is not fused with the norm (the matmuls lie between them: a cycle).
    assert residual.read_bytes == 2 * x.nbytes and residual.write_bytes == x.nbytes


def test_fused_kernel_costs_its_traffic_not_its_ops():
    p = _profile(memory=((1, 1e12),), kernel_gpu_s=0.0)
    x = torch.randn(1024, 1024)
    _, one = _kernels(lambda t: ((t * 2 + 1).exp() * 3).sin(), x)
    assert len(one) == 1  # four pointwise ops, one kernel: read x once, write once
    assert kernel_seconds(one[0], p) == pytest.approx(2 * x.nbytes / 1e12)
    _, cut = _kernels(lambda t: (t * 2) @ (t + 1), x)  # two pointwise heads feed one matmul
    assert [k.kind for k in cut] == [FUSABLE, MATMUL]  # t*2 and t+1: same epoch, same read
    assert cut[0].read_bytes == x.nbytes and cut[0].write_bytes == 2 * x.nbytes


def test_recompute_from_a_saved_tensor_fuses_after_the_matmul():
    """Ops that do not depend on a matmul fuse into the kernel after it that reads them, though
    the graph lists them first (Inductor schedules them there): one kernel reads ``s`` and the
    matmul's output and writes the result; ``s * 2`` never reaches memory."""
    s, x, w = torch.randn(64, 32), torch.randn(64, 16), torch.randn(16, 32)
    _, kernels = _kernels(lambda s, x, w: (x @ w) * (s * 2), s, x, w)
    assert [k.kind for k in kernels] == [MATMUL, FUSABLE]
    assert kernels[1].read_bytes == 2 * s.nbytes and kernels[1].write_bytes == s.nbytes


def test_attention_reads_is_causal_from_the_call_or_the_schema_default():
    """The attention estimate's ``is_causal`` (causal: half the FLOPs), passed by position, by
    keyword, or left at the op's default (False); True where the op has no such argument."""
    from torch import fx

    from shardc.planning.estimate import _is_causal

    g = fx.Graph()
    q = g.placeholder("q")
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default
    calls = {
        g.call_function(flash, (q, q, q, 0.0, True)): True,
        g.call_function(flash, (q, q, q)): False,  # the schema's default
        g.call_function(flash, (q, q, q), {"is_causal": True}): True,
        g.call_function(efficient, (q, q, q, None, True, 0.0, False)): False,
        g.call_function(efficient, (q, q, q, None, True, 0.0, True)): True,
        g.call_function(torch.ops.aten.mm.default, (q, q)): True,  # no such argument
    }
    assert {n: _is_causal(n) for n in calls} == calls


def test_optimizer_step_is_memory_bound_passes():
    p = _profile(memory=((1, 2e12),), kernel_gpu_s=0.0, kernel_launch_s=0.0)
    foreach = optimizer_step_seconds(4e9, 10, p)
    fused = optimizer_step_seconds(4e9, 10, p, temp_factor=0.0)
    assert foreach == pytest.approx(20 * 4e9 / 2e12) and fused == pytest.approx(7 * 4e9 / 2e12)


# ------------------------------------------------------------------------------ the timeline


def _collective(stream="shard") -> Collective:
    return Collective(id="c", kind="all_gather", graph="forward", bucket=0, params=[], bytes=0,
                      buffer_bytes=0, dtype="bfloat16", stream=stream, issue_pos=0, wait_pos=1,
                      first_use_pos=1, last_use_pos=1)


def test_timeline_host_bound_kernels_and_overlap_slowdown():
    p = _profile(kernel_launch_s=10e-6, collective_launch_s=0.0, overlap_slowdown=1.5)
    line = _Timeline(p)
    # Tiny kernels: the host launching them is the bottleneck (10 us each, not 1 us).
    for _ in range(5):
        line.kernel(1e-6)
    assert line.t == pytest.approx(5 * 10e-6 + 1e-6)
    # A long kernel lets the host run ahead: the kernels after it wait only for the device.
    line = _Timeline(p)
    line.kernel(1e-3)
    for _ in range(5):
        line.kernel(1e-6)
    assert line.t == pytest.approx(10e-6 + 1e-3 + 5e-6)
    # Compute beside a collective runs 1.5x slower while the collective runs.
    line = _Timeline(dataclasses.replace(p, kernel_launch_s=0.0))
    c = _collective()
    line.issue(c, 1e-3)
    line.kernel(2e-3)  # 1 ms beside the collective covers 1/1.5 ms of work; the rest alone
    assert line.t == pytest.approx(1e-3 + (2e-3 - 1e-3 / 1.5))
    line.wait(c)
    assert c.stall_s == 0.0
    # A wait stalls the stream only beyond where the next kernel could start anyway: the
    # host, launching tiny kernels, is past the collective's end, so nothing stalls.
    line = _Timeline(p)
    c = _collective()
    line.issue(c, 30e-6)
    for _ in range(5):
        line.kernel(1e-6)
    line.wait(c)
    assert c.stall_s == 0.0 and line.host == pytest.approx(50e-6)
    line.issue(d := _collective("tp"), 1e-3)  # waited at once: all of it stalls
    line.wait(d)
    assert d.stall_s == pytest.approx(1e-3) and line.t == pytest.approx(d.predicted_end_s)
    assert line.delay_s == pytest.approx(1e-3)  # nothing after it to absorb it
    # The time by category adds up to the stream's time: kernels, waiting for the host, waiting
    # for a collective.
    # (the two kernels launched while c ran took 1.5x as long)
    assert line.by_category["other"] == pytest.approx(2 * 1.5e-6 + 3 * 1e-6)
    assert line.by_category["exposed_comm"] == pytest.approx(1e-3)
    assert sum(line.by_category.values()) == pytest.approx(line.t)
    line = _Timeline(p)
    for _ in range(5):
        line.kernel(1e-6, "fused")
    assert line.by_category == pytest.approx({"fused": 5e-6, "launch_bound": 5 * 10e-6 - 4e-6})
    assert sum(line.by_category.values()) == pytest.approx(line.t)


def test_timeline_charges_a_compiled_graphs_host_cost():
    """A compiled graph's kernels cost the host ``compiled_launch_s`` each (not an eager op's
    launch) after ``graph_call_s`` of calling the graph: tiny kernels wait for the host."""
    p = _profile(kernel_launch_s=5e-6, compiled_launch_s=30e-6, graph_call_s=1e-3)
    line = _Timeline(p)
    for _ in range(10):
        line.kernel(1e-6)
    assert line.t == pytest.approx(1e-3 + 10 * 30e-6 + 1e-6)
    assert line.by_category["launch_bound"] == pytest.approx(line.t - 10e-6)


def test_compiled_host_cost_fit_recovers_per_kernel_and_per_call():
    per_kernel, per_call = 25e-6, 400e-6  # per graph; a training step calls two

    def step(kernels: int) -> tuple[float, float]:
        return kernels, 2 * per_call + kernels * per_kernel

    got_kernel, got_call = cal.fit_compiled_host_cost(step(14), step(110))
    assert got_kernel == pytest.approx(per_kernel) and got_call == pytest.approx(per_call)
    with pytest.raises(ValueError, match="launched"):
        cal.fit_compiled_host_cost(step(14), step(14))


def test_compiled_host_cost_over_rounds_takes_medians_and_keeps_the_spread():
    """Seven rounds of the two chains' step times, one of them slowed by other host work
    (another process; Inductor's compile workers starting) in its long chain only: the medians
    recover the terms, where that round alone would have doubled the cost per kernel, and the
    spread holds the round fits."""
    per_kernel, per_call = 10e-6, 300e-6
    kernels = (14, 110)

    def seconds(k: int, noise: float) -> float:
        return 2 * per_call + k * per_kernel + noise

    rounds = [(seconds(14, e), seconds(110, -e)) for e in (0, 2e-6, -2e-6, 1e-6, -1e-6, 0)]
    rounds.insert(2, (seconds(14, 0), seconds(110, 0) + 110 * per_kernel))
    fit_ = cal.fit_compiled_host_rounds(kernels, rounds)
    assert fit_.per_kernel_s == pytest.approx(per_kernel) \
        and fit_.per_call_s == pytest.approx(per_call)
    low, high = fit_.spread["compiled_launch_s"]
    assert low < per_kernel < high and high == pytest.approx(
        cal.fit_compiled_host_cost((14, rounds[2][0]), (110, rounds[2][1]))[0])
    assert fit_.spread["graph_call_s"][0] <= per_call <= fit_.spread["graph_call_s"][1]
    with pytest.raises(ValueError, match="one round"):
        cal.fit_compiled_host_rounds(kernels, [])


def test_interleaved_rounds_alternate_the_order_and_time_every_callable():
    calls: list[tuple[int, str]] = []

    def callable_(i: int):
        return lambda: calls.append((i, "call"))

    out = cal.interleaved_rounds([callable_(0), callable_(1)], rounds=3, steps=4,
                                 sync=lambda: calls.append((-1, "sync")))
    assert len(out) == 3 and all(len(r) == 2 and min(r) >= 0 for r in out)
    order = [i for i, what in calls if what == "call"]
    # Each round: one untimed call and four timed ones per callable, every other round reversed.
    assert order == [0] * 5 + [1] * 5 + [1] * 5 + [0] * 5 + [0] * 5 + [1] * 5
    assert sum(1 for _, what in calls if what == "sync") == 3 * 2 * 2
    with pytest.raises(ValueError, match="rounds >= 1"):
        cal.interleaved_rounds([callable_(0)], rounds=0, steps=1, sync=lambda: None)


# ------------------------------------------------------------------------------ calibrate


def test_calibrate_refuses_without_a_gpu_unless_asked(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cal.main([]) == 2
    assert "no CUDA device here" in capsys.readouterr().err


def test_calibrate_on_cpu_writes_a_readable_profile(tmp_path, monkeypatch):
    # The shapes are module constants of shardc's own; tiny ones keep the test to a second.
    monkeypatch.setattr(cal, "CPU_MATMULS", ((32, 32, 32), (64, 64, 64)))
    monkeypatch.setattr(cal, "CPU_ATTENTION", ((32, 16),))
    monkeypatch.setattr(cal, "CPU_MEMORY", (1 << 16, 1 << 18))
    monkeypatch.setattr(host_cost, "CPU_PARAM_LAYERS", (1, 2))
    out = tmp_path / "cpu.json"
    assert cal.main(["--device", "cpu", "--quick", "--out", str(out), "--name", "ci"]) == 0
    p = load_profile(str(out))
    assert p.name == "ci" and p.source == "measured" and p.version == PROFILE_VERSION == 10
    # No _scaled_mm on the CPU: FP8's host terms are not measured (zeros), and a note says so.
    assert p.fp8_forward_per_scaled_mm_s == p.fp8_backward_per_scaled_mm_s == 0.0
    assert any(n.startswith("FP8 host work not measured") for n in p.notes)
    # No GPU: the host link is the default, and a note says so.
    assert (p.host_to_device_bytes_per_s, p.device_to_host_bytes_per_s) == (25e9, 25e9)
    assert any("host link is the default" in n for n in p.notes)
    assert "calibrate --device cpu" in p.command
    assert {m.dtype for m in p.matmul} == {"float32", "bfloat16"}
    assert all(m.flops_per_s > 0 for m in p.matmul) and p.memory_bandwidth(1 << 17) > 0
    assert {a.pass_ for a in p.attention} == {"forward", "backward"}
    assert p.kernel_launch_s > 0 and p.collectives == ()  # one process: no collectives
    # ... nor the host's seconds per collective: the default, said in a note
    assert p.collective_launch_s == ClusterProfile("", "", "", "", "").collective_launch_s
    assert any(n.startswith("one process: no collective timings") and "per collective" in n
               for n in p.notes)
    # The per-parameter host work, fitted to a sharded model at two depths (notes say so; the
    # values are this CPU's timings, so only their kind is checked).
    assert all(getattr(p, f) >= 0 for f in PER_PARAM_FIELDS)
    assert all(isinstance(getattr(p, f), float) for f in FIXED_FIELDS)
    # (the kernels the cost model launches for the measured graphs are recorded beside the
    # counted ones; none are counted on the CPU)
    assert any(n.startswith("host per parameter tensor fitted to") and "3 params" in n
               and "6 params" in n and "0 kernels, " in n and " in the model" in n
               for n in p.notes)
    # Format 10: each fitted term's spread over the calibration's rounds, around the term.
    spread = {n: (low, high) for n, low, high in p.host_fit_spread}
    assert set(spread) == set(PER_PARAM_FIELDS) | set(FIXED_FIELDS)
    assert all(low <= getattr(p, n) <= high for n, (low, high) in spread.items())
    assert any(n.startswith("host terms fitted") and "[" in n for n in p.notes)
    assert p.intra == Link(*dataclasses.astuple(ClusterProfile("", "", "", "", "").intra))
    # CPU offload's host rates: the fused CPU AdamW timed here; no CUDA, so the link's default
    # each way (asserted above).
    assert p.host_adamw_params_per_s > 0
    assert p.device_to_host_bytes_per_s == DEFAULT_HOST_LINK_BYTES_PER_S
    # The device step against its model (here the CPU's own AdamW and bandwidth): measured.
    assert p.device_adamw_foreach_scale > 0 and p.device_adamw_fused_scale > 0
    # The host-speed probe (format 9): this host's, recorded.
    assert 0 < p.host_probe_s < 1.0


class _SyntheticTimer(cal.Timer):
    """A device where every timing pays a fixed launch cost once, then ``per_call`` per call;
    device work queued ahead (``lead_calls``) hides the launch."""

    def __init__(self, launch_s: float, per_call_s: float) -> None:
        super().__init__(torch.device("cpu"))
        self.launch_s, self.per_call_s, self.calls, self.leads = launch_s, per_call_s, [], []

    def time_calls(self, fn, calls: int, lead_calls: int = 0) -> float:
        self.calls.append(calls)
        self.leads.append(lead_calls)
        return (0.0 if lead_calls else self.launch_s) + calls * self.per_call_s


def test_calibration_times_kernels_back_to_back_not_their_launch():
    # A 10 us kernel behind a 30 us launch: timed alone it looks 4x slower than it runs in a
    # step (the h100 preset's small matmuls and memory-bound kernels were measured so).
    timer = _SyntheticTimer(30e-6, 10e-6)
    assert timer.median(lambda: None) == pytest.approx(40e-6)
    timer.calls.clear()
    per_call = timer.median(lambda: None, batch_s=cal.BATCH_S)
    assert timer.calls[0] == 1 and timer.calls[1] == cal.calls_per_timing(40e-6, 2e-3, 256) == 50
    assert per_call == pytest.approx(10e-6, rel=0.07)
    # Long calls are timed one at a time; tiny ones at most ``most_calls`` at once.
    assert cal.calls_per_timing(5e-3, 2e-3, 256) == 1
    assert cal.calls_per_timing(1e-7, 2e-3, 256) == 256


def test_the_device_adamw_step_is_timed_behind_queued_work():
    # A foreach step whose kernels take 1 ms on the device while its Python launches them over
    # 2 ms: timed alone on an idle device it would read 3 ms, the host's time and not the
    # device's, which the step model prices apart (optimizer_per_param_s).
    timer, profile = _SyntheticTimer(2e-3, 1e-3), _profile()
    scales = cal.measure_device_adamw_scales(timer, profile, 2, 64)
    assert timer.leads and set(timer.leads) == {cal.ADAMW_LEAD_CALLS}
    for impl in ("foreach", "fused"):
        modelled = optimizer_step_seconds(4.0 * 2 * 64, 2, profile, ran=impl)
        assert scales[f"device_adamw_{impl}_scale"] == pytest.approx(1e-3 / modelled)


# ------------------------------------------------------------------------------ per-parameter host


COEFFS = {"region_entry_per_param_s": 35e-6, "forward_graph_per_param_s": 20e-6,
          "backward_entry_per_param_s": 15e-6, "backward_graph_per_param_s": 0.0,
          "grad_handoff_per_param_s": 40e-6,
          "optimizer_per_param_s": 45e-6, "zero_grad_per_param_s": 4e-6,
          "region_entry_fixed_s": 1e-4, "forward_graph_fixed_s": 1.1e-3,
          "backward_entry_fixed_s": 2e-4, "backward_graph_fixed_s": 0.0,
          "grad_handoff_fixed_s": 3e-4,
          "optimizer_fixed_s": 1.8e-3, "zero_grad_fixed_s": 5e-5}


def _phase_times(params: int, coeffs: dict[str, float], call: float, launch: float
                 ) -> host_cost.PhaseTimes:
    """A model's phase times from a known model: each phase's fixed part, the compiled graphs'
    calls and the launches of the kernels the device runs (not in proportion to the
    parameters), and its seconds per parameter tensor. The device runs a kernel per three
    parameters more than the cost model groups (Inductor's, counted): their launches are in the
    fitted per-parameter terms (see the test)."""
    fw_model, bw_model = 4 * params // 3 + 5, 3 * params + 7
    fw_kernels, bw_kernels = fw_model + params // 3, bw_model + params // 3
    c = coeffs
    prelaunch = c["region_entry_fixed_s"] + call + launch + params * c["region_entry_per_param_s"]
    bw_prelaunch = c["backward_entry_fixed_s"] + call + launch \
        + params * c["backward_entry_per_param_s"]
    return host_cost.PhaseTimes(
        params,
        forward_s=prelaunch + c["forward_graph_fixed_s"] + (fw_kernels - 1) * launch
        + params * c["forward_graph_per_param_s"],
        backward_s=bw_prelaunch + c["grad_handoff_fixed_s"] + (bw_kernels - 1) * launch
        + params * c["grad_handoff_per_param_s"],
        optimizer_s=c["optimizer_fixed_s"] + params * c["optimizer_per_param_s"],
        zero_grad_s=c["zero_grad_fixed_s"] + params * c["zero_grad_per_param_s"],
        forward_kernels=fw_kernels, backward_kernels=bw_kernels,
        forward_prelaunch_s=prelaunch, forward_model_kernels=fw_model,
        backward_model_kernels=bw_model, backward_prelaunch_s=bw_prelaunch)


def test_per_param_host_fit_recovers_known_coefficients():
    coeffs = COEFFS
    call, launch = 565e-6, 28e-6
    times = [_phase_times(n, coeffs, call, launch) for n in (24, 96)]
    got = host_cost.fit_param_host_cost(times, launch, call)
    assert set(got) == set(PER_PARAM_FIELDS) | set(FIXED_FIELDS)
    # The launches of the kernels the model does not group (one per three parameters) go to
    # the terms spread over the graphs' launches: the forward's graph work, the backward's.
    fitted = {**coeffs, "forward_graph_per_param_s": 20e-6 + launch / 3,
              "backward_graph_per_param_s": launch / 3}
    assert got == pytest.approx(fitted, rel=1e-9, abs=1e-15)
    assert host_cost.fit_param_host_cost(times, launch, call) == got  # deterministic
    # Three depths: least squares, the same coefficients.
    three = [_phase_times(n, coeffs, call, launch) for n in (24, 48, 96)]
    assert host_cost.fit_param_host_cost(three, launch, call) == pytest.approx(
        fitted, rel=1e-9, abs=1e-15)
    # Not subtracting the launches would fold them into the per-parameter terms: the fit takes
    # out exactly what the per-kernel term prices.
    assert host_cost.fit_param_host_cost(times, 0.0, call)["forward_graph_per_param_s"] > 50e-6
    # Taking out the kernels the device ran instead of the model's takes out launches the step
    # model never charges: the host time of the kernels the model does not group is lost.
    counted = [dataclasses.replace(t, forward_model_kernels=None, backward_model_kernels=None)
               for t in times]
    lost = host_cost.fit_param_host_cost(counted, launch, call)
    assert lost["forward_graph_per_param_s"] == pytest.approx(20e-6, rel=1e-9)
    assert lost["backward_graph_per_param_s"] == 0.0
    assert lost["grad_handoff_per_param_s"] == pytest.approx(40e-6, rel=1e-9)
    # Without the time before the first launch (the CPU), the whole forward is the entry's and
    # the whole backward the hand-off's.
    cpu = [dataclasses.replace(t, forward_prelaunch_s=None, backward_prelaunch_s=None)
           for t in times]
    got = host_cost.fit_param_host_cost(cpu, launch, call)
    assert got["region_entry_per_param_s"] == pytest.approx(35e-6 + 20e-6 + launch / 3,
                                                            rel=1e-9)
    assert got["region_entry_fixed_s"] == pytest.approx(1e-4 + 1.1e-3, rel=1e-9)
    assert got["grad_handoff_per_param_s"] == pytest.approx(15e-6 + 40e-6, rel=1e-9)
    assert got["grad_handoff_fixed_s"] == pytest.approx(2e-4 + 3e-4, rel=1e-9)
    assert got["backward_graph_per_param_s"] == pytest.approx(launch / 3, rel=1e-9)
    assert got["forward_graph_per_param_s"] == got["backward_entry_per_param_s"] == 0.0
    assert got["forward_graph_fixed_s"] == got["backward_entry_fixed_s"] == 0.0
    with pytest.raises(ValueError, match="two or more parameter counts"):
        host_cost.fit_param_host_cost(times[:1] * 2, launch, call)
    with pytest.raises(ValueError, match="zero_grad.*not a finite number"):
        fit.fit_per_param([1, 2], [1e-3, float("nan")], "zero_grad_per_param_s")
    # A slope lost in noise reads as none, and the phase's mean as its fixed part.
    assert fit.fit_per_param([10, 20], [3e-3, 2e-3], "optimizer") == (2.5e-3, 0.0)


def _with_collectives(t: host_cost.PhaseTimes, forward: int, backward: int, per_collective: float,
                      fixed: float = 0.0) -> host_cost.PhaseTimes:
    """``t`` as over several ranks: ``per_collective`` more host seconds for each of the
    ``forward`` and ``backward`` collectives its graphs issue, and ``fixed`` more per step."""
    return dataclasses.replace(
        t, forward_s=t.forward_s + forward * per_collective + fixed,
        backward_s=t.backward_s + backward * per_collective,
        forward_collectives=forward, backward_collectives=backward)


def test_collective_host_fit_recovers_the_host_seconds_per_collective():
    call, launch, per_collective = 565e-6, 28e-6, 80e-6
    one_rank = [_phase_times(n, COEFFS, call, launch) for n in (24, 96)]
    terms = host_cost.fit_param_host_cost(one_rank, launch, call)
    # Two depths: the slope against the collectives; a fixed part per step drops out.
    world = [_with_collectives(t, n // 4, n // 3, per_collective, fixed=7e-4)
             for t, n in zip(one_rank, (24, 96))]
    got = host_cost.fit_collective_host_cost(world, terms, launch, call)
    assert got == pytest.approx(per_collective, rel=1e-9)
    # One depth: through zero.
    alone = [_with_collectives(one_rank[0], 6, 8, per_collective)]
    assert host_cost.fit_collective_host_cost(alone, terms, launch, call) == pytest.approx(
        per_collective, rel=1e-9)
    # The one-rank terms are what it subtracts: without them the per-parameter work would be
    # counted per collective.
    assert host_cost.fit_collective_host_cost(world, {}, launch, call) > 2 * per_collective
    # Over several ranks the host never works less per collective than none.
    faster = [_with_collectives(t, n // 4, n // 3, -per_collective)
              for t, n in zip(one_rank, (24, 96))]
    assert host_cost.fit_collective_host_cost(faster, terms, launch, call) == 0.0
    with pytest.raises(ValueError, match="issue collectives"):
        host_cost.fit_collective_host_cost(one_rank, terms, launch, call)


def _calibrate_two_ranks(rank: int, world: int) -> dict:
    """``calibrate`` on the CPU over this process group with the CPU test's tiny shapes."""
    import torch

    from shardc.planning.profile import ClusterProfile
    from shardc.tools import calibrate as cal
    from shardc.tools import host_cost

    cal.CPU_MATMULS, cal.CPU_ATTENTION, cal.CPU_MEMORY = ((32, 32, 32), (64, 64, 64)), \
        ((32, 16),), (1 << 16, 1 << 18)
    host_cost.CPU_PARAM_LAYERS = (1, 2)
    p = cal.calibrate(torch.device("cpu"), quick=True, log=lambda _: None)
    default = ClusterProfile("", "", "", "", "").collective_launch_s
    return {"launch": p.collective_launch_s, "default": default, "notes": list(p.notes),
            "gpus": p.gpus, "probe": p.host_probe_s,
            "spread": p.fit_spread("collective_launch_s")}


@pytest.mark.slow
def test_calibrate_over_two_ranks_fits_the_host_seconds_per_collective():
    """Over two gloo ranks calibration shards its per-parameter model over both and fits the
    host's seconds per collective; over one rank the default stays, and a note says so (the CPU
    test above)."""
    from dist_utils import run_ranks

    runs = run_ranks(_calibrate_two_ranks, 2)
    for run in runs:
        assert run["gpus"] == 2 and run["launch"] >= 0.0
        (note,) = [n for n in run["notes"] if n.startswith("host per collective fitted over 2")]
        # both depths' graphs issued collectives (gloo runs them on the host: they cost it)
        assert "3 params, " in note and "6 params, " in note and " 0 / " not in note, note
        # each depth with one bucket and with one per parameter tensor (format 10: and the
        # term's spread over the rounds)
        assert "module buckets" in note and "param buckets" in note, note
        low, high = run["spread"]
        assert low <= run["launch"] <= high
    assert all(run["launch"] != run["default"] for run in runs), runs
    # the host probe (format 9): the slowest rank's, the same on both
    assert runs[0]["probe"] == runs[1]["probe"] > 0


def test_host_adamw_is_timed_on_the_ranks_share_of_the_cores(monkeypatch):
    """torchrun sets one OpenMP thread per rank; the host AdamW rate is timed on the cores a
    rank would use (the machine's over the local ranks), and the caller's threads come back."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert cal.host_threads_per_rank() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))
    assert cal.host_threads_per_rank() == 1
    before = torch.get_num_threads()
    assert cal.measure_host_adamw(2, 1024, reps=1, threads=before + 1) > 0
    assert torch.get_num_threads() == before


def test_host_fit_keeps_every_term_non_negative():
    """Two depths determine a line exactly, so noise in one of them trades the fixed part
    against the slope: the fit is bounded to non-negative terms (the line through the origin,
    or the mean, whichever fits better), and a profile fitted before can be refitted from its
    own terms."""
    # A steep line with a negative intercept (2 x H200's forward graph: -0.90 ms + 75.3 us per
    # tensor at 21 and 75 tensors) becomes the least-squares line through the origin.
    counts, seconds = [21, 75], [0.6847e-3, 4.7484e-3]
    fixed, per_param = fit.fit_per_param(counts, seconds, "forward_graph_per_param_s")
    assert fixed == 0.0
    assert per_param == pytest.approx((21 * seconds[0] + 75 * seconds[1]) / (21 ** 2 + 75 ** 2),
                                      rel=1e-12)
    # A noisy pair whose unbounded fit would have a negative slope: the mean (as before).
    assert fit.fit_per_param([10, 20], [3e-3, 2e-3], "optimizer") == (2.5e-3, 0.0)
    # All negative (the other terms price the phase in full): nothing.
    assert fit.fit_per_param([10, 20], [-1e-4, -2e-4], "backward_graph") == (0.0, 0.0)
    # Where the unbounded fit is non-negative it is kept, to the last bit; three points too.
    assert fit.fit_per_param([24, 96], [1e-3 + 24e-5, 1e-3 + 96e-5], "x") == pytest.approx(
        (1e-3, 1e-5), rel=1e-12)
    assert fit.fit_per_param([8, 24, 96], [8e-5, 24e-5, 96e-5], "x") == pytest.approx(
        (0.0, 1e-5), abs=1e-15)
    # From the calibration's phase times: a negative fixed hand-off in the timings gives a
    # fixed term of zero and a slope that prices the deeper model within the trade's error.
    coeffs = {**COEFFS, "grad_handoff_fixed_s": -3e-4}
    call, launch = 565e-6, 28e-6
    times = [_phase_times(n, coeffs, call, launch) for n in (24, 96)]
    got = host_cost.fit_param_host_cost(times, launch, call)
    assert all(got[name] >= 0.0 for name in PER_PARAM_FIELDS + FIXED_FIELDS)
    assert got["grad_handoff_fixed_s"] == 0.0
    assert 0 < got["grad_handoff_per_param_s"] < 40e-6
    assert got["forward_graph_fixed_s"] == pytest.approx(1.1e-3, rel=1e-9)  # others unchanged
    # Refitting a profile's unbounded two-point terms gives what the bounded fit gives from
    # the phase times themselves.
    unbounded = {**got, "grad_handoff_fixed_s": -3e-4, "grad_handoff_per_param_s": 40e-6}
    assert host_cost.refit_nonnegative(unbounded, [24, 96]) == pytest.approx(got, rel=1e-9,
                                                                              abs=1e-15)
    with pytest.raises(ValueError, match="two parameter counts"):
        host_cost.refit_nonnegative(unbounded, [24, 48, 96])


def test_the_fitted_host_terms_reproduce_the_calibration_models_host_time():
    """Priced as the step model prices them (the call, the model's kernels at
    ``compiled_launch_s``, the per-parameter and fixed terms), the fitted terms give back each
    measured phase's host time: nothing the calibration measured is dropped or counted
    twice."""
    call, launch = 565e-6, 28e-6
    times = [_phase_times(n, COEFFS, call, launch) for n in (24, 96)]
    got = host_cost.fit_param_host_cost(times, launch, call)
    for t in times:
        n = t.params

        def phase(name: str, n: int = n) -> float:
            return got[f"{name}_per_param_s"] * n + got[f"{name}_fixed_s"]

        assert call + t.forward_model_kernels * launch + phase("region_entry") \
            + phase("forward_graph") == pytest.approx(t.forward_s, rel=1e-12)
        assert call + t.backward_model_kernels * launch + phase("backward_entry") \
            + phase("backward_graph") + phase("grad_handoff") == pytest.approx(t.backward_s,
                                                                               rel=1e-12)
        assert phase("optimizer") == pytest.approx(t.optimizer_s, rel=1e-12)
        assert phase("zero_grad") == pytest.approx(t.zero_grad_s, rel=1e-12)


def test_older_profiles_read_with_no_per_param_host_work_and_predict_as_before():
    data = load_profile("h100").to_dict()
    for name in PER_PARAM_FIELDS + FIXED_FIELDS:
        data.pop(name)
    data["version"] = 2
    v2 = ClusterProfile.from_dict(data)
    assert v2.version == 2 and all(getattr(v2, f) == 0.0 for f in PER_PARAM_FIELDS)
    assert all(getattr(v2, f) == 0.0 for f in FIXED_FIELDS)
    # The step is the plans' graphs plus the optimizer's device time, as predict_step.py added
    # them before profile version 3.
    plans = [_plan_with(0, 40e-3, queued=5e-3, handoff=0.0),
             _plan_with(1, 10e-3, queued=0.0, handoff=0.0)]
    spec = OptimizerSpec(4e9, 75)
    got = predict_step(plans, v2, spec)
    assert got.step_s == pytest.approx(50e-3 + optimizer_step_seconds(4e9, 75, v2), rel=1e-12)
    assert got.by_category == {"optimizer": optimizer_step_seconds(4e9, 75, v2)}
    # A graph's timeline without entry work is the version-2 one (graph call, then launches).
    line = _Timeline(v2)
    line.kernel(1e-6)
    assert line.t == pytest.approx(v2.graph_call_s + v2.graph_launch_s() + 1e-6)
    assert "param_host" not in line.by_category
    with pytest.raises(ProfileError, match="optimizer_per_param_s is -1"):
        dataclasses.replace(v2, optimizer_per_param_s=-1.0)


def test_the_device_optimizer_step_is_scaled_by_its_measured_ratio():
    """Profile version 8: the device AdamW step's measured-over-modelled ratio multiplies the
    modelled step of that implementation; 0 (older profiles) and the per-tensor loop: as
    modelled. Round-trips through JSON; a negative ratio is refused."""
    base = _profile()
    scaled = dataclasses.replace(base, device_adamw_foreach_scale=1.25,
                                 device_adamw_fused_scale=0.0)
    for ran, factor in (("foreach", 1.25), ("fused", 1.0), ("per_tensor", 1.0)):
        assert optimizer_step_seconds(4e9, 100, scaled, ran=ran) == pytest.approx(
            factor * optimizer_step_seconds(4e9, 100, base, ran=ran))
    again = ClusterProfile.from_json(scaled.to_json())
    assert again.device_adamw_foreach_scale == 1.25 and again.device_optimizer_scale("fused") == 1
    old = {k: v for k, v in base.to_dict().items() if not k.startswith("device_adamw")}
    assert ClusterProfile.from_dict({**old, "version": 7}).device_optimizer_scale("foreach") == 1
    with pytest.raises(ProfileError, match="device_adamw_fused_scale is -1"):
        dataclasses.replace(base, device_adamw_fused_scale=-1.0)


def _plan_with(region: int, graphs_s: float, *, queued: float, handoff: float) -> Plan:
    plan = Plan(PLAN_VERSION, region, 1, {}, [], [])
    plan.predicted.step_time_s = graphs_s
    plan.predicted.backward_queued_s, plan.predicted.grad_handoff_s = queued, handoff
    return plan


def test_entry_work_delays_the_forwards_first_kernel():
    p = _profile(kernel_launch_s=5e-6, compiled_launch_s=30e-6, graph_call_s=1e-3)
    line = _Timeline(p, entry_s=2e-3)
    for _ in range(10):
        line.kernel(1e-6)
    # Host-bound: the graph is longer by the entry work, which the device waits for.
    assert line.t == pytest.approx(1e-3 + 2e-3 + 10 * 30e-6 + 1e-6)
    assert line.by_category["param_host"] == pytest.approx(2e-3)
    assert sum(line.by_category.values()) == pytest.approx(line.t)
    assert line.queued_s() == pytest.approx(1e-6)
    # The forward's other per-parameter work is spread over its launches: a host-bound graph is
    # longer by all of it, a device-bound one (long kernels) not at all.
    spread = _Timeline(p, launch_extra_s=100e-6)
    for _ in range(10):
        spread.kernel(1e-6)
    assert spread.t == pytest.approx(1e-3 + 10 * (30e-6 + 100e-6) + 1e-6)
    bound, plain = _Timeline(p, launch_extra_s=100e-6), _Timeline(p)
    for line in (bound, plain):
        for _ in range(10):
            line.kernel(1e-3)
    assert bound.t == pytest.approx(plain.t + 100e-6)  # only the first launch's share shows


def test_host_work_after_the_backward_hides_only_under_queued_device_work():
    # Device-bound: 5 ms queued and a 10 ms optimizer on the device; the host's 1 ms hand-off,
    # 3 ms of optimizer Python and 0.5 ms zero_grad hide under them: unchanged.
    bound = after_backward_seconds(5e-3, 1e-3, 10e-3, 3e-3, 0.5e-3, ops=10)
    assert bound == pytest.approx((10e-3, 0.0))
    assert bound[0] == pytest.approx(after_backward_seconds(5e-3, 0, 10e-3, 0, 0, ops=10)[0])
    # Host-bound: the device waits for the host's work beyond the 0.5 ms queued; the
    # optimizer's last op runs after the host issues it, and zero_grad ends the step.
    end, idle = after_backward_seconds(0.5e-3, 2e-3, 1e-3, 10e-3, 0.3e-3, ops=10)
    assert end == pytest.approx(2e-3 - 0.5e-3 + 10e-3 + 0.3e-3)
    assert idle == pytest.approx(end - 1e-3)
    # In between: the hand-off exceeds the queued time by 1 ms; the optimizer (device-bound
    # per op) then runs back to back.
    assert after_backward_seconds(1e-3, 2e-3, 10e-3, 1e-3, 0, ops=10)[0] == pytest.approx(
        1e-3 + 1e-3 / 10 + 10e-3)
    with pytest.raises(ValueError, match="at least one"):
        after_backward_seconds(0, 0, 1e-3, 0, 0, ops=0)


def test_step_charges_per_param_host_work_by_the_expected_amount():
    base = _profile(memory=((1, 2e12),), kernel_gpu_s=0.0, kernel_launch_s=0.0)
    per = dataclasses.replace(base, optimizer_per_param_s=50e-6, zero_grad_per_param_s=5e-6)
    spec = OptimizerSpec(param_bytes=4e6, n_params=100)  # tiny: 40 us on the device
    device = optimizer_step_seconds(4e6, 100, base)
    # Host-bound (small batch): two regions; the later region's hand-off (3 ms) exceeds its
    # backward's queued time (1 ms) by 2 ms, the first region's (the last backward) by 1 ms.
    plans = [_plan_with(0, 20e-3, queued=0.5e-3, handoff=1.5e-3),
             _plan_with(1, 10e-3, queued=1e-3, handoff=3e-3)]
    before, after = predict_step(plans, base, spec), predict_step(plans, per, spec)
    assert before.step_s == pytest.approx(30e-3 + 2e-3 + 1e-3 + device)
    # + 5 ms of optimizer and 0.5 ms of zero_grad host work; the device's last optimizer op
    # (a tenth of its time) runs after the host's last share, before zero_grad's end.
    assert after.step_s == pytest.approx(30e-3 + 2e-3 + 1e-3 + 5e-3 + 0.5e-3)
    assert after.by_category["param_host"] == pytest.approx(after.after_s - device)
    # Device-bound (large batch: a 15 ms optimizer, 10 ms queued): unchanged by the host work.
    spec = OptimizerSpec(param_bytes=1.5e9, n_params=100)
    plans = [_plan_with(0, 60e-3, queued=10e-3, handoff=1.5e-3)]
    assert predict_step(plans, per, spec).step_s == pytest.approx(
        60e-3 + optimizer_step_seconds(1.5e9, 100, base))


def _graphs_plan(queued: float, handoff: float) -> Plan:
    """A 50 ms region (forward 20 ms, of it 8 ms waiting for the host and 1 ms for a
    collective; backward 30 ms, of it 5 ms waiting for the host)."""
    plan = _plan_with(0, 50e-3, queued=queued, handoff=handoff)
    plan.predicted.forward_time_s, plan.predicted.backward_time_s = 20e-3, 30e-3
    plan.predicted.time_by_category_s = {"forward/launch_bound": 6e-3,
                                         "forward/param_host": 2e-3,
                                         "backward/launch_bound": 5e-3,
                                         "forward/exposed_comm": 1e-3}
    return plan


def test_cuda_graph_replay_drops_the_graphs_host_waits_and_queues_the_backward():
    """Under CUDA graphs a graph's device time is the plan's without its waits for the host,
    the step waits for one replay call, and the backward's whole device time is queued, so
    the hand-off and the optimizer's host work hide under it."""
    p = _profile(memory=((1, 2e12),), kernel_gpu_s=0.0, kernel_launch_s=0.0, graph_call_s=0.4e-3,
                 optimizer_per_param_s=50e-6)
    spec = OptimizerSpec(param_bytes=4e6, n_params=100)  # 40 us on the device, 5 ms host
    plan = _graphs_plan(queued=0.5e-3, handoff=3e-3)
    eager = predict_step([plan], p, spec)
    replay = predict_step([plan], p, spec, cudagraphs=True)
    device = optimizer_step_seconds(4e6, 100, p)
    # Eager: the graphs' 50 ms, then the host's 3 ms hand-off and 5 ms of optimizer Python
    # beyond the 0.5 ms queued (host-bound).
    assert eager.step_s > 50e-3 + 7e-3
    # Replayed: 12 + 25 ms of device time and one 0.4 ms call; the 25 ms backward is queued,
    # so the hand-off and the optimizer's Python hide under it: the optimizer's device time.
    assert replay.graphs_s == pytest.approx(0.4e-3 + 12e-3 + 25e-3)
    assert replay.step_s == pytest.approx(0.4e-3 + 12e-3 + 25e-3 + device)
    forward, backward = replay.phases[0], replay.phases[1]
    assert forward.seconds == pytest.approx(12.4e-3) and forward.host_wait_s == pytest.approx(
        0.4e-3) and forward.comm_wait_s == pytest.approx(1e-3)
    assert backward.seconds == pytest.approx(25e-3) and backward.host_wait_s == 0.0
    assert sum(ph.seconds for ph in replay.phases) == pytest.approx(replay.step_s)
    assert sum(ph.seconds for ph in eager.phases) == pytest.approx(eager.step_s)


def test_back_to_back_step_is_the_longer_of_the_host_and_the_device_work():
    """Steps back to back: the host starts a step while the device still runs the last one's
    queued work, so the step is the longer of the host's work and the device's work less its
    waits for the host (the waits for collectives stay); from an idle device it is as long or
    longer."""
    p = _profile(memory=((1, 2e12),), kernel_gpu_s=0.0, kernel_launch_s=0.0,
                 optimizer_per_param_s=50e-6, optimizer_fixed_s=1e-3, zero_grad_per_param_s=2e-6)
    # Host-bound: 4 MB of optimizer state (40 us on the device), 5 ms of optimizer Python.
    small = OptimizerSpec(param_bytes=4e6, n_params=100)
    step = predict_step([_graphs_plan(queued=0.5e-3, handoff=3e-3)], p, small)
    host = 50e-3 - 0.5e-3 + 3e-3 + 1e-3 + 100 * 50e-6 + 100 * 2e-6
    assert step.host_s == pytest.approx(host)
    assert step.device_s == pytest.approx(50e-3 - 13e-3 + optimizer_step_seconds(4e6, 100, p))
    # Host-bound from the first launch to zero_grad: the host's work is the whole step, back to
    # back or not (the device-bound case below is where back to back is shorter).
    assert step.steady_s == pytest.approx(host) == pytest.approx(step.step_s)
    # Device-bound: a 1.5 GB optimizer step and 10 ms queued: the host's work (the forward's
    # entry and launches among it) hides under the device's, whose waits for the host go.
    large = OptimizerSpec(param_bytes=1.5e9, n_params=100)
    step = predict_step([_graphs_plan(queued=10e-3, handoff=3e-3)], p, large)
    device = optimizer_step_seconds(1.5e9, 100, p)
    assert step.step_s == pytest.approx(50e-3 + device)
    assert step.host_s < step.device_s
    assert step.steady_s == pytest.approx(50e-3 - 13e-3 + device)
    assert {"steady_s", "host_s", "device_s"} <= set(step.to_dict())
    # Where the host waits for the device within the step (CPU offload) or the graphs replay,
    # back to back is not modelled: the step from an idle device.
    offloaded = OptimizerSpec(param_bytes=4e6, n_params=100, offload="params")
    for got in (predict_step([_graphs_plan(0.5e-3, 3e-3)], p, offloaded),
                predict_step([_graphs_plan(0.5e-3, 3e-3)], p, small, cudagraphs=True)):
        assert got.steady_s == got.step_s and got.host_s == 0.0


def _region_graphs(layers: int = 3):
    """A one-rank region's forward (gathers, matmuls) and backward (a reduce-scatter per
    parameter), traced with fake tensors."""
    import shardc.ops.gather  # noqa: F401  (registers the shardc ops)

    gather, reduce = torch.ops.shardc.gather_param, torch.ops.shardc.reduce_scatter_grad

    def forward(x, *shards):
        h = x
        for i, s in enumerate(shards):
            h = torch.relu(h @ gather(s, f"layers.{i}.weight", 64, 1, "g", None, None,
                                      True).t())
        return h.sum()

    def backward(x, *grads):
        return [reduce(g @ (x.t() @ x), f"layers.{i}.weight", 64, 1, "g", None, torch.float32)
                for i, g in enumerate(grads)]

    shapes = [torch.randn(8, 64)] + [torch.randn(64, 64) for _ in range(layers)]
    return (make_fx(forward, tracing_mode="fake")(*shapes),
            make_fx(backward, tracing_mode="fake")(*shapes))


def test_plan_charges_the_host_per_parameter_tensor():
    """A plan of real graphs with host seconds per parameter tensor: entering the region
    delays the forward (host-bound: its first kernel waits for the guards and inputs) by
    exactly the entry work, shown as ``forward/param_host``; the backward's time is unchanged,
    its gradient hand-off recorded for the step (:mod:`shardc.planning.step`)."""
    from shardc.compile.options import ShardcOptions
    from shardc.planning.schedule import plan_region

    forward, backward = _region_graphs(3)
    base = dataclasses.replace(load_profile("h100"),
                               **dict.fromkeys(PER_PARAM_FIELDS + FIXED_FIELDS, 0.0))
    host = dataclasses.replace(base, region_entry_per_param_s=1e-3, grad_handoff_per_param_s=2e-4,
                               forward_graph_per_param_s=5e-4)
    a, b = (plan_region(forward, backward, ShardcOptions(inductor=False), cluster=p).predicted
            for p in (base, host))
    # Host-bound (tiny kernels): the entry, then the forward's per-parameter work spread over
    # its launches, all of it on the step.
    assert b.forward_time_s == pytest.approx(a.forward_time_s + 3e-3 + 3 * 5e-4, rel=1e-9)
    assert b.time_by_category_s["forward/param_host"] == pytest.approx(3e-3)
    assert sum(v for k, v in b.time_by_category_s.items() if k.startswith("forward/")) == \
        pytest.approx(b.forward_time_s)
    assert b.backward_time_s == pytest.approx(a.backward_time_s, rel=1e-12)
    assert b.grad_handoff_s == pytest.approx(3 * 2e-4) and a.grad_handoff_s == 0.0
    assert b.backward_queued_s == pytest.approx(a.backward_queued_s)
    assert b.backward_queued_s >= 0.0


def test_plan_charges_the_fixed_host_work_once_where_its_phase_runs():
    """Profile version 4: the fixed host seconds per step go to the region called first
    (region 0): its forward waits for the fixed entry and carries the fixed graph work over its
    launches, its backward waits for the backward's entry work (per gradient and fixed) before
    its first launch, and its hand-off holds the fixed part (never below zero). A later
    region gets only the per-parameter terms. Each graph records the kernels it launches."""
    from shardc.compile.options import ShardcOptions
    from shardc.planning.schedule import plan_region

    forward, backward = _region_graphs(3)
    base = dataclasses.replace(load_profile("h100"),
                               **dict.fromkeys(PER_PARAM_FIELDS + FIXED_FIELDS, 0.0))
    host = dataclasses.replace(base, region_entry_fixed_s=1e-3, forward_graph_fixed_s=2e-3,
                               backward_entry_per_param_s=1e-4, backward_entry_fixed_s=4e-4,
                               grad_handoff_per_param_s=2e-4, grad_handoff_fixed_s=5e-4)

    def plan(profile, region):
        return plan_region(forward, backward, ShardcOptions(inductor=False), cluster=profile,
                           region=region).predicted

    a, first, later = plan(base, 0), plan(host, 0), plan(host, 1)
    # Host-bound (tiny kernels): the first region's forward is longer by all of its fixed work,
    # the backward by its entry work (3 gradients); a later region's by neither.
    assert first.forward_time_s == pytest.approx(a.forward_time_s + 1e-3 + 2e-3, rel=1e-9)
    assert first.time_by_category_s["forward/param_host"] == pytest.approx(1e-3)
    assert first.backward_time_s == pytest.approx(a.backward_time_s + 3e-4 + 4e-4, rel=1e-9)
    assert first.grad_handoff_s == pytest.approx(3 * 2e-4 + 5e-4)
    assert later.forward_time_s == pytest.approx(a.forward_time_s, rel=1e-12)
    assert later.backward_time_s == pytest.approx(a.backward_time_s + 3e-4, rel=1e-9)
    assert later.grad_handoff_s == pytest.approx(3 * 2e-4)
    negative = plan(dataclasses.replace(host, grad_handoff_fixed_s=-1.0), 0)
    assert negative.grad_handoff_s == 0.0
    # The kernels each graph launches, as the timeline charged them: 3 matmuls (+ their
    # fused ReLU and the sum) forward, a matmul chain per gradient backward.
    assert a.forward_kernels == first.forward_kernels > 3
    assert a.backward_kernels == first.backward_kernels >= 6


def test_the_backward_call_hides_under_the_forwards_queued_device_work():
    """The host calls the backward as soon as the forward returns: its call and entry work
    hide under the device work the forward left queued (the host running ahead across the
    boundary), and only what exceeds it delays the device."""
    p = _profile(kernel_launch_s=5e-6, compiled_launch_s=30e-6, graph_call_s=1e-3)
    ahead, idle = _Timeline(p, entry_s=2e-3, host_ahead_s=5e-3), _Timeline(p, entry_s=2e-3)
    for line in (ahead, idle):
        line.kernel(1e-3)
    assert ahead.t == pytest.approx(1e-3)  # 3 ms of call and entry under 5 ms queued
    assert "param_host" not in ahead.by_category
    assert idle.t == pytest.approx(1e-3 + 2e-3 + 30e-6 + 1e-3)
    partly = _Timeline(p, entry_s=2e-3, host_ahead_s=1e-3)
    partly.kernel(1e-3)
    assert partly.t == pytest.approx(idle.t - 1e-3)
    # (the device's wait is the entry work's first, then the launch's)
    assert partly.by_category["param_host"] == pytest.approx(2e-3)
    assert partly.by_category["launch_bound"] == pytest.approx(30e-6)


def test_optimizer_fixed_host_work_waits_before_its_first_kernel():
    """The optimizer's fixed host work (grouping parameters and state) runs before its first
    foreach kernel: a host-bound step (nothing queued) is longer by exactly it, a device-bound
    one hides it under the backward's queued work."""
    host_bound = after_backward_seconds(0.0, 2e-3, 10e-3, 1e-3, 0.0, ops=10)
    with_fixed = after_backward_seconds(0.0, 2e-3, 10e-3, 1e-3, 0.0, ops=10,
                                        optimizer_prologue_s=1.8e-3)
    assert with_fixed[0] == pytest.approx(host_bound[0] + 1.8e-3)
    assert with_fixed[1] == pytest.approx(host_bound[1] + 1.8e-3)
    queued = after_backward_seconds(8e-3, 2e-3, 10e-3, 1e-3, 0.0, ops=10)
    assert after_backward_seconds(8e-3, 2e-3, 10e-3, 1e-3, 0.0, ops=10,
                                  optimizer_prologue_s=1.8e-3) == pytest.approx(queued)
    # The whole step: the profile's optimizer and zero_grad fixed terms.
    base = _profile(memory=((1, 2e12),), kernel_gpu_s=0.0, kernel_launch_s=0.0)
    fixed = dataclasses.replace(base, optimizer_fixed_s=1.8e-3, zero_grad_fixed_s=0.1e-3)
    spec = OptimizerSpec(param_bytes=4e6, n_params=100)
    plans = [_plan_with(0, 20e-3, queued=0.5e-3, handoff=1.5e-3)]
    device = optimizer_step_seconds(4e6, 100, base)  # 40 us: the host is the bottleneck
    assert predict_step(plans, base, spec).step_s == pytest.approx(20e-3 + 1e-3 + device)
    # the hand-off beyond the queued work, the optimizer's fixed work, zero_grad's (the
    # optimizer's kernels run under zero_grad's host work)
    assert predict_step(plans, fixed, spec).step_s == pytest.approx(
        20e-3 + 1e-3 + 1.8e-3 + 0.1e-3)
    device_bound = [_plan_with(0, 60e-3, queued=10e-3, handoff=1.5e-3)]
    big = OptimizerSpec(param_bytes=1.5e9, n_params=100)
    assert predict_step(device_bound, fixed, big).step_s == pytest.approx(
        predict_step(device_bound, base, big).step_s)


def test_a_version_3_profile_plans_as_before_and_version_4_hides_the_backward_call():
    """A version-3 profile (no fixed terms, no backward entry) reads with zeros and plans each
    graph from an idle device, as before; the same numbers as version 4 let the backward's
    call hide under the work a device-bound forward left queued."""
    from shardc.compile.options import ShardcOptions
    from shardc.planning.schedule import plan_region

    data = load_profile("h100").to_dict()
    new_in_4 = ("backward_entry_per_param_s", "backward_graph_per_param_s")
    for name in FIXED_FIELDS + new_in_4:
        data.pop(name)
    data["version"] = 3
    v3 = ClusterProfile.from_dict(data)
    assert all(getattr(v3, f) == 0.0 for f in FIXED_FIELDS + new_in_4)
    # Slow matmuls: the forward is device-bound and leaves its matmuls queued.
    slow = tuple(dataclasses.replace(m, flops_per_s=1e7) for m in v3.matmul)
    v3 = dataclasses.replace(v3, matmul=slow)
    v4 = dataclasses.replace(v3, version=4)
    forward, backward = _region_graphs(3)
    old, new = (plan_region(forward, backward, ShardcOptions(inductor=False), cluster=p).predicted
                for p in (v3, v4))
    assert new.forward_time_s == pytest.approx(old.forward_time_s, rel=1e-12)
    hidden = v3.graph_call_s + v3.graph_launch_s()
    assert old.time_by_category_s["backward/launch_bound"] >= hidden
    assert new.backward_time_s == pytest.approx(old.backward_time_s - hidden, rel=1e-9)


def test_the_host_link_is_a_profile_field_and_older_profiles_read_with_the_old_constant():
    """Profile version 5: the pinned host<->device bandwidth each way and a copy's latency,
    which price CPU offload's and activation offload's copies (the plan's copy lane, and the
    offload lever against recompute); a version-4 profile reads with the constants used before
    (25 GB/s, 10 us)."""
    from shardc.planning.offload import choose_lever, link_of
    from shardc.planning.schedule import _duration

    data = load_profile("h100").to_dict()
    for name in ("host_to_device_bytes_per_s", "device_to_host_bytes_per_s",
                 "host_copy_latency_s"):
        data.pop(name)
    data["version"] = 4
    v4 = ClusterProfile.from_dict(data)
    assert (v4.host_to_device_bytes_per_s, v4.device_to_host_bytes_per_s,
            v4.host_copy_latency_s) == (25e9, 25e9, 10e-6)
    assert v4.host_copy_seconds(25 * 10**9, to_device=True) == pytest.approx(1.0 + 10e-6)
    fast = dataclasses.replace(v4, version=5, host_to_device_bytes_per_s=50e9,
                               device_to_host_bytes_per_s=40e9, host_copy_latency_s=5e-6)
    assert ClusterProfile.from_json(fast.to_json()) == fast
    copy = Collective(id="c", kind="h2d_copy", graph="backward", bucket=0, params=[],
                      bytes=10**9, buffer_bytes=10**9, dtype="float32", stream="copy",
                      issue_pos=0, wait_pos=1, first_use_pos=1, last_use_pos=1)
    assert _duration(copy, v4) == pytest.approx(10e-6 + 1 / 25)
    assert _duration(copy, fast) == pytest.approx(5e-6 + 1 / 50)
    assert _duration(dataclasses.replace(copy, kind="d2h_copy"), fast) == \
        pytest.approx(5e-6 + 1 / 40)
    # The lever follows the profile: a 1 ms block saving 100 MB is recomputed over the old
    # 25 GB/s (4 ms each way: 3 + 2 ms exposed, per byte dearer than its 1 ms forward against
    # 90 MB freed), offloaded over a measured 200 GB/s (0.5 ms each way: hidden).
    block = dict(forward_s=1e-3, recompute_bytes=90 * 10**6, offload_bytes=100 * 10**6,
                 can_recompute=True)
    assert not choose_lever(**block, link=link_of(v4)).offload
    measured = dataclasses.replace(fast, host_to_device_bytes_per_s=200e9,
                                   device_to_host_bytes_per_s=200e9)
    lever = choose_lever(**block, link=link_of(measured))
    assert lever.offload and lever.cost_s == 0.0
    assert lever.copy_s == pytest.approx(5e-6 + 100 * 10**6 / 200e9)
    with pytest.raises(ProfileError, match="host_to_device_bytes_per_s is 0"):
        dataclasses.replace(v4, host_to_device_bytes_per_s=0)
    with pytest.raises(ProfileError, match="host_copy_latency_s"):
        dataclasses.replace(v4, host_copy_latency_s=-1.0)
