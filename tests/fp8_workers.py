"""Rank workers and references of the FP8 tests (importable by spawned ranks)."""

from __future__ import annotations

import copy
import types

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from parity import (
    CFG,
    GLOBAL_BATCH,
    SEQ,
    activation_copies,
    backward_ops,
    batches,
    build,
    train,
    train_rank_slice,
)
from torch import nn

import shardc
from shardc.models.llama import Transformer
from shardc.sharding.te import TE_GEMM_WEIGHTS

FP8 = torch.float8_e4m3fn


def fake_quant(w: torch.Tensor, dtype: torch.dtype = FP8) -> torch.Tensor:
    """Reference per-tensor quantize-dequantize of a full weight, written independently of
    shardc: scale = max finite / max|w|, saturate, round, divide back."""
    top = torch.finfo(dtype).max
    scale = top / w.detach().abs().max().float().clamp(min=1e-12)
    return ((w.detach().float() * scale).clamp(-top, top).to(dtype).float() / scale).to(w.dtype)


# The policies the tests shard with, by name (spawned ranks get the name, not the policy).
POLICIES = {
    "linear": shardc.Float8Policy(),
    "embedding": shardc.Float8Policy(modules=(nn.Linear, nn.Embedding)),
}


def _straight_through(w: torch.Tensor) -> torch.Tensor:
    """``fake_quant(w)`` in forward, the identity's gradient in backward."""
    return w + (fake_quant(w) - w).detach()


def _fake_linear(self, x):
    return F.linear(x, _straight_through(self.weight), self.bias)


def _fake_embedding(self, tokens):
    return F.embedding(tokens, _straight_through(self.weight), self.padding_idx)


def fake_quant_modules(model: nn.Module, policy: str = "linear") -> nn.Module:
    """The unsharded reference of FP8 training: every ``nn.Linear`` (and with the ``embedding``
    policy every ``nn.Embedding``) computes with its fake-quantized weight and passes the
    gradient straight through to the weight; a weight shared by two modules (tied embedding and
    output) stays high precision, as shardc keeps it."""
    forwards = {nn.Linear: _fake_linear}
    if policy == "embedding":
        forwards[nn.Embedding] = _fake_embedding
    readers: dict[int, int] = {}
    for m in model.modules():
        weight = m._parameters.get("weight")
        if weight is not None:
            readers[id(weight)] = readers.get(id(weight), 0) + 1
    for m in model.modules():
        if type(m) in forwards and readers[id(m.weight)] == 1:
            m.forward = types.MethodType(forwards[type(m)], m)
    return model


class TiedEmbeddings(nn.Module):
    """A token embedding tied to the output head (one parameter, two readers), a position
    embedding and a linear; 37 token rows are uneven at world sizes 2-4, 9 position rows at 2
    and 4."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(CFG.vocab_size, 12)
        self.pos = nn.Embedding(SEQ, 12)
        self.proj = nn.Linear(12, 12)
        self.head = nn.Linear(12, CFG.vocab_size, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        return self.head(h + F.silu(self.proj(h)))


def build_model(kind: str) -> nn.Module:
    if kind == "tied":
        torch.manual_seed(0)
        return TiedEmbeddings()
    return build(kind)


def reference(kind: str, fake: bool, policy: str = "linear") -> dict:
    model = build_model(kind)
    if fake:
        fake_quant_modules(model, policy)
    tokens, targets = batches()
    losses = train(model, model, tokens, targets)
    return {"losses": torch.stack(losses), "params": copy.deepcopy(dict(model.named_parameters()))}


def _collectives(gm) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in gm.graph.nodes if gm is not None else ():
        if node.op == "call_function" and "_c10d_functional" in str(node.target):
            name = str(node.target).split(".")[1]
            counts[name] = counts.get(name, 0) + 1
    return counts


def fp8_run(rank: int, world: int, kind: str, mode: str, **options) -> dict:
    """Train a parity model with FP8 weights (``policy``, a name of :data:`POLICIES`: linears,
    or linears and embeddings); this rank's slice of the global batch."""
    torch._dynamo.reset()
    model = build_model(kind)
    reshard = options.pop("reshard_after_forward", True)
    policy = POLICIES[options.pop("policy", "linear")]
    shardc.shard(model, reshard_after_forward=reshard, fp8=policy)
    forward = model if mode == "eager" else torch.compile(
        model, backend=shardc.backend(inductor=(mode == "inductor"), **options))
    losses = train_rank_slice(model, forward, rank, world)
    state = shardc.shard_state(model)
    return {
        "losses": losses,
        "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
        "dtypes": {n: p.to_local().dtype for n, p in model.named_parameters()},
        "plans": [r.plan for r in state.regions],
        "collectives": [(_collectives(r.forward), _collectives(r.backward))
                        for r in state.regions],
        "fp8": sorted(fqn for fqn, i in state.params.items() if i.fp8 is not None),
        "activation_copies": activation_copies(state),
        "backward_ops": backward_ops(state),
    }


