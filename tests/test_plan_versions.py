"""Plan format version 5 (version 4's collective kinds, explicit links, typed predictions; block
bodies, CPU offload's copies, elided collectives), and plans written by older versions still
read."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from shardc.planning.plan import (
    PLAN_VERSION,
    Bucket,
    Collective,
    CollectiveKind,
    CompiledBody,
    InlineBlock,
    Plan,
    Predictions,
)

BENCH = Path(__file__).resolve().parent.parent / "docs" / "bench"


def _old_plans() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(BENCH.glob("*_plan.json.gz")):
        data = json.loads(gzip.decompress(path.read_bytes()))
        for i, plan in enumerate(data if isinstance(data, list) else [data]):
            out.append((f"{path.name}[{i}]", plan))
    return out


OLD = _old_plans()


def test_the_benchmark_plans_are_older_versions():
    assert PLAN_VERSION == 5
    assert {plan["version"] for _, plan in OLD} == {1, 3}


@pytest.mark.parametrize("name,data", OLD, ids=[n for n, _ in OLD])
def test_older_plan_reads_with_typed_predictions_and_kinds(name, data):
    plan = Plan.from_dict(data)
    assert plan.version == data["version"]
    assert isinstance(plan.predicted, Predictions)
    assert plan.predicted.to_dict() == data["predicted"]
    assert plan.predicted.step_time_s == data["predicted"]["step_time_s"]
    assert [c.kind for c in plan.collectives] == [c["kind"] for c in data["collectives"]]
    assert all(isinstance(c.kind, CollectiveKind) for c in plan.collectives)
    assert all(c.link == "" for c in plan.collectives)  # no HSDP: nothing to link
    # What the ranks compare is unchanged by reading it with this version.
    assert plan.hash() == data["hash"]


def _hsdp_plan() -> Plan:
    bucket = Bucket(0, "layers.0", ["w"], [8], [4], [3], "float32", "float32", 2, 2, "g1")

    def coll(kind: str, issue: int, wait: int, link: str = "") -> Collective:
        return Collective(
            id=f"backward.{kind}.0", kind=kind, graph="backward", bucket=0, params=["w"],
            bytes=48, buffer_bytes=96, dtype="float32", stream="comm", issue_pos=issue,
            wait_pos=wait, first_use_pos=wait, last_use_pos=wait, link=link,
            group="replicate" if kind == "all_reduce" else "shard")

    rs = coll("reduce_scatter", 1, 2, "backward.all_reduce.0")
    ar = coll("all_reduce", 2, 3, "backward.reduce_scatter.0")
    plan = Plan(PLAN_VERSION, 0, 2, {}, [bucket], [rs, ar], replicate_size=2,
                replicate_group_name="g1")
    plan.predicted.step_time_s = 1.5
    return plan


def test_version_4_round_trips_and_links_both_ways():
    plan = _hsdp_plan()
    data = plan.to_dict()
    assert data["predicted"] == {"step_time_s": 1.5}  # only the predictions made
    assert data["collectives"][0]["kind"] == "reduce_scatter"
    again = Plan.from_dict(json.loads(json.dumps(data)))
    assert again.to_dict() == data
    rs, ar = again.collectives
    assert again.linked(rs) is ar and again.linked(ar) is rs


def test_version_3_hsdp_plan_gets_its_links_from_the_ids():
    data = _hsdp_plan().to_dict()
    data["version"] = 3
    for c in data["collectives"]:
        del c["link"]
    plan = Plan.from_dict(data)
    rs, ar = plan.collectives
    assert (rs.link, ar.link) == (ar.id, rs.id)


def test_predictions_read_by_key_and_refuse_unknown_names():
    p = Predictions(pool_bytes=512.0)
    assert p["pool_bytes"] == 512.0 and "pool_bytes" in p and "peak_bytes" not in p
    assert p.get("peak_bytes", 0.0) == 0.0
    with pytest.raises(KeyError):
        p["peak_bytes"]
    with pytest.raises(KeyError):
        p["pool_bytez"] = 1.0
    with pytest.raises(ValueError, match="pool_bytez"):
        Predictions.from_dict({"pool_bytez": 1.0})


def test_collective_kind_refuses_unknown_kinds():
    with pytest.raises(ValueError):
        CollectiveKind("all_gatherx")
    assert f"{CollectiveKind.ALL_GATHER}" == "all_gather"


def _copy(kind: str, issue: int, wait: int) -> Collective:
    return Collective(id=f"forward.{kind}.0", kind=kind, graph="forward", bucket=0, params=["w"],
                      bytes=96, buffer_bytes=96, dtype="float32", stream="copy",
                      issue_pos=issue, wait_pos=wait, first_use_pos=wait, last_use_pos=wait,
                      group="copy", group_size=1, buffer_lifetime=(issue, wait + 1))


def test_version_5_round_trips_offload_copies_and_host_predictions():
    bucket = Bucket(0, "layers.0", ["w"], [8], [4], [3], "float32", "float32", 2)
    plan = Plan(PLAN_VERSION, 0, 2, {}, [bucket], [], copies=[_copy("h2d_copy", 0, 3)])
    plan.predicted.host_bytes, plan.predicted.device_copy_bytes = 384.0, 96.0
    back = Plan.from_json(plan.to_json())
    assert back == plan
    assert back.copies[0].kind is CollectiveKind.H2D_COPY
    assert back.copies[0].buffer_lifetime == (0, 4)
    # Copies are not collectives: what the ranks compare does not include them.
    assert plan.hash() == Plan(PLAN_VERSION, 0, 2, {}, [bucket], []).hash()


def test_version_4_plan_reads_without_copies():
    data = Plan(4, 0, 1, {}, [], []).to_dict()
    data.pop("copies")
    assert Plan.from_dict(data).copies == []


def test_version_5_block_bodies_round_trip_and_older_plans_have_none():
    plan = _hsdp_plan()
    plan.bodies = [CompiledBody("subgraph_0", "Block", ["layers.0", "layers.1"], 1)]
    plan.inline_blocks = [InlineBlock("layers.2", "no identical sibling")]
    data = json.loads(plan.to_json())
    again = Plan.from_dict(data)
    assert again.bodies == plan.bodies and again.inline_blocks == plan.inline_blocks
    assert again.hash() == plan.hash()  # what ranks compare is unchanged by the new fields
    older = {k: v for k, v in data.items() if k not in ("bodies", "inline_blocks")}
    older["version"] = 4
    read = Plan.from_dict(older)
    assert read.bodies == [] and read.inline_blocks == []


def _asdict_text(plan: Plan) -> str:
    """What ``Plan.to_dict`` serialized before ``json_ready``: ``dataclasses.asdict``'s copy."""
    import dataclasses

    return json.dumps(dataclasses.asdict(plan), default=str)


@pytest.mark.parametrize("once", [True, False])
def test_to_dict_writes_what_asdict_wrote(once):
    """``json_ready`` (no leaf copies) gives ``to_dict`` the text ``asdict`` gave, on real plans
    (bodies, graphs of compute ops, collectives with overlapped ops, the memory breakdown,
    enums, dtypes) and on plans read back from older versions."""
    from shared_plans import bodies_and_inline

    from shardc.planning.json_ready import json_ready

    plans = [bodies_and_inline()[once], _hsdp_plan()] + [Plan.from_dict(d) for _, d in OLD[:3]]
    for plan in plans:
        assert json.dumps(json_ready(plan), default=str) == _asdict_text(plan)
        data = json.loads(_asdict_text(plan))
        data["predicted"], data["hash"] = plan.predicted.to_dict(), plan.hash()
        assert plan.to_dict() == data
