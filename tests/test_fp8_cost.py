"""FP8 in the time model (issue 19): the kernels per-tensor scaling launches (split amax
reductions that the quantize cannot fuse with), FP8's host terms in the cluster profile
(version 6), their calibration fit on synthetic timings, older profiles planning as before, and
the capacity planner tracing FP8 Linears on ``_scaled_mm`` as a GPU runs them. CPU only,
synthetic graphs and timings."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardc.planning.fit import fit_line
from shardc.planning.kernels import FUSABLE, MATMUL, group_kernels, is_split_reduction
from shardc.planning.profile import (
    FP8_HOST_FIELDS,
    PROFILE_VERSION,
    ClusterProfile,
    MatmulPoint,
    ProfileError,
    load_profile,
)
from shardc.sharding.fp8 import local_amax, quantize, scale_from_amax
from shardc.tools import calibrate as cal
from shardc.tools import host_cost

E4M3 = torch.float8_e4m3fn


def _quantize(x: torch.Tensor) -> torch.Tensor:
    """FP8's per-tensor current scaling, as ``shardc.sharding.fp8`` computes it."""
    return quantize(x, scale_from_amax(local_amax(x), E4M3), E4M3)


def _kernels(fn, *args):
    gm = make_fx(fn)(*args)
    return group_kernels(gm.graph, [n for n in gm.graph.nodes if n.op == "call_function"])


def test_quantizing_a_large_tensor_reads_it_twice_in_three_kernels():
    """The amax of a whole activation (32768 elements > 8192: Inductor splits it) is two
    kernels, and the quantize that reads the activation and the amax's scale is a third: it
    cannot fuse with the reduction, so it reads the activation again. Before, the model fused
    all of it into one kernel reading the activation once."""
    x = torch.randn(256, 128, dtype=torch.bfloat16)
    kernels = _kernels(_quantize, x)
    assert [k.kind for k in kernels] == [FUSABLE] * 3
    partial, final, quant = kernels
    assert any(is_split_reduction(n) for n in partial.nodes)
    assert partial.read_bytes == x.nbytes and partial.write_bytes <= 4  # the amax, no copy
    assert final.extra.get("split_reduction_final") and final.bytes == 0
    # The quantize reads x (bf16, not an fp32 copy written by the reduction) and the amax,
    # and writes 1 byte per element.
    assert x.nbytes <= quant.read_bytes <= x.nbytes + 8
    assert quant.write_bytes == x.numel()
    # A small tensor (a tiny model's weight: 4096 elements) is reduced in one block: one
    # kernel, as Inductor fuses it.
    w = torch.randn(64, 64)
    assert [k.kind for k in _kernels(_quantize, w)] == [FUSABLE]


def test_row_reductions_are_not_split():
    """A norm's row reduction (as many outputs as rows) and a loss's mean over 8192 values stay
    fused with their readers, as before."""
    x = torch.randn(512, 64)
    assert not any(is_split_reduction(n) for n in make_fx(
        lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)))(x).graph.nodes)
    kernels = _kernels(lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)), x)
    assert [k.kind for k in kernels] == [FUSABLE]
    assert not any(is_split_reduction(n) for n in make_fx(
        lambda v: v.mean())(torch.randn(8192)).graph.nodes)


def _fp8_linear_step(x, w, g):
    """One FP8 Linear's forward and backward ops (``shardc.sharding.fp8._ScaledMMLinear``)."""
    ws = scale_from_amax(local_amax(w), E4M3)
    wq = quantize(w, ws, E4M3)
    xs = scale_from_amax(local_amax(x), E4M3)
    xq = quantize(x, xs, E4M3)
    y = torch._scaled_mm(xq, wq.t(), scale_a=xs.reciprocal(), scale_b=ws.reciprocal(),
                         out_dtype=torch.bfloat16)
    gs = scale_from_amax(local_amax(g), torch.float8_e5m2)
    gq = quantize(g, gs, torch.float8_e5m2)
    gx = torch._scaled_mm(gq, wq.t().contiguous().t(), scale_a=gs.reciprocal(),
                          scale_b=ws.reciprocal(), out_dtype=torch.bfloat16)
    gw = torch._scaled_mm(gq.t().contiguous(), xq.t().contiguous().t(),
                          scale_a=gs.reciprocal(), scale_b=xs.reciprocal(),
                          out_dtype=torch.bfloat16)
    return y, gx, gw


