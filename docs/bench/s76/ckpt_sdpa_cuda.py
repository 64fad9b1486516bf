"""s76: blocks checkpointed around scaled-dot-product attention without dropout keep one shared
body under Inductor on CUDA, where torch's partitioner wraps the recomputed attention in its
graph-safe form (``graphsafe_run_with_rng_state`` with ``fwd_rng_state_*`` /
``bwd_rng_state_*`` generator placeholders), which shardc's body partition now undoes
(``shardc/passes/body_rng.py``; the CPU form is tested in tests/test_blocks.py).

One GPU, world 1 (NCCL), fp32 with TF32 off (SDPA's memory-efficient kernel):

1. ``unwrap``: a 4-block LM, each block in torch's ``checkpoint_wrapper`` (torchtitan's
   activation checkpointing), attention with ``dropout_p=0``, compiled with ``backend="shardc"``
   (Inductor). Checks: the blocks share one body, none is inline, the region graphs run no
   generator-state wrapper, the body partitions met the graph-safe form (printed), and four SGD
   steps match the unsharded eager model (max relative parameter error printed, tolerance 1e-4).
2. ``dropout``: the same blocks with ``dropout_p=0.1`` compile inline (FX, quick), the reason in
   the plan.
3. ``--keep-wrappers`` (optional, not part of PASS): step 1 with shardc's undoing switched off
   (the wrappers kept in a shared body), to learn whether Inductor on CUDA takes them at all.

Prints one ``PASS``/``FAIL`` line per check and ``RESULT PASS``/``RESULT FAIL`` at the end.
Run from the repository root (about a minute on one H100):

    PYTHONPATH=$PWD:$PWD/tests python3 docs/bench/s76/ckpt_sdpa_cuda.py [--keep-wrappers]
"""

from __future__ import annotations

import copy
import importlib.metadata
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh

import shardc
import shardc.compile.backend as shardc_backend
from shardc import _torch

VOCAB, DIM, HEADS, FFN, DEPTH, SEQ = 128, 64, 4, 128, 4, 32
# --cpu: a dry run of this script itself on the CPU (gloo; the CPU form of the wrappers).
DEVICE = "cpu" if "--cpu" in sys.argv else "cuda"


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, FFN), nn.GELU(), nn.Linear(FFN, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, HEADS, d // HEADS).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


class LM(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(checkpoint_wrapper(Block(dropout)) for _ in range(DEPTH))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _backend(inductor: bool):
    names = {e.name for e in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    if inductor and "shardc" in names:
        return "shardc"  # as users write it (needs shardc's entry point installed)
    return shardc.backend(inductor=inductor)


def _wrappers_run(model: nn.Module) -> list[str]:
    """The generator-state wrappers the compiled regions' graphs (subgraphs included) run."""
    return sorted({str(n.target) for region in shardc.shard_state(model).regions
                   for graph in (region.forward, region.backward) if graph is not None
                   for gm in graph.modules() if isinstance(gm, fx.GraphModule)
                   for n in gm.graph.nodes
                   if n.op == "call_function" and "rng_state" in str(n.target)})


FORMS: list[str] = []  # what each body partition held before shardc's undoing, and undid


def _spy(undo: bool):
    real = shardc_backend.unwrap_drawless_ops
    wrappers = _torch.rng_state_wrappers()

    def spy(fw, bw):
        held = sorted({str(n.target) for gm in (fw, bw) for n in gm.graph.nodes
                       if n.op == "call_function" and n.target in wrappers})
        removed = real(fw, bw) if undo else 0
        FORMS.append(f"partition held {held or 'no wrapper'}, undid {removed}")
        return removed

    shardc_backend.unwrap_drawless_ops = spy


def train_shared(mesh, undo: bool) -> tuple[bool, str]:
    torch._dynamo.reset()
    FORMS.clear()
    _spy(undo)
    torch.manual_seed(0)
    reference = LM().to(DEVICE)
    model = copy.deepcopy(reference)
    shardc.shard(model, mesh)
    compiled = torch.compile(model, backend=_backend(inductor=True))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    data = torch.randint(0, VOCAB, (4, 8, SEQ + 1), device=DEVICE,
                         generator=torch.Generator(DEVICE).manual_seed(1))
    worst = 0.0
    start = time.perf_counter()
    for ids in data:
        for run, opt in zip((reference, compiled), opts):
            out = run(ids[:, :-1])
            F.cross_entropy(out.flatten(0, 1), ids[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
        for p, ref in zip(model.parameters(), reference.parameters()):
            worst = max(worst, ((p.full_tensor() - ref).abs().max()
                                / ref.abs().max().clamp_min(1e-12)).item())
    seconds = time.perf_counter() - start
    plans = [r.plan for r in shardc.shard_state(model).regions]
    bodies = [len(b.blocks) for p in plans for b in p.bodies]
    inline = [(b.module, b.reason[:60]) for p in plans for b in p.inline_blocks]
    wrappers = _wrappers_run(model)
    ok = bodies == [DEPTH] and not inline and worst < 1e-4 and (not undo or not wrappers)
    return ok, (f"bodies {bodies}, inline {inline}, wrappers run {wrappers}, max rel err "
                f"{worst:.2e}, {seconds:.1f} s (4 steps, compile included); "
                f"{'; '.join(dict.fromkeys(FORMS))}")


def dropout_inline(mesh) -> tuple[bool, str]:
    torch._dynamo.reset()
    _spy(True)
    torch.manual_seed(0)
    model = shardc.shard(LM(dropout=0.1).to(DEVICE), mesh)
    compiled = torch.compile(model, backend=_backend(inductor=False))
    compiled(torch.randint(0, VOCAB, (2, SEQ), device=DEVICE)).sum().backward()
    plans = [r.plan for r in shardc.shard_state(model).regions]
    bodies = [len(b.blocks) for p in plans for b in p.bodies]
    inline = {b.module: b.reason for p in plans for b in p.inline_blocks}
    ok = not bodies and len(inline) >= DEPTH - 1 and all(
        "random numbers" in r for r in inline.values())
    return ok, f"bodies {bodies}, inline {sorted(inline)}, wrappers run {_wrappers_run(model)}"


def main() -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29576")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=0, world_size=1)
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    mesh = init_device_mesh(DEVICE, (1,))
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (dry run)"
    print(f"torch {torch.__version__}, {name}", flush=True)
    checks = [("unwrap", lambda: train_shared(mesh, undo=True)),
              ("dropout", lambda: dropout_inline(mesh))]
    if "--keep-wrappers" in sys.argv:
        checks.append(("keep-wrappers (informative)", lambda: train_shared(mesh, undo=False)))
    passed = True
    for name, check in checks:
        try:
            ok, text = check()
        except Exception as exc:  # noqa: BLE001 - a failing check is reported, the rest run
            ok, text = False, f"{type(exc).__name__}: {str(exc)[:400]}"
            traceback.print_exc()
        if not name.endswith("(informative)"):
            passed = passed and ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {text}", flush=True)
    print(f"RESULT {'PASS' if passed else 'FAIL'}", flush=True)
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
