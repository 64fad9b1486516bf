"""2-D meshes for ``train_bench.py``: ``--mesh RxS`` (HSDP) and ``--tp N`` (FSDP+TP).

``--mesh RxS``: a ``("replicate", "shard")`` mesh of R x S ranks; shardc and FSDP2 shard within
``shard`` and all-reduce gradients across ``replicate``. ``--tp N``: a ``("dp", "tp")`` mesh of
world/N x N ranks; the Llama blocks are tensor-parallelized on ``tp`` with torch's API (Megatron
style: q/k/v and w1/w3 column-wise, wo and w2 row-wise, norms and embeddings replicated), then
shardc (or FSDP2) shards over ``dp``. The ranks of one tp group read the same batch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def parse_mesh(spec: str | None, world: int) -> tuple[int, int] | None:
    """``"RxS"`` as ``(R, S)`` (checked against the world size), or None."""
    if not spec:
        return None
    try:
        r, s = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--mesh {spec!r}: expected RxS, e.g. 2x4") from None
    if r * s != world:
        raise SystemExit(f"--mesh {spec}: {r} x {s} != world size {world}")
    return r, s


def build_mesh(device_type: str, world: int, mesh_spec: str | None, tp: int) -> DeviceMesh:
    """The benchmark's mesh: 1-D, HSDP ``(replicate, shard)`` or ``(dp, tp)``."""
    shape = parse_mesh(mesh_spec, world)
    if shape is not None and tp > 1:
        raise SystemExit("--mesh and --tp are exclusive (HSDP+TP is not supported)")
    if tp > 1:
        if world % tp:
            raise SystemExit(f"--tp {tp} does not divide the world size {world}")
        return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    if shape is not None:
        return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world,))


def describe(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names
    if mesh.ndim == 1:
        return f"FSDP {mesh.size()}"
    if names == ("replicate", "shard"):
        return f"HSDP {mesh.size(0)}x{mesh.size(1)} (replicate x shard)"
    return f"FSDP+TP {mesh.size(0)}x{mesh.size(1)} (dp x tp)"


def label(mesh: DeviceMesh) -> str:
    """A short name of the mesh for a table row: ``fsdp 2``, ``hsdp 2x1`` (replicate x shard),
    ``fsdp 1 x tp 2`` (dp x tp)."""
    if mesh.ndim == 1:
        return f"fsdp {mesh.size()}"
    if mesh.mesh_dim_names == ("replicate", "shard"):
        return f"hsdp {mesh.size(0)}x{mesh.size(1)}"
    return f"fsdp {mesh.size(0)} x tp {mesh.size(1)}"


def is_tp(mesh: DeviceMesh) -> bool:
    return mesh.mesh_dim_names == ("dp", "tp")


def data_rank(mesh: DeviceMesh, rank: int) -> int:
    """Which batch a rank reads: its dp coordinate under TP (a tp group shares one batch)."""
    return mesh["dp"].get_local_rank() if is_tp(mesh) else rank


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: the whole mesh (1-D, or 2-D = HSDP), or ``dp`` under TP."""
    return mesh["dp"] if is_tp(mesh) else mesh


def parallelize_llama(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Tensor-parallelize the blocks of ``shardc.models.llama.Transformer`` on ``mesh["tp"]``
    (no-op on other meshes). Heads are split across tp ranks, so each block's attention is told
    its local head counts."""
    if not is_tp(mesh):
        return model
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp_mesh = mesh["tp"]
    tp = tp_mesh.size()
    for i, block in enumerate(model.layers):
        attn = block.attention
        if attn.n_heads % tp or attn.kv_heads % tp:
            raise SystemExit(f"--tp {tp}: layer {i} has {attn.n_heads} heads / {attn.kv_heads} "
                             "kv heads, not divisible by tp")
        parallelize_module(block, tp_mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })
        attn.n_heads //= tp
        attn.kv_heads //= tp
    return model


def init_cpu_group(default_port: int) -> None:
    """A gloo process group for the host-time tools: torchrun's environment, or one rank alone
    (``MASTER_PORT`` from the environment, else ``default_port``); one intra-op thread, so
    that the ranks' host times are not each other's."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(default_port)))
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
