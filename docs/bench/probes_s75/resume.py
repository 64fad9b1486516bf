"""s75: resume mid-training on another world size.

Run: cd <worktree> && PYTHONPATH=.:tests:docs/bench/probes_s75 python docs/bench/probes_s75/resume.py
A:B[,A:B...] [fx|inductor] [adamw|sgd|adagrad] [sched]

Trains round 1's probe model (probe.Net, base scenario) for STEPS_A steps at world A (compiled
through shardc), saves model + optimizer with DCP (shardc.checkpoint.ModelState /
OptimizerState), then a fresh model (other random init) and a fresh optimizer at world B load
it and train STEPS_B more steps. Compared with one uninterrupted unsharded run: the losses of the
resumed steps, every gradient of them and the parameters at the end. `sched`: a LambdaLR too,
its state_dict carried through the checkpoint as a plain (replicated) entry. `lora`: round 1's
LoRA scenario (every block's base frozen) with the optimizer over every parameter (frozen ones
never get state); `lora_trainable`: the optimizer over the trainable ones only.
"""
from __future__ import annotations

import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import probe

STEPS_A, STEPS_B = 3, 3
GB, SEQ = 36, 5


def data():
    g = torch.Generator().manual_seed(7)
    n = STEPS_A + STEPS_B
    return (torch.randint(0, probe.VOCAB, (n, GB, SEQ), generator=g),
            torch.randint(0, probe.VOCAB, (n, GB, SEQ), generator=g))


SCEN = ["base"]
OPT_TRAINABLE = [False]


def make_opt(model, kind, sched):
    ps = [p for p in model.parameters() if p.requires_grad or not OPT_TRAINABLE[0]]
    if kind == "sgd":
        opt = torch.optim.SGD(ps, lr=0.3, momentum=0.9, weight_decay=0.05)
    elif kind == "adagrad":
        opt = torch.optim.Adagrad(ps, lr=5e-2)
    else:
        opt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05)
    s = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i)) if sched else None
    return opt, s


def full(t):
    if t is None:
        return None
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def steps(model, forward, opt, sched, rank, world, sharded, which):
    x_all, y_all = data()
    per = GB // world
    rows = slice(rank * per, (rank + 1) * per)
    losses, grads = [], []
    for step in which:
        x, y = x_all[step, rows], y_all[step, rows]
        loss = F.cross_entropy(forward(x).flatten(0, 1), y.flatten())
        loss.backward()
        grads.append({n: full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        lo = loss.detach().clone()
        if sharded and world > 1:
            dist.all_reduce(lo)
            lo /= world
        losses.append(lo)
    return losses, grads


def phase(rank, world, ckpt, part, mode, kind, sched_on, scen="base", trainable=False):
    import torch.distributed.checkpoint as dcp

    import shardc
    from shardc.checkpoint import ModelState, OptimizerState
    torch.set_num_threads(1)
    SCEN[0], OPT_TRAINABLE[0] = scen, trainable
    sc = probe.SCENARIOS[scen]
    if part == "a":
        model = probe.build(sc)
    else:
        torch.manual_seed(123)  # another init: the load must replace every value
        model = probe.Net(sc)
    shardc.shard(model)
    opt, sched = make_opt(model, kind, sched_on)
    forward = torch.compile(model, backend=shardc.backend(inductor=(mode == "inductor")))

    class Sched:  # the scheduler's state as a DCP Stateful
        def state_dict(self):
            return sched.state_dict() if sched is not None else {}

        def load_state_dict(self, sd):
            if sched is not None:
                sched.load_state_dict(sd)

    state = {"model": ModelState(model), "optim": OptimizerState(model, opt), "sched": Sched()}
    if part == "a":
        losses, grads = steps(model, forward, opt, sched, rank, world, True, range(STEPS_A))
        dcp.save(state, checkpoint_id=ckpt)
    else:
        dcp.load(state, checkpoint_id=ckpt)
        losses, grads = steps(model, forward, opt, sched, rank, world, True,
                              range(STEPS_A, STEPS_A + STEPS_B))
    return {"losses": losses, "grads": grads,
            "params": {n: full(p) for n, p in model.named_parameters()},
            "lr": opt.param_groups[0]["lr"]}


def rel(a, b):
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    a, b = a.double(), b.double()
    return (a - b).norm().item() / (b.norm().item() or 1.0)


if __name__ == "__main__":
    from dist_utils import run_ranks
    torch.set_num_threads(1)
    pairs = [tuple(int(w) for w in p.split(":")) for p in sys.argv[1].split(",")]
    mode = sys.argv[2] if len(sys.argv) > 2 else "fx"
    kind = sys.argv[3] if len(sys.argv) > 3 else "adamw"
    sched_on = "sched" in sys.argv[4:]
    if "lora" in sys.argv[4:] or "lora_trainable" in sys.argv[4:]:
        SCEN[0] = "lora"
        OPT_TRAINABLE[0] = "lora_trainable" in sys.argv[4:]
    model = probe.build(probe.SCENARIOS[SCEN[0]])
    opt, sched = make_opt(model, kind, sched_on)
    ref_l, ref_g = steps(model, model, opt, sched, 0, 1, False, range(STEPS_A + STEPS_B))
    ref_p = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref_lr = opt.param_groups[0]["lr"]
    for a, b in pairs:
        t0 = time.time()
        ckpt = tempfile.mkdtemp(prefix="s75resume_")
        try:
            ra = run_ranks(phase, a, ckpt, "a", mode, kind, sched_on, SCEN[0],
                           OPT_TRAINABLE[0])[0]
            rb = run_ranks(phase, b, ckpt, "b", mode, kind, sched_on, SCEN[0],
                           OPT_TRAINABLE[0])[0]
        except AssertionError as exc:
            print(f"resume {a}->{b} {mode} {kind}: CRASH {str(exc)[-3000:]}", flush=True)
            continue
        bad, worst = [], 0.0

        def check(label, x, y):
            global worst
            e = rel(x, y)
            worst = max(worst, e)
            if not e <= 1e-5:
                bad.append(f"{label}: {e:.2e}")
        for i, lo in enumerate(ra["losses"] + rb["losses"]):
            check(f"loss[{i}]", lo, ref_l[i])
        for i, g in enumerate(ra["grads"] + rb["grads"]):
            for n in ref_g[i]:
                check(f"grad[{i}] {n}", g[n], ref_g[i][n])
        for n in ref_p:
            check(f"param {n}", rb["params"][n], ref_p[n])
        if abs(rb["lr"] - ref_lr) > 1e-12:
            bad.append(f"lr {rb['lr']} vs {ref_lr}")
        print(f"resume {a}->{b} {mode} {kind}{' sched' if sched_on else ''} {SCEN[0]}"
              f"{' trainable-only' if OPT_TRAINABLE[0] else ''}: "
              f"{'PASS' if not bad else 'FAIL'} max rel {worst:.2e} ({time.time() - t0:.0f}s)",
              flush=True)
        for line in bad[:12]:
            print("   ", line, flush=True)
