"""Case 8: state dicts and in-place parameter edits with the packed default."""

from __future__ import annotations

import copy
import os
import sys
import traceback

import torch
import torch._dynamo
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

import shardc

sys.path.insert(0, os.path.dirname(__file__))
from cases1 import MLP, Stack, data  # noqa: E402


def full_sd(model):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def maxdiff(a, b):
    assert set(a) == set(b), (set(a) ^ set(b))
    return max((x.double() - b[k].double()).abs().max().item() for k, x in a.items())


def step(model, forward, opt, s, rank, world, is_ref):
    x, y = data(s)
    per = x.shape[0] // world
    if not is_ref:
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    loss = (forward(x) - y).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss = loss.detach()
    if not is_ref and world > 1:
        dist.all_reduce(loss)
        loss /= world
    return loss.item()


def adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def check_forward(model, forward, rank, world):
    """The compiled forward's output equals an unsharded copy built from the full state dict."""
    plain = Stack([MLP() for _ in range(3)])
    plain.load_state_dict(full_sd(model))
    x, _ = data(77)
    per = x.shape[0] // world
    xs = x[rank * per:(rank + 1) * per]
    with torch.no_grad():
        return (forward(xs) - plain(xs)).abs().max().item()


def worker(rank, world):
    out = {}
    torch.manual_seed(0)
    base = Stack([MLP() for _ in range(3)])
    ref = copy.deepcopy(base)
    ref_opt = adamw(ref)
    ref_losses = [step(ref, ref, ref_opt, s, 0, 1, True) for s in range(2)]

    torch._dynamo.reset()
    model = shardc.shard(copy.deepcopy(base))
    assert shardc.shard_state(model).packed.blocks
    forward = torch.compile(model, backend=shardc.backend(inductor=False))
    opt = adamw(model)
    losses = [step(model, forward, opt, s, rank, world, False) for s in range(2)]
    out["losses"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    out["sd_keys"] = list(model.state_dict()) == list(ref.state_dict())
    out["sd_vals"] = maxdiff(full_sd(model), ref.state_dict())

    def section(name, fn):
        try:
            out[name] = fn()
        except Exception as exc:
            out[name] = f"ERROR {type(exc).__name__}: {exc}"[:600] + traceback.format_exc()[-800:]

    # (a) full state dict into the packed model: set_model_state_dict(full_state_dict=True).
    torch.manual_seed(5)
    other = Stack([MLP() for _ in range(3)])
    new_sd = other.state_dict()

    def set_full():
        set_model_state_dict(model, {k: v.clone() for k, v in new_sd.items()}, options=StateDictOptions(full_state_dict=True))
        ref.load_state_dict(new_sd)
        r = {"after_load": maxdiff(full_sd(model), ref.state_dict()),
             "fwd": check_forward(model, forward, rank, world)}
        ls = [step(model, forward, opt, s, rank, world, False) for s in range(2, 4)]
        rs = [step(ref, ref, ref_opt, s, 0, 1, True) for s in range(2, 4)]
        r["losses"] = max(abs(a - b) for a, b in zip(ls, rs))
        r["params"] = maxdiff(full_sd(model), ref.state_dict())
        r["leaf"] = [b.__dict__.get("_shardc_packed") is not None for b in model.blocks]
        return r

    section("set_full", set_full)

    # (b) load_state_dict of a DTensor state dict (another sharded model's), strict.
    def lsd_dtensor():
        torch.manual_seed(9)
        src_plain = Stack([MLP() for _ in range(3)])
        src = shardc.shard(copy.deepcopy(src_plain), pack_blocks=False)
        model.load_state_dict(src.state_dict())
        ref.load_state_dict(src_plain.state_dict())
        r = {"after_load": maxdiff(full_sd(model), ref.state_dict()),
             "fwd": check_forward(model, forward, rank, world)}
        ls = [step(model, forward, opt, s, rank, world, False) for s in range(4, 6)]
        rs = [step(ref, ref, ref_opt, s, 0, 1, True) for s in range(4, 6)]
        r["losses"] = max(abs(a - b) for a, b in zip(ls, rs))
        r["params"] = maxdiff(full_sd(model), ref.state_dict())
        return r

    section("lsd_dtensor", lsd_dtensor)

    # (c) in-place edits of DTensor parameters: p.mul_, p.data.mul_, p.copy_, to_local().add_
    def inplace():
        r = {}
        with torch.no_grad():
            model.blocks[0].up.weight.mul_(0.5)
            ref.blocks[0].up.weight.mul_(0.5)
            r["mul_"] = check_forward(model, forward, rank, world)
            model.blocks[1].down.weight.data.mul_(1.5)
            ref.blocks[1].down.weight.data.mul_(1.5)
            r["data.mul_"] = check_forward(model, forward, rank, world)
            model.blocks[2].up.bias.copy_(model.blocks[0].up.bias)
            ref.blocks[2].up.bias.copy_(ref.blocks[0].up.bias)
            r["copy_"] = check_forward(model, forward, rank, world)
            model.blocks[1].up.bias.zero_()
            ref.blocks[1].up.bias.zero_()
            r["zero_"] = check_forward(model, forward, rank, world)
            torch.nn.init.zeros_(model.blocks[2].down.bias)
            torch.nn.init.zeros_(ref.blocks[2].down.bias)
            r["init.zeros_"] = check_forward(model, forward, rank, world)
            torch.nn.init.normal_(model.blocks[2].down.weight)
            r["init.normal_"] = check_forward(model, forward, rank, world)
        r["vs_ref_before_normal"] = None
        return r

    section("inplace", inplace)

    # (d) load_state_dict(assign=True) with a DTensor state dict.
    def assign():
        torch.manual_seed(11)
        src_plain = Stack([MLP() for _ in range(3)])
        src = shardc.shard(copy.deepcopy(src_plain), pack_blocks=False)
        model.load_state_dict(src.state_dict(), assign=True)
        r = {"leaf": [b.__dict__.get("_shardc_packed") is not None for b in model.blocks]}
        r["fwd"] = check_forward(model, forward, rank, world)
        return r

    section("assign", assign)
    # (e) get_model_state_dict full
    section("get_full", lambda: maxdiff(
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)),
        full_sd(model)))
    return out


if __name__ == "__main__":
    from dist_utils import run_ranks

    for world in (1, 2, 3):
        try:
            res = run_ranks(worker, world)
        except AssertionError as exc:
            print(f"world {world} ERROR", str(exc)[-3000:])
            continue
        import pprint
        print(f"=== world {world}")
        pprint.pprint(res[0], width=110)
