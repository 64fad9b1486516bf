"""Renderers of a plan: text table, Chrome trace, memory plot, dump_plan (no processes)."""

from __future__ import annotations

import json
import logging
import sys
from collections import defaultdict

import pytest

from shardc.planning.plan import PLAN_VERSION, Bucket, Collective, ComputeOp, Plan
from shardc.tools.render import _abbrev_params, chrome_trace, dump_plan, memory_plot, plan_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LONG_REASON = ("issued once the last gradient of the bucket exists; waited as late as possible "
               "with at most two reduce-scatters in flight")


def _comm_s(buffer_bytes: int, world: int) -> float:
    return (world - 1) * 5e-6 + (world - 1) / world * buffer_bytes / 50e9


def _simulate(ops: list[ComputeOp], durations: list[float], colls: list[Collective], world: int):
    """The planner's two-lane timing model, for hand-built plans (fills predictions)."""
    t = comm_free = exposed = 0.0
    for p in range(len(ops) + 1):
        for c in (c for c in colls if c.issue_pos == p):
            c.predicted_start_s = max(t, comm_free)
            c.predicted_end_s = comm_free = c.predicted_start_s + _comm_s(c.buffer_bytes, world)
        for c in (c for c in colls if c.wait_pos == p):
            if c.predicted_end_s > t:
                c.exposed_s = c.predicted_end_s - t
                exposed += c.exposed_s
                t = c.predicted_end_s
        if p < len(ops):
            ops[p].predicted_start_s, ops[p].predicted_end_s = t, t + durations[p]
            t += durations[p]
    return t, exposed


def _timeline(n_ops: int, colls: list[Collective]) -> list[int]:
    live = [0] * (n_ops + 1)
    for c in colls:
        start, end = c.buffer_lifetime
        for q in range(start, min(end, n_ops + 1)):
            live[q] += c.buffer_bytes
    return live


