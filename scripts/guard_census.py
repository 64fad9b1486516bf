"""Compile one training step of a small sharded Llama (4 blocks, one rank over gloo, CPU) with
shardc's backend, so that ``TORCH_LOGS=guards`` shows the guards Dynamo installs for it (issue
20: the per-step guard evaluation). docs/overhead.md, "Guards per step", counts them by kind.

    TORCH_LOGS=guards PYTHONPATH=$PWD python scripts/guard_census.py 2> guards.log
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shardc
from shardc.models.llama import LlamaConfig, Transformer, llama_loss


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        model = Transformer(LlamaConfig(dim=64, n_layers=4, n_heads=4, vocab_size=128,
                                        max_seq_len=32))
        shardc.shard(model, mesh)
        step = torch.compile(lambda t, y: llama_loss(model(t), y), backend="shardc")
        tokens, targets = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
        step(tokens, targets).backward()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