def fp8_budget_run(rank: int, world: int, kind: str, inductor: bool = False) -> dict:
    """Issue 22's peak budget with FP8 weights (the default policy; FX or Inductor, no pool, no
    prefetch, no margin): a first compile without a budget gives the fixed policy's predicted
    peak (the ranks' largest); the model is then compiled under a budget a byte below it and
    trained (:func:`fp8_run`'s record, plus the plan's budget record, hash and predicted peak,
    and the ops recompute adds to the backward graphs, fixed and budgeted)."""
    import torch.distributed as dist

    backend = dict(comm_pool=False, prefetch=False, peak_memory_margin=0.0)
    torch._dynamo.reset()
    probe = build_model(kind)
    shardc.shard(probe, fp8=POLICIES["linear"])
    fixed = torch.compile(probe, backend=shardc.backend(inductor=inductor, **backend))
    tokens, _ = batches()
    per = GLOBAL_BATCH // world
    fixed(tokens[0, rank * per:(rank + 1) * per])
    low = torch.tensor([int(shardc.explain_all(fixed)[0].predicted.peak_bytes)])
    dist.all_reduce(low, op=dist.ReduceOp.MAX)
    fixed_ops = backward_ops(shardc.shard_state(probe))
    del probe, fixed
    run = fp8_run(rank, world, kind, "inductor" if inductor else "fx",
                  peak_memory_budget_bytes=int(low) - 1, **backend)
    plan = run["plans"][0]
    run.update(budget=plan.budget, hash=plan.hash(), peak=int(plan.predicted.peak_bytes),
               fixed_peak=int(low), bodies=[tuple(b.blocks) for b in plan.bodies],
               backward_ops=(fixed_ops, run["backward_ops"]))
    return run


class Probe(nn.Linear):
    """A linear whose forward returns the weight it reads (the gathered, dequantized one)."""

    def forward(self, x):
        return self.weight * 1.0