def make_plan(n_buckets: int = 3, ops_per_bucket: int = 4, world: int = 4,
              rows: int = 1024, op_s: float = 2e-5, tiny_ops: int = 0) -> Plan:
    """A plan shaped like the planner's: one bucket per layer, forward prefetching one bucket
    ahead, backward all-gathers in reverse and a reduce-scatter per bucket waited at the end.
    ``tiny_ops`` extra sub-microsecond ops (and one zero-duration op) per forward layer."""
    buckets = [
        Bucket(index=k, name=f"layers.{k}", params=[f"layers.{k}.attn.wq.weight",
                                                     f"layers.{k}.mlp.w1.weight"],
               dim0=[rows, rows], padded_rows=[rows // world] * 2, row_numel=[256, 256],
               dtype="bfloat16", reduce_dtype="float32", world=world)
        for k in range(n_buckets)
    ]
    plan = Plan(PLAN_VERSION, region=2, world_size=world,
                options={"inductor": False, "bucket_by": "module", "prefetch": True,
                         "prefetch_depth": 1, "memory_budget_bytes": 0, "dump_dir": None},
                buckets=buckets, collectives=[], group_name="0",
                notes=["hand-built plan for tests"])
    total_t = total_exposed = 0.0
    for graph in ("forward", "backward"):
        ops, durs, first = [], [], []
        layer_order = range(n_buckets) if graph == "forward" else reversed(range(n_buckets))
        for k in layer_order:
            first.append((k, len(ops)))
            for i in range(ops_per_bucket):
                ops.append(ComputeOp(f"{graph[:2]}_mm_{k}_{i}", "aten.mm.default", 2e9, 1e6))
                durs.append(op_s)
            if graph == "forward" and tiny_ops:
                ops.append(ComputeOp(f"view_{k}", "aten.view.default"))
                durs.append(0.0)
                for i in range(tiny_ops):
                    ops.append(ComputeOp(f"add_{k}_{i}", "aten.add.Tensor", 1e3, 1e3))
                    durs.append(2e-7)
        colls = []
        for j, (k, pos) in enumerate(first):
            issue = 0 if j == 0 else first[j - 1][1]
            b = buckets[k]
            nbytes = b.shard_numel * world * 2
            colls.append(Collective(
                id=f"{graph}.all_gather.{k}", kind="all_gather", graph=graph, bucket=k,
                params=list(b.params), bytes=nbytes // world, buffer_bytes=nbytes,
                dtype="bfloat16", stream="comm", issue_pos=issue, wait_pos=pos,
                first_use_pos=pos, last_use_pos=pos + ops_per_bucket - 1,
                reason=("graph start: nothing earlier to overlap with" if j == 0 else
                        f"prefetched 1 bucket(s) ahead, overlapping bucket {first[j - 1][0]}"),
                buffer_lifetime=(issue, pos + ops_per_bucket),
            ))
        if graph == "backward":
            for k, pos in first:
                b = buckets[k]
                nbytes = b.shard_numel * world * 4
                ready = pos + ops_per_bucket
                colls.append(Collective(
                    id=f"backward.reduce_scatter.{k}", kind="reduce_scatter", graph=graph,
                    bucket=k, params=list(b.params), bytes=nbytes // world, buffer_bytes=nbytes,
                    dtype="float32", stream="comm", issue_pos=ready, wait_pos=len(ops),
                    first_use_pos=len(ops), last_use_pos=len(ops), reason=LONG_REASON,
                    buffer_lifetime=(ready, len(ops) + 1), buffer_offset=k * nbytes,
                ))
        colls.sort(key=lambda c: (c.issue_pos, c.kind != "all_gather", c.bucket))
        step, exposed = _simulate(ops, durs, colls, world)
        plan.collectives += colls
        plan.graphs[graph] = ops
        plan.memory_timeline[graph] = _timeline(len(ops), colls)
        plan.predicted[f"{graph}_time_s"] = step
        plan.predicted[f"{graph}_exposed_comm_s"] = exposed
        total_t += step
        total_exposed += exposed
    plan.predicted["step_time_s"] = total_t
    plan.predicted["exposed_comm_s"] = total_exposed
    plan.predicted["comm_time_s"] = sum(c.predicted_end_s - c.predicted_start_s
                                        for c in plan.collectives)
    plan.predicted["peak_comm_buffer_bytes"] = max(max(t) for t in plan.memory_timeline.values())
    return plan


@pytest.fixture
def plan() -> Plan:
    return make_plan(tiny_ops=12)


def _squash(text: str) -> str:
    return " ".join(text.split())


# ------------------------------------------------------------------------------------ table


def test_table_lists_every_collective_and_reason(plan):
    table = plan_table(plan)
    flat = _squash(table)
    assert plan.hash() in table
    assert "world size 4" in table and "region 2" in table
    assert "prefetch_depth=1" in table and "dump_dir" not in table
    assert "hand-built plan for tests" in table
    for c in plan.collectives:
        assert c.id in table
        assert _squash(c.reason) in flat  # wrapped onto continuation lines, never cut
    for b in plan.buckets:
        assert b.name in table
        assert f"layers.{b.index}.{{attn.wq.weight, mlp.w1.weight}}" in table
    # positions carry the compute op's name; the end of the graph is marked
    ag1 = next(c for c in plan.collectives if c.id == "forward.all_gather.1")
    assert f"{ag1.wait_pos} {plan.graphs['forward'][ag1.wait_pos].name}" in table
    assert f"{len(plan.graphs['backward'])} <end>" in table
    # reason lines stay within the requested width
    rows = [line for line in table.splitlines() if "reduce_scatter" in line]
    assert rows and all(len(line.split("  ")[-1]) <= 60 for line in rows)


def test_table_issue_order_and_empty_plan(plan):
    table = plan_table(plan)
    positions = [table.index(c.id + " ") for c in plan.collectives]
    assert positions == sorted(positions)  # plan order is forward, then backward, by issue
    empty = Plan(PLAN_VERSION, 0, 1, {}, [], [])
    text = plan_table(empty)
    assert "0 collectives, 0 buckets" in text


def test_abbrev_params():
    assert _abbrev_params([]) == "-"
    assert _abbrev_params(["a.b"]) == "a.b"
    names = [f"layers.3.mlp.w{i}.weight" for i in range(40)]
    short = _abbrev_params(names, width=60)
    assert short.startswith("layers.3.mlp.{w0.weight, ") and short.endswith(")}")
    assert len(short) <= 60 and "(+" in short
    assert _abbrev_params(["embed.weight", "norm.weight"]) == "embed.weight, norm.weight"


# ------------------------------------------------------------------------------------ trace


def _lanes(trace: dict) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def test_chrome_trace_structure(plan):
    trace = json.loads(json.dumps(chrome_trace(plan)))
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    lanes = _lanes(trace)
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert [procs[p].split()[0] for p in sorted(procs)] == ["forward", "backward"]
    xs = [e for e in events if e["ph"] == "X"]
    compute = [e for e in xs if lanes[(e["pid"], e["tid"])] == "compute" and e["cat"] == "compute"]
    comm = [e for e in xs if lanes[(e["pid"], e["tid"])] == "comm: comm"]
    assert compute and comm
    assert {e["pid"] for e in compute} == set(procs)
    assert all(e["dur"] > 0 for e in compute)
    # every collective once, with its predicted duration and its explanation
    by_id = {c.id: c for c in plan.collectives}
    assert sorted(e["name"] for e in comm) == sorted(by_id)
    for e in comm:
        c = by_id[e["name"]]
        assert e["dur"] == pytest.approx((c.predicted_end_s - c.predicted_start_s) * 1e6)
        assert e["args"]["reason"] == c.reason and e["args"]["bytes"] == c.bytes
        assert e["args"]["dtype"] == c.dtype and e["args"]["params"] == len(c.params)
        assert e["args"]["bucket"] == c.bucket
    # timestamps non-decreasing per lane
    per_lane = defaultdict(list)
    for e in events:
        if e["ph"] != "M":
            per_lane[(e["pid"], e["tid"])].append(e["ts"])
    for ts in per_lane.values():
        assert ts == sorted(ts)
    # issue/wait marks and flows, one per collective
    instants = [e for e in events if e["ph"] == "i"]
    assert len(instants) == 2 * len(plan.collectives)
    assert len([e for e in events if e["ph"] == "s"]) == len(plan.collectives)
    assert len([e for e in events if e["ph"] == "f"]) == len(plan.collectives)
    # counter track of buffer bytes: every value of the timeline appears, peak included
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["pid"] for e in counters} == set(procs)
    peak = plan.predicted["peak_comm_buffer_bytes"]
    assert max(e["args"]["bytes"] for e in counters) == peak
    # backward is placed after forward
    fw_pid, bw_pid = sorted(procs)
    fw_end = max(e["ts"] + e.get("dur", 0) for e in events
                 if e["ph"] != "M" and e["pid"] == fw_pid)
    bw_start = min(e["ts"] for e in events if e["ph"] != "M" and e["pid"] == bw_pid)
    assert bw_start >= fw_end - 1e-6
    assert bw_start == pytest.approx(plan.predicted["forward_time_s"] * 1e6)


