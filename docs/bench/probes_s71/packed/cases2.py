"""Cases 6, 7, 9, 10."""

from __future__ import annotations

import contextlib

import torch
from cases1 import MLP, Stack, data
from harness import default_loss
from torch import nn

import shardc

D, H = 13, 19


def stack3():
    return Stack([MLP() for _ in range(3)])


# 6a. clip_grad_norm_ between backward and step.
def clip(model, opt, step):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


# 6b. gradient accumulation over 2 micro-batches, without no_sync.
def accum_loop(model, forward, x, y, step, opt, is_ref, use_no_sync=False):
    half = x.shape[0] // 2
    total = 0.0
    for i, part in enumerate((slice(0, half), slice(half, None))):
        ctx = (shardc.no_sync(model) if use_no_sync and not is_ref and i == 0
               else contextlib.nullcontext())
        with ctx:
            loss = default_loss(forward(x[part]), y[part]) / 2
            loss.backward()
        total = total + loss.detach()
    return total


def accum_no_sync_loop(*a):
    return accum_loop(*a, use_no_sync=True)


# 7. eval interleaved, dropout p=0 present.
class DropMLP(MLP):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return x + self.drop(self.down(torch.tanh(self.up(x))))


def drop_stack():
    return Stack([DropMLP() for _ in range(3)])


def eval_between(model, forward, step):
    model.eval()
    with torch.no_grad():
        x, _ = data(50 + step, batch=6)
        out = forward(x)
    model.train()
    return out


def eval_between_grad(model, forward, step):
    """eval without no_grad."""
    model.eval()
    x, _ = data(50 + step, batch=6)
    out = forward(x).detach()
    model.train()
    return out


# 9. freeze a block after the first step.
def freeze_block1(model, step):
    if step == 0:
        for p in model.blocks[1].parameters():
            p.requires_grad_(False)


def freeze_one_param(model, step):
    if step == 0:
        model.blocks[1].up.weight.requires_grad_(False)


def unfreeze_one_param(model, step):
    if step == 0:
        model.blocks[1].up.weight.requires_grad_(True)


def stack3_frozen_param():
    m = stack3()
    m.blocks[1].up.weight.requires_grad_(False)
    return m


def opt_all(m):
    return torch.optim.AdamW(list(m.parameters()), lr=1e-2, weight_decay=0.1)


# 10a. keyword-only args, tuple and dict returns.
class KwBlock(MLP):
    def forward(self, x, *, scale, bias=None):
        h = x + self.down(torch.tanh(self.up(x))) * scale
        if bias is not None:
            h = h + bias
        return h


class KwStack(Stack):
    def forward(self, x):
        b = torch.ones(D) * 0.1
        for i, blk in enumerate(self.blocks):
            x = blk(x, scale=0.5 + i, bias=b if i % 2 else None)
        return self.head(x)


class TupleBlock(MLP):
    def forward(self, x, r):
        h = self.down(torch.tanh(self.up(x)))
        return x + h, r + h.mean(-1, keepdim=True)


class TupleStack(Stack):
    def forward(self, x):
        r = torch.zeros(x.shape[0], 1)
        for blk in self.blocks:
            x, r = blk(x, r)
        return self.head(x) + r


class DictBlock(MLP):
    def forward(self, inp):
        x = inp["h"]
        h = self.down(torch.tanh(self.up(x)))
        return {"h": x + h, "aux": inp["aux"] + h.square().mean(-1, keepdim=True)}


class DictStack(Stack):
    def forward(self, x):
        state = {"h": x, "aux": torch.zeros(x.shape[0], 1)}
        for blk in self.blocks:
            state = blk(state)
        return self.head(state["h"]) + state["aux"]


class TwiceStack(Stack):
    """Each block applied twice (weight reuse across time steps)."""

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
            x = blk(x)
        return self.head(x)


class RecurrentStack(Stack):
    """Unrolled: time loop outside, blocks inside; blocks reused every step."""

    def forward(self, x):
        h = x
        for t in range(2):
            for blk in self.blocks:
                h = blk(h)
            h = h * 0.5
        return self.head(h)


class SameTwiceArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, a, b):
        return a + self.down(torch.tanh(self.up(b)))


class SameTwiceStack(Stack):
    def forward(self, x):
        for i, blk in enumerate(self.blocks):
            x = blk(x, x) if i % 2 == 0 else blk(x, x * 2)
        return self.head(x)


def data12(step):
    return data(step, batch=12)


CASES = {
    "clip": {"build": stack3, "data": data, "before_step": clip},
    "accum": {"build": stack3, "data": data12, "loop": accum_loop},
    "accum_no_sync": {"build": stack3, "data": data12, "loop": accum_no_sync_loop},
    "zero_none_false": {"build": stack3, "data": data, "set_to_none": False},
    "clip_accum_zero": {"build": stack3, "data": data12, "loop": accum_no_sync_loop,
                        "before_step": clip, "set_to_none": False},
    "eval_between": {"build": drop_stack, "data": data, "eval_between": eval_between},
    "eval_between_grad": {"build": drop_stack, "data": data,
                          "eval_between": eval_between_grad},
    "freeze_block": {"build": stack3, "data": data, "after_step": freeze_block1},
    "freeze_block_zf": {"build": stack3, "data": data, "after_step": freeze_block1,
                        "set_to_none": False},
    "freeze_param": {"build": stack3, "data": data, "after_step": freeze_one_param},
    "unfreeze_param": {"build": stack3_frozen_param, "data": data,
                       "after_step": unfreeze_one_param, "optimizer": opt_all},
    "kw": {"build": lambda: KwStack([KwBlock() for _ in range(3)]), "data": data},
    "tuple": {"build": lambda: TupleStack([TupleBlock() for _ in range(3)]), "data": data},
    "dict": {"build": lambda: DictStack([DictBlock() for _ in range(3)]), "data": data},
    "twice": {"build": lambda: TwiceStack([MLP() for _ in range(3)]), "data": data},
    "recurrent": {"build": lambda: RecurrentStack([MLP() for _ in range(2)]), "data": data},
    "same_twice": {"build": lambda: SameTwiceStack([SameTwiceArgs() for _ in range(3)]),
                   "data": data},
}
