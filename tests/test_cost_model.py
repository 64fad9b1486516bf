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
    adding no guard (a guard would specialize the plan; on an unbacked size it would raise),
    through a function torch does not deprecate (torch 2.11's ``hint_int`` warned at every
    size)."""
    import warnings

    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from shardc.passes.fx_utils import UNBACKED_SIZE_HINT, size_hint

    env = ShapeEnv()
    backed = env.create_symintnode(env.create_symbol(7, ConstantSource("batch")), hint=7)
    unbacked = env.create_unbacked_symint()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert size_hint(backed * 3 + 1) == 22
        assert size_hint(unbacked) == UNBACKED_SIZE_HINT
        assert size_hint(5) == 5
    assert not env.guards, env.guards


def test_an_indexed_accumulation_moves_its_rows_not_its_destination():
    """The embedding's backward adds each token's gradient into its row of a fresh zero
    destination: a compiler writes it in place, so its bytes are the indices, the values and
    the rows they touch, not the destination (262 MB at the 1b config's vocabulary)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from shardc.planning.cost_model import node_flops_and_bytes

    def embedding_grad(idx, values):
        dest = torch.zeros(32000, 64)
        return torch.ops.aten.index_put(dest, [idx], values, True)

    idx = torch.randint(0, 32000, (128,))
    gm = make_fx(embedding_grad, tracing_mode="fake")(idx, torch.randn(128, 64))
    node = next(n for n in gm.graph.nodes if "index_put" in str(n.target))
    values, indices = 128 * 64 * 4, 128 * 8
    assert node_flops_and_bytes(node)[1] == indices + 3 * values


def test_the_last_reduce_scatter_is_waited_before_the_embedding_gradients_cast():
    """The reduce-scatter before the embedding's (the first block's bucket) is waited before
    the cast of the embedding gradient to the reduce dtype, not after it: Inductor fuses that
    cast into the copy that fills the embedding bucket's send buffer, which runs after the wait
    (two H200s, docs/cost_model.md), so the cast is not compute the reduce-scatter overlaps."""
    from shardc.models.llama import LlamaConfig
    from shardc.tools.planner import PlanSetup, plan_model

    cfg = LlamaConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=8)
    plan = plan_model(cfg, 2, 1, 8, {}, template=False,
                      setup=PlanSetup(precision="bf16", inductor=True))[0]
    reduces = sorted((c for c in plan.collectives if c.kind.value == "reduce_scatter"),
                     key=lambda c: c.issue_pos)
    embedding = next(c for c in reduces if c.params == ["tok_embeddings.weight"])
    before = reduces[reduces.index(embedding) - 1]
    ops = [op.name for op in plan.graphs["backward"]]
    cast = ops[embedding.issue_pos - 1]
    assert cast.startswith("convert_element_type"), ops[before.issue_pos:embedding.issue_pos]
    assert before.wait_pos == embedding.issue_pos - 1  # before the cast
    assert before.overlaps and cast not in before.overlaps
