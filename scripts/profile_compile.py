"""Where the first training step's compile time goes, by depth: ``PYTHONPATH=$PWD python3
scripts/profile_compile.py --blocks 4 16 --world 2`` from the checkout (CPU, gloo).

For each block count, one fresh process group of ``--world`` ranks shards the benchmarks' tiny
llama (``benchmarks/train``) with shardc's default plan, compiles it (FX backend, or Inductor with
``--inductor``, in a fresh cache directory) and runs one training step. Rank 0 profiles the step
with cProfile on process CPU time (so other load on the machine counts less) and prints the
cumulative seconds of the functions that attribute the compile: Dynamo's trace and guards, the
re-trace of every block body call (``invoke_subgraph`` in Dynamo, ``gen_schema`` in AOTAutograd),
AOTAutograd's joint-graph capture, torch's min-cut partition, shardc's own passes and Inductor.
With two or more depths it also prints each added block's self time by area (torch
subpackages, shardc packages, third-party packages: :func:`per_block_self`), which holds on
Python 3.12 where the cumulative rows do not. ``--pack-blocks`` shards with
``pack_blocks=True`` (shardc's default since s70), ``--no-pack-blocks`` with ``False``.
``--opaque`` compiles with ``opaque_body_calls=True`` (later body calls
reach AOTAutograd as stand-ins, ``shardc.passes.body_standin``). ``--out DIR`` keeps each
depth's profile (``pstats``) there. ``--device cuda`` runs one rank per GPU over NCCL with
Inductor, the benchmarks' full-size ``--model`` (default 1b) at ``--seq``/``--batch`` (2048 / 4,
as ``benchmarks/compile_time.py``), timed on the wall clock (Inductor compiles Triton kernels in
worker processes, which process time would miss). On Python 3.12 cProfile (built on
``sys.monitoring``) loses the frames around Dynamo's compiled code: rows of top-level functions
read 0 and some cumulative times are wrong; self times hold. An analysis tool, not a test.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_ROOT = Path(__file__).resolve().parent.parent

# (label, file suffix, function name): the rows printed per depth.
ROWS = (
    ("first step (rank 0, s, profiled)", "benchmarks/train/runner.py", "train_step"),
    ("Dynamo frame (trace + backend)", "_dynamo/convert_frame.py", "_compile_inner"),
    ("  Dynamo: block body calls traced", "_dynamo/variables/invoke_subgraph.py",
     "_call_function"),
    ("  Dynamo: build guards", "_dynamo/guards.py", "build_guards"),
    ("  Dynamo: wrap tensor inputs (VariableBuilder)", "_dynamo/variables/builder.py",
     "wrap_tensor"),
    ("  backend (AOTAutograd + shardc + Inductor)", "_dynamo/output_graph.py",
     "call_user_compiler"),
    ("    AOTAutograd: metadata pass (create_aot_state)", "_functorch/aot_autograd.py",
     "create_aot_state"),
    ("    AOTAutograd: joint graph capture", "_aot_autograd/graph_capture.py",
     "aot_dispatch_autograd_graph"),
    ("      of which: DTensor inputs' second metadata pass", "graph_capture_wrappers.py",
     "aot_dispatch_subclass"),
    ("    AOTAutograd: invoke_subgraph gen_schema", "_higher_order_ops/invoke_subgraph.py",
     "gen_schema"),
    ("    shardc partitioner (all passes)", "shardc/compile/backend.py", "__call__"),
    ("      body stand-ins restored (opaque_body_calls)", "shardc/passes/body_standin.py",
     "restore_body_calls"),
    ("      torch min-cut partition", "shardc/_torch.py", "min_cut_partition"),
    ("      shardc plan + lower + predict", "shardc/compile/pipeline.py", "plan_and_lower"),
    ("    Inductor compile_fx_inner", "_inductor/compile_fx.py", "compile_fx_inner"),
    ("      Inductor: lowering (GraphLowering.run)", "_inductor/graph.py", "run"),
    ("      Inductor: scheduling + codegen", "_inductor/graph.py", "codegen"),
    ("      Inductor: module load + kernel compile", "_inductor/graph.py",
     "compile_to_module"),
)


def _run(rank: int, world: int, blocks: int, inductor: bool, out: str, port: int,
         plain_inputs: bool | None = None, opaque: bool = False, device_type: str = "cpu",
         model: str = "1b", seq: int = 32, batch: int = 2, pack_blocks: bool | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    if not cuda:
        torch.set_num_threads(1)
    for path in (_ROOT, _ROOT / "benchmarks"):
        sys.path.insert(0, str(path))
    import bench_mesh
    from train.runner import train_step
    from train.shardc_mode import setup_shardc
    from train.workload import build_model, model_config, synthetic_batches

    device = torch.device(device_type, rank) if cuda else torch.device("cpu")
    cfg = model_config(model, seq, not cuda, blocks)
    data = synthetic_batches(1, batch, seq, cfg.vocab_size, rank, device)
    setup = setup_shardc(build_model(cfg, device),
                         bench_mesh.build_mesh(device_type, world, None, 1),
                         True, plain_inputs=plain_inputs, pack_blocks=pack_blocks,
                         inductor=inductor,
                         **({"opaque_body_calls": True} if opaque else {}))
    opt = torch.optim.AdamW(setup.params, lr=1e-4)
    clock = time.perf_counter if cuda else time.process_time
    profile = cProfile.Profile(clock) if rank == 0 else None
    if profile is not None:
        profile.enable()
    train_step(setup, opt, *data[0])
    if profile is not None:
        profile.disable()
        profile.dump_stats(out)
    dist.destroy_process_group()


def _cumulative(stats: pstats.Stats, suffix: str, name: str) -> tuple[int, float]:
    calls, seconds = 0, 0.0
    for (path, _, func), (_, ncalls, _, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        if func == name and path.endswith(suffix):
            calls, seconds = calls + ncalls, seconds + cum
    return calls, seconds


def _area(path: str, func: str) -> str:
    """Where a profiled function lives, for the per-block table: a torch subpackage or module,
    a shardc package, a third-party package, or the builtin itself."""
    if path == "~":
        return f"builtin {func[:40]}"
    rel = path.split("site-packages/")[-1]
    if "shardc/" in rel:
        return "shardc/" + rel.split("shardc/", 1)[1].split("/")[0]
    if rel.startswith("<frozen"):
        return "python imports"
    if rel.startswith("/"):  # outside site-packages: Python's own modules, the benchmarks
        return "python stdlib" if "/python3" in rel else f"other {Path(rel).name}"
    parts = rel.split("/")
    if parts[0] == "torch" and len(parts) > 2 and parts[1] in (
            "_inductor", "_dynamo", "fx", "_functorch", "_subclasses", "utils"):
        return "/".join(parts[:3])
    return "/".join(parts[:2]) if parts[0] == "torch" else parts[0]


def per_block_self(small: pstats.Stats, large: pstats.Stats, blocks: int, top: int = 25
                   ) -> list[str]:
    """Self time per function, ``large``'s less ``small``'s over the ``blocks`` more blocks it
    has, summed by area (:func:`_area`): where each added block's seconds go. Self times, not
    cumulative ones, because Python 3.12's cProfile loses cumulative rows around Dynamo's
    code; under the profiler they are about twice the unprofiled seconds."""
    a, b = small.stats, large.stats  # type: ignore[attr-defined]
    by_area: dict[str, float] = {}
    for key in set(a) | set(b):
        diff = (b[key][2] if key in b else 0.0) - (a[key][2] if key in a else 0.0)
        area = _area(key[0], key[2])
        by_area[area] = by_area.get(area, 0.0) + diff / blocks
    total = sum(by_area.values())
    lines = [f"self time per block (ms, profiled), {total * 1e3:.1f} in all; by area:"]
    for area, secs in sorted(by_area.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {secs * 1e3:8.2f}  {area}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[4, 16])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--inductor", action="store_true")
    # (Before s68 the default was plain_inputs=False, the DTensor inputs, which shardc's default
    # has not been since s53: profiles taken without a flag ran AOTAutograd's second metadata
    # pass over DTensor inputs, which the default does not.)
    p.add_argument("--plain-inputs", dest="plain_inputs", action="store_const", const=True,
                   default=None, help="shardc.shard(..., plain_inputs=True) (shardc's default)")
    p.add_argument("--dtensor-inputs", dest="plain_inputs", action="store_const", const=False,
                   help="shardc.shard(..., plain_inputs=False): DTensor region inputs")
    p.add_argument("--pack-blocks", action=argparse.BooleanOptionalAction, default=None,
                   help="shardc.shard(..., pack_blocks=True): one packed input per block "
                        "(shardc's default); --no-pack-blocks: each parameter read on its own")
    p.add_argument("--opaque", action="store_true",
                   help="opaque_body_calls=True: later body calls reach AOTAutograd as stand-ins")
    p.add_argument("--out", default=None, help="keep the profiles here")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one rank per GPU, NCCL, Inductor, full-size model, wall clock")
    p.add_argument("--model", default="1b", help="1b or wide (tiny widths on the CPU)")
    p.add_argument("--seq", type=int, default=None, help="default: 32 (cpu), 2048 (cuda)")
    p.add_argument("--batch", type=int, default=None, help="default: 2 (cpu), 4 (cuda)")
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.inductor = args.inductor or cuda
    seq = args.seq or (2048 if cuda else 32)
    batch = args.batch or (4 if cuda else 2)
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="shardc_profile_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results, profiles = {}, {}
    for blocks in args.blocks:
        out = str(out_dir / f"blocks{blocks}_world{args.world}.prof")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardc_inductor_")
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardc_triton_")
        mp.spawn(_run, args=(args.world, blocks, args.inductor, out,
                             29500 + (os.getpid() + blocks) % 2000, args.plain_inputs,
                             args.opaque, args.device, args.model, seq, batch,
                             args.pack_blocks),
                 nprocs=args.world)
        stats = profiles[blocks] = pstats.Stats(out)
        results[blocks] = [_cumulative(stats, suffix, name) for _, suffix, name in ROWS]
    print(f"{'':48s}" + "".join(f"{f'{b} blocks':>22s}" for b in args.blocks))
    for i, (label, _, _) in enumerate(ROWS):
        cells = "".join(f"{results[b][i][1]:10.2f} s ({results[b][i][0]:4d} calls)"
                        for b in args.blocks)
        print(f"{label:48s}{cells}")
    small, large = min(args.blocks), max(args.blocks)
    if large > small:
        print(f"from {small} to {large} blocks:")
        print("\n".join(per_block_self(profiles[small], profiles[large], large - small)))
    print(f"profiles: {out_dir}")


if __name__ == "__main__":
    main()
