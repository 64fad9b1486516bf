"""The benchmarks' GPU kernel categories (``benchmarks/train/kernels.py``): kernel names as
torch.profiler traces show them on H100/H200, sorted the way the plan's predictions are."""

from __future__ import annotations

import pytest

from benchmarks.train.kernels import kernel_breakdown, kernel_category, kernel_time_by_category


@pytest.mark.parametrize("name, category", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn>",
     "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", "matmul"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>",
     "attention_forward"),
    ("void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>",
     "attention_backward"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1",
     "attention_forward"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x64x128_4x1x1",
     "attention_backward"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention_forward"),
    ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", "attention_backward"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*, void const*)",
     "attention_backward"),
    ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int)",
     "attention_backward"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_7", "fused"),
    ("triton_poi_fused__to_copy_t_1", "fused"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "comm"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<4>>",
     "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
     "other"),
])
def test_kernel_names_are_sorted_into_the_plans_categories(name, category):
    assert kernel_category(name) == category


def test_waited_communication_counts_only_gaps_the_compute_resumed_from():
    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [
        kernel("nvjet_tst_128x256", 0.0, 10.0),
        kernel("ncclDevKernel_AllGather_RING_LL", 5.0, 25.0),  # alone 10..30
        kernel("triton_poi_fused_add_0", 31.0, 9.0),  # starts 1 us after: it waited
        kernel("ncclDevKernel_ReduceScatter_Sum_f32", 45.0, 5.0),  # alone 45..50
        kernel("nvjet_tst_128x256", 100.0, 10.0),  # 50 us later: a gap of its own
    ]
    out = kernel_breakdown(events, steps=1)
    assert out["exposed_comm_ms"] == pytest.approx(25e-3)  # 20 + 5 us with nothing else
    assert out["waited_comm_ms"] == pytest.approx(20e-3)


def test_kernel_time_by_category_sums_per_step_and_counts_idle_time():
    events = [
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x256", "ts": 0.0, "dur": 100.0},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_0", "ts": 150.0, "dur": 50.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 200.0, "dur": 20.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 500.0},  # not GPU
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x256", "ts": 300.0, "dur": 100.0},
    ]
    out = kernel_time_by_category(events, steps=2)
    assert out["matmul"] == pytest.approx(0.1)  # 200 us over 2 steps, in ms
    assert out["fused"] == pytest.approx(0.025) and out["copies"] == pytest.approx(0.01)
    assert out["idle"] == pytest.approx((50.0 + 80.0) / 2 / 1e3)
    assert kernel_time_by_category([], steps=1) == {}


def test_predict_step_sets_predicted_beside_measured_by_category():
    from benchmarks.predict_step import category_table, predicted_by_category

    pred = predicted_by_category([{"forward/matmul": 0.010, "backward/matmul": 0.020,
                                   "backward/launch_bound": 0.001}],
                                 {"optimizer": 0.016, "param_host": 0.0005})
    assert pred["matmul"] == pytest.approx(30.0) and pred["backward/matmul"] == pytest.approx(20.0)
    assert pred["optimizer"] == pytest.approx(16.0) and pred["step/optimizer"] == 16.0
    assert pred["param_host"] == pytest.approx(0.5)
    row = {"status": "ok", "config": {"model": "1b", "layers": 8, "batch": 4, "seq": None},
           "predicted_ms_by_category": pred,
           "measured_ms_by_category": {"matmul": 24.0, "optimizer": 15.0, "idle": 2.0}}
    table = category_table([row], 2048)
    assert table[-1].startswith("| – | 1b | 8 | 4 x 2048 | 30.0 / 24.0 |")  # mesh not named
    assert category_table([{**row, "mesh": "hsdp 2x1"}], 2048)[-1].startswith(
        "| hsdp 2x1 | 1b | 8 | 4 x 2048 | 30.0 / 24.0 |")
    # shardc's pack/unpack copies are Triton kernels on the GPU: compared with fused ones.
    both = category_table([{**row, "predicted_ms_by_category": {**pred, "fused": 2.0,
                                                                "copies": 3.0},
                            "measured_ms_by_category": {"fused": 4.5, "copies": 0.2}}], 2048)
    assert "| 5.0 / 4.7 |" in both[-1] and "| fused + copies |" in both[-3]
    # Device idle: waiting for the host's launches and its per-parameter work.
    assert "| 16.0 / 15.0 | 1.5 / 2.0 |" in table[-1]
    assert category_table([{**row, "status": "error"}], 2048) == []


