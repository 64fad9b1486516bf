"""Inductor's compile workers start from ``shardc.shard`` on a CUDA mesh
(``shardc.compile.compile_workers``); on a CPU mesh nothing starts."""

from __future__ import annotations

from dist_utils import one_rank_mesh
from torch import nn
from torch.distributed.tensor import DTensor

import shardc
from shardc import _torch
from shardc.compile import compile_workers


def _record_warm(monkeypatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(_torch, "warm_inductor_compile_pool", lambda: calls.append("warm"))
    return calls


def test_a_triton_device_starts_the_workers_and_a_cpu_does_not(monkeypatch):
    calls = _record_warm(monkeypatch)
    assert compile_workers.start_for("cpu") is False
    assert calls == []
    assert compile_workers.start_for("cuda") is True
    assert calls == ["warm"]


def test_shard_asks_for_the_workers_with_its_mesh_device_first(monkeypatch):
    seen: list[tuple[str, bool]] = []
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))

    def start_for(device_type: str) -> bool:
        # (still unsharded when asked: the workers warm while shard() runs)
        seen.append((device_type, isinstance(model[0].weight, DTensor)))
        return False

    monkeypatch.setattr(compile_workers, "start_for", start_for)
    with one_rank_mesh() as mesh:
        shardc.shard(model, mesh)
    assert seen == [("cpu", False)]


def test_a_cpu_mesh_starts_no_workers(monkeypatch):
    calls = _record_warm(monkeypatch)
    with one_rank_mesh() as mesh:
        shardc.shard(nn.Linear(5, 3), mesh)
    assert calls == []


def test_the_wrapper_calls_torchs_own_warm_start(monkeypatch):
    """``_torch.warm_inductor_compile_pool`` is torch's ``maybe_warm_pool`` (which honours
    ``TORCH_WARM_POOL=0``, ``TORCHINDUCTOR_COMPILE_THREADS=1`` and a missing Triton itself):
    the entry point exists in this torch and is what the wrapper calls."""
    from torch._inductor import async_compile

    assert callable(getattr(async_compile, "maybe_warm_pool", None))
    called = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: called.append(1))
    _torch.warm_inductor_compile_pool()
    assert called == [1]
