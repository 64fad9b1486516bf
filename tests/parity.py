"""Shared pieces of the parity tests: models, data, the training loop and the comparison.

The reference trains the unsharded model in one process on the global batch; a sharded run gives
each rank its own contiguous slice of the same global batch. The global batch (12) divides every
world size under test (1-4), so one reference serves them all.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardc
from shardc.models.llama import LlamaConfig, Transformer, llama_loss
from shardc.runtime import offload_optimizer

# Dimensions that divide none of the world sizes 2, 3, 4 (and a head dim that stays even).
CFG = LlamaConfig(vocab_size=37, dim=24, n_layers=2, n_heads=4, ffn_dim=45, max_seq_len=16)
TIED_CFG = LlamaConfig(vocab_size=37, dim=24, n_layers=1, n_heads=4, ffn_dim=45,
                       max_seq_len=16, tie_embeddings=True)
GLOBAL_BATCH, SEQ, STEPS, LR = 12, 9, 5, 1e-3
# The feed-forward width of ``build("llama-frozen-w1")``: a rank's tokens at world 2, so that a
# gathered feed-forward weight (FROZEN_W1_FFN x dim) and a hidden state are buffers of one size.
FROZEN_W1_FFN = GLOBAL_BATCH // 2 * SEQ
# The feed-forward width of ``build("llama-wide-ffn")`` (a prime): its parameter shards,
# gradients and optimizer state outweigh the activations at world 2, so moving them to the host
# lowers the step's peak below anything the levers on the device reach.
WIDE_FFN = 449


class VariantModel(nn.Module):
    """A tied-embedding Llama with a frozen layer, an unused parameter and a 3-row parameter
    (so world size 4 leaves a rank with an empty shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = Transformer(TIED_CFG)
        self.unused = nn.Parameter(torch.randn(5, 3))
        self.tiny = nn.Parameter(torch.randn(3, TIED_CFG.vocab_size) * 0.1)
        for p in self.lm.layers[0].attention.parameters():
            p.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.lm(tokens)
        return logits + self.tiny.sum(0)  # a per-token bias: a real gradient


class RepeatedBlock(nn.Module):
    """One block instance applied twice per forward (its gradients are two contributions that
    shardc sums before one reduce-scatter); rows 37, 19, 13 divide none of the world sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(CFG.vocab_size, 13)
        self.block = nn.Sequential(nn.Linear(13, 19), nn.SiLU(), nn.Linear(19, 13))
        self.head = nn.Linear(13, CFG.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.block(h)
        h = h + self.block(h)  # the same instance again
        return self.head(h)


class StackBlock(nn.Module):
    """A pre-norm residual MLP block whose MLP runs under ``torch.utils.checkpoint``
    (non-reentrant): activation checkpointing inside a block body."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(self.mlp, self.norm(x), use_reentrant=False)


class BlockStack(nn.Module):
    """``depth`` identical blocks (one compiled body) and one of another width, ``odd``
    (compiled inline); by default rows 37, 19, 13 and 11, which divide none of the world sizes
    2, 3, 4. (scripts/check_compile_once.py builds a wider, deeper one.)"""

    def __init__(self, dim: int = 13, hidden: int = 19, odd: int = 11, depth: int = 4,
                 vocab: int = CFG.vocab_size) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([StackBlock(dim, hidden) for _ in range(depth)]
                                    + [StackBlock(dim, odd)])
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class UserCheckpointedLlama(Transformer):
    """The parity Llama whose blocks numbered in ``checkpointed`` run under
    ``torch.utils.checkpoint`` (non-reentrant), called from the model's forward as a user
    checkpoints whole blocks; the others run plainly."""

    def __init__(self, cfg: LlamaConfig, checkpointed: tuple[int, ...] = (0,)) -> None:
        super().__init__(cfg)
        self.checkpointed = checkpointed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            if i in self.checkpointed:
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        return self.output(self.norm(h))


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "blocks":
        return BlockStack()
    if kind == "llama":
        return Transformer(CFG)
    if kind == "llama-wide-ffn":  # tests/test_offload_auto.py: parameters outweigh activations
        return Transformer(replace(CFG, ffn_dim=WIDE_FFN))
    if kind == "llama1":  # one block: for the (slow to compile) Inductor runs
        return Transformer(replace(CFG, n_layers=1))
    if kind == "llama-user-ac":  # tests/test_budget_combos.py: layers.0 checkpointed
        return UserCheckpointedLlama(CFG)
    if kind == "llama-user-ac-last":  # the same with layers.1 checkpointed
        return UserCheckpointedLlama(CFG, (1,))
    if kind == "repeated":
        return RepeatedBlock()
    if kind in ("llama-frozen-w1", "llama-frozen-w1-deep"):  # tests/test_body_donations.py
        # deep: three blocks, enough parameter shards saved to put before the backward's
        # donated values that the region keeps its donations (two: one is saved again).
        layers = 3 if kind.endswith("deep") else CFG.n_layers
        model = Transformer(replace(CFG, ffn_dim=FROZEN_W1_FFN, n_layers=layers))
        for layer in model.layers:
            layer.feed_forward.w1.weight.requires_grad_(False)
        return model
    return VariantModel()


def batches(steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = (steps, GLOBAL_BATCH, SEQ)
    return (torch.randint(0, CFG.vocab_size, shape, generator=g),
            torch.randint(0, CFG.vocab_size, shape, generator=g))


def optimizer(model: nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    """``adamw`` (torch's default implementation), ``adamw-fused`` or ``sgd`` (momentum)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR * 30, momentum=0.9)
    return torch.optim.AdamW(params, lr=LR, fused=kind == "adamw-fused")


def train(model: nn.Module, forward, tokens, targets, optim: str = "adamw",
          local_step: bool | str = False, overlap: dict | None = None,
          no_sync: bool = False) -> list[float]:
    """``local_step``: True, the optimizer steps the local shards through
    ``shardc.optim.local_shard_step``; False, as shardc does by default (the local shards where
    exact, ``shardc.optim.default_local_step``); ``"dtensor"``: every step through DTensor
    (the default turned off for this run);
    ``overlap`` (a dict, filled with the handle's counts): ``shardc.step_in_backward``;
    ``no_sync``: two micro-batches per step (each half of the batch, loss / 2), the first
    under ``shardc.no_sync`` (gradient accumulation without communication)."""
    opt = optimizer(model, optim)
    if local_step == "dtensor":
        shardc.optim.set_default_local_step(False)
        try:
            return train(model, forward, tokens, targets, optim, False, overlap, no_sync)
        finally:
            shardc.optim.set_default_local_step(True)
    if local_step:
        shardc.optim.local_shard_step(opt)
    handle = shardc.step_in_backward(model, opt) if overlap is not None else None
    losses = []
    for step in range(tokens.shape[0]):
        if no_sync:
            loss = _accumulate_no_sync(model, forward, tokens[step], targets[step])
        else:
            loss = llama_loss(forward(tokens[step]), targets[step])
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    if handle is not None:
        overlap.update(early=handle.early, signalled=handle.signalled, late=handle.late)
    return losses


def _accumulate_no_sync(model: nn.Module, forward, tokens, targets) -> torch.Tensor:
    """Two micro-batches (halves of the batch; an odd batch's first half one row smaller),
    each loss weighted by its share of the rows, so that the sum is the batch mean whatever
    the split: the first under ``shardc.no_sync``, the second synchronized; returns the step's
    loss (the batch mean)."""
    rows = tokens.shape[0]
    half = rows // 2
    total = 0.0
    for part, sync in ((slice(0, half), False), (slice(half, None), True)):
        with contextlib.nullcontext() if sync else shardc.no_sync(model):
            share = (part.indices(rows)[1] - part.indices(rows)[0]) / rows
            loss = llama_loss(forward(tokens[part]), targets[part]) * share
            loss.backward()
        total = total + loss.detach()
    return total


def reference(kind: str, compile_backend: str | None = None, optim: str = "adamw") -> dict:
    """Unsharded single-process training on the global batch."""
    model = build(kind)
    forward = torch.compile(model, backend=compile_backend) if compile_backend else model
    tokens, targets = batches()
    losses = train(model, forward, tokens, targets, optim)
    return {"losses": torch.stack(losses), "params": copy.deepcopy(dict(model.named_parameters())),
            "eval": eval_forward(model, forward, 0, 1)}


def eval_forward(model: nn.Module, forward, rank: int, world: int) -> torch.Tensor:
    """Outputs of one ``eval()`` + ``torch.no_grad()`` forward on the global batch's first step
    (each rank its slice, gathered back in rank order), then back to training mode."""
    tokens, _ = batches()
    per = GLOBAL_BATCH // world
    model.eval()
    with torch.no_grad():
        out = forward(tokens[0, rank * per:(rank + 1) * per]).contiguous()
    model.train()
    if world == 1:
        return out
    parts = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(parts, out)
    return torch.cat(parts)


def train_rank_slice(model: nn.Module, forward, rank: int, world: int, optim: str = "adamw",
                     local_step: bool | str = False, overlap: dict | None = None,
                     no_sync: bool = False) -> torch.Tensor:
    """Train on this rank's slice of the global batch; the per-step losses averaged over ranks
    (the global mean loss, comparable to the reference's)."""
    tokens, targets = batches()
    per = GLOBAL_BATCH // world
    rows = slice(rank * per, (rank + 1) * per)
    losses = torch.stack(train(model, forward, tokens[:, rows], targets[:, rows], optim,
                               local_step, overlap, no_sync))
    dist.all_reduce(losses)
    return losses / world


# The options that change only the training loop (the optimizer and how it steps), not what is
# sharded or compiled: runs that differ only in these can train one compiled model in turn.
TRAINING_OPTIONS = ("optim", "local_step", "step_in_backward")


def sharded_run(rank: int, world: int, kind: str, mode: str, **options) -> dict:
    """Shard, train on this rank's slice; returns the global mean losses and full parameters.

    ``retrain``: ``{name: training options}`` (keys of :data:`TRAINING_OPTIONS`): after the
    run, the same model (the same compiled regions, no recompile) is put back to its initial
    shards and trained again from scratch with each of these in turn; ``out["retrained"][name]``
    holds each one's losses, parameters, overlap counts and the number of regions then.
    ``hook_after_eval``: a hook is registered on a block after its eval region compiled, with
    Dynamo guarding module hooks (``skip_nnmodule_hook_guards`` off), so the eval recompiles."""
    if options.get("hook_after_eval"):
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
            return _sharded_run(rank, world, kind, mode, **options)
    return _sharded_run(rank, world, kind, mode, **options)


def _sharded_run(rank: int, world: int, kind: str, mode: str, **options) -> dict:
    keep_model = options.pop("keep_model", False)
    retrain = options.pop("retrain", {})
    options_eval = options.pop("eval", False)
    hook_after_eval = options.pop("hook_after_eval", False)
    optim, local_step = options.pop("optim", "adamw"), options.pop("local_step", False)
    dynamic = options.pop("dynamic", None)
    no_sync = options.pop("no_sync", False)
    overlap = {} if options.pop("step_in_backward", False) else None
    model = build(kind)
    if options.pop("indexed", False):
        # Numbered as transformers numbers its layers (self_attn.layer_idx): a scalar that
        # differs per block and that the forward does not read (shardc.sharding.blocks).
        for i, block in enumerate(model.blocks):
            block.index = i
    # None: shard's defaults (plain reads since s53, packed blocks since s70).
    chosen = {k: options.pop(k) for k in ("plain_inputs", "pack_blocks") if k in options}
    shardc.shard(model, reshard_after_forward=options.pop("reshard_after_forward", True),
                 offload=options.pop("offload", None), mp_policy=options.pop("mp_policy", None),
                 **chosen)
    if mode == "eager":
        forward = model
    else:
        forward = torch.compile(model, backend=shardc.backend(inductor=(mode == "inductor"),
                                                              **options), dynamic=dynamic)
    initial = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    losses = train_rank_slice(model, forward, rank, world, optim, local_step, overlap, no_sync)
    evaluated = eval_forward(model, forward, rank, world) if options_eval else None
    hooked = None
    if hook_after_eval:
        # A hook added after compiling (Dynamo guards module hooks, see sharded_run): Dynamo
        # recompiles, and that block runs its own forward.
        model.blocks[1].up.register_forward_hook(lambda *_: None)
        hooked = eval_forward(model, forward, rank, world)
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    grads_none = {n: p.grad is None for n, p in model.named_parameters()}
    state = shardc.shard_state(model)
    plans = [r.plan for r in state.regions]
    out = {"losses": losses, "params": params, "grads_none": grads_none, "plans": plans,
           "collective_ops": collective_ops(state), "eval": evaluated, "eval_hooked": hooked,
           "host_masters": host_masters(model), "overlap": overlap,
           "trainable": {n for n, p in model.named_parameters() if p.requires_grad},
           "activation_copies": activation_copies(state),
           # plain_inputs: gradients handed from the plain leaves to the DTensor parameters.
           "plain_handed": None if state.plain is None else state.plain.handed,
           # pack_blocks: blocks' gradients handed from the packed leaves to the parameters.
           "packed_handed": None if state.packed is None else state.packed.handed}
    out["retrained"] = {name: _retrain(model, forward, rank, world, initial, **training)
                        for name, training in retrain.items()}
    if keep_model:
        out.update(model=model, forward=forward)
    return out


def _retrain(model: nn.Module, forward, rank: int, world: int, initial: dict, *,
             optim: str = "adamw", local_step: bool = False,
             step_in_backward: bool = False) -> dict:
    """Put ``model``'s local shards back to ``initial`` and train it again from scratch (a new
    optimizer) through the same ``forward``; see :func:`sharded_run`'s ``retrain``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(initial[name])
            p.grad = None
    overlap = {} if step_in_backward else None
    losses = train_rank_slice(model, forward, rank, world, optim, local_step, overlap)
    return {"losses": losses, "overlap": overlap,
            "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
            "regions": len(shardc.shard_state(model).regions)}


def host_masters(model: nn.Module) -> dict[str, bool]:
    """Optimizer-only offload: for each parameter with a host master (the copy its optimizer
    stepped on the host), whether the master is a separate tensor equal to the parameter's
    shard (the step's result copied back)."""
    out = {}
    for name, p in model.named_parameters():
        master = offload_optimizer.host_master(p)
        if master is None:
            continue
        local, host = p.to_local(), master.to_local()
        separate = local.numel() == 0 or (
            host.untyped_storage().data_ptr() != local.untyped_storage().data_ptr())
        out[name] = separate and host.device.type == "cpu" and torch.equal(host, local)
    return out


def collective_ops(state) -> int:
    """Communication ops left in the lowered graphs of a sharded model's regions: functional
    collectives (c10d) and shardc's own gather and reduce ops."""
    count = 0
    for region in state.regions:
        for gm in (region.forward, region.backward):
            for node in gm.graph.nodes if gm is not None else ():
                target = getattr(node.target, "namespace", "")
                name = str(node.target)
                if node.op == "call_function" and (
                        target == "_c10d_functional" or name.startswith(
                            ("shardc.gather_param", "shardc.reduce_scatter_grad"))):
                    count += 1
    return count


def activation_copies(state) -> dict[str, int]:
    """Activation offload (shardc.passes.offload_saved) in the lowered graphs of the regions:
    nodes per role ("d2h", "h2d", "wait", "release", "host": the backward's host placeholders),
    the forward outputs that are host copies ("saved_on_host"), the forward's waits
    ("forward_waits": the CPU would block; 0 since the copies are asynchronous), the releases
    that make the compute stream wait ("release_waits"), and "misplaced": device copies read
    before their wait, or waited before they are started, and device->host copies without
    exactly one release after them, of their source (0 when the copies are right)."""
    from shardc.ops.offload_copy import COPY_RELEASE_OP, COPY_WAIT_OP
    from shardc.passes.offload_saved import activation_role

    out = {"d2h": 0, "h2d": 0, "wait": 0, "release": 0, "host": 0, "saved_on_host": 0,
           "forward_waits": 0, "release_waits": 0, "misplaced": 0}
    for region in state.regions:
        for gm in (region.forward, region.backward):
            nodes = list(gm.graph.nodes) if gm is not None else []
            index = {n: i for i, n in enumerate(nodes)}
            for node in nodes:
                role = activation_role(node)
                if role:
                    out[role] += 1
                out["forward_waits"] += gm is region.forward and node.target is COPY_WAIT_OP
                out["release_waits"] += role == "release" and node.args[2]
                if role == "d2h":
                    out["saved_on_host"] += node in gm.graph.output_node().all_input_nodes
                    releases = [u for u in node.users if u.target is COPY_RELEASE_OP]
                    out["misplaced"] += len(releases) != 1 or releases[0].args[0] is not \
                        node.args[0] or index[releases[0]] < index[node]
                if role == "h2d":
                    waits = [u for u in node.users if u.target is COPY_WAIT_OP]
                    readers = [u for u in node.users if u.target is not COPY_WAIT_OP]
                    out["misplaced"] += len(waits) != 1 or any(
                        index[r] < index[waits[0]] for r in readers) or not readers
    return out


# The matrix products a recomputed inline block's forward adds to the backward graph.
_MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")


def backward_ops(state) -> dict[str, int]:
    """What recompute adds to the backward graphs a sharded model's regions hand the compiler
    (Inductor: the graphs it compiles): block-body calls (``invoke_subgraph``: a compile-once
    body recomputed calls its forward body once more) and matrix products (an inline block
    recomputed runs its forward's products again)."""
    out = {"body_calls": 0, "matmuls": 0}
    for region in state.regions:
        for node in region.backward.graph.nodes if region.backward is not None else ():
            out["body_calls"] += node.target is torch.ops.higher_order.invoke_subgraph
            out["matmuls"] += str(node.target) in _MATMULS
    return out


def assert_recomputed_in_backward(record, bodies: list[tuple[str, ...]],
                                  ops: tuple[dict, dict]) -> None:
    """The blocks a budget ``record`` recomputes run their forward again in the backward graph
    the compiler got: one more body call (``invoke_subgraph``) per recomputed block of a
    compile-once body (``bodies``: each body's blocks), and more matrix products than the fixed
    policy's backward when an inline block is recomputed; ``ops``: :func:`backward_ops`, the
    fixed policy's and the budgeted run's."""
    fixed, budgeted = ops
    in_bodies = sum(any(b in body for body in bodies) for b in record.recomputed)
    assert budgeted["body_calls"] == fixed["body_calls"] + in_bodies, (
        fixed, budgeted, record.recomputed, bodies)
    if in_bodies < len(record.recomputed):
        assert budgeted["matmuls"] > fixed["matmuls"], (fixed, budgeted, record.recomputed)


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a whole tensor, ||a - b|| / ||b|| (2-norm over all elements)."""
    a, b = a.double(), b.double()
    scale = b.norm().item() or 1.0
    return (a - b).norm().item() / scale


def assert_parity(run: dict, ref: dict, tol: float = 1e-5) -> None:
    err = max_rel_err(run["losses"], ref["losses"])
    assert err <= tol, (
        f"losses differ: rel err {err:.2e} > {tol}: {run['losses']} vs {ref['losses']}"
    )
    assert run["params"].keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        got = run["params"][name]
        assert got.shape == value.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(value.shape)}"
        err = max_rel_err(got, value.detach())
        assert err <= tol, f"parameter {name}: rel err {err:.2e} > {tol}"