class _Event:
    """A CUDA event's stand-in: the device time (ms) at which it ran."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, other: _Event) -> float:
        return other.ms - self.ms


def test_predict_step_reports_where_each_phase_ends_on_host_and_device():
    from benchmarks.predict_step import (
        PHASES,
        phase_boundaries,
        phase_table,
        predicted_boundaries,
    )
    from shardc.planning.plan import PLAN_VERSION, Plan
    from shardc.planning.step import StepPrediction

    # The host returns from the forward at 9 ms (the device reaches it then too: it waited),
    # from the backward at 24 ms while the device is busy until 27 ms (the host 3 ms ahead).
    host = [100.0, 100.009, 100.024, 100.030, 100.0303]
    events = [_Event(5.0), _Event(14.0), _Event(32.0), _Event(48.0), _Event(48.0)]
    got = phase_boundaries(host, events)
    assert list(got) == list(PHASES)
    assert got["forward"] == pytest.approx({"host": 9.0, "device": 9.0})
    assert got["backward"] == pytest.approx({"host": 24.0, "device": 27.0})
    assert got["zero_grad"] == pytest.approx({"host": 30.3, "device": 43.0})
    assert phase_boundaries(host, None)["backward"] == pytest.approx({"host": 24.0})
    # The model's side: one region whose forward leaves 1 ms queued, whose backward ends with
    # 5 ms queued and a 7 ms hand-off (the host returns 2 ms after the device's end).
    plan = Plan(PLAN_VERSION, 0, 1, {}, [], [])
    p = plan.predicted
    p.forward_time_s, p.backward_time_s, p.forward_queued_s = 8e-3, 10e-3, 1e-3
    p.backward_queued_s, p.grad_handoff_s = 5e-3, 7e-3
    pred = predicted_boundaries([plan], StepPrediction(18e-3, 20e-3, 15e-3))
    assert pred["forward"] == pytest.approx({"host": 7.0, "device": 8.0})
    assert pred["backward"] == pytest.approx({"host": 20.0, "device": 20.0})
    assert pred["zero_grad"] == pytest.approx({"device": 38.0})
    row = {"status": "ok", "config": {"model": "1b", "layers": 8, "batch": 1, "seq": None},
           "measured_phases_ms": got, "predicted_phases_ms": pred}
    table = phase_table([row], 2048)
    assert table[-1].startswith("| – | 1b | 8 | 1 x 2048 | 9.0 / 9.0 | 7.0 / 8.0 | 24.0 / 27.0 | "
                                "20.0 / 20.0 | 30.0 / 43.0 | – |")
    assert table[-1].endswith("| 30.3 / 43.0 | – / 38.0 |")
    assert phase_table([{**row, "status": "error"}], 2048) == []


class _Mesh:
    """A DeviceMesh's stand-in: its shape and dimension names."""

    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> None:
        self.shape, self.mesh_dim_names, self.ndim = shape, names, len(shape)

    def size(self, dim: int | None = None) -> int:
        return self.shape[dim] if dim is not None else int(__import__("math").prod(self.shape))


def test_predict_step_mesh_flags_and_row_labels():
    from benchmarks import bench_mesh
    from benchmarks.predict_step import _args

    args = _args(["--mesh", "2x1", "--configs", "1b:8:4"])
    assert (args.mesh, args.tp) == ("2x1", 1) and _args(["--tp", "2"]).tp == 2
    assert bench_mesh.parse_mesh("1x2", 2) == (1, 2) and bench_mesh.parse_mesh(None, 2) is None
    with pytest.raises(SystemExit):
        bench_mesh.parse_mesh("2x2", 2)
    with pytest.raises(SystemExit):
        bench_mesh.parse_mesh("2by1", 2)
    assert bench_mesh.label(_Mesh((2,))) == "fsdp 2"
    assert bench_mesh.label(_Mesh((2, 1), ("replicate", "shard"))) == "hsdp 2x1"
    assert bench_mesh.label(_Mesh((1, 2), ("replicate", "shard"))) == "hsdp 1x2"
    assert bench_mesh.label(_Mesh((1, 2), ("dp", "tp"))) == "fsdp 1 x tp 2"


