"""``shardc.optim.local_shard_step`` on CPU-offloaded parameters (world 1, eager, in this
process: a one-rank gloo group over a ``HashStore``).

The optimizer steps the host shards themselves; the state it creates on the first step must stay
where the step made it, wrapped as DTensors laid out like the parameter (``DTensor.from_local``
would move a host shard's new state to the mesh's device: on a CUDA mesh, the GPU). On the CPU
the mesh's device is the host too, so what is checked here is that the combination trains
bitwise like the plain offloaded step, that the new state wraps the very tensors the step
created (no copy, no view), and that they stay in place over later steps; the GPU test
``tests/gpu/test_offload_gpu.py::test_local_shard_step_keeps_offloaded_state_on_the_host`` checks
the host placement on a CUDA mesh.
"""

from __future__ import annotations

import torch
from dist_utils import one_rank_mesh
from torch.distributed.tensor import DTensor

import shardc
from shardc.models.llama import LlamaConfig, Transformer, llama_loss

CFG = LlamaConfig(vocab_size=37, dim=24, n_layers=1, n_heads=4, ffn_dim=45, max_seq_len=16)
OFFLOAD = shardc.OffloadPolicy(simulate_on_cpu=True)


def _run(mesh, local_step: bool, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                            list[dict]]:
    """Train ``steps`` AdamW steps (torch's default implementation) on the offloaded model; the
    ids of each parameter's state tensors' local tensors after every step."""
    torch.manual_seed(0)
    model = shardc.shard(Transformer(CFG), mesh, offload=OFFLOAD)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if local_step:
        shardc.optim.local_shard_step(opt)
    gen, ids = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        toks = torch.randint(0, CFG.vocab_size, (2, 8), generator=gen)
        llama_loss(model(toks), toks).backward()
        opt.step()
        opt.zero_grad()
        ids.append({(n, k): id(v._local_tensor) for n, p in model.named_parameters()
                    for k, v in opt.state[p].items() if isinstance(v, DTensor)})
    return model, opt, ids


def test_local_shard_step_on_offloaded_parameters_trains_like_the_dtensor_step():
    with one_rank_mesh() as mesh:
        plain, plain_opt, _ = _run(mesh, False)
        local, local_opt, ids = _run(mesh, True)
        for (name, a), b in zip(plain.named_parameters(), local.parameters(), strict=True):
            assert torch.equal(a.to_local(), b.to_local()), name
        for a, b in zip(plain.parameters(), local.parameters(), strict=True):
            sa, sb = plain_opt.state[a], local_opt.state[b]
            assert sa.keys() == sb.keys()
            for key, va in sa.items():
                vb = sb[key]
                assert type(va) is type(vb), key
                if isinstance(va, DTensor):
                    assert vb.placements == va.placements and vb.shape == va.shape, key
                    assert vb.to_local().device == va.to_local().device, key
                    assert torch.equal(va.to_local(), vb.to_local()), key
                else:
                    assert torch.equal(va, vb), key
        # The moments made by the first step are the tensors every later step updates in place.
        assert ids[0] and ids[0] == ids[1] == ids[2]
