"""Cases 1-5."""

from __future__ import annotations

import torch
from torch import nn

D, H = 13, 19  # uneven over 2, 3


def data(step, batch=6, d=D):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g)


class MLP(nn.Module):
    def __init__(self, d=D, h=H):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(D, D)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


# 1a. LoRA-style: frozen base weight + trainable adapters in every block.
class LoRA(nn.Module):
    def __init__(self, d=D, h=H, r=3):
        super().__init__()
        self.base = nn.Linear(d, h)
        self.a = nn.Parameter(torch.randn(r, d) * 0.3)
        self.b = nn.Parameter(torch.randn(h, r) * 0.3)
        self.down = nn.Linear(h, d)
        self.base.weight.requires_grad_(False)
        self.base.bias.requires_grad_(False)

    def forward(self, x):
        return x + self.down(torch.tanh(self.base(x) + x @ self.a.t() @ self.b.t()))


def lora():
    return Stack([LoRA() for _ in range(3)])


# 1b. A whole frozen block among trainable ones (same structure).
def frozen_block():
    m = Stack([MLP() for _ in range(3)])
    for p in m.blocks[1].parameters():
        p.requires_grad_(False)
    return m


# 1c. Two frozen blocks, one trainable (frozen group of 2 identical).
def frozen_two():
    m = Stack([MLP() for _ in range(3)])
    for i in (0, 2):
        for p in m.blocks[i].parameters():
            p.requires_grad_(False)
    return m


# 2. Mixed dtypes within a block.
class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H)
        self.scale = nn.Parameter(torch.ones(H, dtype=torch.float64))

    def forward(self, x):
        return x + (torch.tanh(self.up(x)) * self.scale.float()).sum(-1, keepdim=True)


def mixed():
    return Stack([Mixed() for _ in range(3)])


# 2b. All blocks in bf16 but the head fp32 (packed in bf16).
class BF(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H).to(torch.bfloat16)
        self.down = nn.Linear(H, D).to(torch.bfloat16)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x.bfloat16()))).float()


def bf_blocks():
    return Stack([BF() for _ in range(3)])


# 3a. Tied between two blocks of the ModuleList.
def tied_blocks():
    m = Stack([MLP() for _ in range(3)])
    m.blocks[2].up.weight = m.blocks[0].up.weight
    return m


# 3b. Embedding tied to a weight inside the last block.
class EmbStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, D)
        self.blocks = nn.ModuleList([MLP(D, D) for _ in range(3)])
        self.head = nn.Linear(D, 11, bias=False)

    def forward(self, tok):
        x = self.embed(tok)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def emb_tied():
    m = EmbStack()
    # blocks[-1].down.weight is (D, D); embedding (11, D): tie embed to a block's (D,D)? shapes
    # differ; tie head.weight (11, D) -> needs (11, D) in block: use up of a D->11 ... instead tie
    # a block weight with a non-block module of the same shape.
    m.extra = nn.Linear(D, D, bias=False)
    m.extra.weight = m.blocks[-1].down.weight
    return m


class EmbStack2(EmbStack):
    def forward(self, tok):
        x = self.embed(tok)
        for b in self.blocks:
            x = b(x)
        return self.head(self.extra(x))


def emb_tied2():
    m = EmbStack2()
    m.extra = nn.Linear(D, D, bias=False)
    m.extra.weight = m.blocks[-1].down.weight
    return m


def tok_data(step, batch=6):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 11, (batch, 5), generator=g), torch.randint(0, 11, (batch, 5),
                                                                         generator=g)


def ce(out, y):
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


# 4a. BatchNorm in blocks.
class BNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H)
        self.bn = nn.BatchNorm1d(H)
        self.down = nn.Linear(H, D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.bn(self.up(x))))


def bn():
    return Stack([BNBlock() for _ in range(3)])


# 4b. Registered buffer counter / EMA updated in forward.
class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(H))

    def forward(self, x):
        h = torch.tanh(self.up(x))
        if self.training:
            self.calls += 1
            with torch.no_grad():
                self.ema.mul_(0.9).add_(h.detach().mean(0) * 0.1)
        return x + self.down(h) + self.ema.sum() * 0.01


def counter():
    return Stack([Counter() for _ in range(3)])


# 5a. Blocks that differ in the same ModuleList.
class MLPExtra(MLP):
    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(D, D)

    def forward(self, x):
        return super().forward(x) + self.extra(x)


def differ():
    return Stack([MLP(), MLPExtra(), MLP(D, 7), MLP(), MLPExtra(), MLP(D, 7)])


def differ_order():
    # A group whose members are interleaved with inline ones.
    return Stack([MLP(), MLP(D, 7), MLP(), MLPExtra()])


CASES = {
    "lora": {"build": lora, "data": data},
    "frozen_block": {"build": frozen_block, "data": data},
    "frozen_two": {"build": frozen_two, "data": data},
    "mixed": {"build": mixed, "data": data},
    "bf_blocks": {"build": bf_blocks, "data": data},
    "tied_blocks": {"build": tied_blocks, "data": data},
    "emb_tied": {"build": emb_tied2, "data": tok_data, "loss": ce},
    "bn": {"build": bn, "data": data},
    "counter": {"build": counter, "data": data},
    "differ": {"build": differ, "data": data},
    "differ_order": {"build": differ_order, "data": data},
}