def test_predict_step_offload_flags_make_the_policy_the_spec_and_the_row_labels():
    """--offload / --step-in-backward: the OffloadPolicy train_bench shards with, the
    OptimizerSpec the CLI's ``plan --offload ... --optimizer adamw`` builds (impl "auto": torch's
    default AdamW, per tensor where a group holds host tensors), and rows, meta and the report
    naming the offload. No process group."""
    import torch

    from benchmarks.predict_step import (  # offload_policy: train.shardc_mode's, as it shards
        _args,
        offload_label,
        offload_lines,
        offload_policy,
        optimizer_spec,
        row_head,
    )
    from shardc.tools.planner import PlanSetup
    from shardc.tools.planner import optimizer_spec as cli_spec

    plain = _args([])
    assert (plain.offload, plain.step_in_backward) == ("none", False)
    spec = optimizer_spec(plain, {}, 1e6, 10)
    assert (spec.offload, spec.overlap, spec.impl, spec.param_bytes, spec.n_params) == (
        "none", False, "auto", 1e6, 10)
    for argv, offload, overlap in ((["--offload", "params"], "params", False),
                                   (["--offload", "params", "--step-in-backward"], "params", True),
                                   (["--offload", "optimizer"], "optimizer", False)):
        args = _args(argv)
        spec = optimizer_spec(args, {}, 4e6, 21)
        assert (spec.offload, spec.overlap, spec.impl) == (offload, overlap, "auto")
        assert (spec.state_factor, spec.temp_factor) == (2.0, 1.0)
        assert spec.ran(host_in_group=True) == "per_tensor"
        # The CLI planner's spec for the same setup (--optimizer adamw) agrees but for the name.
        cli = PlanSetup(offload=offload, step_in_backward=overlap, optimizer="adamw")
        torch_spec = cli_spec(torch.nn.Linear(2, 2), cli)
        for field in ("offload", "overlap", "impl", "state_factor", "temp_factor"):
            assert getattr(spec, field) == getattr(torch_spec, field), field
    # A backend option's optimizer kind is what runs (and what the spec prices).
    assert optimizer_spec(_args(["--offload", "params"]), {"optimizer_impl": "fused"}, 1.0,
                          1).impl == "fused"
    for bad in (["--step-in-backward"], ["--offload", "optimizer", "--step-in-backward"],
                ["--offload", "both"]):
        with pytest.raises(SystemExit):
            _args(bad)
    # The policies, as train_bench's shardc-offload modes shard (simulated on a CPU mesh).
    assert offload_policy("none", on_cpu=True) is None and offload_policy(False, True) is None
    full, opt_only = offload_policy("params", on_cpu=True), offload_policy("optimizer", False)
    assert (full.params, full.optimizer, full.simulate_on_cpu) == (True, True, True)
    assert (opt_only.params, opt_only.optimizer, opt_only.simulate_on_cpu) == (False, True, False)
    assert offload_policy(True, on_cpu=False).params is True
    assert offload_policy("auto", on_cpu=False).params == "auto"
    # Rows and the report name it; reports from before --offload read as none.
    row = {"mesh": "fsdp 1", "config": {"model": "1b", "layers": 8, "batch": 4, "seq": None}}
    assert row_head(row, 2048) == "| fsdp 1 | 1b | 8 | 4 x 2048 |"
    assert row_head({**row, "offload": "params", "step_in_backward": True}, 2048) == (
        "| fsdp 1, offload params + step_in_backward | 1b | 8 | 4 x 2048 |")
    assert row_head({**row, "offload": "optimizer"}, 2048).startswith(
        "| fsdp 1, offload optimizer |")
    assert offload_label("none") is None and offload_lines({}) == []
    assert "step_in_backward" in offload_lines({"offload": "params", "step_in_backward": True})[0]


