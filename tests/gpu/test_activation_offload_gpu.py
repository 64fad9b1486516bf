"""Activation offload on a CUDA device (``pytest -m gpu tests/gpu/test_activation_offload_gpu.py``;
one GPU): the saved activations of every block go to pinned host memory on the copy stream in
the forward and are prefetched back for the backward (``activation_offload=("*",)``), FX and
Inductor; training equals the run without offload (to 1e-5: GPU kernels are not all bitwise
reproducible) and the unsharded model on the GPU, and the forward's saved values really are
host tensors. Saved values already on the host (attention's RNG seed and offset: host scalars
outside CUDA-graph capture, though their fake values name the GPU) are left where they are,
not copied (``shardc.passes.host_resident``).
The CPU tests of the same path (the copies as separate host tensors): tests/test_parity.py,
tests/test_parity_inductor.py, tests/test_real_models.py (the planner's choice).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shardc
from shardc.models.llama import LlamaConfig, Transformer, llama_loss
from shardc.passes.host_resident import on_host
from shardc.passes.offload_saved import activation_role

pytestmark = pytest.mark.gpu

CFG = LlamaConfig(vocab_size=256, dim=128, n_layers=3, n_heads=4, ffn_dim=200, max_seq_len=64)
STEPS, BATCH, SEQ = 4, 4, 32


@pytest.fixture(scope="module")
def mesh():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.cuda.set_device(0)
    init = os.path.join(tempfile.mkdtemp(), "pg")
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1)
    yield init_device_mesh("cuda", (1,))
    dist.destroy_process_group()


def _train(model, forward) -> list[float]:
    g = torch.Generator().manual_seed(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(STEPS):
        toks = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g).cuda()
        loss = llama_loss(forward(toks[:, :-1]), toks[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _sharded(mesh, inductor: bool, **options):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = shardc.shard(Transformer(CFG).cuda(), mesh)
    compiled = torch.compile(model, backend=shardc.backend(inductor=inductor, **options))
    return model, compiled, _train(model, compiled)


@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
def test_offloaded_activations_train_like_saved_ones(mesh, inductor):
    torch.manual_seed(0)
    ref = Transformer(CFG).cuda()
    ref_losses = _train(ref, ref)
    _, _, plain = _sharded(mesh, inductor)
    model, compiled, losses = _sharded(mesh, inductor, activation_offload=("*",))
    # The copies move bits unchanged; the tolerance is for kernels that are not bitwise
    # reproducible run to run on a GPU (attention's backward) and Inductor's fusion around them.
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, plain)), (losses, plain)
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, ref_losses))
    (region,) = shardc.shard_state(model).regions
    fw = region.forward
    d2h = [n for n in fw.graph.nodes if activation_role(n) == "d2h"]
    assert len(d2h) > 0 and all(n.meta["val"].device.type == "cpu" for n in d2h)
    # Only device values are copied; those already on the host stay saved as they are, and the
    # plan's note says so.
    assert not any(on_host(n.args[0], "cuda") for n in d2h)
    saved = [a for a in fw.graph.output_node().args[0]
             if isinstance(a, torch.fx.Node) and not activation_role(a)]  # not the host copies
    plan = shardc.explain(compiled)
    if any(on_host(n, "cuda") for n in saved):
        assert any("already on the host" in note for note in plan.notes), plan.notes
    assert {c.kind for c in plan.copies if c.origin == "activation"} == {"d2h_copy", "h2d_copy"}
    assert plan.predicted.host_bytes > 0


def _device(node) -> str:
    val = node.meta.get("val")
    return val.device.type if isinstance(val, torch.Tensor) else "?"


def _on_device(node) -> bool:
    return _device(node) == "cuda"


@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
def test_the_forward_does_not_wait_for_its_copies(mesh, inductor):
    """No CPU wait: when the compiled forward returns, its device->host copies are still
    pending (their events not taken), whatever the GPU's speed; the backward's copies back take
    them (waited on the copy stream), and the step trains like the one without offload."""
    from shardc.ops import offload_copy
    from shardc.ops.offload_copy import COPY_RELEASE_OP, COPY_WAIT_OP

    model, compiled, _ = _sharded(mesh, inductor, activation_offload=("*",))
    (region,) = shardc.shard_state(model).regions
    fw_nodes = list(region.forward.graph.nodes)
    d2h = sum(activation_role(n) == "d2h" for n in fw_nodes)
    assert not any(n.target is COPY_WAIT_OP for n in fw_nodes)
    assert sum(n.target is COPY_RELEASE_OP for n in fw_nodes) == d2h > 0
    # A saved value already on the host (attention's RNG seed and offset live on the CPU
    # outside CUDA-graph capture) would be copied at once and never pending: the pass leaves
    # them out (shardc.passes.host_resident), so every copy's source is on the device.
    from_device = sum(activation_role(n) == "d2h" and _on_device(n.args[0])
                      and not on_host(n.args[0], "cuda") for n in fw_nodes)
    assert from_device == d2h
    toks = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1)).cuda()
    # Keyed by (device, data pointer): a pinned buffer of an earlier step can come back at the
    # same address, so a copy of this forward is told apart by its event, not by its key.
    before = dict(offload_copy._PENDING)
    stale_host = sum(k[0] == "cpu" for k in before)
    # Every copy recorded as pending in the forward (shardc's own module, restored below): tells
    # copies never recorded (made at once) from copies whose keys collide.
    recorded, remember = [], offload_copy._remember
    offload_copy._remember = lambda out, event: (
        recorded.append((offload_copy._key(out), tuple(out.shape), out.dtype)),
        remember(out, event))[-1]
    try:
        loss = llama_loss(compiled(toks[:, :-1]), toks[:, 1:])
    finally:
        offload_copy._remember = remember
    host = {k: e for k, e in offload_copy._PENDING.items()
            if k[0] == "cpu" and before.get(k) is not e}
    # (A copy of an empty value is made at once and is never pending: the sources say which.)
    sources = [(str(n.args[0].target), tuple(n.meta["val"].shape), _device(n.args[0]))
               for n in fw_nodes if activation_role(n) == "d2h"]
    print("d2h sources:", sources)
    print("recorded copies:", len(recorded), "distinct keys:", len({r[0] for r in recorded}),
          recorded)
    assert len(host) == from_device, (len(host), from_device, d2h, stale_host, len(recorded))
    loss.backward()
    left = [k for k, e in host.items() if offload_copy._PENDING.get(k) is e]
    assert not left, (len(left), d2h)
    torch.cuda.synchronize()
    assert torch.isfinite(loss)
