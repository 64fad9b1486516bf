"""Parameter offload as the peak budget's last lever: ``OffloadPolicy(params="auto")``.

``shardc.shard(model, mesh, offload=shardc.OffloadPolicy(params="auto"))`` shards as without
offload: the shards, their gradients and the optimizer's state live on the device. What
differs is the compiled read of each parameter: it always goes through
``shardc::offload_to_device`` (:mod:`shardc.ops.offload_copy`), so the graph Dynamo traces is
the same wherever the shards live. While they are on the device, the backend drops those
copies from the joint graph before anything is planned
(:func:`shardc.passes.offload_unplaced.drop_offload_copies`): the plan and the compiled code are
those of the model sharded without offload.

When a region's peak budget is refused by every other lever (the levers on the device, then the
optimizer's state on the host, ``shardc.compile.budget_search``), the backend moves every
parameter's shard to the host (:func:`move_to_host`: pinned on CUDA, the parameter objects
kept, so the user's optimizer, ``state_dict()`` and DCP see the same parameters) and compiles the
region again: planned now as a model sharded with ``OffloadPolicy()``, its shards copied to the
device before their gathers and its gradients back, the optimizer stepping on the host. That
plan meets the budget or is refused naming its own minimum, with everything on the host.

Why every parameter, and why once: where a shard lives decides where ``torch.optim`` keeps its
state and steps, for the whole model; parameters of one optimizer group on two devices are
refused by the offload check. The decision follows from a refusal that every rank computes
from the same numbers (the largest over the ranks), so every rank moves its shards, and it is
made at most once per model: the later regions (an eval forward, a new shape) are planned with
the shards on the host, as for ``OffloadPolicy()``.

Not available (the refusal stands, naming the reason in the log): after an earlier region of
the model put part of the optimizer's state on the host (optimizer-only offload holds host
copies of those parameters). FP8 parameters and FSDP+TP meshes are refused at
``shardc.shard`` as for any offload.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch.distributed.tensor import DTensor

from shardc import _torch
from shardc.runtime import offload_check
from shardc.sharding.offload import OffloadPolicy, check_host_memory, to_host

log = logging.getLogger("shardc")


@dataclasses.dataclass
class AutoOffload:
    """A model sharded with ``OffloadPolicy(params="auto")`` (on its ``ShardState``)."""

    policy: OffloadPolicy  # params=True: what is applied when the planner chooses it
    device: str  # where the compiled reads copy a host shard to (the mesh's device)
    pin: bool  # host shards and gradients pinned (CUDA meshes)
    placed: bool = False  # the planner moved the shards to the host
    reason: str = ""  # why (the refusal without it), once placed
    device_minimum_bytes: int = 0  # the refused feasible minimum with the shards on the device

    def reads_copy(self) -> bool:
        """Whether a parameter read copies the shard: always when compiled (the graph is the
        same wherever the shards live), and eagerly once the shards are on the host."""
        return torch.compiler.is_compiling() or self.placed


def note(auto: AutoOffload, shard_params: int) -> str:
    """The plan's note for a region planned after the planner moved the shards."""
    return (f"parameter shards, gradients and optimizer state on the host "
            f"(OffloadPolicy(params='auto'), {shard_params} parameters): chosen by the peak "
            f"budget as the last lever, because with them on the device the feasible minimum "
            f"was {auto.device_minimum_bytes} B ({auto.device_minimum_bytes / 2 ** 20:.1f} MiB), "
            "above the budget; the copies to and from the host are in this plan's copies")


class ParamOffloadChosen(Exception):  # noqa: N818 - a decision, not an error
    """The peak budget needs the parameter shards on the host (raised by the partitioner,
    handled by the backend, which moves them and compiles the region again). ``refusal``: the
    budget's refusal with the shards on the device."""

    def __init__(self, refusal: Exception) -> None:
        super().__init__(str(refusal))
        self.refusal = refusal


def unplaced(state) -> bool:
    """Whether ``state``'s model lets the planner offload its shards and they are still on
    the device (its compiled graphs' offload copies are then dropped)."""
    auto = getattr(state, "auto_offload", None)
    return auto is not None and not auto.placed


def why_not(state) -> str:
    """Why the shards of ``state``'s model cannot be moved to the host now ("" where they can)."""
    auto = getattr(state, "auto_offload", None)
    if auto is None:
        return "the model was not sharded with OffloadPolicy(params='auto')"
    if auto.placed:
        return "the parameter shards are on the host already"
    if state.optimizer_planned_on_host or state.optimizer_planned_host_params:
        return ("an earlier region put the optimizer's state on the host with the shards on "
                "the device")
    if state.root is None or state.root() is None:
        return "the sharded model is gone"
    return ""


def choose(state, refusal: Exception) -> None:
    """Raise :class:`ParamOffloadChosen` for ``refusal`` (a peak budget below the minimum with
    the shards on the device) where the shards of ``state``'s model may go to the host; return
    (the caller raises the refusal) where they may not."""
    if getattr(refusal, "minimum_bytes", None) is None:
        return  # not a budget below the minimum
    why = why_not(state)
    if why:
        if getattr(state, "auto_offload", None) is not None:
            log.info("shardc: parameter offload not chosen: %s", why)
        return
    raise ParamOffloadChosen(refusal)


def sharded_param(root: torch.nn.Module, fqn: str) -> torch.Tensor:
    """The DTensor parameter ``fqn`` of ``root`` (read from ``_parameters``: attribute reads of
    a sharded module's parameters gather them inside a forward)."""
    owner, _, name = fqn.rpartition(".")
    return root.get_submodule(owner)._parameters[name]


def move_to_host(state, chosen: ParamOffloadChosen) -> int:
    """Move every parameter shard of ``state``'s model (and any gradient it holds) to the host,
    pinned on CUDA, keeping the parameter objects; record the model as offloaded
    (``state.offload``, the parameters' infos). Returns the number of parameters moved."""
    auto = state.auto_offload
    root = state.root()
    params = {fqn: sharded_param(root, fqn) for fqn in state.params}
    shard_bytes = sum(p.to_local().numel() * p.to_local().element_size()
                      for p in params.values())
    check_host_memory(shard_bytes, auto.policy)
    mesh_type = state.mesh.device_type
    for fqn, param in params.items():
        _torch.move_dtensor_local(param, to_host(param.to_local(), auto.policy, mesh_type))
        grad = param.grad
        if isinstance(grad, DTensor):
            _torch.move_dtensor_local(grad, to_host(grad.to_local(), auto.policy, mesh_type))
        offload_check.remember(param, fqn)
        state.params[fqn] = dataclasses.replace(state.params[fqn], offload_device=auto.device,
                                                offload_pin=auto.pin)
    for module in root.modules():  # the classes shardc made record the infos too
        infos = type(module).__dict__.get("_shardc_infos")
        for name, info in (infos or {}).items():
            infos[name] = state.params.get(info.fqn, info)
    state.offload = auto.policy
    auto.placed = True
    auto.reason = str(chosen.refusal)
    auto.device_minimum_bytes = int(chosen.refusal.minimum_bytes)
    log.warning("shardc: the peak budget moves the parameter shards, their gradients and the "
                "optimizer's state to the host (%d parameters, %.1f MiB of shards on this "
                "rank): every other lever was refused: %s", len(params), shard_bytes / 2 ** 20,
                auto.reason)
    return len(params)
