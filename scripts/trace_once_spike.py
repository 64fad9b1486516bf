"""World-1 FX measurement of shardc's trace-once path (issue 18): one process per depth, the
benchmarks' tiny llama, one training step then two more; prints Dynamo's trace seconds, the
first step, losses and the number of body traces. ``SHARDC_TRACE_ONCE=0`` turns the path off.

    PYTHONPATH=$PWD python3 scripts/trace_once_spike.py --blocks 2 16 [--inductor]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


def _one(blocks: int, inductor: bool) -> dict:
    import torch
    import torch.distributed as dist

    for path in (_ROOT, _ROOT / "benchmarks"):
        sys.path.insert(0, str(path))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 2000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    import bench_mesh
    from train.runner import train_step
    from train.shardc_mode import setup_shardc
    from train.workload import build_model, model_config, synthetic_batches

    cpu = torch.device("cpu")
    cfg = model_config("1b", 32, True, blocks)
    data = synthetic_batches(3, 2, 32, cfg.vocab_size, 0, cpu)
    setup = setup_shardc(build_model(cfg, cpu), bench_mesh.build_mesh("cpu", 1, None, 1),
                         True, inductor=inductor)
    opt = torch.optim.AdamW(setup.params, lr=1e-3)
    t0 = time.perf_counter()
    losses = [train_step(setup, opt, *data[0]).item()]
    first = time.perf_counter() - t0
    losses += [train_step(setup, opt, *data[i]).item() for i in (1, 2)]
    names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    times = dict(zip(names, (float(v) for v in values)))
    dist.destroy_process_group()
    return {"blocks": blocks, "first_step_s": round(first, 2), "losses": losses,
            "dynamo": {k: round(v, 2) for k, v in times.items()
                       if k in ("_compile.compile_inner", "bytecode_tracing", "build_guards",
                                "OutputGraph.call_user_compiler")}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, nargs="+", default=[2, 16])
    p.add_argument("--inductor", action="store_true")
    p.add_argument("--one", type=int, default=None)
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(_one(args.one, args.inductor)))
        return
    for blocks in args.blocks:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="ind_")}
        cmd = [sys.executable, __file__, "--one", str(blocks)] + (["--inductor"] if args.inductor
                                                                   else [])
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-3000:]
        print(line, flush=True)


if __name__ == "__main__":
    main()