def test_an_fp8_linear_prices_its_amax_kernels_and_second_reads():
    """Per FP8 Linear of a transformer's size, the activation and the output gradient are
    each read twice (amax, then quantize) in two more kernels each (the split reductions);
    the weight too. The model's bytes and kernels grow by exactly that."""
    t, i, o = 512, 256, 128  # every tensor above 8192 elements
    x, w, g = (torch.randn(t, i, dtype=torch.bfloat16), torch.randn(o, i),
               torch.randn(t, o, dtype=torch.bfloat16))
    kernels = _kernels(_fp8_linear_step, x, w, g)
    assert sum(k.kind == MATMUL for k in kernels) == 3
    finals = [k for k in kernels if k.extra.get("split_reduction_final")]
    assert len(finals) == 3  # the weight's, the activation's and the gradient's amax
    fused_reads = sum(k.read_bytes for k in kernels if k.kind == FUSABLE)
    # x, w and g each read by their amax and again by their quantize (+ a few scalars).
    assert 2 * (x.nbytes + w.nbytes + g.nbytes) <= fused_reads \
        <= 2 * (x.nbytes + w.nbytes + g.nbytes) + 64


# ------------------------------------------------------------------------------ the profile


def _profile(**changes) -> ClusterProfile:
    base = ClusterProfile(
        name="synthetic", device="test", source="measured", command="pytest", date="today",
        matmul=(MatmulPoint("bfloat16", 1024, 1024, 1024, 100e12),
                MatmulPoint("float8_e4m3fn", 1024, 1024, 1024, 200e12)),
        memory=((1 << 20, 1e12), (1 << 30, 3e12)),
        kernel_gpu_s=1e-6, kernel_launch_s=5e-6, compiled_launch_s=20e-6, graph_call_s=1e-4)
    return dataclasses.replace(base, **changes)


def test_profile_version_6_round_trips_and_version_5_reads_with_zeros():
    assert PROFILE_VERSION == 10
    p = _profile(fp8_forward_per_scaled_mm_s=40e-6, fp8_backward_per_scaled_mm_s=15e-6)
    assert ClusterProfile.from_json(p.to_json()) == p
    data = load_profile("h100").to_dict()
    for name in FP8_HOST_FIELDS:
        data.pop(name, None)
    data["version"] = 5
    v5 = ClusterProfile.from_dict(data)
    assert all(getattr(v5, f) == 0.0 for f in FP8_HOST_FIELDS)
    with pytest.raises(ProfileError, match="fp8_forward_per_scaled_mm_s"):
        _profile(fp8_forward_per_scaled_mm_s=float("nan"))


def _fp8_region_graphs(layers: int = 2):
    """A one-rank region of FP8 Linears (gathered FP8 weights, quantized activations and
    gradients, ``_scaled_mm``), traced with fake tensors: the forward and the backward."""
    import shardc.ops.gather  # noqa: F401  (registers the shardc ops)

    gather, reduce = torch.ops.shardc.gather_param, torch.ops.shardc.reduce_scatter_grad

    def forward(x, *shards):
        h = x
        for n, s in enumerate(shards):
            full = gather(_quantize(s), f"layers.{n}.weight", 64, 1, "g", None, None, True)
            xs = scale_from_amax(local_amax(h), E4M3)
            h = torch._scaled_mm(quantize(h, xs, E4M3), full.t(), scale_a=xs.reciprocal(),
                                 scale_b=xs.reciprocal(), out_dtype=torch.bfloat16)
        return h.float().sum()

    def backward(x, *shards):
        out = []
        for n, s in enumerate(shards):
            gq = _quantize(x)
            wq = _quantize(s)
            one = torch.ones(())
            torch._scaled_mm(gq, wq.t().contiguous().t(), scale_a=one, scale_b=one,
                             out_dtype=torch.bfloat16)
            gw = torch._scaled_mm(gq.t().contiguous(), gq, scale_a=one, scale_b=one,
                                  out_dtype=torch.bfloat16)
            out.append(reduce(gw.float(), f"layers.{n}.weight", 64, 1, "g", None,
                              torch.float32))
        return out

    shapes = [torch.randn(16, 64, dtype=torch.bfloat16)] + [torch.randn(64, 64)
                                                             for _ in range(layers)]
    return (make_fx(forward, tracing_mode="fake")(*shapes),
            make_fx(backward, tracing_mode="fake")(*shapes))


