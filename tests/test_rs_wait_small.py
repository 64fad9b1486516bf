"""``ShardcOptions.reduce_scatter_wait_past_small_buckets``: a reduce-scatter's wait passes over
the next buckets of at most 1/16 its send bytes (FP8's norm bucket after a layer's Linear
bucket) to the next larger bucket's first write.

The rule on synthetic reductions (the clamps, the 1/16 boundary, the reason); a planned FP8
step on the CPU (the Linear buckets' waits move past the norm buckets, nothing else moves, the
predicted peak does not drop); FP8 training at world 2 over gloo with the option against
without it (bitwise: only wait positions move) and against the unsharded fake-quantized
reference (FX; Inductor marked slow); and HSDP 2x2, where the replicate all-reduces
move with the waits that issue them.
"""

from __future__ import annotations

import functools

import pytest
import torch
from dist_utils import run_ranks
from fp8_workers import POLICIES, build_model, reference
from parity import assert_parity, build, train_rank_slice
from parity import reference as plain_reference
from torch.distributed.device_mesh import init_device_mesh

import shardc
from shardc.compile.options import ShardcOptions
from shardc.planning.plan import Bucket, Collective, CollectiveKind, Plan
from shardc.planning.schedule import (
    SMALL_BUCKET_DIVISOR,
    WAIT_BEFORE_NEXT,
    _next_large,
    _Reduction,
    _wait_before,
    _wait_past_small,
)
from shardc.runtime.comm_errors import COLLECTIVE_META
from shardc.tools.model_spec import parse_model
from shardc.tools.planner import PlanSetup, plan_model

OPTION = "reduce_scatter_wait_past_small_buckets"
END = 100


def _reduction(index: int, ready: int, send_bytes: int, first_write: int | None = None,
               fill: int | None = None, latest: int = END) -> _Reduction:
    bucket = Bucket(index=index, name=f"b{index}", params=[f"p{index}"], dim0=[1],
                    padded_rows=[1], row_numel=[1], dtype="float32", reduce_dtype="float32",
                    world=2)
    return _Reduction(ready, bucket, [f"p{index}"], latest, first_write,
                      ready if fill is None else fill, send_bytes)


def _default_wait(items: list[_Reduction], j: int) -> int:
    following = items[j + 1] if j + 1 < len(items) else None
    return min(max(_wait_before(following, items[j].ready, END), items[j].ready), items[j].latest)


def test_the_wait_passes_over_small_buckets_to_the_next_large_one():
    """A large bucket, a small one (1/16 of its bytes: small) written four ops after the large
    issue, then a large one packed at op 40: the default waits at the small one's first write,
    the option where the next large buffer is packed, clamped by the first reader."""
    items = [_reduction(0, 10, 1600), _reduction(1, 20, 100, first_write=14),
             _reduction(2, 45, 1600, fill=40)]
    assert _next_large(items, 0) == 2 and _next_large(items, 1) == 2
    assert _default_wait(items, 0) == 14
    wait, reason = _wait_past_small(items, 0, END, _default_wait(items, 0))
    assert wait == 40
    assert OPTION in reason and "bucket 2's send buffer" in reason and "op 14 without" in reason
    # The small bucket's own wait: the large one after it is its next bucket, as by default.
    assert _wait_past_small(items, 1, END, _default_wait(items, 1)) == (40, WAIT_BEFORE_NEXT)
    # Never past the first reader of the reduced gradients.
    clamped = [items[0]._replace(latest=30), *items[1:]]
    wait, reason = _wait_past_small(clamped, 0, END, _default_wait(clamped, 0))
    assert wait == 30 and "first reader" in reason


def test_only_buckets_of_at_most_a_sixteenth_are_small():
    """One byte over 1/16 is a large bucket: the wait stays before it; none large after: the
    graph's end."""
    big = 16 * 100
    over = [_reduction(0, 10, big), _reduction(1, 20, 101, first_write=14),
            _reduction(2, 45, big, fill=40)]
    assert _next_large(over, 0) == 1
    assert _wait_past_small(over, 0, END, _default_wait(over, 0)) == (14, WAIT_BEFORE_NEXT)
    last = [_reduction(0, 10, big), _reduction(1, 20, big // SMALL_BUCKET_DIVISOR,
                                               first_write=14)]
    wait, reason = _wait_past_small(last, 0, END, _default_wait(last, 0))
    assert wait == END and "the end of the graph" in reason


def test_the_option_is_off_by_default():
    assert ShardcOptions().reduce_scatter_wait_past_small_buckets is False
    assert ShardcOptions(**{OPTION: True}).as_dict()[OPTION] is True


