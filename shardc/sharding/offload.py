"""CPU offload: ``shardc.shard(model, mesh, offload=shardc.OffloadPolicy())``.

With offload, each parameter's local shard (the fp32 master), its gradient and therefore the
optimizer's state (``torch.optim`` creates state where its parameters are) live in host memory,
pinned when the mesh is CUDA. The user's optimizer is unchanged: it steps on the CPU, on the
DTensor parameters whose local tensors are host tensors (its ``foreach``/``fused`` CPU kernels
where torch has them). The parameters stay DTensors on the user's mesh, in global coordinates,
so ``state_dict()`` and DCP see the same keys and shapes as without offload.

Inside a forward, a parameter read copies the host shard to the device
(``shardc::offload_to_device``, :mod:`shardc.ops.offload_copy`) and all-gathers that copy; the
gradient's reduced shard goes back to the host (``shardc::offload_to_host``). Compiled, both are
graph nodes that the plan places on its ``copy`` lane (``shardc.planning.schedule``).

On a CPU mesh, "host" and "device" are the same memory and offload means nothing, so it is
refused unless ``simulate_on_cpu=True``: a testing mode in which the copies are real, separate
tensors (every host->device copy and device->host copy runs, so mistakes in the copies, their
casts or their order show up in CPU tests exactly as they would on a GPU).

Only the local shard is ever pinned or asked ``is_pinned()``: both go to the DTensor's local
tensor, never through DTensor dispatch.

``OffloadPolicy(params=False, optimizer=True)`` (optimizer only) keeps the shards and their
gradients on the device (no copy in the graphs) and steps the optimizer on host copies of them,
with host state (:mod:`shardc.runtime.offload_optimizer`). ``params=True, optimizer=False``
is refused with the reason (:func:`check_policy`; docs/offload.md).

``OffloadPolicy(params="auto")`` leaves the choice to the peak memory budget: the shards start
on the device, and the planner moves them (with their gradients and the optimizer's state) to
the host, as ``OffloadPolicy()`` would have placed them, only where nothing else meets the
budget (:mod:`shardc.sharding.auto_offload`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# Host bytes per byte of fp32 master, by what is offloaded: the master itself, its gradient and
# (Adam's two moments) the optimizer state. The check is a floor: an optimizer that keeps more
# state per parameter needs more.
_GRAD_COPIES = 1
_ADAM_STATE_COPIES = 2


@dataclass(frozen=True)
class OffloadPolicy:
    """What lives in host memory (see :mod:`shardc.sharding.offload`).

    ``params`` and ``optimizer``: the parameter shards (fp32 masters) with their gradients, and
    the optimizer's state and step. ``OffloadPolicy()`` (both): the shards, gradients and state
    live on the host and the optimizer steps there on the parameters themselves.
    ``params="auto"``: the shards start on the device; a peak memory budget
    (``peak_memory_budget_bytes``) that no other lever meets moves them to the host at compile
    time, as the last resort (:mod:`shardc.sharding.auto_offload`); without a budget, or where
    one is met otherwise, they stay on the device and nothing is offloaded.
    ``OffloadPolicy(params=False, optimizer=True)`` (optimizer only): the shards and gradients
    stay on the device; the optimizer steps on host copies of them, with host state
    (:mod:`shardc.runtime.offload_optimizer`). ``params=True, optimizer=False`` is refused with
    the reason (``check_policy``).
    ``pin_memory``: pin the host shards and gradients (CUDA meshes only; pinned memory is what
    makes the copies asynchronous).
    ``simulate_on_cpu``: allow a CPU mesh (testing: the copies are real separate tensors).
    ``optimizer_state_factor``: bytes of optimizer state per byte of parameter shard, for the
    host-memory check and the plan's host prediction (2: Adam/AdamW).
    ``check_host_memory``: refuse a host whose available memory cannot hold the offloaded state
    (see ``check_host_memory``); ``False`` for hosts whose available memory grows on demand
    (some virtual machines report a small ``MemAvailable`` that grows as memory is touched).
    """

    params: bool | str = True  # True, False or "auto"
    optimizer: bool = True
    pin_memory: bool = True
    simulate_on_cpu: bool = False
    optimizer_state_factor: float = _ADAM_STATE_COPIES
    check_host_memory: bool = True

    def enabled(self) -> bool:
        return bool(self.params or self.optimizer)

    @property
    def planner_decides(self) -> bool:
        """``params="auto"``: whether the shards go to the host is the peak budget's choice."""
        return self.params == "auto"


