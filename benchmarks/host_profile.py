"""Per-step Python calls of a steady-state training step, by phase (cProfile; CPU, gloo).

Deterministic counts of the host work a step does: the steps are run as forward, backward,
``optimizer.step()``, ``zero_grad()``, and each phase of ``--steps`` steady-state steps (after
``--warmup``) is profiled with its own ``cProfile.Profile``. Per phase it prints the functions
by calls per step and by own (``tottime``) time per step, and a summary by where the function
lives (shardc, DTensor, Dynamo, AOTAutograd, autograd, optim, other torch, other). Call counts
are exact and the same on every run; times include cProfile's overhead and this machine's
load, so compare them only back to back. Run on two ranks (rank 0 reports)::

    torchrun --nproc-per-node 2 benchmarks/host_profile.py --n-layers 16 [--fx] [--plain]
        [--local-step] [--json OUT.json]

Public API only (``shardc.shard``, ``shardc.backend``, ``shardc.optim.local_shard_step``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

_BENCHMARKS = Path(__file__).resolve().parent
for _path in (_BENCHMARKS.parent, _BENCHMARKS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import bench_mesh  # noqa: E402
from train.baselines import setup_bound  # noqa: E402
from train.setup import compiled_loss  # noqa: E402
from train.workload import build_model, model_config, synthetic_batches  # noqa: E402

import shardc  # noqa: E402

PHASES = ("forward", "backward", "optimizer.step", "zero_grad")

# (substring of the file path, owner) in the order tried.
OWNERS = (("/shardc/", "shardc"), ("distributed/tensor", "DTensor"),
          ("torch/_dynamo", "Dynamo"), ("torch/_functorch", "AOTAutograd"),
          ("torch/_inductor", "Inductor"), ("torch/autograd", "autograd"),
          ("torch/optim", "optim"), ("torch/", "other torch"), ("~", "builtin"))


def owner(path: str) -> str:
    return next((who for part, who in OWNERS if part in path), "other")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="1b")
    p.add_argument("--n-layers", type=int, default=16)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fx", action="store_true", help="the FX backend instead of Inductor")
    p.add_argument("--plain", action="store_true",
                   help="shardc.shard(..., plain_inputs=True): shardc's default since s53")
    p.add_argument("--dtensor-reads", action="store_true",
                   help="shardc.shard(..., plain_inputs=False): the default before s53")
    p.add_argument("--local-step", action="store_true",
                   help="shardc.optim.local_shard_step(optimizer)")
    p.add_argument("--bound", action="store_true",
                   help="the bound instead of shardc: replicated parameters, Inductor, no "
                        "communication (benchmarks/train/baselines.py)")
    p.add_argument("--foreach", action="store_true", help="AdamW(foreach=True), as on GPUs")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default=None, help="write the per-function table here (rank 0)")
    p.add_argument("--dump", default=None,
                   help="write each phase's raw profile to DUMP.<phase>.prof (rank 0; pstats)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    bench_mesh.init_cpu_group(29541)
    cfg = model_config(args.model, args.seq, True, args.n_layers, args.width)
    model = build_model(cfg, torch.device("cpu"))
    if args.bound:
        loss_fn = setup_bound(model, True).loss
    else:
        mp = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                         reduce_dtype=torch.float32)
        shardc.shard(model, mp_policy=mp, plain_inputs=not args.dtensor_reads)
        loss_fn = compiled_loss(model, True, backend=shardc.backend(inductor=not args.fx))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4,
                            **({"foreach": True} if args.foreach else {}))
    if args.local_step:
        shardc.optim.local_shard_step(opt)
    tokens, targets = synthetic_batches(1, 1, args.seq, cfg.vocab_size, dist.get_rank(),
                                        torch.device("cpu"))[0]
    box = {}
    fns = {"forward": lambda: box.__setitem__("loss", loss_fn(tokens, targets)),
           "backward": lambda: box["loss"].backward(),
           "optimizer.step": opt.step,
           "zero_grad": lambda: opt.zero_grad(set_to_none=True)}
    for _ in range(args.warmup):
        for fn in fns.values():
            fn()
    profs = {ph: cProfile.Profile() for ph in PHASES}
    for _ in range(args.steps):
        for ph, fn in fns.items():
            profs[ph].enable()
            fn()
            profs[ph].disable()
    n_params = sum(1 for _ in model.parameters())
    table: dict[str, dict] = {}
    for ph in PHASES:
        stats = pstats.Stats(profs[ph]).stats
        rows = []
        for (path, line, name), (_cc, nc, tt, ct, _) in stats.items():
            rows.append({"fn": f"{Path(path).name}:{line}({name})" if path != "~" else name,
                         "path": path, "owner": owner(path), "calls": nc / args.steps,
                         "tottime_ms": tt * 1e3 / args.steps,
                         "cumtime_ms": ct * 1e3 / args.steps})
        table[ph] = {"rows": rows}
    if dist.get_rank() == 0:
        print(f"# {' '.join(sys.argv)}\n# world {dist.get_world_size()}, torch "
              f"{torch.__version__}, {args.n_layers} layers, {n_params} parameters, "
              f"{'bound' if args.bound else 'fx' if args.fx else 'inductor'}, plain={args.plain}, "
              f"local_step={args.local_step}; per step (mean of {args.steps})")
        for ph in PHASES:
            rows = table[ph]["rows"]
            total_calls = sum(r["calls"] for r in rows)
            total_ms = sum(r["tottime_ms"] for r in rows)
            print(f"\n## {ph}: {total_calls:.0f} calls, {total_ms:.2f} ms (profiled)")
            by = defaultdict(lambda: [0.0, 0.0])
            for r in rows:
                by[r["owner"]][0] += r["calls"]
                by[r["owner"]][1] += r["tottime_ms"]
            print("  by owner: " + ", ".join(f"{k} {c:.0f} calls {t:.2f} ms" for k, (c, t)
                                            in sorted(by.items(), key=lambda kv: -kv[1][0])))
            print("  shardc functions:")
            for r in sorted((r for r in rows if r["owner"] == "shardc"),
                            key=lambda r: -r["calls"]):
                print(f"    {r['calls']:8.1f} {r['tottime_ms']:7.3f} ms "
                      f"{r['cumtime_ms']:7.3f} cum  {r['fn']}")
            print(f"  top {args.top} by calls:")
            for r in sorted(rows, key=lambda r: -r["calls"])[:args.top]:
                print(f"    {r['calls']:8.1f} {r['tottime_ms']:7.3f} ms  [{r['owner']}] {r['fn']}")
            print(f"  top {args.top} by tottime:")
            for r in sorted(rows, key=lambda r: -r["tottime_ms"])[:args.top]:
                print(f"    {r['calls']:8.1f} {r['tottime_ms']:7.3f} ms  [{r['owner']}] {r['fn']}")
        if args.json:
            Path(args.json).write_text(json.dumps(table, indent=0))
        if args.dump:
            for ph in PHASES:
                profs[ph].dump_stats(f"{args.dump}.{ph}.prof")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
