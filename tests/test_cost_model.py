"""The analytical cost model: symbolic communication times, roofline compute, calibration."""

from __future__ import annotations

import pytest
import sympy

from shardc.planning.cost_model import ALPHA, B, ClusterSpec, W, calibrate, collective_time_expr


def test_collective_expression_is_symbolic_in_world_and_bandwidth():
    expr = collective_time_expr("all_gather", 1_000_000)
    assert expr.free_symbols == {W, B, ALPHA}
    spec = ClusterSpec(bus_bandwidth=50e9, latency_s=5e-6)
    for world in (2, 8, 1024):
        expected = (world - 1) * 5e-6 + (world - 1) / world * 1_000_000 / 50e9
        assert spec.evaluate(expr, world) == pytest.approx(expected)
        assert spec.collective_seconds("all_gather", 1_000_000, world) == pytest.approx(expected)
    # One plan, any cluster: substitute a different bandwidth into the same expression.
    faster = float(expr.subs({W: 8, B: 400e9, ALPHA: 5e-6}))
    assert faster < spec.evaluate(expr, 8)
    assert sympy.simplify(collective_time_expr("all_reduce", 10) -
                          2 * collective_time_expr("reduce_scatter", 10)) == 0
    # Kinds found in tensor-parallel graphs: all-to-all moves like an all-gather of its buffer;
    # a broadcast puts the whole buffer on every link.
    assert collective_time_expr("all_to_all", 10) == collective_time_expr("all_gather", 10)
    assert spec.collective_seconds("broadcast", 1_000_000, 4) == pytest.approx(
        3 * 5e-6 + 1_000_000 / 50e9)


def test_roofline_compute_time():
    spec = ClusterSpec(peak_flops=100e12, mem_bandwidth=1e12)
    assert spec.compute_seconds(1e12, 1e6) == pytest.approx(0.01)  # compute bound
    assert spec.compute_seconds(1e6, 1e9) == pytest.approx(1e-3)   # memory bound


def test_calibration_recovers_bandwidth_and_latency():
    truth = ClusterSpec(bus_bandwidth=80e9, latency_s=7e-6)
    samples = [(kind, nbytes, world, truth.collective_seconds(kind, nbytes, world))
               for kind in ("all_gather", "reduce_scatter")
               for nbytes in (1 << 16, 1 << 22, 1 << 26) for world in (2, 4, 8)]
    fitted = calibrate(ClusterSpec(), samples)
    assert fitted.bus_bandwidth == pytest.approx(80e9, rel=1e-6)
    assert fitted.latency_s == pytest.approx(7e-6, rel=1e-6)
    with pytest.raises(ValueError, match="at least two"):
        calibrate(ClusterSpec(), samples[:1])
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time_expr("scatter", 1)


def test_size_hints_never_guard():
    """Planning reads dynamic sizes as the traced size and data-dependent ones as a stand-in,
    adding no guard (a guard would specialize the plan; on an unbacked size it would raise)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from shardc.passes.fx_utils import UNBACKED_SIZE_HINT, size_hint

    env = ShapeEnv()
    backed = env.create_symintnode(env.create_symbol(7, ConstantSource("batch")), hint=7)
    unbacked = env.create_unbacked_symint()
    assert size_hint(backed * 3 + 1) == 22
    assert size_hint(unbacked) == UNBACKED_SIZE_HINT
    assert size_hint(5) == 5
    assert not env.guards, env.guards
