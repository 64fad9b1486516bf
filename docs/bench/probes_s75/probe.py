"""s75 probes (round 2; extends round 1's docs/bench/compat_s74/probe.py) of the packed default (``pack_blocks``) against an unsharded reference.

Run: cd <worktree> && PYTHONPATH=.:tests:docs/bench/probes_s75 python docs/bench/probes_s75/run.py
SCENARIO[,SCENARIO...] WORLDS [fx|inductor]

Each scenario trains a small residual stack (embedding, ``NL`` identical blocks in an
``nn.ModuleList``, norm, head; widths 20 / 35 / vocab 23 divide none of 2, 3) for ``STEPS``
optimizer steps, unsharded in one process on the global batch (the reference) and through
``torch.compile(backend=shardc)`` on gloo ranks, each rank its contiguous slice of the batch.
Compared: the per-step losses (mean over ranks), every parameter's reduced gradient at every
step (after clipping where clipped), clip norms, eval outputs, and the parameters at the end.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

DIM, HID, VOCAB, NL, RANK_LORA = 20, 35, 23, 3, 4
GLOBAL_BATCH, SEQ, STEPS = 36, 5, 4


@dataclass
class Sc:
    lora: bool = False
    freeze_base: bool = False  # every block's base weights frozen (LoRA)
    freeze_first: int = 0  # the first k blocks frozen entirely
    groups: bool = False  # two param groups: decay on matrices only, other lr
    sched: bool = False
    clip_norm: float | None = None
    clip_value: float | None = None
    micro: int = 1
    no_sync: bool = False
    bf16_param: bool = False
    mp: bool = False
    odd_params: bool = False  # 1-element, 2-row (< world 3), odd sizes
    buffers: bool = False
    eval_between: bool = False
    state_dict_rt: bool = False  # model + optimizer state_dict round trip at step 2
    dcp_rt: bool = False
    tie: bool = False
    shared_across_blocks: bool = False
    inplace: bool = False
    optim: str = "adamw"
    weight_decay: float = 0.05
    tol: float = 1e-5
    pack_blocks: bool | None = None  # None: shard's default
    outside_read: bool = False  # the model reads a block's parameter outside the block
    shared_module: bool = False  # blocks[1].norm is blocks[0].norm
    shared_all: bool = False  # every block's `up` is one module (ALBERT-like)
    keep_grads: bool = False  # zero_grad(set_to_none=False)
    freeze_mid: bool = False  # up.weight frozen for step 2, trainable again at step 3
    freeze_after_shard: bool = False  # the LoRA base frozen after shard (train's start)
    two_forwards: bool = False  # two forwards, one backward of the summed loss
    inference_eval: bool = False  # eval under torch.inference_mode
    teacher: bool = False  # a train-mode forward under no_grad between steps
    skip_block: bool = False  # blocks[1] skipped at steps 1 and 2 (layer drop)
    data_inplace: bool = False  # p.data.mul_ / p.data.copy_ between steps
    set_sd: bool = False  # torch.distributed.checkpoint.state_dict get/set round trip
    scalar: bool = False  # a 0-dim parameter in each block (ReZero's alpha)
    cube: bool = False  # a 3-D parameter with dim0 3 in each block
    noncontig: bool = False  # a transposed (non-contiguous) parameter in each block
    to_double: bool = False  # model.to(torch.float64) after shard
    no_reshard: bool = False  # reshard_after_forward=False
    train_in_eval: bool = False  # every step in eval mode (dropout off, as fine-tuning does)
    changing_seq: bool = False  # the sequence length changes between steps
    teacher_model: bool = False  # a second sharded model: EMA teacher, distillation loss
    deepcopy_teacher: bool = False  # the teacher is copy.deepcopy of the sharded student
    train_copy: bool = False  # train a copy.deepcopy of the sharded model instead of it
    extra: dict = field(default_factory=dict)
    # --- round 2 (s75) ---
    varlen: bool = False  # micro-batches of different sequence lengths within one step
    autocast: bool = False  # torch.autocast("cpu", bf16) around every forward
    ckpt: str = ""  # "nonreentrant" | "reentrant" | "selective" | "wrapper" (per block)
    freeze_all: bool = False  # model.requires_grad_(False) before shard
    unfreeze: tuple = ()  # name prefixes made trainable at train start (after shard)
    unfreeze_step1: tuple = ()  # name prefixes made trainable at step 1 (after a compiled step)
    mha: bool = False  # each block: nn.MultiheadAttention (causal) + MLP
    sequential: bool = False  # the blocks in an nn.Sequential, called as one
    twice: bool = False  # blocks[0] called twice per forward
    compile_how: str = "torch.compile"  # | "model.compile" | "forward"
    weight_norm: bool = False  # parametrizations.weight_norm on every block's up
    opt_all: bool = False  # optimizer over every parameter (frozen ones included)
    # the reference runs each rank's rows as its own micro-batch (loss / world each), so
    # low-precision ops see the same rows as on the ranks (run.py: a reference per world)
    emulate: bool = False
    rank_var: str = ""  # "seq" | "batch": each rank's sequence length / rows differ per step
    freeze_all_after_shard: bool = False  # requires_grad_(False) on everything after shard
    grad_replace: bool = False  # p.grad = p.grad * 0.5 (a new tensor) before each step
    compile_opt: str = ""  # torch.compile(opt.step) with this backend (a compiled optimizer)
    opt_in_bwd: bool = False  # one optimizer per parameter, stepped from its post-accumulate hook


SCENARIOS: dict[str, Sc] = {
    "base": Sc(),
    "lora": Sc(lora=True, freeze_base=True),
    "lora_first_k": Sc(lora=True, freeze_first=1),
    "freeze_first_k": Sc(freeze_first=2),
    "groups_sched": Sc(groups=True, sched=True),
    "clip_norm": Sc(clip_norm=0.05),
    "clip_value": Sc(clip_value=0.002),
    "accum2": Sc(micro=2),
    "accum3_no_sync": Sc(micro=3, no_sync=True),
    "accum2_no_sync_clip": Sc(micro=2, no_sync=True, clip_norm=0.05),
    "bf16_param": Sc(bf16_param=True, tol=2e-2),
    "mp_bf16": Sc(mp=True, tol=3e-2),
    # scalar gradients (sums over every token): summation order differs by world at ~5e-5,
    # equally with pack_blocks=False
    "odd_params": Sc(odd_params=True, tol=1e-4),
    "buffers_eval": Sc(buffers=True, eval_between=True),
    "eval_between": Sc(eval_between=True),
    "state_dict_rt": Sc(state_dict_rt=True),
    "dcp_rt": Sc(dcp_rt=True),
    "tie": Sc(tie=True),
    "shared_param": Sc(shared_across_blocks=True),
    "inplace": Sc(inplace=True),
    "sgd_inplace": Sc(inplace=True, optim="sgd"),
    "outside_read": Sc(outside_read=True),
    "shared_module": Sc(shared_module=True),
    "shared_all": Sc(shared_all=True),
    "keep_grads": Sc(keep_grads=True, micro=2),
    "freeze_mid": Sc(freeze_mid=True),
    "lora_freeze_after_shard": Sc(lora=True, freeze_after_shard=True),
    "two_forwards": Sc(two_forwards=True),
    "inference_eval": Sc(inference_eval=True, eval_between=True),
    "teacher": Sc(teacher=True),
    "skip_block": Sc(skip_block=True),
    "data_inplace": Sc(data_inplace=True),
    "set_sd": Sc(set_sd=True),
    "scalar": Sc(scalar=True),
    "cube": Sc(cube=True),
    "noncontig": Sc(noncontig=True),
    "to_double": Sc(to_double=True, tol=1e-12),
    "no_reshard": Sc(no_reshard=True),
    "noncontig_ckpt": Sc(noncontig=True, dcp_rt=True, state_dict_rt=True, tol=2e-5),
    "train_in_eval": Sc(train_in_eval=True),
    "changing_seq": Sc(changing_seq=True),
    "teacher_model": Sc(teacher_model=True),
    "deepcopy_teacher": Sc(teacher_model=True, deepcopy_teacher=True),
    "train_copy": Sc(train_copy=True),
    # --- round 2 (s75) ---
    "sgd_nesterov": Sc(optim="sgd_nesterov"),
    "adamw_noforeach": Sc(optim="adamw_noforeach"),
    "adamw_fused": Sc(optim="adamw_fused"),
    "adafactor": Sc(optim="adafactor"),
    "muon": Sc(optim="muon"),
    # Muon with its Newton-Schulz iteration in fp32 (torch's runs it in bf16): tells rounding
    # noise amplified by bf16 from a wrong update
    "muon_fp32": Sc(optim="muon_fp32"),
    "adagrad": Sc(optim="adagrad"),
    "rmsprop": Sc(optim="rmsprop"),
    "nadam": Sc(optim="nadam"),
    "radam": Sc(optim="radam"),
    "adamax": Sc(optim="adamax"),
    "adam_amsgrad": Sc(optim="adam_amsgrad"),
    "lbfgs": Sc(optim="lbfgs", weight_decay=0.0),
    "varlen_accum": Sc(micro=3, varlen=True),
    "varlen_accum_no_sync": Sc(micro=3, varlen=True, no_sync=True),
    "varlen_accum_no_sync_sgd": Sc(micro=3, varlen=True, no_sync=True, optim="sgd"),
    "autocast": Sc(autocast=True, tol=2e-2),
    "autocast_sgd": Sc(autocast=True, tol=2e-2, optim="sgd"),
    "rank_var_seq": Sc(emulate=True, rank_var="seq"),
    "rank_var_seq_contig": Sc(emulate=True, rank_var="seq_contig", optim="sgd"),
    "rank_var_seq_clone": Sc(emulate=True, rank_var="seq_clone", optim="sgd"),
    "rank_var_seq_hist": Sc(emulate=True, rank_var="seq_hist", optim="sgd"),
    "rank_var_seq_hist_mark": Sc(emulate=True, rank_var="seq_hist_mark", optim="sgd"),
    "rank_var_batch": Sc(emulate=True, rank_var="batch"),
    "rank_var_seq_sgd": Sc(emulate=True, rank_var="seq", optim="sgd"),
    "freeze_all_after_shard": Sc(freeze_all_after_shard=True, unfreeze=("blocks.1.", "head."),
                                 unfreeze_step1=("",), opt_all=True, optim="sgd"),
    "grad_replace": Sc(grad_replace=True, keep_grads=True, micro=2),
    "grad_replace_sgd": Sc(grad_replace=True, keep_grads=True, micro=2, optim="sgd"),
    "opt_in_bwd": Sc(opt_in_bwd=True),
    "compiled_opt_step": Sc(compile_opt="inductor"),
    "compiled_opt_step_sgd": Sc(compile_opt="inductor", optim="sgd"),
    "opt_in_bwd_sgd": Sc(opt_in_bwd=True, optim="sgd"),
    "autocast_ckpt": Sc(autocast=True, emulate=True, ckpt="nonreentrant"),
    "autocast_ckpt_reentrant": Sc(autocast=True, emulate=True, ckpt="reentrant"),
    "autocast_ckpt_selective": Sc(autocast=True, emulate=True, ckpt="selective"),
    "compile_dynamic": Sc(compile_how="dynamic", changing_seq=True),
    "compile_fullgraph": Sc(compile_how="fullgraph"),
    "autocast_emul": Sc(autocast=True, tol=1e-5, emulate=True),
    "autocast_emul_sgd": Sc(autocast=True, tol=1e-5, emulate=True, optim="sgd"),
    "ckpt_nonreentrant": Sc(ckpt="nonreentrant"),
    "ckpt_reentrant": Sc(ckpt="reentrant"),
    "ckpt_selective": Sc(ckpt="selective"),
    "ckpt_wrapper": Sc(ckpt="wrapper"),
    "ckpt_wrapper_reentrant": Sc(ckpt="wrapper_reentrant"),
    # bug C's fix direction, simulated: the wrapper's named_parameters/buffers not stripping
    # its prefix (torch's ActivationWrapper methods replaced by nn.Module's, in this process)
    "ckpt_wrapper_unstripped": Sc(ckpt="wrapper_unstripped"),
    "unfreeze_before_compile": Sc(freeze_all=True, unfreeze=("blocks.1.", "head.")),
    "unfreeze_step1": Sc(freeze_all=True, unfreeze=("blocks.1.",),
                         unfreeze_step1=("blocks.2.", "embed."), opt_all=True),
    "unfreeze_all_step1": Sc(freeze_all=True, unfreeze=("head.",),
                             unfreeze_step1=("",), opt_all=True),
    "unfreeze_all_step1_sgd": Sc(freeze_all=True, unfreeze=("head.",),
                                 unfreeze_step1=("",), opt_all=True, optim="sgd"),
    "mha": Sc(mha=True, optim="sgd"),
    "mha_adamw": Sc(mha=True, tol=1e-4),
    "sequential": Sc(sequential=True),
    "twice": Sc(twice=True),
    "model_compile": Sc(compile_how="model.compile"),
    "compile_forward": Sc(compile_how="forward"),
    "weight_norm": Sc(weight_norm=True),
}


class Block(nn.Module):
    def __init__(self, sc: Sc) -> None:
        super().__init__()
        self.sc = sc.lora, sc.buffers, sc.bf16_param, sc.odd_params
        self.shapes = sc.scalar, sc.cube, sc.noncontig
        if sc.scalar:
            self.alpha = nn.Parameter(torch.tensor(0.7))
        if sc.cube:
            self.cube = nn.Parameter(torch.randn(3, 4, DIM) * 0.1)
        if sc.noncontig:
            self.tw = nn.Parameter(torch.randn(DIM, 7).t() * 0.1)  # (7, DIM), strides (1, 7)
        self.norm = nn.LayerNorm(DIM)
        self.mha = None
        if sc.mha:
            self.anorm = nn.LayerNorm(DIM)
            self.mha = nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.up = nn.Linear(DIM, HID)
        self.down = nn.Linear(HID, DIM, bias=False)
        if sc.lora:
            self.lora_a = nn.Parameter(torch.randn(RANK_LORA, DIM) * 0.1)
            self.lora_b = nn.Parameter(torch.randn(HID, RANK_LORA) * 0.1)
        if sc.buffers:
            self.register_buffer("running", torch.zeros(DIM))
            self.register_buffer("count", torch.zeros((), dtype=torch.int64))
            self.register_buffer("ramp", torch.arange(DIM, dtype=torch.float32) / DIM,
                                 persistent=False)
        if sc.bf16_param:
            self.bscale = nn.Parameter(torch.ones(DIM, dtype=torch.bfloat16))
        if sc.odd_params:
            self.one = nn.Parameter(torch.ones(1))
            self.two = nn.Parameter(torch.randn(2, DIM) * 0.1)  # fewer rows than world 3
            self.odd = nn.Parameter(torch.randn(7) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora, buffers, bf16, odd = self.sc
        if self.mha is not None:
            a = self.anorm(x)
            s = x.shape[1]
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=x.device), 1)
            x = x + self.mha(a, a, a, attn_mask=mask, need_weights=False)[0]
        h = self.norm(x)
        u = self.up(h)
        if lora:
            u = u + (h @ self.lora_a.t()) @ self.lora_b.t()
        y = self.down(F.gelu(u))
        if buffers:
            if self.training:
                with torch.no_grad():
                    # from the (gathered) parameters, not the rank's batch: the same on
                    # every rank and in the reference
                    self.running.mul_(0.9).add_(0.1 * self.norm.weight.detach())
                    self.count.add_(1)
            y = y + self.running * 0.1 + self.ramp * 0.01
        if bf16:
            y = y * self.bscale.float()
        if odd:
            y = y * self.one * (1 + self.odd.sum()) + self.two.sum(0)
        scalar, cube, noncontig = self.shapes
        if scalar:
            y = y * self.alpha
        if cube:
            y = y + torch.tanh(self.cube).sum((0, 1))
        if noncontig:
            y = y + (h @ self.tw.t()) @ self.tw * 0.1
        return x + y


class Net(nn.Module):
    def __init__(self, sc: Sc) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        if sc.sequential:
            self.blocks = nn.Sequential(*[Block(sc) for _ in range(NL)])
        else:
            self.blocks = nn.ModuleList(Block(sc) for _ in range(NL))
        self.ckpt = sc.ckpt
        self.twice = sc.twice
        if sc.weight_norm:
            for block in self.blocks:
                torch.nn.utils.parametrizations.weight_norm(block.up)
        if sc.ckpt.startswith("wrapper"):
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointImpl, checkpoint_wrapper)
            impl = (CheckpointImpl.REENTRANT if sc.ckpt == "wrapper_reentrant"
                    else CheckpointImpl.NO_REENTRANT)
            if sc.ckpt == "wrapper_unstripped":
                from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
                cw.ActivationWrapper.named_parameters = nn.Module.named_parameters
                cw.ActivationWrapper.named_buffers = nn.Module.named_buffers
            for i in range(NL):
                self.blocks[i] = checkpoint_wrapper(self.blocks[i], checkpoint_impl=impl)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if sc.tie:
            self.head.weight = self.embed.weight
        self.outside_read = sc.outside_read
        self.skip = -1
        if sc.shared_module:
            self.blocks[1].norm = self.blocks[0].norm
        if sc.shared_all:
            for block in self.blocks[1:]:
                block.up = self.blocks[0].up
        if sc.shared_across_blocks:
            # one parameter in two different blocks
            self.blocks[1].up.weight = self.blocks[0].up.weight
        for i, block in enumerate(self.blocks):
            if sc.freeze_base:
                for name in ("norm", "up", "down"):
                    getattr(block, name).requires_grad_(False)
            if i < sc.freeze_first:
                for name, p in block.named_parameters():
                    if not name.startswith("lora"):
                        p.requires_grad_(False)
        if sc.freeze_all:
            self.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if isinstance(self.blocks, nn.Sequential):
            h = self.blocks(h)
        for i, block in enumerate(self.blocks if not isinstance(self.blocks, nn.Sequential)
                                  else []):
            if i == self.skip:
                continue
            for _ in range(2 if self.twice and i == 0 else 1):
                if self.ckpt in ("nonreentrant", "reentrant"):
                    from torch.utils.checkpoint import checkpoint
                    h = checkpoint(block, h, use_reentrant=self.ckpt == "reentrant")
                elif self.ckpt == "selective":
                    import functools

                    from torch.utils.checkpoint import (
                        CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts)

                    def policy(ctx, op, *args, **kwargs):
                        if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                            return CheckpointPolicy.MUST_SAVE
                        return CheckpointPolicy.PREFER_RECOMPUTE
                    h = checkpoint(block, h, use_reentrant=False, context_fn=functools.partial(
                        create_selective_checkpoint_contexts, policy))
                else:
                    h = block(h)
        if self.outside_read:  # the first block's norm again, read outside the block
            n = self.blocks[0].norm
            h = F.layer_norm(h, (DIM,), n.weight, n.bias)
        return self.head(self.norm(h))


def build(sc: Sc) -> Net:
    torch.manual_seed(0)
    return Net(sc)


def data():
    g = torch.Generator().manual_seed(1)
    shape = (STEPS, GLOBAL_BATCH, SEQ)
    return (torch.randint(0, VOCAB, shape, generator=g),
            torch.randint(0, VOCAB, shape, generator=g),
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g))


def make_optimizer(model: nn.Module, sc: Sc):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if sc.groups:
        decay = [p for n, p in named if p.ndim >= 2]
        rest = [p for n, p in named if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": 0.1, "lr": 2e-2},
                  {"params": rest, "weight_decay": 0.0, "lr": 5e-3}]
    else:
        groups = [{"params": [p for _, p in named]}]
    wd = sc.weight_decay
    if sc.opt_all:
        groups = [{"params": list(model.parameters())}]
    if sc.optim == "sgd":
        opt = torch.optim.SGD(groups, lr=0.3, momentum=0.9, weight_decay=sc.weight_decay)
    elif sc.optim == "sgd_nesterov":
        opt = torch.optim.SGD(groups, lr=0.3, momentum=0.9, nesterov=True, weight_decay=wd)
    elif sc.optim == "adamw_noforeach":
        opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=wd, foreach=False)
    elif sc.optim == "adamw_fused":
        opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=wd, fused=True)
    elif sc.optim == "adam_amsgrad":
        opt = torch.optim.Adam(groups, lr=1e-2, weight_decay=wd, amsgrad=True)
    elif sc.optim == "adafactor":
        opt = torch.optim.Adafactor(groups, lr=1e-2, weight_decay=wd)
    elif sc.optim == "adagrad":
        opt = torch.optim.Adagrad(groups, lr=5e-2, weight_decay=wd)
    elif sc.optim == "rmsprop":
        opt = torch.optim.RMSprop(groups, lr=1e-2, momentum=0.5, centered=True,
                                  weight_decay=wd)
    elif sc.optim == "nadam":
        opt = torch.optim.NAdam(groups, lr=1e-2, weight_decay=wd)
    elif sc.optim == "radam":
        opt = torch.optim.RAdam(groups, lr=1e-2, weight_decay=wd)
    elif sc.optim == "adamax":
        opt = torch.optim.Adamax(groups, lr=1e-2, weight_decay=wd)
    elif sc.optim == "lbfgs":
        opt = torch.optim.LBFGS([p for g in groups for p in g["params"]], lr=0.5,
                                max_iter=3, history_size=4)
    elif sc.optim in ("muon", "muon_fp32"):
        if sc.optim == "muon_fp32":
            import torch.optim._muon as _muon

            def ns_fp32(grad, ns_coefficients, ns_steps, eps):
                a, b, c = ns_coefficients
                x = grad.float()
                if grad.size(0) > grad.size(1):
                    x = x.T
                x = x / x.norm().clamp(min=eps)
                for _ in range(ns_steps):
                    g = x @ x.T
                    x = torch.addmm(x, torch.addmm(g, g, g, beta=b, alpha=c), x, beta=a)
                if grad.size(0) > grad.size(1):
                    x = x.T
                return x
            _muon._zeropower_via_newtonschulz = ns_fp32
        # Muon on the blocks' 2-D weights, AdamW on the rest (two optimizers, as users do)
        ps = [p for g in groups for p in g["params"]]
        names = {id(p): n for n, p in model.named_parameters()}
        mat = [p for p in ps if p.ndim == 2 and names[id(p)].startswith("blocks.")]
        rest = [p for p in ps if not (p.ndim == 2 and names[id(p)].startswith("blocks."))]
        opt = _Multi([torch.optim.Muon(mat, lr=2e-2, weight_decay=wd),
                      torch.optim.AdamW(rest, lr=1e-2, weight_decay=wd)])
    else:
        opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=sc.weight_decay)
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
             if sc.sched else None)
    return opt, sched


class _One(nn.Module):
    """A module holding one parameter (make_optimizer's argument for opt_in_bwd)."""

    def __init__(self, p):
        super().__init__()
        self._p = [p]

    def named_parameters(self, *a, **k):
        return iter([("p", self._p[0])])

    def parameters(self, *a, **k):
        return iter(self._p)


class _Multi:
    def __init__(self, opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def _rank_cut(sc, x, y, r, step):
    """Rank r's rows at this step under ``rank_var`` (the same in the reference's emulation)."""
    k = (r + step) % 3
    if sc.rank_var == "seq":
        return x[:, :SEQ - k], y[:, :SEQ - k]
    if sc.rank_var == "seq_clone":  # fresh tensors, as a DataLoader's (no view base)
        return x[:, :SEQ - k].clone(), y[:, :SEQ - k].clone()
    if sc.rank_var.startswith("seq_hist"):  # rank 0 keeps length 5 until step 2, others vary
        k = 0 if r == 0 and step < 2 else (r + step) % 3
        return x[:, :SEQ - k].clone(), y[:, :SEQ - k].clone()
    if sc.rank_var == "seq_contig":  # as a collate function pads/cuts: contiguous
        return x[:, :SEQ - k].contiguous(), y[:, :SEQ - k].contiguous()
    if sc.rank_var == "batch":
        return x[:x.shape[0] - k], y[:y.shape[0] - k]
    return x, y


def _unfreeze(model, prefixes):
    for n, p in model.named_parameters():
        if any(n.startswith(pre) for pre in prefixes):
            p.requires_grad_(True)


def full(t):
    if t is None:
        return None
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train(model: nn.Module, forward, sc: Sc, rank: int, world: int, sharded: bool,
          tmpdir: str | None = None, teacher=None, emu_world: int = 1) -> dict:
    import shardc

    if sc.freeze_after_shard:
        for block in model.blocks:
            for name in ("norm", "up", "down"):
                getattr(block, name).requires_grad_(False)
    if sc.freeze_all_after_shard:
        model.requires_grad_(False)
    if sc.unfreeze:
        _unfreeze(model, sc.unfreeze)
    opt, sched = make_optimizer(model, sc)
    if sc.opt_in_bwd:  # torchtune's optimizer-in-backward: each parameter steps in its hook
        per_param = {}
        for p in model.parameters():
            if p.requires_grad:
                per_param[p] = make_optimizer(_One(p), sc)[0]

                def hook(q):
                    per_param[q].step()
                    per_param[q].zero_grad()
                p.register_post_accumulate_grad_hook(hook)
    tokens, targets, eval_tokens = data()
    per = GLOBAL_BATCH // world
    rows = slice(rank * per, (rank + 1) * per)
    out = {"losses": [], "grads": [], "norms": [], "evals": [], "buffers": []}
    ema = None
    for step in range(STEPS):
        if sc.inplace and step == 1:
            ema = [p.detach().clone() for p in model.parameters()]
        if sc.inplace and step == 2:
            with torch.no_grad():
                for p, e in zip(model.parameters(), ema):
                    e.lerp_(p, 0.5)
                model.blocks[1].up.weight.mul_(0.5)
                model.blocks[0].down.weight.add_(0.01)
                torch.nn.init.constant_(model.blocks[2].up.bias, 0.1)
                # EMA copy back into the last block's and the head's parameters
                names = [n for n, _ in model.named_parameters()]
                for n, p, e in zip(names, model.parameters(), ema):
                    if n.startswith(("blocks.2.", "head.")):
                        p.copy_(e)
        if sc.unfreeze_step1 and step == 1:
            _unfreeze(model, sc.unfreeze_step1)
        if sc.freeze_mid and step in (2, 3):
            for block in model.blocks:
                block.up.weight.requires_grad_(step == 3)
        if sc.skip_block:
            model.skip = 1 if step in (1, 2) else -1
        if sc.data_inplace and step == 2:
            with torch.no_grad():
                model.blocks[1].up.weight.data.mul_(0.5)
                model.blocks[2].down.weight.data.copy_(model.blocks[0].down.weight.data)
                for p in model.blocks[0].parameters():
                    p.data.add_(0.01)
        if sc.teacher and step in (1, 2):
            with torch.no_grad():
                t = forward(eval_tokens[rows])
            out["evals"].append(_gathered(t.contiguous(), sharded, world))
        if sc.set_sd and step == 2 and sharded:
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
            msd, osd = get_state_dict(model, opt)
            msd = {k: v.clone() for k, v in msd.items()}
            osd = copy.deepcopy(osd)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.0)
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        if sc.state_dict_rt and step == 2:
            msd = {k: v.clone() if hasattr(v, "clone") else v
                   for k, v in model.state_dict().items()}
            osd = copy.deepcopy(opt.state_dict())
            # perturb, then restore: the load must put every value back
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.0)
            model.load_state_dict(msd)
            opt.load_state_dict(osd)
        if sc.dcp_rt and step == 2 and sharded:
            import torch.distributed.checkpoint as dcp

            from shardc.checkpoint import ModelState, OptimizerState
            dcp.save({"model": ModelState(model), "optim": OptimizerState(model, opt)},
                     checkpoint_id=tmpdir)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.0)
            for st in opt.state.values():
                for v in st.values():
                    if torch.is_tensor(v) and v.ndim > 0:
                        v.mul_(0.0)
            dcp.load({"model": ModelState(model), "optim": OptimizerState(model, opt)},
                     checkpoint_id=tmpdir)
        if sc.eval_between and step in (1, 3):
            model.eval()
            with torch.inference_mode() if sc.inference_eval else torch.no_grad():
                o = forward(eval_tokens[rows]).contiguous()
            o = o.clone()
            model.train()
            if sharded and world > 1:
                parts = [torch.empty_like(o) for _ in range(world)]
                dist.all_gather(parts, o)
                o = torch.cat(parts)
            out["evals"].append(o)
        x, y = tokens[step, rows], targets[step, rows]
        if sc.changing_seq:
            x, y = x[:, :SEQ - step % 3], y[:, :SEQ - step % 3]
        if sc.rank_var and sharded:
            x, y = _rank_cut(sc, x, y, rank, step)

        if sc.train_in_eval:
            model.eval()
        m_rows = x.shape[0] // sc.micro
        if sc.emulate and not sharded and emu_world > 1:
            er = x.shape[0] // emu_world
            total = 0.0
            for r in range(emu_world):
                xr, yr = _rank_cut(sc, x[r * er:(r + 1) * er], y[r * er:(r + 1) * er], r, step)
                with (torch.autocast("cpu", dtype=torch.bfloat16) if sc.autocast else _null()):
                    lo = F.cross_entropy(forward(xr).float().flatten(0, 1), yr.flatten())
                # unscaled, as each rank's backward; the mean over ranks after, in fp32, as
                # the reduce-scatter's (1/3 in a bf16 backward would round on its own)
                lo.backward()
                total = total + lo.detach() / emu_world
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(emu_world)
            m_rows = None
            emu_total = total
        total = 0.0 if m_rows is not None else emu_total
        if teacher is not None:
            t_model, t_forward = teacher
            with torch.no_grad():
                t_logits = t_forward(x)
            loss = (F.cross_entropy(forward(x).flatten(0, 1), y.flatten())
                    + 0.5 * F.mse_loss(forward(x), t_logits))
            loss.backward()
            total = loss.detach()
        if sc.two_forwards:
            half = x.shape[0] // 2
            loss = (F.cross_entropy(forward(x[:half]).flatten(0, 1), y[:half].flatten())
                    + F.cross_entropy(forward(x[half:]).flatten(0, 1), y[half:].flatten())) / 2
            loss.backward()
            total = loss.detach()
        for m in range(0 if sc.two_forwards or teacher is not None or m_rows is None
                       else sc.micro):
            part = slice(m * m_rows, (m + 1) * m_rows)
            if not sharded and emu_world > 1:
                # micro-batch m of every emulated rank, so each micro-batch holds the same rows
                # as the ranks' micro-batches m together (varlen: their lengths differ)
                er = x.shape[0] // emu_world // sc.micro
                part = torch.cat([torch.arange(r * er * sc.micro + m * er,
                                               r * er * sc.micro + (m + 1) * er)
                                  for r in range(emu_world)])
            ctx = (shardc.no_sync(model) if sharded and sc.no_sync and m < sc.micro - 1
                   else _null())
            xm, ym = x[part], y[part]
            if sharded and sc.rank_var.endswith("_mark"):
                # the documented fix: the length marked dynamic (on the tensor passed)
                torch._dynamo.mark_dynamic(xm, 1)
            if sc.varlen:  # micro-batch m keeps SEQ - m tokens (a different length each)
                xm, ym = xm[:, :SEQ - m], ym[:, :SEQ - m]
            ac = (torch.autocast("cpu", dtype=torch.bfloat16) if sc.autocast else _null())
            if sc.optim == "lbfgs":
                def closure():
                    opt.zero_grad()
                    lo = F.cross_entropy(forward(xm).float().flatten(0, 1), ym.flatten())
                    lo.backward()
                    lg = lo.detach().clone()
                    if sharded and world > 1:
                        dist.all_reduce(lg)
                        lg = lg / world
                    return lg
                loss = opt.step(closure)
                total = total + loss
                continue
            with ctx, ac:
                logits = forward(xm)
                loss = F.cross_entropy(logits.float().flatten(0, 1) if not sc.to_double
                                       else logits.flatten(0, 1), ym.flatten()) / sc.micro
                loss.backward()
            total = total + loss.detach()
        if sharded and world > 1:
            total = total.clone()
            dist.all_reduce(total)
            total = total / world
        out["losses"].append(total)
        if sc.clip_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], sc.clip_norm)
            out["norms"].append(full(norm))
        if sc.clip_value is not None:
            torch.nn.utils.clip_grad_value_(
                [p for p in model.parameters() if p.requires_grad], sc.clip_value)
        if sc.grad_replace:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad = p.grad * 0.5
        out["grads"].append({n: full(p.grad) for n, p in model.named_parameters()})
        if sc.optim != "lbfgs":
            if sc.compile_opt:
                if step == 0:
                    opt_step = torch.compile(opt.step, backend=sc.compile_opt)
                opt_step()
            else:
                opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=not sc.keep_grads)
        if teacher is not None:
            with torch.no_grad():
                for pt, ps in zip(teacher[0].parameters(), model.parameters()):
                    pt.lerp_(ps, 0.3)
        if sc.buffers:
            out["buffers"].append({n: b.detach().clone() for n, b in model.named_buffers()})
    out["losses"] = torch.stack(out["losses"])
    out["params"] = {n: full(p) for n, p in model.named_parameters()}
    out["state_dict_keys"] = list(model.state_dict().keys())
    if teacher is not None:
        out["params"].update({"teacher." + n: full(p)
                              for n, p in teacher[0].named_parameters()})
    return out


