"""What is live at the peak of a CUDA memory history (``torch.cuda.memory._snapshot()``).

Used by ``train_bench.py --memory-snapshot`` to say where a mode's peak memory goes. The trace's
allocation events are replayed in order; at the moment the live bytes are largest, the live
blocks are grouped by the first stack frame outside torch's own Python files (for compiled code
that is a line of Inductor's generated module, whose text names the buffer's shape), so the
summary reads like "forward activation (4, 2048, 32000) bf16: 0.5 GiB".

With ``SHARDC_MEMORY_DUMP=<dir>`` in the environment, the recorded step's allocation events (with
their stack frames) are also written to ``<dir>/memory_trace_dev<N>.pkl.gz``, and the compiled
modules they name (Inductor's generated code) are copied next to it, so the history can be
replayed line by line against the plan offline.
"""

from __future__ import annotations

import gzip
import linecache
import os
import pickle
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

_TORCH_DIRS = ("/torch/", "/site-packages/", "/dist-packages/")


def _site(frames: list[dict[str, Any]]) -> tuple[str, str]:
    """(key, source line) of the first frame not in torch or another installed package; the
    innermost frame when every frame is."""
    for fr in frames:
        name = fr.get("filename", "")
        if "torchinductor" in name or not any(d in name for d in _TORCH_DIRS):
            line = linecache.getline(name, fr.get("line", 0)).strip()
            short = name.rsplit("/", 1)[-1]
            return f"{short}:{fr.get('line')} ({fr.get('name')})", line[:160]
    if frames:
        fr = frames[0]
        return f"{fr.get('filename', '?').rsplit('/', 1)[-1]}:{fr.get('line')} " \
               f"({fr.get('name')})", ""
    return "<no stack>", ""


def _phase(frames: list[dict[str, Any]]) -> str:
    names = " ".join(f"{fr.get('filename', '')}:{fr.get('name', '')}" for fr in frames)
    if "torch/optim" in names:
        return "optimizer"
    if "backward" in names or "autograd" in names:
        return "backward"
    return "forward/other"


def live_at_peak(trace: list[dict[str, Any]], top: int = 25) -> dict[str, Any]:
    """Replay ``trace`` (one device's ``device_traces`` entry) and describe its peak."""
    live: dict[int, dict[str, Any]] = {}
    total = peak = 0
    peak_blocks: list[dict[str, Any]] = []
    peak_event: dict[str, Any] | None = None
    for ev in trace:
        action = ev.get("action")
        if action == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if total > peak:
                peak, peak_blocks, peak_event = total, list(live.values()), ev
        elif action == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
    groups: dict[str, dict[str, Any]] = defaultdict(lambda: {"bytes": 0, "count": 0})
    by_phase: dict[str, int] = defaultdict(int)
    for block in peak_blocks:
        frames = block.get("frames") or []
        key, line = _site(frames)
        g = groups[key]
        g["bytes"] += block["size"]
        g["count"] += 1
        g["source"] = line
        by_phase[_phase(frames)] += block["size"]
    ranked = sorted(groups.items(), key=lambda kv: -kv[1]["bytes"])
    return {
        "peak_live_bytes": peak,
        "blocks": len(peak_blocks),
        "peak_at": _site(peak_event.get("frames") or [])[0] if peak_event else None,
        "peak_phase": _phase(peak_event.get("frames") or []) if peak_event else None,
        "by_phase_bytes": dict(by_phase),
        "top": [{"site": k, **v} for k, v in ranked[:top]],
    }


def dump_trace(trace: list[dict[str, Any]], device_index: int, out_dir: str) -> None:
    """Write the allocation events of ``trace`` and the generated modules they name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keep = ("action", "addr", "size", "stream")
    events, sources = [], set()
    for ev in trace:
        frames = [(f.get("filename", ""), f.get("line", 0), f.get("name", ""))
                  for f in (ev.get("frames") or [])[:12]]
        sources.update(name for name, _, _ in frames if "torchinductor" in name)
        events.append({**{k: ev.get(k) for k in keep}, "frames": frames})
    with gzip.open(out / f"memory_trace_dev{device_index}.pkl.gz", "wb") as f:
        pickle.dump(events, f)
    for src in sorted(sources):
        if os.path.isfile(src):
            shutil.copy(src, out / Path(src).name)


def record_and_summarize(device_index: int, run_step) -> dict[str, Any]:
    """Run ``run_step()`` with the CUDA memory history recorded; summary of its peak."""
    import torch

    torch.cuda.synchronize(device_index)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        run_step()
        torch.cuda.synchronize(device_index)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    traces = snap.get("device_traces") or []
    trace = traces[device_index] if device_index < len(traces) else []
    if os.environ.get("SHARDC_MEMORY_DUMP"):
        dump_trace(trace, device_index, os.environ["SHARDC_MEMORY_DUMP"])
    # Blocks allocated before recording started are live throughout (parameters, optimizer
    # state): the snapshot's segments list them with state "active_allocated".
    before = sum(b["size"] for seg in snap.get("segments", []) for b in seg.get("blocks", [])
                 if b.get("state") == "active_allocated" and not b.get("frames"))
    out = live_at_peak(trace)
    out["allocated_before_recording_bytes_lower_bound"] = before
    return out