def check_policy(policy: OffloadPolicy, mesh_device_type: str) -> None:
    """Refuse a policy that cannot work here, before anything is allocated."""
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"shardc.shard: offload must be a shardc.OffloadPolicy, got {policy!r}")
    if policy.params not in (True, False, "auto"):
        raise ValueError(f"shardc.shard: OffloadPolicy(params={policy.params!r}): use True, "
                         "False or \"auto\" (the peak memory budget decides)")
    if policy.params and not policy.optimizer:
        raise NotImplementedError(
            f"shardc.shard: OffloadPolicy(params={policy.params!r}, optimizer=False) "
            "(parameters only) is not "
            "supported. torch.optim keeps its state and steps where its parameters are, and "
            "autograd puts a parameter's .grad where the parameter is: with the parameter "
            "shards on the host, the gradients and the optimizer state would be on the host "
            "too (that is OffloadPolicy()). Keeping gradients and state on the device while "
            "the shards live on the host would save only the 4 bytes per parameter of the "
            "shard itself, out of the 16 of shard, gradient and Adam state, and copy every "
            "shard to the device and back at every step. Use OffloadPolicy() (everything on "
            "the host) or OffloadPolicy(params=False, optimizer=True) (optimizer state and "
            "step on the host, shards and gradients on the device)."
        )
    if mesh_device_type == "cpu" and not policy.simulate_on_cpu:
        raise ValueError(
            "shardc.shard: offload=OffloadPolicy(...) on a CPU mesh means nothing: the "
            "parameters, gradients and optimizer state are already in host memory. Drop "
            "offload=..., or, to exercise the offload code path in CPU tests, pass "
            "OffloadPolicy(simulate_on_cpu=True) (the copies then run as separate host tensors)."
        )


def host_available_bytes() -> int | None:
    """Host memory available to new allocations (psutil if installed, else /proc/meminfo's
    MemAvailable); None where neither says. Tests replace this function, not torch's."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def local_ranks() -> int:
    """Processes of this job sharing this host (torchrun's LOCAL_WORLD_SIZE; 1 if unset)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def host_bytes_needed(shard_bytes: int, policy: OffloadPolicy) -> int:
    """Host bytes one rank keeps: its master shards, their gradients and optimizer state."""
    return int(shard_bytes * (1 + _GRAD_COPIES + policy.optimizer_state_factor))


def check_host_memory(shard_bytes: int, policy: OffloadPolicy) -> None:
    """Refuse, with the numbers, a host that cannot hold the offloaded state of every local
    rank. ``shard_bytes``: this rank's parameter shard bytes (the masters' dtype)."""
    available = host_available_bytes() if policy.check_host_memory else None
    if available is None:
        return
    per_rank = host_bytes_needed(shard_bytes, policy)
    ranks = local_ranks()
    needed = per_rank * ranks
    if needed > available:
        gib = 2.0 ** 30
        raise MemoryError(
            f"shardc.shard: offload needs {needed / gib:.2f} GiB of host memory "
            f"({ranks} local rank(s) x {per_rank / gib:.2f} GiB: parameter shards "
            f"{shard_bytes / gib:.2f} GiB, as much again for their gradients and "
            f"{policy.optimizer_state_factor:g}x for optimizer state), but the host has "
            f"{available / gib:.2f} GiB available. Shard over more hosts, offload less "
            "(no offload) or free host memory (OffloadPolicy(check_host_memory=False) skips "
            "this check where available memory grows on demand)."
        )


def to_host(local: torch.Tensor, policy: OffloadPolicy, mesh_device_type: str) -> torch.Tensor:
    """The host copy of a local shard, pinned when the mesh is CUDA and the policy asks (a
    plain tensor: pinning never goes through DTensor)."""
    # ``local`` is a fresh tensor of this rank's rows (never the user's): no copy if on the host.
    host = local.detach() if local.device.type == "cpu" else local.detach().to("cpu")
    if wants_pinned(policy, mesh_device_type) and not host.is_pinned():
        host = host.pin_memory()
    return host


def wants_pinned(policy: OffloadPolicy, mesh_device_type: str) -> bool:
    return policy.pin_memory and mesh_device_type == "cuda" and torch.cuda.is_available()


def copy_target(mesh_device_type: str) -> str:
    """The device string the forward copies shards to (the current CUDA device on CUDA)."""
    if mesh_device_type == "cuda":
        return f"cuda:{torch.cuda.current_device()}"
    return mesh_device_type
