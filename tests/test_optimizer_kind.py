"""Which torch.optim implementation steps a group, and the temporaries and host time the
predictions give it (``shardc.planning.optimizer_kind``): checked against what torch's own
AdamW allocates on CPU tensors (a dispatch mode counting the live tensors the step creates)
and against torch's own choice of implementation (``_default_to_fused_or_foreach``)."""

from __future__ import annotations

import dataclasses
import functools
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardc.compile.options import ShardcOptions
from shardc.planning import optimizer_kind
from shardc.planning.estimate import host_optimizer_seconds, optimizer_step_seconds
from shardc.planning.optimizer_kind import (
    DEFAULT_PER_TENSOR_HOST_SLOWDOWN,
    per_tensor_temp_bytes,
    ran,
    step_temp_bytes,
)
from shardc.planning.profile import ClusterProfile, load_profile

SIZES = [1000, 5000, 3000, 5000, 200]  # elements of fp32 parameters, in the group's order


class LiveTensors(TorchDispatchMode):
    """The most bytes of ``device`` tensors that ops create (new storage) and the caller keeps
    alive at once: the temporaries of an optimizer step (its state exists before)."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.device, self.live, self.peak = device, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type == self.device}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != self.device or t.dim() == 0:
                continue
            if t.untyped_storage().data_ptr() in inputs:  # in place, or a view
                continue
            n = t.untyped_storage().nbytes()
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, n)
        return out

    def _free(self, n: int) -> None:
        self.live -= n


def _measured(devices=None, **kwargs) -> int:
    """Peak bytes of CPU temporaries of AdamW's second step over SIZES (``devices``: each
    parameter's device, "meta" standing in for one stepped elsewhere)."""
    devices = devices or ["cpu"] * len(SIZES)
    params = [torch.zeros(n, device=d, requires_grad=True) for n, d in zip(SIZES, devices)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-3, **kwargs)
    opt.step()  # creates the state
    with LiveTensors() as live:
        opt.step()
    assert live.live == 0
    return live.peak


def test_predicted_temporaries_are_what_torch_allocates():
    """foreach: one list as large as the stepped shards; fused: none; per tensor: a tensor's
    square root and quotient beside the previous tensor's ``denom`` (2 x 5000 + 3000 here, not
    one tensor's worth); a group whose other members step elsewhere (here on "meta", the host
    masters' stand-in) per tensor: only its own tensors' temporaries, and a neighbour stepped
    elsewhere holds none here."""
    nbytes = [4 * n for n in SIZES]
    total = sum(nbytes)
    per_tensor = per_tensor_temp_bytes(nbytes)
    assert per_tensor == 4 * (2 * 5000 + 3000)
    assert _measured(foreach=True) == step_temp_bytes("foreach", total, per_tensor) == total
    assert _measured(fused=True) == step_temp_bytes("fused", total, per_tensor) == 0
    assert _measured(foreach=False) == step_temp_bytes("per_tensor", total, per_tensor)
    # torch's default on CPU tensors (no foreach kernels there) is the per-tensor loop
    assert _measured() == per_tensor
    # the mixed group: the third parameter steps elsewhere
    where = ["cpu", "cpu", "meta", "cpu", "cpu"]
    mixed = per_tensor_temp_bytes([None if d == "meta" else b for b, d in zip(nbytes, where)])
    assert mixed == 4 * (2 * 5000 + 1000)
    assert _measured(where) == mixed
    # an optimizer with less state than Adam's: one shard
    assert per_tensor_temp_bytes(nbytes, state_factor=1.0) == 4 * 5000