def test_the_fp8_plan_charges_its_host_work_and_an_older_profile_plans_as_before():
    """A host-bound FP8 region (tiny kernels): the profile's FP8 terms lengthen the forward
    by exactly their seconds per ``_scaled_mm`` (2 in the forward, 4 in the backward), spread
    over the launches; zeros (a version-5 profile) plan exactly as before."""
    from shardc.compile.options import ShardcOptions
    from shardc.planning.schedule import plan_region

    forward, backward = _fp8_region_graphs(2)
    base = _profile(version=5)
    priced = dataclasses.replace(base, version=6, fp8_forward_per_scaled_mm_s=40e-6,
                                 fp8_backward_per_scaled_mm_s=15e-6)
    old, same, new = (plan_region(forward, backward, ShardcOptions(inductor=False),
                                  cluster=p).predicted
                      for p in (base, dataclasses.replace(base, version=6), priced))
    assert (same.forward_time_s, same.backward_time_s) == (old.forward_time_s,
                                                          old.backward_time_s)
    assert new.forward_time_s == pytest.approx(old.forward_time_s + 2 * 40e-6, rel=1e-9)
    assert new.backward_time_s == pytest.approx(old.backward_time_s + 4 * 15e-6, rel=1e-9)
    assert new.forward_kernels == old.forward_kernels
    # A negative term takes host work off, never more than the graph's spread work (none
    # here): the graph is then planned as with zeros.
    negative = dataclasses.replace(priced, fp8_forward_per_scaled_mm_s=-1.0)
    floor = plan_region(forward, backward, ShardcOptions(inductor=False),
                        cluster=negative).predicted
    assert floor.forward_time_s == old.forward_time_s


# ------------------------------------------------------------------------------ calibration

BF16_TERMS = {"region_entry_per_param_s": 40e-6, "forward_graph_per_param_s": 30e-6,
              "backward_entry_per_param_s": 10e-6, "backward_graph_per_param_s": 20e-6,
              "grad_handoff_per_param_s": 60e-6, "optimizer_per_param_s": 50e-6,
              "zero_grad_per_param_s": 4e-6, "region_entry_fixed_s": 1e-4,
              "forward_graph_fixed_s": 1e-3, "backward_entry_fixed_s": 2e-4,
              "backward_graph_fixed_s": 0.0, "grad_handoff_fixed_s": -3e-4,
              "optimizer_fixed_s": 1.5e-3, "zero_grad_fixed_s": 5e-5}


def _fp8_phase_times(layers: int, fp8_fw: float, fp8_bw: float, call: float, launch: float,
                     *, fp8: bool = True, host_error: tuple[float, float] = (0.0, 0.0)
                     ) -> host_cost.PhaseTimes:
    """An FP8 tiny Llama's phase times from a known model: 9 parameter tensors and 7
    ``_scaled_mm`` per block (3 more tensors and the head's outside), the bf16 terms, the
    model's kernels at ``launch`` each (Inductor runs 20% more: their launches are in the bf16
    terms' graph work), and the FP8 terms per ``_scaled_mm``. ``fp8=False``: the same model
    without FP8 (no ``_scaled_mm``, fewer kernels). ``host_error``: host seconds per parameter
    tensor in the forward and the backward graph that the bf16 terms do not price (their fit's
    error on this host), in both variants."""
    c = BF16_TERMS
    params, fw_mms = 9 * layers + 3, (7 * layers + 1) * fp8
    bw_mms = 2 * fw_mms
    fw_model, bw_model = (30 if fp8 else 22) * layers + 8, (40 if fp8 else 31) * layers + 9
    prelaunch = call + launch + c["region_entry_fixed_s"] + params * c["region_entry_per_param_s"]
    forward = prelaunch + (fw_model - 1) * launch + c["forward_graph_fixed_s"] \
        + params * (c["forward_graph_per_param_s"] + host_error[0]) + fw_mms * fp8_fw
    bw_prelaunch = call + launch + c["backward_entry_fixed_s"] \
        + params * c["backward_entry_per_param_s"]
    backward = bw_prelaunch + (bw_model - 1) * launch + c["backward_graph_fixed_s"] \
        + params * c["backward_graph_per_param_s"] + c["grad_handoff_fixed_s"] \
        + params * (c["grad_handoff_per_param_s"] + host_error[1]) + bw_mms * fp8_bw
    return host_cost.PhaseTimes(
        params, forward_s=forward, backward_s=backward, optimizer_s=1e-3, zero_grad_s=1e-4,
        forward_kernels=fw_model * 6 // 5, backward_kernels=bw_model,
        forward_prelaunch_s=prelaunch, forward_model_kernels=fw_model,
        backward_model_kernels=bw_model, backward_prelaunch_s=bw_prelaunch,
        forward_scaled_mms=fw_mms, backward_scaled_mms=bw_mms)


