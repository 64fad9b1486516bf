"""Where the CUDA caching allocator's reserved memory goes, one mode per process (s54 probe).

    python docs/bench/compile_time/s54/memseg.py MODE LAYERS OUT.json

World 1, the benchmarks' 1b config at batch 4 x 2048. Records the allocator's history over four
steps (the first compiles), then replays it: each ``segment_alloc`` with the request that made
it (size, site) and, at the moment reserved memory peaks, every segment's size, the bytes live
in it and its largest live blocks. Written to compare ``shardc`` (per-parameter reads) with
``shardc-packed`` (their reserved peaks differ by 4.4% at 32 layers, allocated peaks not).

s55: also writes the history in ``shardc.memory.allocator_history``'s compact format
(``OUT.history.json.gz``, the segments at the start from a snapshot taken just before the
recording) and replays it through shardc's allocator model, so that changes to the requests
(a block's gradient as per-parameter pieces, say) can be priced offline on the CPU machine."""
import dataclasses
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "benchmarks"))

import bench_mesh  # noqa: E402
import torch  # noqa: E402
from memory_peak import _site  # noqa: E402
from train.modes import setup_mode  # noqa: E402
from train.runner import train_step  # noqa: E402
from train.workload import model_config, synthetic_batches  # noqa: E402
from train_bench import init_distributed  # noqa: E402

from shardc.memory.allocator_history import compact  # noqa: E402
from shardc.memory.allocator_history import replay as model_replay  # noqa: E402


def replay(trace: list) -> dict:
    live, segments = {}, {}
    allocated = reserved = peak_reserved = 0
    made, at_peak = [], None
    for ev in trace:
        action = ev["action"]
        if action == "alloc":
            live[ev["addr"]] = ev
            allocated += ev["size"]
        elif action == "free_completed" and ev["addr"] in live:
            allocated -= live.pop(ev["addr"])["size"]
        elif action == "segment_alloc":
            segments[ev["addr"]] = ev["size"]
            reserved += ev["size"]
            made.append({"size": ev["size"], "reserved_after": reserved, "allocated": allocated,
                         "site": _site(ev.get("frames") or [])[0]})
            if reserved > peak_reserved:
                peak_reserved = reserved
                per = []
                for start, size in sorted(segments.items()):
                    used = sorted((b["size"] for b in live.values()
                                   if start <= b["addr"] < start + size), reverse=True)
                    per.append({"segment": size, "used": sum(used), "blocks": len(used),
                                "largest": used[:4]})
                at_peak = {"reserved": reserved, "allocated": allocated, "segments": per}
        elif action == "segment_free":
            reserved -= segments.pop(ev["addr"], 0)
    return {"segment_allocs": made, "at_peak_reserved": at_peak}


def main() -> None:
    mode, layers, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    _, world, device = init_distributed("cuda", 120)
    mesh = bench_mesh.build_mesh("cuda", world, None, 1)
    cfg = model_config("1b", 2048, False, layers)
    setup = setup_mode(mode, cfg, device, mesh, True)
    opt = torch.optim.AdamW(setup.params, lr=1e-4)
    data = iter(synthetic_batches(6, 4, 2048, cfg.vocab_size, 0, device))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
    for _ in range(4):
        train_step(setup, opt, *next(data))
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    stats = torch.cuda.memory_stats()
    res = {"mode": mode, "layers": layers, "max_reserved": torch.cuda.max_memory_reserved(),
           "max_allocated": torch.cuda.max_memory_allocated(),
           "stats": {k: v for k, v in stats.items() if k.endswith(".all.peak") or "retries" in k},
           **replay(snap["device_traces"][0])}
    history = compact(snap, start)
    with gzip.open(out.replace(".json", "") + ".history.json.gz", "wt") as f:
        json.dump(history, f, separators=(",", ":"))
    res["model_replay"] = dataclasses.asdict(model_replay(history))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(mode, layers, f"reserved {res['max_reserved'] / 2**30:.2f} GiB, allocated "
          f"{res['max_allocated'] / 2**30:.2f} GiB, {len(res['segment_allocs'])} segments made")
    print("model replay:", res["model_replay"])


if __name__ == "__main__":
    main()
