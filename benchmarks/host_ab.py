"""Host time of shardc with and without ``plain_inputs``, interleaved step by step (CPU).

On a shared, loaded CPU machine, rows measured one after the other differ by more than the
effect measured; this script builds both models in one process (same weights, data, AdamW)
and alternates their steps, timing each phase by the process's CPU time (``time.process_time``:
not counting time spent preempted). A plain ``python`` run is a world of one; under ``torchrun``
each rank reports its own medians (rank 0 prints)::

    python benchmarks/host_ab.py --n-layers 8 --steps 30 --out docs/bench/overhead --name ab8

Public API only (``shardc.shard``, ``shardc.backend``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

_BENCHMARKS = Path(__file__).resolve().parent
for _path in (_BENCHMARKS.parent, _BENCHMARKS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import bench_mesh  # noqa: E402
from train.provenance import git_describe, launch_command  # noqa: E402
from train.setup import swap_param_reads  # noqa: E402
from train.workload import build_model, model_config  # noqa: E402

import shardc  # noqa: E402

PHASES = ("forward", "backward", "optimizer.step", "zero_grad")
# name -> (plain_inputs, shardc.optim.local_shard_step, pack_blocks) ("shardc" is the DTensor
# reads, shardc.shard's default before s53; "shardc-plain" its default since; "shardc-packed":
# the plain reads with each repeated block read as one packed buffer); "bound": no shardc
# (replicated parameters read as bf16, Inductor, no communication: benchmarks/train/baselines.py).
VARIANTS = {"shardc": (False, False, False), "shardc-plain": (True, False, False),
            "shardc-local": (False, True, False), "shardc-plain-local": (True, True, False),
            "shardc-packed": (True, False, True), "bound": None}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--width", type=int, default=32, help="model dimension (tiny 1b config)")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fx", action="store_true", help="the FX backend instead of Inductor")
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS),
                   default=["shardc", "shardc-plain"],
                   help="the models built and stepped in turn (default: with and without "
                        "plain_inputs)")
    p.add_argument("--foreach", action="store_true",
                   help="AdamW(foreach=True), torch's choice on GPUs (on CPU: per tensor)")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="host_ab")
    return p.parse_args(argv)


def step(compiled, opt, tokens) -> dict[str, float]:
    """One training step; each phase's process CPU time in ms."""
    out, box = {}, {}
    fns = (("forward", lambda: box.__setitem__("loss", compiled(tokens).float().mean())),
           ("backward", lambda: box["loss"].backward()), ("optimizer.step", opt.step),
           ("zero_grad", lambda: opt.zero_grad(set_to_none=True)))
    for name, fn in fns:
        t = time.process_time()
        fn()
        out[name] = (time.process_time() - t) * 1e3
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    bench_mesh.init_cpu_group(29531)
    cfg = model_config("1b", args.seq, True, args.n_layers, args.width)
    mp = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs = {}
    for name in args.variants:
        model = build_model(cfg, torch.device("cpu"))
        if VARIANTS[name] is None:
            swap_param_reads(model, lambda p: p.to(torch.bfloat16))  # as setup_bound
            compiled = torch.compile(model)
        else:
            shardc.shard(model, mp_policy=mp, plain_inputs=VARIANTS[name][0],
                         pack_blocks=VARIANTS[name][2])
            compiled = torch.compile(model, backend=shardc.backend(inductor=not args.fx))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4,
                                **({"foreach": True} if args.foreach else {}))
        if VARIANTS[name] is not None and VARIANTS[name][1]:
            shardc.optim.local_shard_step(opt)
        runs[name] = (compiled, opt)
        n_params = sum(1 for _ in model.parameters())
    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=g)
    for compiled, opt in runs.values():
        for _ in range(args.warmup):
            step(compiled, opt, tokens)
    times: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for _ in range(args.steps):  # interleaved: load changes affect both alike
        for name, (compiled, opt) in runs.items():
            times[name].append(step(compiled, opt, tokens))
    rows = {name: {ph: statistics.median(t[ph] for t in ts) for ph in PHASES}
            for name, ts in times.items()}
    for name, ts in times.items():
        rows[name]["step"] = statistics.median(sum(t.values()) for t in ts)
    report = {"command": launch_command(sys.argv if argv is None else ["benchmarks/host_ab.py",
                                                                       *argv]),
              "git": git_describe(), "torch": torch.__version__,
              "world": dist.get_world_size(), "n_layers": args.n_layers,
              "n_param_tensors": n_params,
              "backend": "fx" if args.fx else "inductor", "foreach": args.foreach,
              "process_cpu_ms": rows}
    if dist.get_rank() == 0:
        lines = [f"# {report['command']}", "",
                 f"cpu x {report['world']}, torch {report['torch']}, git {report['git']}, "
                 f"{args.n_layers} layers ({report['n_param_tensors']} parameters), "
                 f"{report['backend']}{', foreach AdamW' if args.foreach else ''}; process "
                 f"CPU ms per phase, median of {args.steps} interleaved steps", "",
                 "| mode | " + " | ".join(PHASES) + " | step |",
                 "|---|" + "---|" * (len(PHASES) + 1)]
        for name, row in rows.items():
            lines.append(f"| {name} | " + " | ".join(f"{row[ph]:.2f}" for ph in PHASES)
                         + f" | {row['step']:.2f} |")
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
            (out / f"{args.name}.md").write_text(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