def _gathered(o, sharded, world):
    if sharded and world > 1:
        parts = [torch.empty_like(o) for _ in range(world)]
        dist.all_gather(parts, o)
        return torch.cat(parts)
    return o


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def reference(name: str, emu_world: int = 1) -> dict:
    sc = SCENARIOS[name]
    model = build(sc)
    if sc.mp:
        return None
    if sc.to_double:
        model.to(torch.float64)
    teacher = None
    if sc.teacher_model:
        torch.manual_seed(5)
        t = copy.deepcopy(model) if sc.deepcopy_teacher else Net(sc)
        teacher = (t, t)
    return train(model, model, sc, 0, 1, False, teacher=teacher, emu_world=emu_world)


def sharded_run(rank: int, world: int, name: str, mode: str, pack=None) -> dict:
    import tempfile

    import shardc

    torch.set_num_threads(1)
    sc = SCENARIOS[name]
    model = build(sc)
    kwargs = {}
    if sc.mp:
        kwargs["mp_policy"] = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                          reduce_dtype=torch.float32)
    p = sc.pack_blocks if pack is None else pack
    if p is not None:
        kwargs["pack_blocks"] = p
    if sc.no_reshard:
        kwargs["reshard_after_forward"] = False
    shardc.shard(model, **kwargs)
    if sc.to_double:
        model.to(torch.float64)
    state = shardc.shard_state(model)
    packed = sorted(state.packed.blocks) if state.packed is not None else []
    be = shardc.backend(inductor=(mode == "inductor"))
    if mode == "eager":
        forward = model
    elif sc.compile_how == "model.compile":
        model.compile(backend=be)
        forward = model
    elif sc.compile_how == "dynamic":
        forward = torch.compile(model, backend=be, dynamic=True)
    elif sc.compile_how == "fullgraph":
        forward = torch.compile(model, backend=be, fullgraph=True)
    elif sc.compile_how == "forward":
        forward = torch.compile(model.forward, backend=be)
    else:
        forward = torch.compile(model, backend=be)
    tmp = None
    if sc.dcp_rt:
        obj = [tempfile.mkdtemp() if rank == 0 else None]
        dist.broadcast_object_list(obj)
        tmp = obj[0]
    teacher = None
    if sc.train_copy:
        model = copy.deepcopy(model)
        forward = torch.compile(model, backend=shardc.backend(inductor=(mode == "inductor")))
    if sc.teacher_model:
        torch.manual_seed(5)
        t = copy.deepcopy(model) if sc.deepcopy_teacher else shardc.shard(Net(sc), **kwargs)
        teacher = (t, torch.compile(t, backend=shardc.backend(inductor=(mode == "inductor"))))
    out = train(model, forward, sc, rank, world, True, tmp, teacher)
    out["packed"] = packed
    out["unpacked"] = [(u.module, u.reason) for u in state.blocks.unpacked] \
        if state.blocks is not None else []
    out["handed"] = state.packed.handed if state.packed is not None else None
    return out