def test_predict_step_probe_host_adamw_flag_the_implementation_and_the_report():
    """--probe-host-adamw: refused where no host optimizer step is priced; the implementation
    probed is the one the prediction prices host tensors at (per tensor for torch's default,
    fused where the backend option says); the probe's setup on the CPU (no process group);
    the rows' second prediction and the report's table of it. No process group."""
    import torch

    from benchmarks.predict_step import (
        _args,
        adamw_probe_table,
        host_adamw_ran,
        probe_host_adamw_setup,
        probed_log,
        probed_predictions,
        render,
    )
    from shardc.planning.profile import resolve_profile

    assert _args([]).probe_host_adamw is False
    args = _args(["--offload", "params", "--probe-host-adamw"])
    assert args.probe_host_adamw and host_adamw_ran(args) == "per_tensor"
    assert _args(["--memory-budget", "auto", "--probe-host-adamw"]).probe_host_adamw
    with pytest.raises(SystemExit):
        _args(["--probe-host-adamw"])  # no host step to price
    assert host_adamw_ran(_args(["--offload", "optimizer", "--probe-host-adamw",
                                 "--backend-option", "optimizer_impl=fused"])) == "fused"
    assert host_adamw_ran(_args(["--offload", "params", "--backend-option",
                                 "optimizer_temp_factor=0"])) == "fused"
    profile = resolve_profile({"profile": "h200"})
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        probed, meta = probe_host_adamw_setup(profile, args, torch.device("cpu"))
    finally:
        torch.set_num_threads(before)
    assert meta["threads"] == 1 and meta["ran"] == "per_tensor" and meta["profile"] == "h200"
    assert meta["profile_params_per_s"] == profile.host_adamw_per_tensor_params_per_s
    assert probed.host_adamw_per_tensor_params_per_s == meta["probed_params_per_s"] > 0
    assert probed.host_adamw_params_per_s == profile.host_adamw_params_per_s
    assert meta["calibration_threads"] >= 1 and meta["probe_s"] >= 0

    class _Step:
        steady_s, step_s, after_s, optimizer_host_s = 0.9, 1.0, 0.7, 0.6

    pred = probed_predictions(_Step())
    assert pred == {"predicted_step_probed_adamw_s": 0.9,
                    "predicted_synced_step_probed_adamw_s": 1.0,
                    "predicted_optimizer_probed_adamw_s": 0.7,
                    "predicted_optimizer_host_probed_adamw_s": 0.6}
    row = {"status": "ok", "mesh": "fsdp 1", "offload": "params",
           "config": {"model": "1b", "layers": 8, "batch": 4, "seq": None,
                      "precision": "bf16"},
           "predicted_step_s": 0.9528, "measured_step_s": 0.7527,
           "predicted_synced_step_s": 0.9528, "predicted_fwd_bwd_s": 0.1,
           "measured_fwd_bwd_s": 0.1, "predicted_optimizer_s": 0.85,
           "measured_optimizer_s": 0.7265, "predicted_exposed_comm_s": 0.0, **pred}
    probe = {"ran": "per_tensor", "field": "host_adamw_per_tensor_params_per_s",
             "probed_params_per_s": 0.75e9, "profile_params_per_s": 0.569e9,
             "ratio": 0.75 / 0.569, "threads": 16, "tensors": 8, "numel": 1 << 24,
             "probe_s": 1.4}
    meta_report = {"command": "c", "git": "g", "date": "d", "gpu": "H200", "world_size": 1,
                   "torch": "2.11", "nccl": "2", "profile": "h200", "seq": 2048, "steps": 5,
                   "warmup": 2, "offload": "params", "host_adamw_probe": probe}
    report = {"meta": meta_report, "results": [row]}
    table = adamw_probe_table(report, 2048)
    assert "per_tensor, 8 x 16M elements on 16 intra-op thread(s)" in table[1]
    assert "0.750 G params/s against the profile's 0.569 (x1.318)" in table[1]
    assert table[-1] == ("| fsdp 1, offload params | 1b | 8 | 4 x 2048 | 952.8 | 900.0 | "
                         "752.7 | +26.6% | +19.6% | 700.0 | 726.5 |")
    assert "\n".join(table) in render(report)
    assert probed_log(row) == "; probed AdamW: predicted 900.0 ms (+19.6%)"
    # Reports without the probe (or rows without its prediction): no table, no log part.
    assert adamw_probe_table({**report, "meta": {**meta_report, "host_adamw_probe": None}},
                             2048) == []
    plain = {k: v for k, v in row.items() if "probed" not in k}
    assert adamw_probe_table({**report, "results": [plain]}, 2048) == []
    assert probed_log(plain) == ""
    assert "Host AdamW probed" not in render({"meta": {**meta_report, "host_adamw_probe": None},
                                              "results": [plain]})


