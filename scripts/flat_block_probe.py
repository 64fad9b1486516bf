"""What a block's parameter count costs the compile (issue 18): the tiny llama of
``shardc.models.llama`` against the same model whose blocks hold their nine weights in one flat
parameter, sliced into views inside the block's forward. One rank over gloo, CPU; prints the
first step's seconds, torch's timed compile events (Dynamo's trace, guard building, the
backend), the guard count and the block groups. An analysis tool, not a test:

    PYTHONPATH=$PWD python scripts/flat_block_probe.py --blocks 2 8 --mode llama flat [--inductor]

Each (mode, blocks) runs in its own process (Dynamo's counters are per process), with fresh
Inductor/Triton cache directories under ``--cache-root``.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from shardc.models.llama import LlamaConfig, Transformer, apply_rope, llama_loss


class FlatBlock(nn.Module):
    """A llama block (RMSNorm, rotary attention, SwiGLU) whose weights are views of ``flat``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        d, h, hd = cfg.dim, cfg.hidden_dim, cfg.head_dim
        # Underscored: block_signature compares public attributes, and these are equal anyway.
        self._shapes = (("attention_norm", (d,)), ("wq", (cfg.n_heads * hd, d)),
                        ("wk", (cfg.kv_heads * hd, d)), ("wv", (cfg.kv_heads * hd, d)),
                        ("wo", (d, cfg.n_heads * hd)), ("ffn_norm", (d,)), ("w1", (h, d)),
                        ("w3", (h, d)), ("w2", (d, h)))
        numel = sum(math.prod(shape) for _, shape in self._shapes)
        self.flat = nn.Parameter(torch.randn(numel) * 0.02)
        self._heads, self._kv_heads, self._head_dim = cfg.n_heads, cfg.kv_heads, hd
        self._eps = cfg.norm_eps

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self._eps)
        return normed.type_as(x) * weight

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        w, offset = {}, 0
        for name, shape in self._shapes:
            numel = math.prod(shape)
            w[name] = self.flat[offset:offset + numel].view(shape)
            offset += numel
        b, s, _ = x.shape
        a = self._norm(x, w["attention_norm"])
        q = F.linear(a, w["wq"]).view(b, s, self._heads, self._head_dim)
        k = F.linear(a, w["wk"]).view(b, s, self._kv_heads, self._head_dim)
        v = F.linear(a, w["wv"]).view(b, s, self._kv_heads, self._head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + F.linear(out.transpose(1, 2).reshape(b, s, -1), w["wo"])
        f = self._norm(h, w["ffn_norm"])
        return h + F.linear(F.silu(F.linear(f, w["w1"])) * F.linear(f, w["w3"]), w["w2"])


def run_one(mode: str, blocks: int, inductor: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import shardc
    from shardc import _torch

    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        cfg = LlamaConfig(dim=64, n_layers=blocks, n_heads=4, vocab_size=128, max_seq_len=32)
        model = Transformer(cfg)
        if mode == "flat":
            model.layers = nn.ModuleList(FlatBlock(cfg) for _ in range(blocks))
        shardc.shard(model, init_device_mesh("cpu", (1,)))

        def step(t, y):
            return llama_loss(model(t), y)

        compiled = torch.compile(step, backend=shardc.backend(inductor=inductor))
        tokens, targets = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
        start = time.perf_counter()
        compiled(tokens, targets).backward()
        first = time.perf_counter() - start
        from torch._dynamo.utils import compile_times
        names, values = compile_times(repr="csv", aggregate=True)
        timed = {n: float(v) for n, v in zip(names, values)}
        groups = [len(g.members) for g in shardc.shard_state(model).blocks.groups]
        print(f"{mode:5s} blocks={blocks:3d} first={first:6.2f} s  "
              f"trace={timed.get('bytecode_tracing', 0):5.2f}  "
              f"build_guards={timed.get('build_guards', 0):5.3f}  "
              f"backend={timed.get('OutputGraph.call_user_compiler', 0):5.2f}  "
              f"guards={len(_torch.cached_guards(step.__code__))}  groups={groups}", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[2, 8])
    p.add_argument("--mode", nargs="+", choices=("llama", "flat"), default=["llama", "flat"])
    p.add_argument("--inductor", action="store_true", help="Inductor (default: FX graphs)")
    p.add_argument("--cache-root", default=None)
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        run_one(args.child[0], int(args.child[1]), args.inductor)
        return
    root = args.cache_root or tempfile.mkdtemp(prefix="flat_block_probe_")
    for mode in args.mode:
        for blocks in args.blocks:
            caches = os.path.join(root, f"{mode}_{blocks}")
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29591",
                       TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(caches, "triton"))
            cmd = [sys.executable, __file__, "--child", mode, str(blocks)]
            subprocess.run(cmd + (["--inductor"] if args.inductor else []), env=env, check=True)


if __name__ == "__main__":
    main()
