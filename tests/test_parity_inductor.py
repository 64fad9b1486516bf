"""Parity of the Inductor-compiled planned graphs, world sizes 1-4.

The reference is the unsharded model compiled by torch's default backend (Inductor), so fused
kernel rounding is not mistaken for a sharding error.
"""

from __future__ import annotations

import pytest
import torch._dynamo
from dist_utils import run_ranks
from parity import assert_parity, reference, sharded_run


@pytest.fixture(scope="module")
def inductor_reference():
    torch._dynamo.reset()
    return reference("llama1", compile_backend="inductor")


def _inductor_run(rank: int, world: int) -> dict:
    out = sharded_run(rank, world, "llama1", "inductor")
    assert out["plans"] and all(p is not None for p in out["plans"]), "no region was planned"
    out["plans"] = len(out["plans"])
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_inductor(world, inductor_reference):
    run = run_ranks(_inductor_run, world)[0]
    assert_parity(run, inductor_reference)
