"""The CUDA caching allocator's model (``shardc.memory.caching_allocator``): its rules one by one,
and a recorded H200 history replayed request by request (``shardc.memory.allocator_history``)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from shardc.memory.allocator_history import compact, replay
from shardc.memory.caching_allocator import CachingAllocatorModel, segment_bytes
from shardc.memory.cuda_blocks import block_bytes

MiB = 1 << 20
# docs/bench/budget/optoff_peak_s23: one H200, torch 2.11, tests/gpu/test_offload_gpu.py's
# budget run recorded by gpu_snap.py there, made compact (allocator_history.compact).
HISTORY = Path(__file__).parent / "data" / "h200_allocator_history_s23.json.gz"
RECORDED_MAX_ALLOCATED = 1_987_259_392  # torch.cuda.max_memory_allocated() of that run (snap.log)


def test_a_recorded_h200_history_replays_at_the_recorded_addresses():
    with gzip.open(HISTORY, "rt") as f:
        history = json.load(f)
    result = replay(history)
    assert result.requests == 1924
    assert result.misplaced == 0
    assert result.segments_made == result.segments_recorded == 59
    assert result.peak_allocated == RECORDED_MAX_ALLOCATED


def test_a_misplaced_request_is_counted():
    history = {"version": 1, "segments": [],
               "events": [["s", 0, 20 * MiB], ["a", 4096, 4 * MiB], ["f", 4096]]}
    assert replay(history).misplaced == 1  # the model puts it at the segment's start, 0


def test_an_unknown_version_is_refused():
    with pytest.raises(ValueError, match="version 2"):
        replay({"version": 2, "segments": [], "events": []})


@pytest.mark.parametrize("nbytes", [1, 511, 512, MiB, MiB + 1, 4 * MiB, 10 * MiB, 11 * MiB,
                                    10 * MiB + 1, 131_072_000, 12 * MiB + 512])
def test_a_fresh_segment_counts_what_cuda_blocks_counts(nbytes):
    model = CachingAllocatorModel()
    model.malloc(nbytes)
    assert model.allocated == block_bytes(nbytes)
    assert model.reserved == segment_bytes(block_bytes(nbytes))


def test_segments_by_request_size():
    assert segment_bytes(512) == 2 * MiB  # the small pool
    assert segment_bytes(MiB + 512) == 20 * MiB
    assert segment_bytes(10 * MiB) == 10 * MiB
    assert segment_bytes(11 * MiB) == 12 * MiB


def test_the_best_fit_takes_the_smallest_block_then_the_lowest_address():
    model = CachingAllocatorModel()
    a = model.malloc(40 * MiB)
    b = model.malloc(30 * MiB)
    c = model.malloc(40 * MiB)
    keep = [model.malloc(12 * MiB) for _ in range(3)]  # nothing merges with a freed block
    del keep
    for address in (c, b, a):
        model.free(address)
    assert model.malloc(25 * MiB) == b  # 30 MiB fits better than either 40 MiB
    assert model.malloc(35 * MiB) == a  # two 40 MiB blocks: the lower address
    assert model.segments == 6


def test_freed_neighbours_merge_and_a_larger_request_fits_into_them():
    model = CachingAllocatorModel()
    big = model.malloc(100 * MiB)
    model.free(big)
    low, mid, high = (model.malloc(30 * MiB) for _ in range(3))
    assert (mid - low, high - mid) == (30 * MiB, 30 * MiB)  # one segment, split in order
    model.free(low)
    model.free(high)
    assert model.would_make_segment(60 * MiB)  # 40 + 30 MiB free, but not side by side
    model.free(mid)
    assert not model.would_make_segment(100 * MiB)  # merged back into one block
    assert model.malloc(100 * MiB) == big
    assert model.segments == 1


def test_fragments_make_segments_that_one_block_would_not():
    """Equal allocated bytes, different reserved: the case the model exists for."""
    whole, pieces = CachingAllocatorModel(), CachingAllocatorModel()
    for model, request in ((whole, 180 * MiB), (pieces, 18 * MiB)):
        activations = [model.malloc(90 * MiB) for _ in range(4)]
        kept = [model.malloc(2 * MiB) for _ in range(4)]  # between the freed ones below
        del kept
        for address in activations[::2]:
            model.free(address)  # 180 MiB free, in two 90 MiB blocks apart
        for _ in range(180 * MiB // request):
            model.malloc(request)
    assert whole.peak_allocated == pieces.peak_allocated
    # the pieces fit into the freed blocks, five in each; the whole needs a segment of its own
    assert whole.peak_reserved == pieces.peak_reserved + 180 * MiB


def test_a_small_block_splits_where_a_large_one_would_not():
    model = CachingAllocatorModel()
    model.malloc(MiB - 512)  # the small pool: 2 MiB segment, rest 1 MiB + 512 B split off
    assert model.allocated == MiB - 512
    large = CachingAllocatorModel()
    large.malloc(19 * MiB)  # 20 MiB segment: 1 MiB left, not more than 1 MiB: not split
    assert large.allocated == 20 * MiB


def test_a_double_free_raises():
    model = CachingAllocatorModel()
    address = model.malloc(MiB)
    model.free(address)
    with pytest.raises(ValueError, match="freed twice"):
        model.free(address)


def test_compact_infers_the_segments_a_recording_started_with():
    snapshot = {
        "device_traces": [[
            {"action": "alloc", "addr": 1000, "size": 4 * MiB},
            {"action": "free_completed", "addr": 1000, "size": 4 * MiB},
            {"action": "segment_free", "addr": 1000, "size": 20 * MiB},
        ]],
        "segments": [{"address": 5000, "total_size": 2 * MiB, "segment_type": "small",
                      "blocks": [{"size": 512, "state": "active_allocated"},
                                 {"size": 2 * MiB - 512, "state": "inactive"}]}],
    }
    history = compact(snapshot)
    assert history["segments"] == [[1000, 20 * MiB, []], [5000, 2 * MiB, [[0, 512]]]]
    assert replay(history).misplaced == 0
