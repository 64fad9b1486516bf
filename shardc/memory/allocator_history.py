"""Recorded CUDA allocator histories, replayed through :mod:`shardc.memory.caching_allocator`.

A history is what ``torch.cuda.memory._snapshot()`` returns after
``torch.cuda.memory._record_memory_history()`` (its ``device_traces`` and ``segments``), made
compact: the segments that existed when the recording began and, in order, every request,
free and segment the allocator made. Replaying it checks the model (each request must land at
the address the real allocator gave it) and lets a change to the requests be priced offline:
drop, merge or split some of them and see what the allocator would have reserved.

Compact format (``json``), version 1::

    {"version": 1,
     "segments": [[address, size, [[offset, size], ...]], ...],  # at the start, taken blocks
     "events": [["a", address, requested bytes] | ["f", address] | ["s", address, size], ...]}

``"a"``: a request (``alloc``), ``"f"``: its block freed (``free_completed``), ``"s"``: a segment
made (``segment_alloc``). A segment of 2 MiB is the small pool's (a large request's segment is at
least 10 MiB). Recordings over one stream only (the model has one).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.memory.caching_allocator import CachingAllocatorModel

VERSION = 1


def compact(snapshot: dict, start: dict | None = None) -> dict:
    """The compact history of ``snapshot`` (device 0's trace). ``start``: a snapshot taken just
    before the recording began (its segments and their allocated blocks). Without it, the
    segments at the start are inferred: those the trace frees or the final snapshot holds that
    the trace did not make, each free except for the allocated blocks the final snapshot shows
    that no request of the trace made."""
    trace = snapshot["device_traces"][0]
    events, made, requested = [], set(), set()
    for e in trace:
        action = e["action"]
        if action == "alloc":
            events.append(["a", e["addr"], e["size"]])
            requested.add(e["addr"])
        elif action == "free_completed":
            events.append(["f", e["addr"]])
        elif action == "segment_alloc":
            events.append(["s", e["addr"], e["size"]])
            made.add(e["addr"])
        elif action == "segment_free":
            break  # empty_cache: the replay ends here
    if start is not None:
        segments = [_segment(s, lambda addr: True) for s in start["segments"]]
    else:
        known = {s["address"]: s for s in snapshot["segments"]}
        freed = {e["addr"]: e["size"] for e in trace if e["action"] == "segment_free"}
        segments = []
        for addr in sorted({*freed, *known} - made):
            if addr in known:
                segments.append(_segment(known[addr], lambda a: a not in requested))
            else:
                segments.append([addr, freed[addr], []])
    return {"version": VERSION, "segments": segments, "events": events}


def _segment(seg: dict, taken_before) -> list:
    taken, offset = [], 0
    for block in seg["blocks"]:
        addr = seg["address"] + offset
        if block["state"] == "active_allocated" and taken_before(addr):
            taken.append([offset, block["size"]])
        offset += block["size"]
    return [seg["address"], seg["total_size"], taken]


@dataclass(frozen=True)
class Replayed:
    """What a replay found: requests at their recorded address and not, segments made (in the
    model, and in the recording), and the model's reserved and allocated peaks (bytes)."""

    requests: int
    misplaced: int
    segments_made: int
    segments_recorded: int
    peak_reserved: int
    peak_allocated: int


def replay(history: dict) -> Replayed:
    """Run ``history``'s requests and frees through a :class:`CachingAllocatorModel` that
    starts with its segments; new segments take the recorded addresses in order. A request the
    model places elsewhere than recorded is counted (``misplaced``) and the replay follows the
    recording from then on (its frees name the recorded addresses)."""
    if history.get("version") != VERSION:
        raise ValueError(f"allocator history version {history.get('version')!r}: "
                         f"this replay reads version {VERSION}")
    model = CachingAllocatorModel()
    for address, size, taken in history["segments"]:
        model.add_segment(address, size, tuple(map(tuple, taken)))
    segments = [e for e in history["events"] if e[0] == "s"]
    next_segment = 0
    requests = misplaced = made = 0
    where: dict[int, int] = {}  # recorded address -> the model's
    for event in history["events"]:
        if event[0] == "a":
            address = None
            if model.would_make_segment(event[2]):
                address = segments[next_segment][1] if next_segment < len(segments) else None
                next_segment += 1
                made += 1
            placed = model.malloc(event[2], address)
            requests += 1
            misplaced += placed != event[1]
            where[event[1]] = placed
        elif event[0] == "f":
            model.free(where.pop(event[1]))
    return Replayed(requests, misplaced, made, len(segments), model.peak_reserved,
                    model.peak_allocated)
