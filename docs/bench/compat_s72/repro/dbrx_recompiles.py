"""s73 repro: transformers' DBRX (tiny random config, N layers) at world 1, compiled with shardc's
backend or plain ``torch.compile``: a few forward/backward steps at sequence length 17, then
Dynamo's recompiles counted per compiled function and the functions that hit
``recompile_limit``. With ``--check``: hf_sweep's check against the unsharded model instead
(shardc only, SGD, sequence lengths 17, 17, 13).

    PYTHONPATH=$PWD python docs/bench/compat_s72/repro/dbrx_recompiles.py [--plain] [--check]
        [--layers N] [--steps S] [--recompile-limit L]
"""

import argparse
import collections
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hf_sweep  # noqa: E402

SITE = os.path.dirname(os.path.dirname(torch.__file__)) + os.sep


class _Recompiles(logging.Handler):
    def __init__(self):
        super().__init__()
        self.counts, self.limit_hits = collections.Counter(), []

    def emit(self, record):
        message = record.getMessage()
        if "Recompiling function " in message:
            where = message.split("Recompiling function ")[1].split("\n")[0]
            self.counts[where.replace(SITE, "")] += 1
        if "hit config.recompile_limit" in message and "function: " in message:
            self.limit_hits.append(message.split("function: ")[1].split("\n")[0].replace(SITE, ""))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--recompile-limit", type=int, default=None)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29655")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    if args.recompile_limit is not None:
        torch._dynamo.config.recompile_limit = args.recompile_limit
    base = hf_sweep._dbrx
    hf_sweep.FAMILIES["dbrx"] = ("DbrxConfig", "DbrxForCausalLM",
                                 lambda c: {**base(c), "n_layers": args.layers})
    from torch.distributed.device_mesh import init_device_mesh

    import shardc

    mesh = init_device_mesh("cpu", (1,))
    handler = _Recompiles()
    logging.getLogger("torch._dynamo").addHandler(handler)
    torch._logging.set_logs(recompiles=True)
    if args.check:
        print(hf_sweep._run("dbrx", "sgd", 0, 1, dict(hf_sweep.COMMON), mesh,
                            "plain-compile" if args.plain else "packed")[:120], flush=True)
    else:
        model = hf_sweep.build("dbrx", dict(hf_sweep.COMMON))
        if args.plain:
            forward = torch.compile(model)
        else:
            shardc.shard(model, mesh)
            forward = torch.compile(model, backend=shardc.backend())
        generator = torch.Generator().manual_seed(1)
        for step in range(args.steps):
            ids = torch.randint(0, 64, (2, 17), generator=generator)
            start = time.perf_counter()
            hf_sweep._loss(forward, ids).backward()
            print(f"step {step}: {time.perf_counter() - start:.2f} s", flush=True)
    print(f"{'plain' if args.plain else 'shardc'}, {args.layers} layers: recompiles")
    for where, count in sorted(handler.counts.items()):
        print(f"  {count:3d}  {where}")
    print("recompile_limit hit:", handler.limit_hits or "none")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