def test_chrome_trace_merges_tiny_and_drops_zero_duration_ops(plan):
    trace = chrome_trace(plan)
    compute = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]
    names = [e["name"] for e in compute]
    assert not any(name.startswith("view_") for name in names)
    merged = [e for e in compute if "ops" in e["args"]]
    assert merged and all(e["args"]["ops"] > 1 for e in merged)
    # merged events cover the ops they stand for, and no op is lost
    covered = sum(e["args"]["ops"] if "ops" in e["args"] else 1 for e in compute)
    nonzero = [op for ops in plan.graphs.values() for op in ops
               if op.predicted_end_s > op.predicted_start_s]
    assert covered >= len(nonzero)
    assert sum(e["dur"] for e in compute) == pytest.approx(
        sum(op.predicted_end_s - op.predicted_start_s for op in nonzero) * 1e6)


def test_chrome_trace_stays_small_for_a_large_model():
    # 80 layers, ~15k compute ops in all, most of them tiny.
    big = make_plan(n_buckets=80, ops_per_bucket=60, tiny_ops=40, op_s=3e-6)
    assert sum(len(ops) for ops in big.graphs.values()) > 12_000
    blob = json.dumps(chrome_trace(big), separators=(",", ":"))
    assert len(blob) < 4_000_000


# ------------------------------------------------------------------------------ memory plot


