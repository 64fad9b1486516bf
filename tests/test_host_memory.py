"""A plan's host memory must fit the host (``shardc.compile.host_memory``): offloaded saved
activations and the peak budget's share of the optimizer in pinned host memory are checked
against the host's available memory for every local rank when the plan is made, and refused
with what it needs, what the host has and what to change, instead of failing mid-step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
from dist_utils import run_ranks
from parity import batches, build, llama_loss

import shardc
from shardc.compile import host_memory
from shardc.planning.budget import MemoryBudgetError
from shardc.sharding import offload

GIB = 1 << 30


def _plan(host_bytes: float) -> SimpleNamespace:
    return SimpleNamespace(predicted=SimpleNamespace(host_bytes=host_bytes), group_name="")


def test_refused_when_the_local_ranks_need_more_than_the_host_has(monkeypatch):
    monkeypatch.setattr(offload, "host_available_bytes", lambda: 100 * GIB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    # 8 ranks x 13 GiB (10 of activations, 2 of the budget's optimizer share, 1 of CPU
    # offload's state) > 100 GiB.
    with pytest.raises(MemoryBudgetError) as err:
        host_memory.refuse_overcommit(_plan(13 * GIB), 10 * GIB, 2 * GIB)
    text = str(err.value)
    for part in ("13.00 GiB per rank", "saved activations 10.00 GiB",
                 "optimizer masters, gradients and state 2.00 GiB",
                 "CPU offload's shards, gradients and state 1.00 GiB",
                 "8 local rank(s) need 104.00 GiB", "a host has 100.00 GiB available",
                 "activation_offload='never'", "check_host_memory=False"):
        assert part in text, (part, text)
    # It fits with fewer ranks per host; the check can be turned off; nothing of shardc's own
    # on the host (CPU offload alone, checked at shard time) is not checked here.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    host_memory.refuse_overcommit(_plan(13 * GIB), 10 * GIB, 2 * GIB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    host_memory.refuse_overcommit(_plan(13 * GIB), 10 * GIB, 2 * GIB, check=False)
    host_memory.refuse_overcommit(_plan(200 * GIB), 0, 0)
    # A host that does not say what it has: nothing to check against.
    monkeypatch.setattr(offload, "host_available_bytes", lambda: None)
    host_memory.refuse_overcommit(_plan(13 * GIB), 10 * GIB, 2 * GIB)


def _train_with_offloaded_activations(rank: int, world: int, check: bool,
                                      short: tuple[int, ...] = (0,)) -> str:
    """One step of a Llama whose blocks' saved activations go to the host, where the ranks in
    ``short`` say their host has 1 KiB available (the others: plenty): the error's text, or
    "trained"."""
    available = 1024 if rank in short else 1 << 40
    offload.host_available_bytes = lambda: available  # this spawned process only
    torch._dynamo.reset()
    model = build("llama")
    shardc.shard(model)
    forward = torch.compile(model, backend=shardc.backend(
        inductor=False, activation_offload=("*",), check_host_memory=check))
    tokens, targets = batches()
    try:
        llama_loss(forward(tokens[0]), targets[0]).backward()
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        return f"{type(exc).__name__}: {exc}"
    return "trained"


def test_a_plan_offloading_more_than_the_host_has_is_refused_at_compile_time():
    (refused,) = run_ranks(_train_with_offloaded_activations, 1, True)
    assert "MemoryBudgetError" in refused and "saved activations" in refused, refused
    assert "1 local rank(s)" in refused and "has 0.00 GiB available" in refused, refused
    (trained,) = run_ranks(_train_with_offloaded_activations, 1, False)
    assert trained == "trained"


def test_every_rank_refuses_when_one_host_is_short():
    """Two ranks, only rank 1's host short: both refuse at compile time (the ranks agree on the
    outcome), instead of rank 0 waiting at its first collective for a rank that stopped."""
    refused = run_ranks(_train_with_offloaded_activations, 2, True, (1,))
    for text in refused:
        assert "MemoryBudgetError" in text and "a host has 0.00 GiB available" in text, refused
