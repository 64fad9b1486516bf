"""Partial optimizer offload at run time (issue 22's last lever): one optimizer parameter group
mixing parameters that step on the host (``shardc.runtime.offload_optimizer.adopt``, the peak
budget's choice) with parameters that step where they are.

World 1 on the CPU, in this process (a one-rank gloo group over a ``HashStore``, destroyed after
each test): the host-stepped parameters go through the host masters and the device-stepped ones
do not, so the step must be bitwise the plain one, and the optimizer's ``state_dict()`` must show
the same keys, shapes and values. (A real second device is covered by the GPU tests; on the CPU
every tensor is on one device, which is what makes the bitwise comparison exact.)
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import one_rank_mesh
from torch.distributed.tensor import DTensor

import shardc
from shardc.models.llama import LlamaConfig, Transformer, llama_loss
from shardc.runtime import offload_optimizer

CFG = LlamaConfig(vocab_size=37, dim=24, n_layers=2, n_heads=4, ffn_dim=45, max_seq_len=16)


def _sharded(mesh) -> torch.nn.Module:
    torch.manual_seed(0)
    return shardc.shard(Transformer(CFG), mesh)


def _train(model, opt, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        toks = torch.randint(0, CFG.vocab_size, (2, 8), generator=gen)
        llama_loss(model(toks), toks).backward()
        opt.step()
        opt.zero_grad()


def _host_subset(model) -> list[tuple[str, torch.Tensor]]:
    """Every other parameter of the model: a strict subset, from several layers."""
    return list(model.named_parameters())[::2]


def _values(sd: dict) -> dict:
    """An optimizer state dict's state as plain tensors (local shards at world 1)."""
    out = {}
    for key, state in sd["state"].items():
        for name, value in state.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            out[(key, name)] = local.detach().clone() if isinstance(local, torch.Tensor) \
                else local
    return out


@pytest.mark.parametrize("kind", ["default", "foreach", "fused"])
def test_a_group_mixing_host_and_device_parameters_steps_like_the_plain_one(kind):
    """AdamW over one group, half of its parameters stepped on the host: after 3 steps the
    parameters and every state value are bitwise those of the plain step, the state is keyed
    by the parameters (host local tensors only for the host-stepped ones), state_dict() shows
    the same keys, shapes and values, and loading it back changes nothing."""
    flags = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[kind]
    with one_rank_mesh() as mesh:
        plain = _sharded(mesh)
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, **flags)
        _train(plain, plain_opt)

        mixed = _sharded(mesh)
        hosted = _host_subset(mixed)
        assert offload_optimizer.adopt(hosted, pin=False) == len(hosted)
        mixed_opt = torch.optim.AdamW(mixed.parameters(), lr=1e-2, **flags)
        assert len(mixed_opt.param_groups) == 1
        _train(mixed, mixed_opt)

        host_ids = {id(p) for _, p in hosted}
        masters = [offload_optimizer.host_master(p) for p in mixed.parameters()]
        assert [m is not None for m in masters] == [id(p) in host_ids
                                                    for p in mixed.parameters()]
        for a, b in zip(plain.parameters(), mixed.parameters(), strict=True):
            assert torch.equal(a.to_local(), b.to_local())
        assert {id(p) for p in mixed_opt.state} == {id(p) for p in mixed.parameters()}
        assert [id(p) for p in mixed_opt.param_groups[0]["params"]] == \
            [id(p) for p in mixed.parameters()]
        plain_sd, mixed_sd = plain_opt.state_dict(), mixed_opt.state_dict()
        assert plain_sd["param_groups"] == mixed_sd["param_groups"]
        want, got = _values(plain_sd), _values(mixed_sd)
        assert want.keys() == got.keys()
        for key, value in want.items():
            assert torch.equal(value, got[key]) if isinstance(value, torch.Tensor) \
                else value == got[key], key
        mixed_opt.load_state_dict(mixed_sd)
        _train(plain, plain_opt, steps=1)
        _train(mixed, mixed_opt, steps=1)
        for a, b in zip(plain.parameters(), mixed.parameters(), strict=True):
            assert torch.equal(a.to_local(), b.to_local())


def test_a_tensor_lr_on_another_device_is_refused_naming_the_parameter():
    """A host-stepped parameter's group whose lr is a tensor off the host: refused at the
    step, naming the parameter and what to pass instead (the meta device stands in for a GPU);
    capturable=True stays refused as before."""
    with one_rank_mesh() as mesh:
        model = _sharded(mesh)
        name, first = next(iter(model.named_parameters()))
        offload_optimizer.adopt([(name, first)], pin=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt.param_groups[0]["lr"] = torch.tensor(1e-2, device="meta")  # as a scheduler may
        toks = torch.randint(0, CFG.vocab_size, (2, 8))
        llama_loss(model(toks), toks).backward()
        with pytest.raises(RuntimeError, match="lr as a tensor on meta") as refused:
            opt.step()
        assert name in str(refused.value) and "float or a CPU tensor" in str(refused.value)
        capturable = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)
        with pytest.raises(RuntimeError, match="capturable=True"):
            capturable.step()