class TeShapedProbe(nn.Module):
    """The parameter layout of TransformerEngine's ``LayerNormMLP`` (a 1-D norm weight beside
    GEMM weights named ``fc1_weight`` / ``fc2_weight``); returns the weights it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_norm_weight = nn.Parameter(torch.randn(5))
        self.fc1_weight = nn.Parameter(torch.randn(5, 4))
        self.fc2_weight = nn.Parameter(torch.randn(3, 5))

    def forward(self, x):
        return self.layer_norm_weight * 1.0, self.fc1_weight * 1.0, self.fc2_weight * 1.0


class Probes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # 45, 37 and 1 rows: uneven for world 2-4, and an empty shard from world 2 on.
        self.a = Probe(24, 45, bias=False)
        self.b = Probe(7, 1, bias=False)
        self.c = TeShapedProbe()
        self.d = nn.Embedding(37, 6)  # read through nn.Embedding's own forward
        self.e = nn.Embedding(1, 5)
        with torch.no_grad():
            self.a.weight[3, 5] = 0.0123  # a value far below the others
            self.a.weight[0, 0] = -3.5  # the amax
            self.d.weight[2, 3] = 0.0123  # on rank 0 at world 2 ...
            self.d.weight[30, 1] = 4.5  # ... and the amax on rank 1

    def forward(self, x):
        # Looking every row up returns the embedding's whole (gathered, dequantized) weight.
        rows = [torch.arange(m.num_embeddings, device=x.device) for m in (self.d, self.e)]
        return (self.a(x), self.b(x), *self.c(x), self.d(rows[0]), self.e(rows[1]))


PROBE_NAMES = ("a.weight", "b.weight", "c.layer_norm_weight", "c.fc1_weight", "c.fc2_weight",
               "d.weight", "e.weight")
# nn.Linear's `weight`, the TE-shaped module's GEMM weights (as shardc.te_float8_policy) and
# nn.Embedding's `weight`.
PROBE_POLICY = shardc.Float8Policy(modules=(nn.Linear, TeShapedProbe, nn.Embedding),
                                   weights=TE_GEMM_WEIGHTS)


def gather_numerics(rank: int, world: int) -> dict:
    """Gathered FP8 weights (eager and compiled) and the full weights they came from."""
    out = {}
    for mode in ("eager", "fx", "inductor"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Probes()
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        shardc.shard(model, fp8=PROBE_POLICY)
        forward = model if mode == "eager" else torch.compile(
            model, backend=shardc.backend(inductor=(mode == "inductor")))
        out[mode] = {n: v.detach() for n, v in zip(PROBE_NAMES, forward(torch.zeros(2, 24)))}
        out[f"{mode} fp8"] = sorted(n for n, i in shardc.shard_state(model).params.items()
                                    if i.fp8 is not None)
        out["full"] = full
    return out


def checkpoint_round_trip(rank: int, world: int, path: str) -> dict:
    """Train two FP8 steps, save with DCP, load into a fresh model; report dtypes and values."""
    model = build("llama")
    shardc.shard(model, fp8=shardc.Float8Policy())
    tokens, targets = batches(3)
    per = GLOBAL_BATCH // world
    rows = slice(rank * per, (rank + 1) * per)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    from shardc.models.llama import llama_loss
    for step in range(2):
        llama_loss(model(tokens[step, rows]), targets[step, rows]).backward()
        opt.step()
        opt.zero_grad()
    state = {"model": model.state_dict()}
    dcp.save(state, checkpoint_id=path)
    fresh = Transformer(CFG)
    shardc.shard(fresh, fp8=shardc.Float8Policy())
    loaded = {"model": fresh.state_dict()}
    dcp.load(loaded, checkpoint_id=path)
    fresh.load_state_dict(loaded["model"])
    with torch.no_grad():
        out_saved = model(tokens[2, rows])
        out_loaded = fresh(tokens[2, rows])
    full = {n: v.full_tensor() for n, v in model.state_dict().items()}
    return {
        "dtypes": {n: v.dtype for n, v in state["model"].items()},
        "optim_dtypes": sorted({str(t.dtype) for s in opt.state.values() for t in s.values()
                                if torch.is_tensor(t) and t.dim() > 0}),
        "full": full,
        "loaded": {n: v.full_tensor() for n, v in fresh.state_dict().items()},
        "outputs_equal": torch.equal(out_saved, out_loaded),
    }


def fp8_only_region(rank: int, world: int) -> dict:
    """A model whose only parameters are FP8 weights (bias-free linears): Dynamo traces each FP8
    gather into an ``autograd.Function`` subgraph, so the region has no top-level gather; it
    must still be planned by shardc (not compiled like an unsharded graph)."""
    out = {}
    for mode in ("eager", "fx"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(),
                              nn.Linear(32, 8, bias=False))
        shardc.shard(model, fp8=shardc.Float8Policy())
        forward = model if mode == "eager" else torch.compile(
            model, backend=shardc.backend(inductor=False))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(2):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = forward(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        state = shardc.shard_state(model)
        out[mode] = {
            "losses": torch.stack(losses),
            "regions": len(state.regions),
            "gathers": [(c.dtype, tuple(c.params)) for r in state.regions if r.plan is not None
                        for c in r.plan.collectives if c.kind == "all_gather"],
            "collectives": [(_collectives(r.forward), _collectives(r.backward))
                            for r in state.regions],
        }
    return out
