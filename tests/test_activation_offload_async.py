"""Activation offload without a CPU wait (issue 22): the ordering logic, on the CPU.

A CPU cannot show GPU asynchrony; what it can show is the order the graphs and the copy ops
impose: the forward has no CPU wait, each device->host copy is released (the compute stream
waits for it, its source may be reused from there) once, after the next block's matching copy
starts (or, for the last block, after the value's last forward reader), and the copy back
waits for a pending copy into its host source on the copy stream, which drops it from the
pending copies; the release leaves it pending. Parity (worlds 1-4, bitwise equal to the run
without offload): tests/test_parity.py (``offload_activations``); on a GPU:
tests/gpu/test_activation_offload_gpu.py.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from shardc.ops import offload_copy
from shardc.ops.offload_copy import COPY_RELEASE_OP, COPY_WAIT_OP
from shardc.passes.offload_saved import activation_role, offload_saved

_aten = torch.ops.aten


class _Stream:
    """Records the events a stream is told to wait for."""

    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


def test_the_copy_back_waits_for_a_pending_copy_and_the_release_keeps_it_pending():
    host, other = torch.empty(4), torch.empty(4)
    event = object()
    offload_copy._PENDING[offload_copy._key(host)] = event
    try:
        compute, copy = _Stream(), _Stream()
        # The release: the compute stream waits; the copy stays pending for the copy back.
        assert offload_copy.release_wait(compute, host) and compute.waited == [event]
        assert offload_copy._key(host) in offload_copy._PENDING
        # The copy back waits on the copy stream and takes it off the pending copies.
        assert offload_copy.await_host_copy(copy, host) and copy.waited == [event]
        assert offload_copy._key(host) not in offload_copy._PENDING
        # Nothing pending (a CPU mesh, or a copy already waited): nothing to wait for.
        assert not offload_copy.await_host_copy(copy, host) and copy.waited == [event]
        assert not offload_copy.release_wait(compute, other) and compute.waited == [event]
    finally:
        offload_copy._PENDING.pop(offload_copy._key(host), None)


def _graphs() -> tuple[fx.GraphModule, fx.GraphModule]:
    """A forward of two "blocks" (two saved values each) and its backward."""
    fw = fx.Graph()
    x = fw.placeholder("x")
    x.meta["val"] = torch.randn(3, 4)
    vals = {}
    prev = x
    for name, op in (("a0", _aten.relu.default), ("a1", _aten.sin.default),
                     ("c0", _aten.relu.default), ("c1", _aten.sin.default)):
        prev = fw.call_function(op, (prev,))
        prev.name = name
        prev.meta["val"] = torch.randn(3, 4)
        vals[name] = prev
    loss = fw.call_function(_aten.sum.default, (prev,))
    loss.meta["val"] = torch.tensor(0.0)
    fw.output((loss, *vals.values()))
    bw = fx.Graph()
    phs = {}
    for name in vals:
        phs[name] = bw.placeholder(name)
        phs[name].meta["val"] = torch.randn(3, 4)
    acc = None
    for name in ("c1", "c0", "a1", "a0"):  # the backward reads the last block first
        acc = bw.call_function(_aten.mul.Tensor, (phs[name], 2.0 if acc is None else acc))
        acc.meta["val"] = torch.randn(3, 4)
    bw.output((acc,))
    return fx.GraphModule(torch.nn.Module(), fw), fx.GraphModule(torch.nn.Module(), bw)


def test_releases_follow_the_next_blocks_copies_and_the_forward_never_waits():
    fw, bw = _graphs()
    groups = {"a0": "b0", "a1": "b0", "c0": "b1", "c1": "b1"}
    done = offload_saved(fw, bw, 1, groups, pin=False)
    assert [v.name for v in done] == ["a0", "a1", "c0", "c1"]
    nodes = list(fw.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    assert not [n for n in nodes if n.target is COPY_WAIT_OP]  # no CPU wait in the forward
    starts = {n.args[0].name: n for n in nodes if activation_role(n) == "d2h"}
    releases = {n.args[0].name: n for n in nodes if n.target is COPY_RELEASE_OP}
    assert set(releases) == set(starts) and all(r.args[2] for r in releases.values())
    # Every copy is released with a wait, so none records its source on the copy stream
    # (record=False): the allocator may reuse a freed source at once, in stream order.
    assert all(s.args[5] is False for s in starts.values())
    for name, release in releases.items():
        assert release.args[1] is starts[name] and index[release] > index[starts[name]]
    # Block b0's i-th value is released right after block b1's i-th copy starts.
    assert releases["a0"].prev is starts["c0"] and releases["a1"].prev is starts["c1"]
    # The last block's after its values' last forward readers (c0: read by c1; c1: by sum).
    readers = {n: [u for u in n.users if u.op != "output" and u.target is not COPY_RELEASE_OP]
               for n in (starts["c0"].args[0], starts["c1"].args[0])}
    for value, users in readers.items():
        assert index[releases[value.name]] > max(index[u] for u in users)
    # The backward's copies back: one per value, waited by the compute stream before the
    # first reader.
    h2d = [n for n in bw.graph.nodes if activation_role(n) == "h2d"]
    assert len(h2d) == 4
    # Same values computed (a CPU mesh: every copy is a separate tensor).
    x = torch.randn(3, 4)
    out = fw(x)
    assert torch.equal(out[1], torch.relu(x)) and out[1].device.type == "cpu"


def test_attention_rng_state_is_not_offloaded_though_its_fake_value_is_on_the_device():
    """Attention's dropout seed/offset: fake tensors put them on the GPU, the kernel returns them
    on the host (outside CUDA-graph capture), so an offload would copy host to host at once and
    never be pending (seen on an H200: 2 copies per block). They stay saved; the rest offload."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardc.passes.offload_saved import offloadable_saved

    graph = fx.Graph()
    q = graph.placeholder("q")
    attn = graph.call_function(_aten._scaled_dot_product_efficient_attention.default,
                               (q, q, q, None, True))
    outs = [graph.call_function(operator.getitem, (attn, i)) for i in range(4)]
    relu = graph.call_function(_aten.relu.default, (outs[0],))
    graph.output((relu, *outs))  # one user output, then the saved values
    with FakeTensorMode():
        q.meta["val"] = torch.empty(2, 4, 8, 16, device="cuda")
        vals = _aten._scaled_dot_product_efficient_attention.default(
            q.meta["val"], q.meta["val"], q.meta["val"], None, True)
        for node, val in zip(outs, vals):
            node.meta["val"] = val
        relu.meta["val"] = torch.relu(vals[0])
    assert all(n.meta["val"].device.type == "cuda" for n in outs)  # what the fake values say
    chosen = offloadable_saved(fx.GraphModule(torch.nn.Module(), graph), 1)
    # logsumexp offloads (the output too where its layout is contiguous); the RNG state does not
    assert outs[1] in chosen and outs[2] not in chosen and outs[3] not in chosen
