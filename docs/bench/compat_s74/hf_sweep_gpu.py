"""The transformers sweep of ``docs/bench/compat_s72/hf_sweep.py`` on one GPU (a probe, not a
test): each family's tiny random-config causal LM sharded with shardc's defaults (packed
blocks, plain inputs) on a one-rank NCCL mesh, compiled by shardc's backend (Inductor, Triton
kernels), trained three steps (sequence lengths 17, 17, 13: the third a dynamic-shape
recompile) against the same model unsharded and eager on the same GPU:

    PYTHONPATH=$PWD python docs/bench/compat_s74/hf_sweep_gpu.py [--jobs 8] [--opt adamw]
        [--bf16] [--uneven] [FAMILY ...]

fp32 (default): loss, every ``.grad`` (presence and value) and every parameter after each step
within the CPU sweep's tolerance (1e-4; matmuls in full fp32: TF32 stays off, torch's
default). ``--bf16``: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``
against the fp32 reference: a smoke check that the family compiles and trains under mixed
precision (every loss finite, each step's loss within 5% of the reference's, no ``.grad``
presence difference), not a parity check. Each family runs in its own process (``--jobs`` at
a time: Inductor's compile is host-bound), so a failure or hang of one stops no other.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location(
    "hf_sweep", _HERE.parent / "compat_s72" / "hf_sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)

BF16_LOSS_RTOL = 0.05


def _run(name: str, kind: str, common: dict, mesh, bf16: bool, device: torch.device,
         plain: bool = False) -> str:
    import shardc
    from shardc.sharding.packed_blocks import packed_block_names

    reference = sweep.build(name, common).to(device)
    model = copy.deepcopy(reference)
    torch._dynamo.reset()
    policy = (shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 else None)
    if plain:  # plain torch.compile of the unsharded model: is a mismatch torch's?
        forward, packed = torch.compile(model), "-"
    else:
        shardc.shard(model, mesh, mp_policy=policy)
        forward = torch.compile(model, backend=shardc.backend())
        packed = len(packed_block_names(model))
    names = [n for n, _ in reference.named_parameters()]
    ref_params = dict(reference.named_parameters())
    params = dict(model.named_parameters())
    ref_opt = sweep._optimizer(kind, reference.parameters())
    opt = sweep._optimizer(kind, model.parameters())
    generator = torch.Generator().manual_seed(1)
    loss_diff = grad_diff = param_diff = 0.0
    presence: dict[str, tuple] = {}
    worst = ("", 0.0)
    finite = True
    for step, seq in enumerate(sweep.SEQS):
        ids = torch.randint(0, common["vocab_size"], (sweep.PER_RANK, seq),
                            generator=generator).to(device)
        ref_loss = sweep._loss(reference, ids)
        ref_loss.backward()
        loss = sweep._loss(forward, ids)
        loss.backward()
        finite = finite and math.isfinite(loss.item())
        diff = abs(loss.item() - ref_loss.item())
        loss_diff = max(loss_diff, diff / abs(ref_loss.item()) if bf16 else diff)
        for n in names:
            r, p = ref_params[n].grad, params[n].grad
            if (r is None) != (p is None):
                presence.setdefault(n, (step, r is not None, p is not None))
            elif r is not None and not bf16:
                grad_diff = max(grad_diff, sweep._full(p).sub(r).abs().max().item())
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        if not bf16:
            for n in names:
                d = sweep._full(params[n].detach()).sub(ref_params[n].detach()).abs().max().item()
                param_diff = max(param_diff, d)
                if d > worst[1]:
                    worst = (n, d)
    regions = "-" if plain else [(len(p.bodies), len(p.inline_blocks))
                                 for p in shardc.explain_all(forward)]
    if bf16:
        ok = finite and loss_diff < BF16_LOSS_RTOL and not presence
        line = (f"{name:12s} {kind:5s} {'OK ' if ok else 'BAD'} bf16 loss rel {loss_diff:.1e} "
                f"finite {finite} packed {packed} regions {regions}")
    else:
        ok = max(loss_diff, grad_diff, param_diff) < sweep.TOL and not presence
        line = (f"{name:12s} {kind:5s} {'OK ' if ok else 'BAD'} loss {loss_diff:.1e} grad "
                f"{grad_diff:.1e} param {param_diff:.1e} packed {packed} regions {regions}")
    line += sweep.presence_text(presence)
    if not ok and not bf16:
        line += f"\n    largest parameter difference: {worst[0]} {worst[1]:.2e}"
    return line


def child(name: str, kinds: list[str], uneven: bool, bf16: bool, port: int, on: str,
          plain: bool = False) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = on == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(on, (1,))
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    common = {**sweep.COMMON, **sweep.UNEVEN} if uneven else dict(sweep.COMMON)
    for kind in kinds:
        start = time.perf_counter()
        try:
            line = _run(name, kind, common, mesh, bf16, device, plain)
        except Exception as exc:  # a probe: report and go on
            line = f"{name:12s} {kind:5s} FAIL {type(exc).__name__}: {str(exc)[:400]}"
            traceback.print_exc(limit=8, file=sys.stderr)
        print(f"{line}  [{time.perf_counter() - start:.0f} s]", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--opt", default="adamw")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--uneven", action="store_true")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--port", type=int, default=29950)
    parser.add_argument("--logs", default=None, help="each family's stderr here")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a one-rank gloo check of this script itself")
    parser.add_argument("--plain-compile", action="store_true",
                        help="no shardc: plain torch.compile (Inductor) of the unsharded model")
    parser.add_argument("--eager", default="",
                        help="comma-separated families built with eager attention as well")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("families", nargs="*", default=list(sweep.FAMILIES))
    args = parser.parse_args()
    kinds = args.opt.split(",")
    sweep.EAGER_ATTENTION = (*sweep.EAGER_ATTENTION, *filter(None, args.eager.split(",")))
    if args.child is not None:
        child(args.child, kinds, args.uneven, args.bf16, args.port, args.device,
              args.plain_compile)
        return
    import transformers

    flags = (f"{'bf16 ' if args.bf16 else ''}{'uneven ' if args.uneven else ''}"
             f"{'plain-compile ' if args.plain_compile else ''}")
    print(f"# world 1 {args.device} {flags}"
          f"packed torch {torch.__version__} transformers {transformers.__version__} "
          f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'}", flush=True)
    logs = Path(args.logs) if args.logs else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    pending = list(enumerate(args.families))
    running: list[tuple[str, subprocess.Popen, float]] = []
    while pending or running:
        while pending and len(running) < args.jobs:
            i, name = pending.pop(0)
            cmd = [sys.executable, __file__, "--child", name, "--opt", args.opt,
                   "--port", str(args.port + i), "--device", args.device, "--eager", args.eager,
                   *(["--bf16"] if args.bf16 else []), *(["--uneven"] if args.uneven else []),
                   *(["--plain-compile"] if args.plain_compile else [])]
            err = open(logs / f"{name}.log", "w") if logs else subprocess.DEVNULL
            running.append((name, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err,
                                                   text=True), time.monotonic()))
        for item in list(running):
            name, proc, started = item
            if proc.poll() is None and time.monotonic() - started < args.timeout:
                continue
            if proc.poll() is None:
                proc.kill()
                print(f"{name:12s} TIMEOUT after {args.timeout:.0f} s", flush=True)
            else:
                out = proc.stdout.read().strip()
                print(out if out else f"{name:12s} CRASH rc={proc.returncode}", flush=True)
            running.remove(item)
        time.sleep(1)


if __name__ == "__main__":
    main()