def test_fp8_host_fit_recovers_known_coefficients():
    call, launch = 300e-6, 25e-6
    fp8_fw, fp8_bw = 45e-6, 18e-6
    one = [_fp8_phase_times(4, fp8_fw, fp8_bw, call, launch)]
    two = [_fp8_phase_times(n, fp8_fw, fp8_bw, call, launch) for n in (2, 8)]
    for times in (one, two):  # one depth: through zero; two: the slope
        got = host_cost.fit_fp8_host_cost(times, BF16_TERMS, launch, call)
        assert got == pytest.approx({"fp8_forward_per_scaled_mm_s": fp8_fw,
                                     "fp8_backward_per_scaled_mm_s": fp8_bw}, rel=1e-9)
    # Two depths see through a fixed difference (the FP8 model's own per-step work): the
    # slope stays, where one depth would take it for work per _scaled_mm.
    shifted = [dataclasses.replace(t, forward_s=t.forward_s + 1e-3) for t in two]
    got = host_cost.fit_fp8_host_cost(shifted, BF16_TERMS, launch, call)
    assert got["fp8_forward_per_scaled_mm_s"] == pytest.approx(fp8_fw, rel=1e-9)
    # Priced back as the step model prices it, the fitted terms give the measured phases.
    t = two[1]
    left_fw, left_bw = host_cost.residual_seconds(t, BF16_TERMS, launch, call)
    assert left_fw == pytest.approx(t.forward_scaled_mms * fp8_fw, rel=1e-9)
    assert left_bw == pytest.approx(t.backward_scaled_mms * fp8_bw, rel=1e-9)
    # Where the model charges more launches than the host makes (a weight's quantize in
    # place of the cast the bf16 terms hold), the term is negative, and recovered as such.
    cheaper = [_fp8_phase_times(n, -12e-6, 0.0, call, launch) for n in (2, 8)]
    got = host_cost.fit_fp8_host_cost(cheaper, BF16_TERMS, launch, call)
    assert got["fp8_forward_per_scaled_mm_s"] == pytest.approx(-12e-6, rel=1e-9)
    assert got["fp8_backward_per_scaled_mm_s"] == pytest.approx(0.0, abs=1e-15)
    with pytest.raises(ValueError, match="_scaled_mm"):
        host_cost.fit_fp8_host_cost([dataclasses.replace(one[0], forward_scaled_mms=0)],
                                    BF16_TERMS, launch, call)


