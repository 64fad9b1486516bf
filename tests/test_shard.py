"""shardc.shard: placements, uneven and empty shards, meta-device init, and clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import shardc
from shardc.models.llama import LlamaConfig, Transformer


def _placements(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    full = nn.Linear(5, 3)  # dim 0 = 3 rows: world 4 leaves rank 3 empty
    reference = {n: p.detach().clone() for n, p in full.named_parameters()}
    shardc.shard(full)
    out = {}
    for name, p in full.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
        assert p.shape == reference[name].shape, name
        assert torch.equal(p.full_tensor(), reference[name]), name
        out[name] = tuple(p.to_local().shape)
    # Outside a forward, attribute reads return the sharded parameter itself.
    assert full.weight is full._parameters["weight"]
    return out


def test_uneven_and_empty_shards():
    shapes = run_ranks(_placements, 4)
    assert [s["weight"] for s in shapes] == [(1, 5), (1, 5), (1, 5), (0, 5)]
    assert [s["bias"] for s in shapes] == [(1,), (1,), (1,), (0,)]


def _meta_init(rank: int, world: int) -> dict:
    cfg = LlamaConfig(vocab_size=37, dim=24, n_layers=1, n_heads=4, ffn_dim=45, max_seq_len=16)
    with torch.device("meta"):
        model = Transformer(cfg)
    shardc.shard(model)
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    assert all(p.to_local().device.type == "cpu" for p in model.parameters())
    # User init after sharding runs on the shards (attribute reads outside forward).
    torch.manual_seed(0)
    model.init_weights(buffer_device="cpu")
    norms = model.norm.weight.full_tensor()
    std = model.layers[0].attention.wq.weight.full_tensor().std().item()
    logits = model(torch.randint(0, 37, (2, 5)))
    return {"local_numel": local_numel, "total": cfg.num_params(), "norm_ones": bool(
        torch.all(norms == 1)), "std": std, "finite": bool(torch.isfinite(logits).all())}


def test_meta_device_materializes_shard_by_shard():
    results = run_ranks(_meta_init, 3)
    total = results[0]["total"]
    assert sum(r["local_numel"] for r in results) == total
    assert all(r["local_numel"] < total for r in results), "no rank holds the full model"
    for r in results:
        assert r["norm_ones"] and r["finite"]
        assert 0.015 < r["std"] < 0.025


def _errors(rank: int, world: int) -> list[str]:
    messages = []

    def expect(exc_type, fn):
        with pytest.raises(exc_type) as info:
            fn()
        messages.append(str(info.value))

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    shardc.shard(model)
    expect(ValueError, lambda: shardc.shard(model))
    expect(ValueError, lambda: shardc.shard(model[0]))
    mesh_2d = init_device_mesh("cpu", (1, 1))
    expect(ValueError, lambda: shardc.shard(nn.Linear(2, 2), mesh_2d))  # unnamed dims
    meta_mesh = DeviceMesh.from_group(dist.group.WORLD, "meta")
    expect(ValueError, lambda: shardc.shard(nn.Linear(2, 2), meta_mesh))
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    expect(ValueError, lambda: shardc.shard(mixed))

    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.temperature = nn.Parameter(torch.tensor(1.0))

    expect(NotImplementedError, lambda: shardc.shard(Scalar()))

    class Quantized(torch.Tensor):
        """Stands for a TE Float8Tensor: a parameter with FSDP2's all-gather hooks."""

        def fsdp_pre_all_gather(self, *args, **kwargs):
            raise AssertionError("shardc must not call it")

    layer = nn.Linear(2, 4)
    layer.weight = nn.Parameter(torch.Tensor._make_subclass(Quantized, torch.zeros(4, 2)))
    expect(NotImplementedError, lambda: shardc.shard(layer))
    return messages


def test_bad_input_errors_name_the_problem():
    messages = run_ranks(_errors, 1)[0]
    twice, child, two_d, device, mixed, scalar, quantized = messages
    assert "already sharded" in twice and "the module" in twice
    assert "already sharded" in child
    assert "2-D mesh" in two_d and "mesh_dim_names" in two_d
    assert "'weight'" in device and "meta" in device and "cpu" in device
    assert "different devices" in mixed and "'1.weight'" in mixed
    assert "'temperature'" in scalar and "scalar" in scalar
    assert "'weight'" in quantized and "Quantized" in quantized
    # Only TransformerEngine's Float8Tensor parameters are sharded as FP8 (tests/gpu).
    assert "Float8Tensor" in quantized and "Float8Policy" in quantized


def test_shard_without_process_group_says_what_to_do():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        shardc.shard(nn.Linear(2, 2))


# --- Issue 16: aliased parameters, optimizers holding replaced parameters (no processes) ------


class _Aliased(nn.Module):
    def __init__(self, tie: bool, view: bool, disjoint: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(4, 2)
        if tie:
            self.b.weight = self.a.weight  # one parameter in two modules: fine
        elif view:
            self.b.weight = nn.Parameter(self.a.weight.detach()[1:3])
        elif disjoint:  # two parameters viewing disjoint rows of one buffer (cuDNN's RNNs)
            flat = torch.zeros(8, 4)
            self.a.weight = nn.Parameter(flat[:6])
            self.b.weight = nn.Parameter(flat[6:])


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_aliased_parameters_are_found_tied_ones_are_not(device):
    """Distinct parameters whose memory overlaps are refused, naming both; tied parameters (one
    object), independent ones and disjoint views of one buffer are not, on real and on meta
    tensors (whose storages have no data pointer to compare)."""
    from shardc.sharding.shard import _check_aliases

    with torch.device(device):
        tied, plain, view, disjoint = (_Aliased(tie=t, view=v, disjoint=d) for t, v, d in
                                       ((True, False, False), (False, False, False),
                                        (False, True, False), (False, False, True)))
    _check_aliases(tied)
    _check_aliases(plain)
    _check_aliases(disjoint)
    with pytest.raises(ValueError, match=r"'a.weight' and 'b.weight' share storage") as err:
        _check_aliases(view)
    assert "same nn.Parameter object" in str(err.value) and ".clone()" in str(err.value)


def test_optimizer_holding_replaced_parameters_raises_at_step():
    """An optimizer holding parameters recorded as replaced raises at step() naming them; the
    record holds them weakly (gone with the last reference), and other optimizers step."""
    import gc

    from shardc.runtime import replaced_params

    old = nn.Parameter(torch.ones(3))
    replaced_params.remember(old, "layer.weight")
    stale = torch.optim.SGD([old], lr=0.1)
    old.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"holds 1 parameter\(s\) that shardc.shard replaced "
                                           r"\('layer.weight'\)"):
        stale.step()
    assert torch.equal(old.detach(), torch.ones(3)), "the stale optimizer changed nothing"
    fresh = nn.Parameter(torch.ones(3))
    fresh.grad = torch.ones(3)
    torch.optim.SGD([fresh], lr=0.1).step()
    assert torch.allclose(fresh.detach(), torch.full((3,), 0.9))
    key = id(old)
    del stale, old
    gc.collect()
    assert key not in replaced_params._REPLACED