def test_train_bench_names_the_plans_step_time_the_graphs_not_the_step():
    """``predicted_step_time_s`` (key kept) is the plans' forward+backward graphs: the goals'
    sentence says so and points to predict_step.py for the whole step."""
    from benchmarks.train.goals import diagnose

    lines = diagnose({"shardc": {"predicted_step_time_s": 0.126, "predicted_comm_time_s": 0.01,
                                 "predicted_exposed_comm_s": 0.002, "n_regions": 1}})
    line = next(x for x in lines if x.startswith("Plan prediction"))
    assert "forward+backward graphs 126.0 ms" in line and "predict_step.py" in line
    assert "step 126.0" not in line


def test_predict_step_counts_the_plans_collectives_by_group():
    from benchmarks.predict_step import comm_by_group, comm_table
    from shardc.planning.plan import PLAN_VERSION, Collective, Plan

    def coll(kind: str, group: str, mib: int, ms: float, elided: bool = False) -> Collective:
        return Collective("c", kind, "backward", 0, [], 0, mib << 20, "float32", group, 0, 1, 1,
                          1, predicted_end_s=ms / 1e3, exposed_s=ms / 2e3, group=group,
                          group_size=2, elided=elided)

    plan = Plan(PLAN_VERSION, 0, 1, {}, [], [])
    plan.collectives = [coll("reduce_scatter", "shard", 4, 1.0, elided=True),
                        coll("all_reduce", "replicate", 4, 2.0),
                        coll("all_reduce", "replicate", 8, 3.0), coll("all_reduce", "tp", 1, 0.4)]
    got = comm_by_group([plan])
    assert got["replicate/all_reduce"] == pytest.approx(
        {"n": 2, "elided": 0, "mib": 12.0, "ms": 5.0, "exposed_ms": 2.5})
    assert got["shard/reduce_scatter"]["elided"] == 1 and got["shard/reduce_scatter"]["n"] == 0
    row = {"status": "ok", "mesh": "hsdp 2x1", "predicted_comm_by_group": got,
           "config": {"model": "1b", "layers": 8, "batch": 4, "seq": None}}
    assert comm_table([row], 2048)[-1] == (
        "| hsdp 2x1 | 1b | 8 | 4 x 2048 | replicate/all_reduce: 2 x, 12.0 MiB, 5.0 ms (2.5); "
        "shard/reduce_scatter: –, 1 elided; tp/all_reduce: 1 x, 1.0 MiB, 0.4 ms (0.2) |")


def test_plan_vs_measured_plans_the_mesh_the_gpu_run_used():
    from benchmarks.plan_vs_measured import mesh_setup

    old = mesh_setup({"world_size": 2})  # reports before --mesh / --tp: FSDP over every rank
    assert (old.tp, old.shard_size, old.precision, old.inductor) == (1, None, "bf16", True)
    assert mesh_setup({"mesh_shape": [2, 1], "tp": 1}).shard_size == 1
    assert mesh_setup({"mesh_shape": None, "tp": 2}).tp == 2
    assert (old.offload, old.step_in_backward, old.optimizer_name) == ("none", False, "adamw")
    offloaded = mesh_setup({"offload": "params", "step_in_backward": True})
    assert (offloaded.offload, offloaded.step_in_backward) == ("params", True)
    assert offloaded.optimizer_name == "adamw"  # torch's default AdamW, as the run stepped


def test_plan_vs_measured_plans_with_the_runs_budget_and_cuda_graphs():
    from benchmarks.plan_vs_measured import _run_options
    from shardc.planning.budget import auto_budget
    from shardc.tools.planner import DEVICES_GIB, GIB

    cluster = {"profile": "h200"}
    assert _run_options({"memory_budget": None}, cluster) == {"cluster": cluster}
    assert _run_options({"memory_budget": "123"}, cluster)["peak_memory_budget_bytes"] == 123
    auto = _run_options({"memory_budget": "auto", "gpu": "NVIDIA H200"}, cluster)
    assert auto["peak_memory_budget_bytes"] == auto_budget(DEVICES_GIB["h200"] * GIB)
    with pytest.raises(SystemExit, match="not known"):
        _run_options({"memory_budget": "auto", "gpu": "cpu"}, cluster)