def rel(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    a, b = a.double(), b.double()
    if a.shape != b.shape:
        return float("inf")
    scale = b.norm().item() or 1.0
    return (a - b).norm().item() / scale


def compare(got: dict, ref: dict, tol: float) -> tuple[bool, list[str], float]:
    bad, worst = [], 0.0

    def check(label, a, b):
        nonlocal worst
        e = rel(a, b)
        worst = max(worst, e)
        if not e <= tol:
            bad.append(f"{label}: {e:.2e}")

    check("losses", got["losses"], ref["losses"])
    for i, (g, r) in enumerate(zip(got["norms"], ref["norms"])):
        check(f"norm[{i}]", g, r)
    for i, (g, r) in enumerate(zip(got["evals"], ref["evals"])):
        check(f"eval[{i}]", g, r)
    for i, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
        for n in r:
            check(f"grad[{i}] {n}", g.get(n), r[n])
    for n in ref["params"]:
        check(f"param {n}", got["params"].get(n), ref["params"][n])
    for i, (g, r) in enumerate(zip(got["buffers"], ref["buffers"])):
        for n in r:
            check(f"buffer[{i}] {n}", g.get(n), r[n])
    if got["state_dict_keys"] != ref["state_dict_keys"]:
        bad.append(f"state_dict keys {got['state_dict_keys']} vs {ref['state_dict_keys']}")
    return not bad, bad, worst
