"""Probe harness: a model trained (a) unsharded eagerly on the global batch, (b) sharded packed
(default) and compiled, (c) sharded pack_blocks=False and compiled; compares (b) with (a) and (c).

Each case: build() -> model; data(step) -> (x, y) global batch; loss(out, y); optional
hooks: before_step(model, opt, step), loop override."""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch._dynamo
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import shardc

sys.path.insert(0, os.path.dirname(__file__))


def full(t):
    if t is None:
        return None
    if isinstance(t, DTensor):
        return t.full_tensor().detach().clone()
    return t.detach().clone()


def default_loss(out, y):
    return (out - y).square().mean()


def train(model, forward, case, rank, world, steps, is_ref):
    """Returns dict: losses (global mean), grads per step (full), params, buffers."""
    opt = case.get("optimizer", lambda m: torch.optim.AdamW(
        [p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1))(model)
    losses, grads, evals = [], [], []
    loop = case.get("loop")
    for step in range(steps):
        x, y = case["data"](step)
        per = x.shape[0] // world
        sl = slice(rank * per, (rank + 1) * per)
        xs, ys = (x, y) if is_ref else (x[sl], y[sl])
        if loop is not None:
            loss = loop(model, forward, xs, ys, step, opt, is_ref)
        else:
            loss = case.get("loss", default_loss)(forward(xs), ys)
            loss.backward()
        if "before_step" in case:
            case["before_step"](model, opt, step)
        grads.append({n: full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=case.get("set_to_none", True))
        loss = loss.detach().clone()
        if not is_ref and world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss)
        if "eval_between" in case:
            evals.append(case["eval_between"](model, forward, step))
        if "after_step" in case:
            case["after_step"](model, step)
    return {"losses": torch.stack(losses), "grads": grads,
            "params": {n: full(p) for n, p in model.named_parameters()},
            "buffers": {n: full(b) for n, b in model.named_buffers()},
            "evals": evals}


def cmp(a, b, path=""):
    """max abs diff per leaf (None where both None), and mismatches of structure."""
    out = {}
    if isinstance(a, dict):
        for k in set(a) | set(b):
            if k not in a or k not in b:
                out[path + str(k)] = "missing in " + ("a" if k not in a else "b")
                continue
            out.update(cmp(a[k], b[k], f"{path}{k}."))
    elif isinstance(a, list | tuple):
        if len(a) != len(b):
            out[path] = f"len {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            out.update(cmp(x, y, f"{path}{i}."))
    elif a is None or b is None:
        if (a is None) != (b is None):
            out[path] = f"None vs {type(b).__name__}" if a is None else f"{type(a).__name__} vs None"
    elif isinstance(a, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            out[path] = f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        else:
            d = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            scale = max(a.double().abs().max().item() if a.numel() else 0.0, 1e-12)
            out[path] = d / max(scale, 1.0)
    return out


def worker(rank, world, case_name, module, mode="fx", steps=3, variants=("packed", "unpacked"),
           shard_kwargs=None):
    import importlib
    sys.path.insert(0, os.path.dirname(__file__))
    case = importlib.import_module(module).CASES[case_name]
    torch.manual_seed(0)
    base = case["build"]()
    results = {}
    ref = copy.deepcopy(base)
    results["ref"] = train(ref, ref, case, rank, world, steps, True)
    for variant in variants:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        if "prepare" in case:
            case["prepare"](model)
        kw = dict(shard_kwargs or {})
        kw.update(case.get("shard_kwargs", {}))
        if variant == "unpacked":
            kw["pack_blocks"] = False
        shardc.shard(model, **kw)
        state = shardc.shard_state(model)
        packed = sorted(state.packed.blocks) if state.packed is not None else []
        forward = torch.compile(model, backend=shardc.backend(inductor=mode == "inductor"),
                                dynamic=True if os.environ.get("DYNAMIC") else None)
        r = train(model, forward, case, rank, world, steps, False)
        r["packed_blocks"] = packed
        r["unpacked_reasons"] = [(f.module, f.reason) for f in state.blocks.unpacked] \
            if state.blocks is not None else []
        r["handed"] = None if state.packed is None else state.packed.handed
        if "check" in case:
            r["check"] = case["check"](model)
        results[variant] = r
    return results


def report(results, tol=1e-5):
    ref = results["ref"]
    lines, bad = [], False
    for variant in [k for k in results if k != "ref"]:
        r = results[variant]
        lines.append(f"[{variant}] packed={r['packed_blocks']} unpacked={r['unpacked_reasons']} "
                     f"handed={r['handed']} check={r.get('check')}")
        for label, other in (("vs ref", ref), ("vs unpacked", results.get("unpacked"))):
            if other is None or other is r:
                continue
            for key in ("losses", "grads", "params", "buffers", "evals"):
                diffs = cmp(r[key], other[key])
                worst = {k: v for k, v in diffs.items() if isinstance(v, str) or v > tol}
                m = max([v for v in diffs.values() if not isinstance(v, str)], default=0.0)
                if worst:
                    bad = True
                    lines.append(f"  {label} {key}: BAD max={m:.3g} {dict(list(worst.items())[:8])}")
                elif os.environ.get("VERBOSE"):
                    lines.append(f"  {label} {key}: ok max={m:.3g}")
    return "\n".join(lines), bad


def run(case_name, module, worlds=(1, 2, 3), tol=1e-5, **kw):
    from dist_utils import run_ranks
    summary = []
    for world in worlds:
        try:
            out = run_ranks(worker, world, case_name, module, **kw)
        except AssertionError as exc:
            msg = str(exc)
            errlen = int(os.environ.get("ERRLEN", 1500))
            print(f"=== {case_name} world={world}: ERROR\n{msg[-errlen:]}")
            summary.append((case_name, world, "ERROR"))
            continue
        text, bad = report(out[0], tol)
        print(f"=== {case_name} world={world}: {'BAD' if bad else 'ok'}\n{text}")
        summary.append((case_name, world, "BAD" if bad else "ok"))
    return summary
