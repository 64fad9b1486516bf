"""More edge cases: unused params in a block, scalar params, intra-block ties, two lists,
eager/compiled mixing, dtype conversion after shard."""

from __future__ import annotations

import torch
from cases1 import MLP, Stack, data
from torch import nn

D, H = 13, 19


class Unused(MLP):
    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(D, 5)

    def forward(self, x):
        return super().forward(x)


class TrainOnly(MLP):
    """A parameter read only in eval mode."""

    def __init__(self):
        super().__init__()
        self.eval_scale = nn.Parameter(torch.ones(D))

    def forward(self, x):
        y = super().forward(x)
        return y if self.training else y * self.eval_scale


class Scalar(MLP):
    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        return x + self.alpha * self.down(torch.tanh(self.up(x)))


class IntraTied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.b.weight = self.a.weight

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class TwoLists(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.ModuleList([MLP() for _ in range(2)])
        self.dec = nn.ModuleList([MLP() for _ in range(2)])
        self.head = nn.Linear(D, D)

    def forward(self, x):
        for b in self.enc:
            x = b(x)
        for b in self.dec:
            x = b(x)
        return self.head(x)


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList([nn.ModuleList([MLP() for _ in range(2)]) for _ in range(2)])
        self.head = nn.Linear(D, D)

    def forward(self, x):
        for st in self.stages:
            for b in st:
                x = b(x)
        return self.head(x)


class Conv(nn.Module):
    """4-D weights (conv) in blocks."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(3, 5, 3, padding=1)
        self.c2 = nn.Conv1d(5, 3, 3, padding=1)

    def forward(self, x):
        return x + self.c2(torch.tanh(self.c1(x)))


class ConvStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Conv() for _ in range(3)])
        self.head = nn.Linear(D, D)

    def forward(self, x):
        x = x.view(x.shape[0], 1, D).expand(-1, 3, -1).contiguous()
        for b in self.blocks:
            x = b(x)
        return self.head(x.sum(1))


def eval_mode_forward(model, forward, step):
    model.eval()
    with torch.no_grad():
        out = forward(data(50 + step)[0])
    model.train()
    return out


def stack_of(cls, n=3):
    return lambda: Stack([cls() for _ in range(n)])


def mixed_eager(model, forward, x, y, step, opt, is_ref):
    f = model if step % 2 == 1 else forward  # odd steps eager
    loss = (f(x) - y).square().mean()
    loss.backward()
    return loss


def retain_twice(model, forward, x, y, step, opt, is_ref):
    loss = (forward(x) - y).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()
    return loss


def no_grad_train_forward(model, forward, x, y, step, opt, is_ref):
    with torch.no_grad():
        forward(x)  # train-mode forward without grad (e.g. a logging pass)
    loss = (forward(x) - y).square().mean()
    loss.backward()
    return loss


CASES = {
    "unused": {"build": stack_of(Unused), "data": data},
    "train_only": {"build": stack_of(TrainOnly), "data": data,
                   "eval_between": eval_mode_forward},
    "scalar": {"build": stack_of(Scalar), "data": data},
    "intra_tied": {"build": stack_of(IntraTied), "data": data},
    "two_lists": {"build": TwoLists, "data": data},
    "nested": {"build": Nested, "data": data},
    "conv": {"build": ConvStack, "data": data},
    "mixed_eager": {"build": stack_of(MLP), "data": data, "loop": mixed_eager},
    "retain_twice": {"build": stack_of(MLP), "data": data, "loop": retain_twice},
    "no_grad_train": {"build": stack_of(MLP), "data": data, "loop": no_grad_train_forward},
}


class Cfg:
    def __init__(self, scale):
        self.scale = scale


class UnusedObj(Unused):
    def forward(self, x, cfg):
        return x + self.down(torch.tanh(self.up(x))) * cfg.scale


class ObjStack(Stack):
    def forward(self, x):
        cfg = Cfg(0.5)
        for b in self.blocks:
            x = b(x, cfg)
        return self.head(x)


CASES["unused_obj"] = {"build": lambda: ObjStack([UnusedObj() for _ in range(3)]), "data": data}


class StageF(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([MLP() for _ in range(2)])
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


class NestedF(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList([StageF() for _ in range(2)])
        self.head = nn.Linear(D, D)

    def forward(self, x):
        for st in self.stages:
            x = st(x)
        return self.head(x)


CASES["nested_f"] = {"build": NestedF, "data": data}