def test_memory_plot_writes_png(plan, tmp_path):
    pytest.importorskip("matplotlib")
    plan.predicted["peak_bytes"] = 3 * plan.predicted["peak_comm_buffer_bytes"]
    out = memory_plot(plan, tmp_path / "sub" / "m.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    empty = Plan(PLAN_VERSION, 0, 1, {}, [], [])
    assert memory_plot(empty, tmp_path / "empty.png").read_bytes()[:8] == PNG_MAGIC


def test_memory_plot_without_matplotlib(plan, tmp_path, monkeypatch, caplog):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        memory_plot(plan, tmp_path / "m.png")
    with caplog.at_level(logging.WARNING, logger="shardc"):
        paths = dump_plan(plan, tmp_path / "dump")
    assert [p.name for p in paths] == ["region2.rank0.plan.txt", "region2.rank0.plan.json",
                                      "region2.rank0.trace.json"]
    assert "memory plot" in caplog.text


# ------------------------------------------------------------------------------------- dump


def test_dump_plan_writes_files_and_round_trips(plan, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "new" / "dir"
    paths = dump_plan(plan, out, rank=3)
    assert [p.name for p in paths] == [
        "region2.rank3.plan.txt", "region2.rank3.plan.json", "region2.rank3.trace.json",
        "region2.rank3.memory.png",
    ]
    assert all(p.parent == out and p.stat().st_size > 0 for p in paths)
    txt, js, trace, png = paths
    assert plan.hash() in txt.read_text()
    loaded = Plan.from_json(js.read_text())
    assert loaded.to_dict() == plan.to_dict()
    assert loaded.hash() == plan.hash()
    assert json.loads(trace.read_text())["traceEvents"]
    assert png.read_bytes()[:8] == PNG_MAGIC
    # deterministic: writing again gives the same text, JSON and trace
    again = dump_plan(plan, out, rank=3)
    assert [p.read_bytes() for p in again[:3]] == [p.read_bytes() for p in paths[:3]]


# ------------------------------------------------------------------------- from a real graph


def test_render_plan_of_a_traced_forward_graph():
    torch = pytest.importorskip("torch")
    from torch.fx.experimental.proxy_tensor import make_fx

    import shardc.ops.gather  # noqa: F401  (registers shardc::gather_param)
    from shardc.compile.options import ShardcOptions
    from shardc.planning.schedule import plan_region

    world = 4

    def forward(x, *shards):
        h = x
        for i in range(3):
            wq, wo = (torch.ops.shardc.gather_param(shards[2 * i + j], f"layers.{i}.{n}.weight",
                                                    64, world, "g", None, None, True)
                      for j, n in enumerate(("wq", "wo")))
            h = torch.relu(h @ wq.t()) @ wo.t() + h
        return h.sum()

    args = [torch.randn(8, 64)] + [torch.randn(16, 64) for _ in range(6)]
    gm = make_fx(forward, tracing_mode="fake")(*args)
    real = plan_region(gm, None, ShardcOptions(inductor=False), region=0)
    table = plan_table(real)
    for c in real.collectives:
        assert c.id in table
    trace = json.loads(json.dumps(chrome_trace(real)))
    comm = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "all_gather"]
    assert len(comm) == len(real.collectives) == 3
    # (tuples in ``options``, e.g. bucket_modules, come back from JSON as lists)
    loaded = Plan.from_json(real.to_json())
    assert json.loads(loaded.to_json()) == json.loads(real.to_json())
    assert loaded.hash() == real.hash()


def _with_tp_collective(plan: Plan) -> Collective:
    """Add to ``plan`` an all-reduce DTensor issued over the tp group in the forward graph."""
    ops = plan.graphs["forward"]
    found = Collective(
        id="forward.all_reduce.tp.0", kind="all_reduce", graph="forward", bucket=-1, params=[],
        bytes=4096, buffer_bytes=4096, dtype="bfloat16", stream="tp", issue_pos=2, wait_pos=5,
        first_use_pos=5, last_use_pos=6, reason="issued by DTensor (tensor parallelism) in w2",
        predicted_start_s=ops[2].predicted_start_s, predicted_end_s=ops[4].predicted_end_s,
        group="tp", origin="graph", group_size=2, nodes=["all_reduce_1", "wait_tensor_1"],
        tensors=["mm_3: bfloat16[8, 256]", "wait_tensor_1: bfloat16[8, 256]"])
    plan.collectives.append(found)
    plan.mesh, plan.tp_size, plan.tp_group_name = "FSDP+TP: dp 4 x tp 2", 2, "7"
    return found


def test_found_collectives_render_on_their_group_lane(plan):
    found = _with_tp_collective(plan)
    table = plan_table(plan)
    row = next(line for line in table.splitlines() if line.startswith(found.id))
    assert row.split()[1:4] == ["all_reduce", "tp", "-"]  # kind, group, no bucket
    assert "found in the traced graphs, over the tp group: 1 all_reduce 4.00 KiB" in table
    assert "mesh: FSDP+TP: dp 4 x tp 2" in table and "tp group 7" in table
    assert "all-gather bytes by dtype: bfloat16" in table  # shardc's own, without the tp one
    trace = chrome_trace(plan)
    lanes = _lanes(trace)
    assert {"comm: comm", "comm: tp"} <= set(lanes.values())
    (event,) = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == found.id]
    assert lanes[(event["pid"], event["tid"])] == "comm: tp"
    assert event["args"]["nodes"] == found.nodes and event["args"]["tensors"] == found.tensors
    assert event["args"]["group"] == "tp" and event["args"]["origin"] == "graph"
    loaded = Plan.from_json(plan.to_json())
    assert loaded.to_dict() == plan.to_dict()
    # The plan hash covers the found collective's kind, not its (activation) bytes.
    digest = plan.hash()
    found.bytes = found.buffer_bytes = 8192
    assert plan.hash() == digest
    found.kind = "all_gather"
    assert plan.hash() != digest


