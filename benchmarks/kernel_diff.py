"""Every GPU kernel of a step, per phase, for one mode: to compare what Inductor generates.

One mode per process (so that ``TORCH_LOGS=output_code`` logs only that mode's code)::

    TORCH_LOGS=output_code python benchmarks/kernel_diff.py --mode bound --out out/kd 2> bound.log
    TORCH_LOGS=output_code python benchmarks/kernel_diff.py --mode shardc --out out/kd 2> sc.log
    python benchmarks/kernel_diff.py --compare out/kd/bound.json out/kd/shardc.json

The model, data and optimizer are ``step_overhead.py``'s (world 1). Each phase is synchronized
before and after, so a kernel belongs to the phase whose host interval holds its start. Writes
``<out>/<mode>.json``: per phase, ``[name, launches per step, ms per step]`` for every kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

_BENCHMARKS = Path(__file__).resolve().parent
for _path in (_BENCHMARKS.parent, _BENCHMARKS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import step_overhead  # noqa: E402
from train.modes import setup_mode  # noqa: E402
from train.workload import model_config, synthetic_batches  # noqa: E402


def kernels_by_phase(events: list[dict], steps: int) -> dict[str, list]:
    marks = sorted((e for e in events if e.get("ph") == "X"
                    and str(e.get("name", "")).startswith("phase:")), key=lambda e: e["ts"])
    out: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        phase = "outside"
        for m in marks:
            if m["ts"] <= e["ts"] < m["ts"] + m["dur"]:
                phase = m["name"][len("phase:"):]
                break
        row = out[phase][str(e["name"])]
        row[0] += 1
        row[1] += e["dur"] / 1e3
    return {ph: sorted(([n, c / steps, round(ms / steps, 4)] for n, (c, ms) in d.items()),
                       key=lambda r: -r[2]) for ph, d in out.items()}


def run(args: argparse.Namespace) -> None:
    device = step_overhead.init("cuda" if torch.cuda.is_available() else "cpu")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (1,))
    cfg = model_config(args.model, args.seq, args.tiny, args.n_layers)
    data = synthetic_batches(args.warmup + args.steps, args.batch, args.seq, cfg.vocab_size, 0,
                             device)
    setup = setup_mode(args.mode, cfg, device, mesh)
    opt = step_overhead.make_optimizer(setup, "default")
    for batch in data[:args.warmup]:
        step_overhead.timed_step(setup, opt, batch, device, synced=True)
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for batch in data[args.warmup:]:
            step_overhead.timed_step(setup, opt, batch, device, synced=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text()).get("traceEvents", [])
    report = {"mode": args.mode, "n_layers": cfg.n_layers, "batch": args.batch, "seq": args.seq,
              "kernels": kernels_by_phase(events, args.steps)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.mode}.json").write_text(json.dumps(report, indent=1) + "\n")
    for phase, rows in report["kernels"].items():
        total = sum(r[2] for r in rows)
        print(f"## {args.mode} {phase}: {len(rows)} kernels, {sum(r[1] for r in rows):g} "
              f"launches, {total:.3f} ms per step")
        for name, n, ms in rows:
            print(f"  {ms:9.4f} ms {n:6g}x  {name[:140]}")
    torch.distributed.destroy_process_group()


def compare(a_path: str, b_path: str) -> None:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    for phase in sorted(set(a["kernels"]) | set(b["kernels"])):
        ka = {r[0]: r for r in a["kernels"].get(phase, [])}
        kb = {r[0]: r for r in b["kernels"].get(phase, [])}
        ta, tb = (sum(r[2] for r in k.values()) for k in (ka, kb))
        print(f"## {phase}: {a['mode']} {ta:.3f} ms, {b['mode']} {tb:.3f} ms")
        for name in sorted(set(ka) | set(kb), key=lambda n: -max(ka.get(n, [0, 0, 0])[2],
                                                                kb.get(n, [0, 0, 0])[2])):
            ra, rb = ka.get(name, [name, 0, 0.0]), kb.get(name, [name, 0, 0.0])
            print(f"  {ra[2]:9.4f} ({ra[1]:4g}x) | {rb[2]:9.4f} ({rb[1]:4g}x)  {name[:120]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="shardc")
    p.add_argument("--model", choices=("1b", "wide"), default="1b")
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="out/kernel_diff")
    p.add_argument("--compare", nargs=2, metavar=("A_JSON", "B_JSON"))
    args = p.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        run(args)


if __name__ == "__main__":
    main()
