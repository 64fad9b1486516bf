"""Models, data and helpers for the checkpoint tests (imported by their spawned workers).

Sizes are chosen so that no world size used (1-4) splits every parameter evenly: the Llama config
has 37- and 45-row parameters, and :class:`Tiny` has 2- and 3-row parameters, so 3 and 4 ranks give
ranks with empty shards (``torch.chunk`` semantics). The Llama model has no biases.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor

import shardc
from shardc.models.llama import LlamaConfig, Transformer, llama_loss
from shardc.runtime.collectives import padded_rows, shard_rows

LLAMA = LlamaConfig(vocab_size=37, dim=24, n_layers=1, n_heads=4, ffn_dim=45, max_seq_len=16)
LR = 1e-2


class Tiny(nn.Module):
    """Biases, a persistent and a non-persistent buffer; 3- and 2-row parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.fc2 = nn.Linear(3, 2)
        self.register_buffer("scale", torch.tensor([1.5, -0.5]))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


def llama(seed: int = 0, *, sharded: bool = True, **shard_kwargs: Any) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(LLAMA)
    return shardc.shard(model, **shard_kwargs) if sharded else model


def tiny(seed: int = 0, *, sharded: bool = True) -> Tiny:
    torch.manual_seed(seed)
    model = Tiny()
    return shardc.shard(model) if sharded else model


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def tokens(step: int, rank: int) -> torch.Tensor:
    """This rank's batch of a step (independent of the world size)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, LLAMA.vocab_size, (2, 8), generator=gen)


def tiny_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5000 + 1000 * step + rank)
    return torch.randn(3, 4, generator=gen), torch.randn(3, 2, generator=gen)


def llama_step(call: Callable, opt: torch.optim.Optimizer, step: int, rank: int) -> torch.Tensor:
    """One training step on this rank's batch; returns the (local) loss."""
    toks = tokens(step, rank)
    loss = llama_loss(call(toks), torch.roll(toks, -1, dims=1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach().clone()


def tiny_step(call: Callable, opt: torch.optim.Optimizer, step: int, rank: int) -> torch.Tensor:
    x, y = tiny_batch(step, rank)
    loss = (call(x) - y).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach().clone()


def full(value: Any) -> Any:
    """A tree with every DTensor gathered into a plain tensor (collective: same order on all)."""
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(full(v) for v in value)
    return value


def full_state(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict:
    """Gathered model and optimizer state, optimizer keyed by parameter name."""
    out = {"model": full(model.state_dict())}
    if opt is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        state = {names[id(p)]: full(s) for p, s in opt.state.items()}
        out["optim"] = dict(sorted(state.items()))
        out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return out


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two trees differ (tensors: bitwise, dtype and shape); empty if identical."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        if not torch.equal(a, b):
            return [f"{path}: max abs diff {(a.double() - b.double()).abs().max().item():.3g}"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: missing on one side" for k in set(a) ^ set(b)]
        for k in a:
            if k in b:
                out += diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def local_rows(full_tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's ``torch.chunk`` rows of a full tensor (possibly none)."""
    dim0 = full_tensor.shape[0]
    start = min(rank * padded_rows(dim0, world), dim0)
    return full_tensor.narrow(0, start, shard_rows(dim0, world, rank)).clone()


def state_from_full(model: nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    """Fill a sharded model and its AdamW from gathered state without any checkpoint API.

    The reference for "training that was never interrupted": the same values put into place by
    hand (each rank keeps its ``torch.chunk`` rows; ``step`` as the plain tensor AdamW keeps).
    """

    def shard_of(value: torch.Tensor, like: DTensor) -> torch.Tensor:
        mesh = like.device_mesh
        return local_rows(value, mesh.get_local_rank(), mesh.size())

    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            value = state["model"][name]
            if isinstance(tensor, DTensor):
                tensor.to_local().copy_(shard_of(value, tensor))
            else:
                tensor.copy_(value)
    for name, p in model.named_parameters():
        entry = {}
        for key, value in state["optim"][name].items():
            if key == "step":
                entry[key] = value.clone()
            else:
                entry[key] = DTensor.from_local(
                    shard_of(value, p), p.device_mesh, p.placements, run_check=False,
                    shape=p.shape, stride=p.stride(),
                )
        opt.state[p] = entry


def _group_main(rank: int, world: int, init_file: str, out_dir: str, fn, args) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        payload = ("ok", fn(rank, world, *args))
    except BaseException as exc:
        payload = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(payload, f)
    os._exit(0)  # no destroy_process_group: peers may be dead


def run_group(fn: Callable, world: int, *args: Any, timeout: float = 300) -> list[tuple]:
    """Run ``fn(rank, world, *args)`` on gloo ranks where some rank may die on purpose.

    Unlike ``dist_utils.run_ranks`` a dying rank does not take the others down at once: every
    rank runs until it returns, raises or exits. Returns ``(exitcode, status, value)`` per rank;
    status is "ok", "error" (value: the traceback) or "died" (no report).
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        procs = [ctx.Process(target=_group_main, args=(r, world, init_file, tmp, fn, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        out = []
        for r, p in enumerate(procs):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    status, value = pickle.load(f)
            else:
                status, value = "died", None
            out.append((p.exitcode, status, value))
        return out
