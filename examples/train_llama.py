"""Train a small Llama-style model with shardc on CPU ranks (gloo), then checkpoint it with DCP.

    python examples/train_llama.py                 # 2 ranks, spawned here
    torchrun --nproc-per-node 2 examples/train_llama.py

What it shows: parameters sharded as DTensors (``shardc.shard``), the step compiled with
``torch.compile(model, backend="shardc")``, the loss going down, the communication plan dumped as
text, JSON, a Perfetto trace and a memory plot, and a ``torch.distributed.checkpoint`` save that
a freshly built model loads and continues from, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardc
from shardc.models.llama import LlamaConfig, Transformer, llama_loss
from shardc.tools.render import dump_plan, plan_table

# Dimensions deliberately not divisible by the world size: uneven shards are the normal case.
CONFIG = LlamaConfig(vocab_size=61, dim=48, n_layers=3, n_heads=4, ffn_dim=130, max_seq_len=32)


def synthetic_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 0):
    """Sequences that follow a fixed random successor table (with 10% noise): learnable."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab, generator=g)
    for _ in range(steps):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(seq):
            noise = torch.rand(batch, generator=g) < 0.1
            tokens[:, t + 1] = torch.where(
                noise, torch.randint(0, vocab, (batch,), generator=g), successor[tokens[:, t]]
            )
        yield tokens[:, :-1], tokens[:, 1:]


def build(args) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # same initial values on every rank; each keeps its own shard
    model = Transformer(CONFIG)
    shardc.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    options = {"inductor": args.inductor}
    compiled = torch.compile(model, backend="shardc", options=options)
    return model, compiled, opt


def step(compiled, opt, tokens, targets) -> torch.Tensor:
    loss = llama_loss(compiled(tokens), targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def main_rank(rank: int, world: int, args) -> None:
    log = print if rank == 0 else (lambda *a, **k: None)
    out = Path(args.out)
    model, compiled, opt = build(args)
    per_rank = args.batch // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    losses = []
    data = synthetic_batches(args.steps + 1, args.batch, 24, CONFIG.vocab_size)
    for i, (tokens, targets) in zip(range(args.steps), data):
        loss = step(compiled, opt, tokens[rows], targets[rows])
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        if i % 5 == 0 or i == args.steps - 1:
            log(f"step {i:3d}  loss {losses[-1]:.4f}")
    if not losses[-1] < 0.7 * losses[0]:
        raise SystemExit(f"the loss did not go down enough: {losses[0]:.4f} -> {losses[-1]:.4f}")

    plan = shardc.explain(compiled)
    written = dump_plan(plan, out / "plan", rank=rank)
    log("\n" + plan_table(plan))
    log("plan files: " + ", ".join(str(p) for p in written))

    # Save with DCP, reload into a freshly built model, and check both continue identically.
    ckpt = out / "checkpoint"
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt))
    fresh_model, fresh_compiled, fresh_opt = build(args)
    fresh_model_sd, fresh_optim_sd = get_state_dict(fresh_model, fresh_opt)
    state = {"model": fresh_model_sd, "optim": fresh_optim_sd}
    dcp.load(state, checkpoint_id=str(ckpt))
    set_state_dict(fresh_model, fresh_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    for (name, a), (_, b) in zip(model.named_parameters(), fresh_model.named_parameters()):
        if not torch.equal(a.full_tensor(), b.full_tensor()):
            raise SystemExit(f"reloaded parameter {name} differs from the saved one")
    tokens, targets = next(data)
    original = step(compiled, opt, tokens[rows], targets[rows])
    reloaded = step(fresh_compiled, fresh_opt, tokens[rows], targets[rows])
    if not torch.equal(original, reloaded):
        raise SystemExit(f"the reloaded model's next loss differs: {original} vs {reloaded}")
    log(f"checkpoint saved to {ckpt}, reloaded into a fresh model: parameters and the next "
        f"step's loss ({reloaded.item():.4f}) are identical")


def _spawned(rank: int, world: int, init_file: str, args) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    try:
        torch.set_num_threads(1)
        main_rank(rank, world, args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn (without torchrun)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="global batch (divided by ranks)")
    parser.add_argument("--out", default="out/demo", help="where the plan and checkpoint go")
    parser.add_argument("--inductor", action=argparse.BooleanOptionalAction, default=True,
                        help="compile the planned graphs with Inductor (default) or run them as FX")
    args = parser.parse_args()
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
        try:
            main_rank(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(args.nproc, os.path.join(tmp, "pg"), args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
