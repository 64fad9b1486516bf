"""Check that repeated blocks compile once (shardc.sharding.blocks) on this machine's torch, on
CUDA, world 1: ``PYTHONPATH=$PWD python3 scripts/check_compile_once.py`` from the checkout.

A stack of six identical residual MLP blocks (the MLP under non-reentrant activation
checkpointing) and one block of another width is sharded with shardc and trained for three SGD
steps, once with ``compile_blocks_once=True`` (the default) and once with ``False`` (every block
inline), with the FX backend and with Inductor. Asserts, for each backend:

* the training region's plan has exactly one block body, called by the six identical blocks and
  partitioned once, and the odd block inline with its reason;
* an ``eval()`` + ``torch.no_grad()`` forward calls the same body, not partitioned;
* losses and the eval outputs equal those of ``compile_blocks_once=False`` (relative error
  <= 1e-5 for FX, 1e-4 for Inductor, whose kernels may fuse differently).

Prints one JSON line per run (torch version, first-step seconds) and ``OK`` at the end; exits
non-zero on the first failed check. ``--cpu`` runs the same checks on the CPU over gloo (a dry
run of the script; the CUDA run is the one that counts).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import shardc

# The model of the parity tests (tests/parity.py), wider and deeper here.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from parity import BlockStack  # noqa: E402

DIM, HIDDEN, ODD, VOCAB, DEPTH, STEPS = 64, 96, 40, 101, 6, 3


def run(inductor: bool, once: bool, device: str) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = BlockStack(DIM, HIDDEN, ODD, DEPTH, VOCAB).to(device)
    shardc.shard(model)
    compiled = torch.compile(model, backend=shardc.backend(inductor=inductor,
                                                           compile_blocks_once=once))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, VOCAB, (STEPS + 1, 8, 33), device=device, generator=g)
    losses, first_step_s = [], 0.0
    for step in range(STEPS):
        start = time.perf_counter()
        logits = compiled(tokens[step, :, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                           tokens[step, :, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()
        if step == 0:
            first_step_s = time.perf_counter() - start
        losses.append(loss.detach())
    model.eval()
    with torch.no_grad():
        evaluated = compiled(tokens[STEPS, :, :-1]).float()
    model.train()
    plans = [r.plan for r in shardc.shard_state(model).regions if r.plan is not None]
    return {"losses": torch.stack(losses).float(), "eval": evaluated, "first_step_s": first_step_s,
            "bodies": [[(tuple(b.blocks), b.partitions) for b in p.bodies] for p in plans],
            "inline": [{b.module: b.reason for b in p.inline_blocks} for p in plans]}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / (b.norm() or 1.0)).item()


def check(name: str, ok: bool, detail: object) -> None:
    if not ok:
        print(f"FAILED: {name}: {detail}", flush=True)
        sys.exit(1)


def main() -> None:
    device = "cpu" if "--cpu" in sys.argv[1:] else "cuda"
    if device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("this check needs a CUDA device (or --cpu for a dry run)")
        torch.cuda.set_device(0)
    init = os.path.join(tempfile.mkdtemp(), "init")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init}",
                            rank=0, world_size=1)
    identical = tuple(f"blocks.{i}" for i in range(DEPTH))
    odd = f"blocks.{DEPTH}"
    try:
        for inductor, tol in ((False, 1e-5), (True, 1e-4)):
            mode = "inductor" if inductor else "fx"
            once, inline = run(inductor, True, device), run(inductor, False, device)
            for label, r in (("once", once), ("inline", inline)):
                print(json.dumps({"torch": torch.__version__, "device": device, "mode": mode,
                                  "blocks": label,
                                  "first_step_s": round(r["first_step_s"], 2),
                                  "bodies": r["bodies"]}), flush=True)
            check(f"{mode}: two regions (train, eval)", len(once["bodies"]) == 2, once["bodies"])
            train_bodies, eval_bodies = once["bodies"]
            check(f"{mode}: one body for the identical blocks, partitioned once",
                  train_bodies == [(identical, 1)], train_bodies)
            check(f"{mode}: the eval region calls the body, no partition",
                  eval_bodies == [(identical, 0)], eval_bodies)
            for inline_blocks in once["inline"]:
                check(f"{mode}: the odd block inline", list(inline_blocks) == [odd], inline_blocks)
            check(f"{mode}: compile_blocks_once=False has no body",
                  all(b == [] for b in inline["bodies"]), inline["bodies"])
            for key in ("losses", "eval"):
                err = rel_err(once[key], inline[key])
                check(f"{mode}: {key} equal with and without bodies", err <= tol,
                      f"rel err {err:.2e} > {tol}")
    finally:
        dist.destroy_process_group()
    print("OK", flush=True)


if __name__ == "__main__":
    main()
