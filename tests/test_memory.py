"""Peak-memory prediction from graph liveness, and the communication pool's offsets."""

from __future__ import annotations

import torch
from torch import fx

from shardc.cli import parse_model_spec, plan_model
from shardc.passes.memory import comm_buffers, liveness_peak


def _graph(fn, *args) -> fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*args)


def test_liveness_frees_after_last_use_and_views_share_storage():
    def f(x):  # x: 1000 floats = 4000 B
        a = x * 2          # 4000 B, dies after b
        b = a.view(10, 100) + 1   # the view shares a's storage; b is 4000 B
        c = b.sum()        # 4 B
        return c

    gm = _graph(f, torch.randn(1000))
    peak, timeline = liveness_peak(gm, skip=set())
    # x dies after a = x * 2; a (through its view) lives until b exists: never three at once.
    assert peak == 8000
    assert timeline[-1] == 4, "only the output is alive at the end"

    def g(x):
        return x * 2, x.sum()

    gm = _graph(g, torch.randn(1000))
    assert liveness_peak(gm, skip=set())[0] == 8004
    skip = set(gm.graph.find_nodes(op="placeholder"))
    assert liveness_peak(gm, skip=skip)[0] == 4004, "skipped placeholders count nothing"


def _overlaps(a, b) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_plan_pool_offsets_never_overlap_live_buffers():
    plan, _ = plan_model(parse_model_spec("llama-tiny:n_layers=3"), 4, 2, 32, {})
    buffers = comm_buffers(plan)
    offsets = plan.pool_offsets
    assert len(offsets) == len(buffers)
    placed = [(b.start, b.end, offsets[f"{b.collective}.{b.role}"], b.nbytes) for b in buffers]
    for i, (s1, e1, o1, n1) in enumerate(placed):
        assert o1 % 512 == 0 and o1 + n1 <= plan.predicted["pool_bytes"]
        for s2, e2, o2, n2 in placed[i + 1:]:
            if _overlaps((s1, e1), (s2, e2)):
                assert not _overlaps((o1, o1 + n1), (o2, o2 + n2))
    assert plan.predicted["pool_bytes"] >= plan.predicted["pool_lower_bound_bytes"] > 0
    predicted = plan.predicted
    assert predicted["peak_bytes"] >= predicted["param_bytes"] + predicted["optimizer_state_bytes"]
    assert predicted["optimizer_state_bytes"] == 2 * predicted["param_bytes"]
