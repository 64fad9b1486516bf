"""s75 repro: torch's checkpoint_wrapper on the blocks before shardc.shard (torchtitan / FSDP2
users' activation checkpointing) fails in shard() with the packed default.

Run: cd <worktree> && python docs/bench/probes_s75/repros/checkpoint_wrapper_packed.py
One process, gloo world 1 (the packing runs at any world size). Seen (torch 2.13, s75):
    KeyError: 'blocks.0.lin.weight'   (shardc/sharding/shard.py, _pack_blocks)
With pack_blocks=False it shards and trains at parity (probes.md).
"""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import shardc


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.lin(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(checkpoint_wrapper(Block()) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("gloo", rank=0, world_size=1)
    pack = os.environ.get("PACK", "1") == "1"
    model = Net()
    # names differ: CheckpointWrapper.named_parameters strips its prefix, the root's does not
    print([n for n, _ in model.named_parameters()][:2],
          [n for n, _ in model.blocks[0].named_parameters()][:1])
    shardc.shard(model, pack_blocks=pack)
    out = torch.compile(model, backend=shardc.backend(inductor=False))(torch.randn(3, 8))
    out.sum().backward()
    print("ok", pack)
    dist.destroy_process_group()