def test_older_plans_read_with_defaults_and_unknown_versions_are_refused():
    plan = make_plan(world=2)
    assert plan.collectives
    data = json.loads(plan.to_json())
    # A version 2 plan, as that format wrote it: no fields of collectives found in the graph.
    data["version"] = 2
    for key in ("tp_size", "tp_group_name"):
        data.pop(key)
    for c in data["collectives"]:
        for key in ("origin", "group_size", "nodes", "tensors"):
            c.pop(key)
    old = Plan.from_dict(data)
    assert old.version == 2 and old.tp_size == 1
    assert {(c.origin, c.group_size) for c in old.collectives} == {("shardc", 0)}
    assert old.hash() == plan.hash()
    # A version 1 plan, as the previous format wrote it: no 2-D mesh fields.
    data["version"] = 1
    for key in ("mesh", "replicate_size", "replicate_group_name"):
        data.pop(key)
    for bucket in data["buckets"]:
        bucket.pop("replicate"), bucket.pop("replicate_group")
    for c in data["collectives"]:
        c.pop("group")
    old = Plan.from_dict(data)
    assert old.version == 1 and old.replicate_size == 1
    assert [b.replicate for b in old.buckets] == [1] * len(plan.buckets)
    assert {c.group for c in old.collectives} == {"shard"}
    assert [c.id for c in old.collectives] == [c.id for c in plan.collectives]
    data["version"] = PLAN_VERSION + 1
    with pytest.raises(ValueError, match="plan version"):
        Plan.from_dict(data)
