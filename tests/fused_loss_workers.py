"""Workers of the fused-loss tests (tests/test_fused_loss.py): tiny models trained with the
loss inside the compiled region, against the unsharded single-process reference."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardc
from shardc.models.llama import LlamaConfig, Transformer

CFG = LlamaConfig(vocab_size=37, dim=24, n_layers=2, n_heads=4, ffn_dim=45, max_seq_len=16)
BATCH, SEQ, STEPS, LR = 12, 9, 3, 1e-3


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "hf":
        from transformers import LlamaConfig as HfConfig
        from transformers import LlamaForCausalLM

        cfg = HfConfig(vocab_size=37, hidden_size=24, intermediate_size=40,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=16, tie_word_embeddings=False)
        cfg._attn_implementation = "eager"
        return LlamaForCausalLM(cfg)
    if kind == "tied":  # the output weight is the embedding's: its gradient has two terms
        from dataclasses import replace

        return Transformer(replace(CFG, tie_embeddings=True))
    return Transformer(CFG)


def data(ignore: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (STEPS, BATCH, SEQ), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (STEPS, BATCH, SEQ), generator=g)
    if ignore:
        targets[:, :, ::3] = -100
    return tokens, targets


def loss_of(kind: str, model: nn.Module, tokens, targets, smoothing: float = 0.0,
            with_logits: bool = False):
    """The training step's loss (and, ``with_logits``, the logits too)."""
    if kind == "hf":
        out = model(input_ids=tokens, labels=targets)
        return (out.loss, out.logits) if with_logits else out.loss
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1),
                           label_smoothing=smoothing)
    return (loss, logits) if with_logits else loss


def train(kind: str, model: nn.Module, step, rank: int, world: int, ignore: bool,
          with_logits: bool = False) -> torch.Tensor:
    tokens, targets = data(ignore)
    per = BATCH // world
    rows = slice(rank * per, (rank + 1) * per)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for s in range(STEPS):
        out = step(tokens[s, rows], targets[s, rows])
        loss = out[0] if with_logits else out
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float())
    losses = torch.stack(losses)
    if dist.is_initialized() and world > 1:
        dist.all_reduce(losses)
    return losses / world


def reference(kind: str, ignore: bool = False) -> dict:
    """The unsharded model trained eagerly in one process on the global batch."""
    model = build(kind)
    losses = train(kind, model, lambda t, y: loss_of(kind, model, t, y), 0, 1, ignore)
    return {"losses": losses, "params": copy.deepcopy(dict(model.named_parameters()))}


def sharded(rank: int, world: int, kind: str, mode: str, ignore: bool = False,
            mp: bool = False, smoothing: float = 0.0, with_logits: bool = False,
            **options) -> dict:
    model = build(kind)
    policy = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                         reduce_dtype=torch.float32) if mp else None
    shardc.shard(model, mp_policy=policy)
    backend = shardc.backend(inductor=mode == "inductor", **options)

    def fn(tokens, targets):
        return loss_of(kind, model, tokens, targets, smoothing, with_logits)

    step = torch.compile(fn, backend=backend)
    losses = train(kind, model, step, rank, world, ignore, with_logits)
    state = shardc.shard_state(model)
    plans = [r.plan for r in state.regions if r.backward is not None]
    torch._dynamo.reset()  # the next run in this process compiles anew
    fused_ops = sum(1 for r in state.regions for gm in (r.forward, r.backward)
                    if gm is not None for n in gm.graph.nodes
                    if "fused_linear_cross_entropy" in str(n.target))
    from shardc.passes.fused_loss import LOSS_OPS

    loss_ops = sum(1 for r in state.regions for gm in (r.forward, r.backward)
                   if gm is not None for n in gm.graph.nodes if n.target in LOSS_OPS)
    return {"losses": losses, "plans": plans, "fused_ops": fused_ops, "loss_ops": loss_ops,
            "params": {n: p.full_tensor().detach().clone()
                       for n, p in model.named_parameters()}}


def budget_runs(rank: int, world: int, inductor: bool = False) -> dict:
    """The planner's choice (world 1, FX or Inductor, a vocabulary large enough that the logits
    matter): the fully resharded unfused peak (a roomy budget, the fused loss off), then the
    budget one byte below it (the lever chosen) and at it (not needed), and (FX) no budget
    (untouched)."""
    import shardc.models.llama as llama

    big = LlamaConfig(vocab_size=1024, dim=24, n_layers=2, n_heads=4, ffn_dim=45,
                      max_seq_len=16)
    out = {}

    def run(name: str, **options) -> None:
        torch.manual_seed(0)
        model = llama.Transformer(big)
        shardc.shard(model)
        step = torch.compile(lambda t, y: loss_of("llama", model, t, y),
                             backend=shardc.backend(inductor=inductor, comm_pool=False,
                                                    peak_memory_margin=0, **options))
        tokens, targets = data(False)
        loss = step(tokens[0], targets[0])
        loss.backward()
        plan = [r.plan for r in shardc.shard_state(model).regions if r.backward is not None][0]
        from shardc.passes.fused_loss import LOSS_OPS

        state = shardc.shard_state(model)
        loss_ops = sum(1 for r in state.regions for gm in (r.forward, r.backward)
                       if gm is not None for n in gm.graph.nodes if n.target in LOSS_OPS)
        out[name] = {"plan": plan.to_dict(), "loss": loss.item(), "hash": plan.hash(),
                     "text": plan.table(), "loss_ops": loss_ops}
        torch._dynamo.reset()

    run("roomy", peak_memory_budget_bytes=1 << 40, fused_loss=False)
    minimum = out["roomy"]["plan"]["budget"]["minimum_bytes"]
    out["minimum"] = minimum
    run("tight", peak_memory_budget_bytes=minimum - 1)
    # Under Inductor the unfused loss is decomposed by shardc (kept whole for the pattern),
    # which predicts a few bytes more than Inductor's own decomposition (104 B here).
    run("fits", peak_memory_budget_bytes=minimum + (1024 if inductor else 0))
    if not inductor:
        run("none")
        run("off", fused_loss=False)
    return out