def test_the_steps_exposed_communication_is_the_least_a_rank_waited():
    """Ranks meet at every collective, so the rank with the most compute waits least, and that
    least is what communication adds to the step; the step itself is the slowest rank's."""
    from benchmarks.predict_matrix import step_comm
    from benchmarks.predict_step import _slowest

    ranks = [{"status": "ok", "measured_step_s": 0.186, "measured_waited_comm_s": 0.0085,
              "measured_exposed_comm_s": 0.0089},
             {"status": "ok", "measured_step_s": 0.185, "measured_waited_comm_s": 0.0037,
              "measured_exposed_comm_s": 0.0041}]
    merged = _slowest(ranks)
    assert merged["measured_step_s"] == 0.186
    assert (merged["measured_waited_comm_s"], merged["measured_exposed_comm_s"]) == (0.0037,
                                                                                   0.0041)
    # Reports merged before kept each rank's: the matrix reads the least from them.
    assert step_comm({**ranks[0], "measured_per_rank": ranks}) == (0.0037, 0.0085)
    assert step_comm({"measured_exposed_comm_s": 0.002}) == (0.002, 0.002)
    assert step_comm({"measured_step_s": 1.0}) == (None, None)


def test_predict_matrix_runs_each_part_and_checks_the_goals(tmp_path):
    import json

    from benchmarks.predict_matrix import launches, load_reports, render, split_configs

    assert split_configs("a,b,c,d,e", 2) == ["a,c,e", "b,d"]
    assert split_configs("a", 3) == ["a"]
    runs = launches("1gpu", ["0", "1"], ["--cudagraphs"], tmp_path)
    assert [env for _, env in runs] == [{"CUDA_VISIBLE_DEVICES": "0"},
                                        {"CUDA_VISIBLE_DEVICES": "1"}]
    assert all(argv[-1] == "--cudagraphs" and "--nproc-per-node" in argv for argv, _ in runs)
    (tp_argv, tp_env), = launches("tp2", ["0", "1"], [], tmp_path)
    assert tp_argv[tp_argv.index("--tp") + 1] == "2" and tp_env == {"CUDA_VISIBLE_DEVICES": "0,1"}

    meta = {"command": "c", "git": "0" * 40, "date": "d", "gpu": "g", "world_size": 2,
            "torch": "t", "profile": "p", "seq": 2048, "mesh": "fsdp 2"}

    def row(pred_ms, meas_ms, pred_comm_ms, waited_ms, layers=8):
        return {"status": "ok", "mesh": "fsdp 2",
                "config": {"model": "1b", "layers": layers, "batch": 4, "precision": "bf16"},
                "predicted_step_s": pred_ms / 1e3, "measured_step_s": meas_ms / 1e3,
                "predicted_exposed_comm_s": pred_comm_ms / 1e3,
                "measured_waited_comm_s": waited_ms / 1e3,
                "predicted_peak_bytes": 9 << 30, "measured_peak_bytes": 10 << 30}

    report = {"meta": meta, "results": [row(96, 100, 1.0, 2.9), row(89, 100, 1.0, 3.1, 16),
                                        {"status": "error", "reason": "boom", "mesh": "fsdp 2",
                                         "config": {"model": "wide", "layers": 8, "batch": 2,
                                                    "precision": "bf16"}}]}
    (tmp_path / "predict_fsdp2.json").write_text(json.dumps(report))
    (tmp_path / "predict_matrix.json").write_text("{}")  # not a part's report
    text = render(load_reports(tmp_path))
    assert "| 2 | fsdp 2 | 1b | 8 | 4 x 2048 | bf16 | 96.0 | 100.0 | -4.0% | 1.0 / 2.9 |" in text
    assert "error: boom" in text
    assert "- step within 10%: 1 of 2 rows (within 5%: 1; largest |error| 11.0%)" in text
    assert "within max(2 ms, 25%)" in text and ": 1 of 2 rows" in text
    assert "- peak within 5%: 0 of 2 rows" in text
