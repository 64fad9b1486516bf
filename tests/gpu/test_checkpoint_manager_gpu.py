"""``shardc.checkpoint.CheckpointManager`` on a CUDA mesh (``pytest -m gpu
tests/gpu/test_checkpoint_manager_gpu.py``; one GPU, NCCL).

A compiled (Inductor) sharded llama trains two AdamW steps; the manager saves step 2
synchronously and step 3 with ``async_save`` while the next step already changes the
parameters; a fresh sharded model loads each, holds the saved values bitwise (parameters and
optimizer state, on the GPU), and its next step equals the uninterrupted run's (the loss
bitwise; the updated values within 1e-5: the embedding's gradient sums with atomics). The
marker lists every file DCP wrote. On torch 2.11 ``dcp.save`` returns metadata without
``storage_data`` and every save raised before it was marked complete (fixed in the forty-seventh
session; the CPU test of that path: tests/test_checkpoint.py).
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shardc
from shardc.checkpoint import MARKER_NAME, CheckpointManager, ModelState, OptimizerState
from shardc.models.llama import LlamaConfig, Transformer, llama_loss

pytestmark = pytest.mark.gpu

CFG = LlamaConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, ffn_dim=200, max_seq_len=64)
BATCH, SEQ = 4, 32


@pytest.fixture(scope="module")
def mesh():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.cuda.set_device(0)
    init = os.path.join(tempfile.mkdtemp(), "pg")
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{init}", rank=0,
                            world_size=1)
    yield init_device_mesh("cuda", (1,))
    dist.destroy_process_group()


def _model(mesh, seed: int):
    torch.manual_seed(seed)
    model = Transformer(CFG).cuda()
    shardc.shard(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, torch.compile(model, backend=shardc.backend()), opt


def _step(forward, opt, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=gen).cuda()
    loss = llama_loss(forward(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _states(model, opt) -> dict:
    return {"model": ModelState(model), "optim": OptimizerState(model, opt)}


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {f"param.{n}": p.to_local().detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key, value in opt.state[p].items():
            if torch.is_tensor(value) and value.dim() > 0:
                out[f"state.{n}.{key}"] = value.to_local().detach().clone()
    return out


def _assert_equal(got: dict, want: dict, bitwise: bool = True) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].device.type == "cuda", key
        if bitwise:
            assert torch.equal(got[key], value), key
        else:
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_manager_saves_and_loads_on_a_cuda_mesh(mesh, tmp_path):
    model, forward, opt = _model(mesh, 0)
    for step in range(2):
        _step(forward, opt, step)
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    mgr.save(2, _states(model, opt))
    saved_2 = _snapshot(model, opt)
    _step(forward, opt, 2)
    saved_3 = _snapshot(model, opt)
    future = mgr.async_save(3, _states(model, opt))
    loss_4 = _step(forward, opt, 3)  # changes the parameters while the save may be writing
    future.result()
    after_4 = _snapshot(model, opt)
    assert mgr.steps() == [2, 3]
    step_dir = tmp_path / "ckpt" / "step_00000003"
    listed = set(json.loads((step_dir / MARKER_NAME).read_text())["files"])
    assert listed == {p.name for p in step_dir.iterdir() if p.name != MARKER_NAME}

    for step, saved in ((2, saved_2), (3, saved_3)):
        fresh, fresh_forward, fresh_opt = _model(mesh, 7)
        _step(fresh_forward, fresh_opt, 0)  # optimizer state exists, values differ
        mgr.load(_states(fresh, fresh_opt), step=step)
        _assert_equal(_snapshot(fresh, fresh_opt), saved)
        if step == 3:  # the next step after a load is the uninterrupted run's next step
            assert torch.equal(_step(fresh_forward, fresh_opt, 3), loss_4)
            # Not bitwise: the embedding's gradient sums with atomic adds on the GPU.
            _assert_equal(_snapshot(fresh, fresh_opt), after_4, bitwise=False)