def test_fp8_host_fit_paired_with_bf16_twins_cancels_the_bf16_terms_error():
    """Where this host's bf16 work differs from what the bf16 terms price (their fit's error:
    here 12 / 7 us per parameter tensor more), the FP8 residual alone takes that error as FP8
    work; taken less the same depths' bf16 models (timed in the same rounds) it cancels, and
    the FP8 terms come back exactly."""
    call, launch, fp8_fw, fp8_bw = 300e-6, 25e-6, 45e-6, 18e-6
    error = (12e-6, 7e-6)
    fp8 = [_fp8_phase_times(n, fp8_fw, fp8_bw, call, launch, host_error=error) for n in (2, 6)]
    bf16 = [_fp8_phase_times(n, 0.0, 0.0, call, launch, fp8=False, host_error=error)
            for n in (2, 6)]
    alone = host_cost.fit_fp8_host_cost(fp8, BF16_TERMS, launch, call)
    assert alone["fp8_forward_per_scaled_mm_s"] > fp8_fw * 1.2
    paired = host_cost.fit_fp8_host_cost(fp8, BF16_TERMS, launch, call, bf16)
    assert paired == pytest.approx({"fp8_forward_per_scaled_mm_s": fp8_fw,
                                    "fp8_backward_per_scaled_mm_s": fp8_bw}, rel=1e-9)
    # Without an error the pairing changes nothing.
    exact = [_fp8_phase_times(n, fp8_fw, fp8_bw, call, launch) for n in (2, 6)]
    twins = [_fp8_phase_times(n, 0.0, 0.0, call, launch, fp8=False) for n in (2, 6)]
    assert host_cost.fit_fp8_host_cost(exact, BF16_TERMS, launch, call, twins) == pytest.approx(
        host_cost.fit_fp8_host_cost(exact, BF16_TERMS, launch, call), rel=1e-9)
    with pytest.raises(ValueError, match="pairs each FP8 model"):
        host_cost.fit_fp8_host_cost(fp8, BF16_TERMS, launch, call, bf16[:1])
    with pytest.raises(ValueError, match="pairs each FP8 model"):
        host_cost.fit_fp8_host_cost(fp8, BF16_TERMS, launch, call, fp8)


def test_fp8_host_fit_goes_through_zero_where_the_line_starts_below_it():
    """Two depths whose residuals make a line with a negative intercept (a steeper slope than
    the work per ``_scaled_mm``, which would over-price every larger model): the term is the
    least-squares line through zero, below the two-point slope; a positive intercept keeps
    the slope (the FP8 model's own per-step work drops out)."""
    call, launch = 300e-6, 25e-6
    two = [_fp8_phase_times(n, 45e-6, 18e-6, call, launch) for n in (2, 8)]
    below = [dataclasses.replace(t, forward_s=t.forward_s - 0.2e-3 * (t.params < 40))
             for t in two]
    counts = [t.forward_scaled_mms for t in below]
    left = [host_cost.residual_seconds(t, BF16_TERMS, launch, call)[0] for t in below]
    fixed, slope = fit_line(counts, left)
    assert fixed < 0 and slope > 45e-6
    got = host_cost.fit_fp8_host_cost(below, BF16_TERMS, launch, call)
    through_zero = sum(c * x for c, x in zip(counts, left)) / sum(c * c for c in counts)
    assert got["fp8_forward_per_scaled_mm_s"] == pytest.approx(through_zero, rel=1e-12)
    assert got["fp8_forward_per_scaled_mm_s"] < slope
    assert got["fp8_backward_per_scaled_mm_s"] == pytest.approx(18e-6, rel=1e-9)
    above = [dataclasses.replace(t, forward_s=t.forward_s + 0.2e-3 * (t.params < 40))
             for t in two]
    got = host_cost.fit_fp8_host_cost(above, BF16_TERMS, launch, call)
    counts_left = [(t.forward_scaled_mms, host_cost.residual_seconds(t, BF16_TERMS, launch,
                                                                     call)[0]) for t in above]
    assert got["fp8_forward_per_scaled_mm_s"] == pytest.approx(
        fit_line(*zip(*counts_left))[1], rel=1e-12)


def test_calibrate_skips_fp8_where_scaled_mm_does_not_run():
    """On the CPU, or a GPU whose matmul timings have no FP8 (pre-Hopper: ``_scaled_mm``
    raised), the FP8 model is never built: zeros, and the notes say why."""
    def log(msg: str) -> None:
        raise AssertionError(f"nothing to log: {msg}")

    bf16_only = [MatmulPoint("bfloat16", 1024, 1024, 1024, 1e14)]
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        terms, note = cal._measure_fp8(device, bf16_only, BF16_TERMS, 2e-5, 1e-4, log, 0.0)
        assert terms == {} and "not measured" in note
    fp8 = bf16_only + [MatmulPoint("float8_e4m3fn", 1024, 1024, 1024, 2e14)]
    terms, note = cal._measure_fp8(torch.device("cpu"), fp8, BF16_TERMS, 2e-5, 1e-4, log, 0.0)
    assert terms == {}