@functools.cache
def _fp8_plan(on: bool) -> Plan:
    """llama-tiny (two layers) at world 2, bf16 with FP8 Linears, planned on the CPU (a
    fake-world trace, the same for both values of the option)."""
    plan, _ = plan_model(parse_model("llama-tiny", []), 2, 2, 32, {OPTION: on},
                         setup=PlanSetup(precision="bf16", fp8=True))
    return plan


def _reduce_scatters(plan: Plan) -> list[Collective]:
    """The backward's reduce-scatters in issue order."""
    return sorted((c for c in plan.collectives if c.graph == "backward"
                   and c.kind == CollectiveKind.REDUCE_SCATTER and c.origin == "shardc"),
                  key=lambda c: (c.issue_pos, c.bucket))


def _large_before_small(colls: list[Collective]) -> list[tuple[Collective, Collective]]:
    """(a reduce-scatter, the next one) where the next sends at most 1/16 of its bytes."""
    return [(a, b) for a, b in zip(colls, colls[1:])
            if b.buffer_bytes * SMALL_BUCKET_DIVISOR <= a.buffer_bytes]


@pytest.mark.slow  # suite time (s29): an FP8 plan of an opt-in option, 27 s
def test_fp8_plan_waits_each_linear_bucket_past_its_norm_bucket():
    """Each layer's Linear bucket (float8) is followed by its norm bucket (bf16): by default
    its reduce-scatter is waited before the norm bucket's is issued (at its first write), with
    the option after it; every other collective keeps its positions, and the peak predicted
    from the lowered graphs does not drop (the large buffer lives longer)."""
    off, on = _fp8_plan(False), _fp8_plan(True)
    assert on.options[OPTION] is True and off.options[OPTION] is False
    rs_off, rs_on = _reduce_scatters(off), _reduce_scatters(on)
    pairs = _large_before_small(rs_off)
    linear = [(a, b) for a, b in pairs if "layers." in a.params[0]
              and off.buckets[a.bucket].dtype.startswith("float8")]
    assert len(linear) == 2, [(a.id, b.id) for a, b in pairs]
    moved_on = {c.id: c for c in rs_on}
    for big, small in pairs:
        later = moved_on[big.id]
        assert big.wait_pos <= small.issue_pos < later.wait_pos, (big.id, small.id)
        assert OPTION in later.reason and big.reason == WAIT_BEFORE_NEXT
    moved = {big.id for big, _ in pairs}
    by_id = {c.id: c for c in on.collectives}
    for c in off.collectives:
        if c.id not in moved:
            got = by_id[c.id]
            assert (got.issue_pos, got.wait_pos, got.reason) == (c.issue_pos, c.wait_pos,
                                                                  c.reason), c.id
    assert on.hash() == off.hash()  # the same collectives: only rank-local waits moved
    assert on.predicted.peak_comm_buffer_bytes >= off.predicted.peak_comm_buffer_bytes
    assert on.predicted.peak_bytes >= off.predicted.peak_bytes > 0
    # The stream stalls no more than by default (the large waits come later).
    assert on.predicted.comm_stall_s <= off.predicted.comm_stall_s


def _lowered_spans(backward: torch.fx.GraphModule) -> dict[str, tuple[int, int]]:
    """Collective id -> (first, last) index of its nodes (issue, wait) in the lowered
    backward graph that ran."""
    spans: dict[str, tuple[int, int]] = {}
    for i, node in enumerate(backward.graph.nodes):
        cid = node.meta.get(COLLECTIVE_META)
        if cid is not None:
            spans[cid] = (spans.get(cid, (i, i))[0], i)
    return spans


def _fp8_training(rank: int, world: int, mode: str, **options) -> dict:
    """:func:`fp8_workers.fp8_run`'s training (two-layer Llama, FP8 Linear weights, this rank's
    slice), keeping where each collective's nodes are in the lowered backward."""
    torch._dynamo.reset()
    model = build_model("llama")
    shardc.shard(model, fp8=POLICIES["linear"])
    forward = torch.compile(model, backend=shardc.backend(inductor=mode == "inductor",
                                                          **options))
    losses = train_rank_slice(model, forward, rank, world)
    (region,) = shardc.shard_state(model).regions
    return {"losses": losses, "plan": region.plan, "spans": _lowered_spans(region.backward),
            "params": {n: p.full_tensor().detach().clone()
                       for n, p in model.named_parameters()}}


