"""The optimizer's first step over a sharded model's parameters, and its steady step, by depth
and by how the optimizer steps: through DTensor's dispatch (``dtensor``: shardc's default local
step turned off) or as shardc steps by default (``default``: the local shards where exact,
``shardc.optim.default_local_step``).

DTensor computes the sharding of each foreach op over every parameter the first time it sees
that list (cached afterwards); from torch 2.12 it re-reads the whole argument list for each
tensor, so the first step grows with the square of the parameter tensors. Each (depth, mode)
runs in its own process, world 1 (gloo on CPU, NCCL on a GPU), AdamW (``foreach=True``), the
benchmarks' llama (``--tiny``: width 64) with gradients set to ones::

    python benchmarks/optimizer_first_step.py --tiny --depths 8 64 --out docs/bench/optimizer
    python benchmarks/optimizer_first_step.py --device cuda --depths 8 64      # one GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("dtensor", "default")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", type=int, nargs="+", default=[8, 64])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--model", choices=("1b", "wide"), default="1b")
    p.add_argument("--tiny", action="store_true", help="width 64 (CPU runs)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=5, help="steps after the first")
    p.add_argument("--pack-blocks", action=argparse.BooleanOptionalAction, default=None,
                   help="shardc.shard's pack_blocks (default: shardc's default, packed)")
    p.add_argument("--out", default=None, help="directory for optimizer_first_step.{json,md}")
    p.add_argument("--name", default="optimizer_first_step")
    p.add_argument("--child", nargs=2, metavar=("DEPTH", "MODE"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train.workload import build_model, model_config

    import shardc

    depth, mode = int(args.child[0]), args.child[1]
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device(args.device)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    cfg = model_config(args.model, 128, args.tiny, depth, width=64 if args.tiny else None)
    model = build_model(cfg, device)
    shardc.shard(model, init_device_mesh(args.device, (1,)),
                 **({} if args.pack_blocks is None else {"pack_blocks": args.pack_blocks}))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    if mode == "dtensor":
        shardc.optim.set_default_local_step(False, opt)
    times = []
    for _ in range(1 + args.steps):
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    from train.provenance import git_describe, shardc_source_hash

    device_name = (torch.cuda.get_device_name(0) if args.device == "cuda"
                   else f"cpu x {os.cpu_count()}")
    print(json.dumps({"depth": depth, "mode": mode, "params": len(list(model.parameters())),
                      "first_step_s": times[0], "steady_step_s": statistics.median(times[1:]),
                      "torch": torch.__version__, "git": git_describe(),
                      "shardc_sha256": shardc_source_hash(), "device": device_name}))
    dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return
    rows = []
    base = [sys.executable, __file__, "--model", args.model, "--device", args.device,
            "--steps", str(args.steps)] + (["--tiny"] if args.tiny else []) + (
            [] if args.pack_blocks is None else
            ["--pack-blocks" if args.pack_blocks else "--no-pack-blocks"])
    for depth in args.depths:
        for mode in args.modes:
            out = subprocess.run(base + ["--child", str(depth), mode], check=True,
                                 capture_output=True, text=True, env=dict(os.environ))
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{depth:4d} layers {row['params']:5d} tensors {mode:8s} first step "
                  f"{row['first_step_s']:.3f} s, steady {row['steady_step_s'] * 1e3:.2f} ms",
                  flush=True)
    if args.out:
        write(Path(args.out), args.name, rows, " ".join([Path(sys.executable).name, *sys.argv]))


def write(out: Path, name: str, rows: list[dict], command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    first = rows[0]
    lines = [f"`{command}` (torch {first['torch']}, {first.get('device', '?')}, commit "
             f"{first.get('git')}, shardc sha256 {first.get('shardc_sha256', '?')[:16]})", "",
             "| layers | parameter tensors | mode | first step | steady step |",
             "|---:|---:|---|---:|---:|"]
    lines += [f"| {r['depth']} | {r['params']} | {r['mode']} | {r['first_step_s']:.3f} s | "
              f"{r['steady_step_s'] * 1e3:.2f} ms |" for r in rows]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