def test_auto_follows_torchs_choice(monkeypatch):
    """``"auto"`` (foreach and fused unset) runs foreach only where every tensor of the group is
    on a device with foreach kernels: torch's ``_default_to_fused_or_foreach``, with the CPU
    standing in for CUDA and "meta" for the host."""
    import torch.optim.optimizer as optim_mod

    monkeypatch.setattr(optim_mod, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    device = [torch.zeros(2), torch.zeros(3)]
    mixed = device + [torch.zeros(2, device="meta")]
    for group, host in ((device, False), (mixed, True)):
        _, foreach = optim_mod._default_to_fused_or_foreach(group, False, use_fused=False)
        assert foreach == (ran("auto", host_in_group=host) == "foreach")
    assert ran("auto", host_in_group=True) == "per_tensor"
    assert ran("auto", 0.0) == "fused"  # optimizer_temp_factor=0 as it read before
    for impl in ("foreach", "fused", "per_tensor"):
        assert ran(impl, host_in_group=True) == ran(impl, host_in_group=False) == impl
    with pytest.raises(ValueError, match="optimizer_impl"):
        ShardcOptions(optimizer_impl="multi")


def test_options_of_an_optimizer():
    p = [torch.nn.Parameter(torch.zeros(2))]
    kind = optimizer_kind.from_optimizer
    assert kind(torch.optim.AdamW(p)) == {"optimizer_impl": "auto", "optimizer_state_factor": 2.0,
                                          "optimizer_temp_factor": 1.0}
    assert kind(torch.optim.AdamW(p, fused=True))["optimizer_impl"] == "fused"
    assert kind(torch.optim.AdamW(p, foreach=True))["optimizer_impl"] == "foreach"
    assert kind(torch.optim.AdamW(p, foreach=False))["optimizer_impl"] == "per_tensor"
    # Adam's L2 weight decay adds a foreach list (grads + params)
    assert kind(torch.optim.Adam(p, weight_decay=0.1))["optimizer_temp_factor"] == 2.0
    assert kind(torch.optim.SGD(p, lr=0.1, momentum=0.9))["optimizer_state_factor"] == 1.0
    ShardcOptions(**kind(torch.optim.AdamW(p, fused=True)))


@functools.cache
def _plans():
    """A tiny Llama planned at world 1 with each AdamW implementation (FX, one trace each)."""
    from shardc.tools.model_spec import parse_model
    from shardc.tools.planner import PlanSetup, plan_model

    spec = parse_model("llama-tiny", ["n_layers=1", "dim=32", "n_heads=2", "vocab_size=64"])
    return {name: plan_model(spec, 1, 1, 8, {}, setup=PlanSetup(optimizer=name))[0]
            for name in ("adamw", "adamw-fused", "adamw-per-tensor")}


def test_the_plans_step_peak_counts_the_implementations_temporaries():
    plans = _plans()
    base = plans["adamw"].predicted  # torch's default on a CUDA device: foreach
    assert base.optimizer_temp_bytes == base.param_bytes
    fused = plans["adamw-fused"].predicted
    assert fused.optimizer_temp_bytes == 0
    assert fused.optimizer_step_peak_bytes == base.optimizer_step_peak_bytes - base.param_bytes
    per = plans["adamw-per-tensor"]
    # the MLP's three weights (256 x 32 fp32, 32 KiB each) are the largest shards, stepped one
    # after another: 2 x 32 KiB + the previous one's denom, 32 KiB
    assert per.predicted.optimizer_temp_bytes == 3 * 256 * 32 * 4 < base.param_bytes
    assert any("per tensor implementation (optimizer_impl='per_tensor')" in n
               for n in per.notes), per.notes


def test_host_step_rate_follows_the_implementation(tmp_path):
    """The host step: fused at ``host_adamw_params_per_s``; per tensor (torch's default on host
    tensors; CPU foreach loops over the same kernels) at ``host_adamw_per_tensor_params_per_s``
    (profile version 7), else the fused rate over DEFAULT_PER_TENSOR_HOST_SLOWDOWN; a version-6
    profile reads without it; the device step per tensor launches a kernel per tensor."""
    # the h100 preset without the measured per-tensor host rate and device AdamW factors
    prof = dataclasses.replace(load_profile("h100"), host_adamw_per_tensor_params_per_s=0.0,
                               device_adamw_foreach_scale=0.0, device_adamw_fused_scale=0.0)
    fused = host_optimizer_seconds(4e9, prof, ran="fused")
    assert fused == pytest.approx(1e9 / prof.host_adamw_params_per_s)
    for kind in ("per_tensor", "foreach"):
        assert host_optimizer_seconds(4e9, prof, ran=kind) == pytest.approx(
            fused * DEFAULT_PER_TENSOR_HOST_SLOWDOWN)
    measured = dataclasses.replace(prof, host_adamw_per_tensor_params_per_s=1e9)
    assert host_optimizer_seconds(4e9, measured, ran="per_tensor") == pytest.approx(1.0)
    assert ClusterProfile.from_json(measured.to_json()) == measured
    old = measured.to_dict()
    old.update(version=6)
    del old["host_adamw_per_tensor_params_per_s"]
    assert ClusterProfile.from_dict(old).host_adamw_rate("per_tensor") == pytest.approx(
        prof.host_adamw_params_per_s / DEFAULT_PER_TENSOR_HOST_SLOWDOWN)
    with pytest.raises(ValueError, match="host_adamw_per_tensor_params_per_s"):
        dataclasses.replace(prof, host_adamw_per_tensor_params_per_s=-1.0)
    foreach = optimizer_step_seconds(4e6, 160, prof, ran="foreach")
    per = optimizer_step_seconds(4e6, 160, prof, ran="per_tensor")
    assert per - foreach == pytest.approx(10 * (160 - 10) * max(prof.kernel_gpu_s,
                                                                prof.kernel_launch_s))