def _with_and_without(rank: int, world: int, mode: str) -> dict[bool, dict]:
    """:func:`_fp8_training` without and with the option; with it under FX the pool poisons
    each dead buffer (``debug_pool``), so a buffer read after its planned end shows as NaN."""
    return {on: _fp8_training(rank, world, mode, **({OPTION: True, "debug_pool": mode == "fx"}
                                                    if on else {}))
            for on in (False, True)}


@pytest.fixture(scope="module")
def fake_quant_reference() -> dict:
    """The unsharded two-layer Llama trained with fake-quantized Linear weights."""
    return reference("llama", True, "linear")


def _check_runs(runs: list[dict[bool, dict]], ref: dict) -> None:
    for rank_runs in runs:
        off, on = rank_runs[False], rank_runs[True]
        # Only wait positions moved: the same numbers, bit for bit ...
        assert torch.equal(on["losses"], off["losses"])
        for name, value in off["params"].items():
            assert torch.equal(on["params"][name], value), name
        # ... and those of the unsharded fake-quantized model (test_fp8's tolerance).
        assert_parity(on, ref, tol=1e-4)
        assert_parity(off, ref, tol=1e-4)
        # The lowered backward waits each Linear bucket's reduce-scatter after the norm
        # bucket's is issued with the option, before it without.
        pairs = _large_before_small(_reduce_scatters(off["plan"]))
        assert len(pairs) >= 2
        for big, small in pairs:
            assert off["spans"][big.id][1] < off["spans"][small.id][0], (big.id, small.id)
            assert on["spans"][big.id][1] > on["spans"][small.id][0], (big.id, small.id)
        assert on["plan"].predicted.peak_bytes >= off["plan"].predicted.peak_bytes


@pytest.mark.slow  # suite time (s29): the option's plans stay checked by the tests above
def test_training_with_the_option_is_bitwise_the_same(fake_quant_reference):
    """World 2 over gloo, planned FX graphs with the communication pool (its offsets follow
    the longer lifetimes; dead buffers poisoned)."""
    _check_runs(run_ranks(_with_and_without, 2, "fx"), fake_quant_reference)


@pytest.mark.slow
def test_training_with_the_option_under_inductor(fake_quant_reference):
    """The same under Inductor (no pool: its allocator reuses the buffers; CPU compiles)."""
    _check_runs(run_ranks(_with_and_without, 2, "inductor"), fake_quant_reference)


def _hsdp_with_and_without(rank: int, world: int) -> dict[bool, dict]:
    """The one-layer Llama on a 2x2 (replicate, shard) mesh, every parameter its own bucket
    (``bucket_by="param"``: norm weights after Linear weights, so waits move), planned FX with
    the pool, without and with the option (with it, dead buffers poisoned): each
    reduce-scatter's wait issues its bucket's replicate all-reduce, so the all-reduces move
    with the waits."""
    out = {}
    for on in (False, True):
        torch._dynamo.reset()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = shardc.shard(build("llama1"), mesh)
        options = {OPTION: True, "debug_pool": True} if on else {}
        forward = torch.compile(model, backend=shardc.backend(inductor=False, bucket_by="param",
                                                              **options))
        losses = train_rank_slice(model, forward, rank, world)
        (region,) = shardc.shard_state(model).regions
        out[on] = {"losses": losses, "plan": region.plan,
                   "params": {n: p.full_tensor().detach().clone()
                              for n, p in model.named_parameters()}}
    return out


# Four ranks on the CI's two cores (12 s): the option is opt-in and the world-2 FSDP test above
# covers the default suite.
@pytest.mark.slow
def test_hsdp_training_with_the_option_is_bitwise_the_same():
    """HSDP 2x2 (four gloo ranks): the option moves reduce-scatter waits and with them the
    replicate all-reduces they issue; the same numbers bit for bit, at parity with the
    unsharded model."""
    ref = plain_reference("llama1")
    for rank_runs in run_ranks(_hsdp_with_and_without, 4):
        off, on = rank_runs[False], rank_runs[True]
        moved = [c.id for c in _reduce_scatters(on["plan"])
                 if c.wait_pos != off["plan"].collective(c.id).wait_pos]
        assert moved, "no wait moved: the test does not exercise the option"
        for c in on["plan"].collectives:
            if c.link and c.kind == CollectiveKind.ALL_REDUCE:
                assert c.issue_pos == on["plan"].collective(c.link).wait_pos, c.id
        assert torch.equal(on["losses"], off["losses"])
        for name, value in off["params"].items():
            assert torch.equal(on["params"][name], value), name
        assert_parity(on, ref)
