"""Why do packed blocks reserve more than per-parameter reads (s71: 21.51 against 20.60 GiB at
16 layers, allocated equal)? One mode per process (``torchrun --nproc-per-node 1``): the
benchmark's warm-up and timed steps, then the caching allocator's counters and its segments.

    torchrun --nproc-per-node 1 docs/bench/s72/reserved_probe.py MODE LAYERS
"""

from __future__ import annotations

import collections
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))

import bench_mesh  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from train.runner import RunSettings, run_mode  # noqa: E402
from train.workload import model_config  # noqa: E402

GiB = float(1 << 30)
MiB = float(1 << 20)


def main() -> None:
    mode, layers = sys.argv[1], int(sys.argv[2])
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", device_id=device)
    mesh = bench_mesh.build_mesh("cuda", 1, None, 1)
    cfg = model_config("1b", 2048, False, layers)
    s = RunSettings("1b", cfg, 4, 2048, steps=8, warmup=3, profile_steps=0, lr=1e-4,
                    peak_flops=989e12, device=device)
    res = run_mode(mode, s, mesh, 0, print)
    st = torch.cuda.memory_stats(device)
    keys = ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "reserved_bytes.all.current",
            "inactive_split_bytes.all.peak", "segment.all.peak", "segment.all.current",
            "num_alloc_retries", "num_device_alloc", "oversize_allocations.peak")
    out = {"mode": mode, "layers": layers, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
           "step_ms_median": sorted(res["step_ms"])[len(res["step_ms"]) // 2],
           "timed_peak_alloc_gib": res["peak_alloc_bytes"] / GiB,
           "timed_peak_reserved_gib": res["peak_reserved_bytes"] / GiB,
           "stats": {k: st.get(k) for k in keys}}
    # The segments left after the mode (its tensors freed, the cache kept): their sizes.
    segs = torch.cuda.memory_snapshot()
    hist = collections.Counter()
    for seg in segs:
        hist[(seg["segment_type"], round(seg["total_size"] / MiB, 1))] += 1
    out["segments"] = sorted(([t, mib, n] for (t, mib), n in hist.items()),
                             key=lambda r: -r[1] * r[2])[:40]
    out["segments_total_gib"] = sum(s["total_size"] for s in segs) / GiB
    print("PROBE " + json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
