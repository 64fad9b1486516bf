"""The peak budget's last lever: the optimizer's state and step on the host.

At one rank (and wherever the parameters outweigh the activations) the step's peak is not in
the forward or the backward but around ``optimizer.step()``: parameter shards, gradients, the
optimizer's state (2 bytes per parameter byte with Adam) and its step's temporaries (1 with
torch's ``foreach`` AdamW), 20 bytes per fp32 parameter. Keeping buckets gathered, recomputing
or offloading activations cannot lower that (``shardc.memory.peak``: the "optimizer step"
column). Optimizer-only offload (``OffloadPolicy(params=False, optimizer=True)``,
``shardc.runtime.offload_optimizer``) can, and it changes no compiled graph: only the step
moves to the host, through public optimizer step hooks. So the planner can decide it at
compile time, after the other levers:

* **when**: only where no configuration of the other levers meets the budget (their feasible
  minimum is over it); the search is then made again with the state on the host (every peak
  drops by the state's bytes, the step's also by its temporaries), so the other levers spend
  the room it frees (keeping buckets gathered again) and a budget it cannot meet is refused
  naming the new minimum.
* **what**: the fewest buckets whose state must go (``shardc.compile.budget_search``'s
  ``_host_subset``): the buckets ordered by their shards' bytes, largest first, ties by index
  (:func:`units`; sizes the largest over the ranks), the first subset the shortest prefix
  whose freed bytes cover the excess over the budget (:func:`take`), each subset verified by
  the device levers' search with its state on the host and grown on a refusal, at most
  :data:`MAX_SUBSET_TRIALS`; then every parameter's. The runtime lets a parameter group mix
  host-stepped and device-stepped parameters (``shardc.runtime.offload_optimizer``), so the
  optimizer built over ``model.parameters()`` in one group steps the chosen ones on the host
  and the others where they are. A model's regions share one optimizer, so parameters one
  region puts on the host stay there for the later regions.
* **price** (:func:`price`, over the chosen parameters only), all inside ``optimizer.step()``
  (not overlapped with the backward): the copies (:func:`copy_seconds`, which the whole-step
  prediction, ``shardc.planning.step``, prices them with too) of the shards and of the
  gradients to the host and of the updated shards back, each a copy at the profile's host link
  in its direction
  (``device_to_host_bytes_per_s``, ``host_to_device_bytes_per_s``, ``host_copy_latency_s``:
  ``ClusterProfile.host_copy_seconds``), and the host step at the profile's rate for the
  implementation that runs there (``ClusterProfile.host_adamw_rate``: fused, or per tensor as
  torch's default steps a group holding host tensors; the option ``optimizer_impl``).

Full parameter offload (shards and gradients on the host too) is not decided here: a budget
below what the optimizer's offload reaches is refused, naming it; for a model sharded with
``OffloadPolicy(params="auto")`` the backend then moves the shards to the host and plans the
region again (:mod:`shardc.sharding.auto_offload`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from shardc.planning.estimate import host_optimizer_seconds
from shardc.planning.plan import OptimizerDecision, Plan
from shardc.planning.profile import ClusterProfile

MODES = ("auto", "never", "simulate")
# Subsets of the buckets verified (each by a search of the device levers) before every
# parameter's state goes to the host, whatever the model.
MAX_SUBSET_TRIALS = 3
_MiB = float(1 << 20)


@dataclass(frozen=True)
class HostUnit:
    """A bucket whose parameters' optimizer state and step may go to the host together:
    ``nbytes`` the largest rank's bytes of their shards (the state is ``optimizer_state_factor``
    times that), ``numel`` their elements per rank (padding included)."""

    bucket: int
    name: str
    params: tuple[str, ...]
    nbytes: int
    numel: int


def units(plan: Plan, bytes_of: Callable[[int, tuple[str, ...]], int],
          already: Collection[str] = ()) -> list[HostUnit]:
    """The buckets of ``plan`` whose state may move, largest first, ties by bucket index: the
    same order on every rank, since ``bytes_of(bucket index, its parameters)`` is to return the
    largest rank's bytes of those parameters' shards. A parameter in two buckets counts in the
    first; parameters in ``already`` (on the host from an earlier region), and buckets left with
    nothing, are left out."""
    seen, out = set(already), []
    for b in plan.buckets:
        params, numel = [], 0
        for fqn, rows, row_numel in zip(b.params, b.padded_rows, b.row_numel):
            if fqn not in seen:
                seen.add(fqn)
                params.append(fqn)
                numel += rows * row_numel
        nbytes = bytes_of(b.index, tuple(params)) if params else 0
        if nbytes > 0:
            out.append(HostUnit(b.index, b.name, tuple(params), nbytes, numel))
    return sorted(out, key=lambda u: (-u.nbytes, u.bucket))


def take(order: list[HostUnit], have: int, excess: int, freed_per_byte: float) -> int:
    """How many of ``order``'s first units to put on the host: the ``have`` already taken and
    then the fewest more whose shard bytes times ``freed_per_byte`` (the device bytes a shard
    byte's state frees where the peak is: the state, plus the step's temporaries in the
    optimizer step's column) cover ``excess`` (at least one more)."""
    count, freed = have, 0.0
    while count < len(order) and (count == have or freed < excess):
        freed += order[count].nbytes * freed_per_byte
        count += 1
    return count


class StepOverBudget(Exception):
    """The optimizer step's peak (shards, gradients, state, temporaries: the same in every
    configuration of the device levers) is over the budget, so no configuration of theirs can
    meet it: the planner skips their search and puts the state on the host. ``floor_bytes``:
    that peak (a lower bound of their feasible minimum), ``plan``: the plan it is from."""

    def __init__(self, floor_bytes: int, plan) -> None:
        super().__init__(f"the optimizer step's peak {floor_bytes} B is over the budget")
        self.floor_bytes, self.plan = floor_bytes, plan


def copy_seconds(param_bytes: float, grad_bytes: float, profile: ClusterProfile
                 ) -> tuple[float, float]:
    """Seconds of optimizer-only offload's copies inside ``optimizer.step()``: (to the host:
    the ``param_bytes`` of shards and the ``grad_bytes`` of gradients, two copies; back to the
    device: the updated shards, one copy), each priced by ``profile.host_copy_seconds`` (its
    direction's rate plus the latency; a copy of no bytes costs nothing). The one price of
    these copies: the planner's decision (:func:`price`) and the whole-step prediction
    (``shardc.planning.step``) both read it."""
    to_host = profile.host_copy_seconds(param_bytes, to_device=False) \
        + profile.host_copy_seconds(grad_bytes, to_device=False)
    return to_host, profile.host_copy_seconds(param_bytes, to_device=True)


def price(param_bytes: int, grad_bytes: int, n_params: int, profile: ClusterProfile,
          ran: str = "fused") -> tuple[float, float, float]:
    """Seconds of the offloaded step's three phases: (shards and gradients to the host, the
    host step over ``n_params`` parameters, the updated shards back to the device); the copies
    are :func:`copy_seconds`', the host step is torch's CPU AdamW's in implementation ``ran``
    (``shardc.planning.optimizer_kind``: the option ``optimizer_impl``'s on a group holding host
    tensors, per tensor for ``"auto"``; :func:`shardc.planning.estimate.
    host_optimizer_seconds`, which the step prediction prices the host step with too)."""
    d2h, h2d = copy_seconds(param_bytes, grad_bytes, profile)
    step = host_optimizer_seconds(4.0 * n_params, profile, state_factor=2.0, temp_factor=0.0,
                                  ran=ran)
    return d2h, step, h2d


def why_not(mode: str, device_type: str, offload, fp8: bool, tp: bool) -> str:
    """Why the lever is not available to a region ("" where it is): ``mode`` the option
    ``optimizer_offload``; ``device_type`` the mesh's; ``offload`` the model's
    ``OffloadPolicy`` (None: none); ``fp8`` / ``tp``: FP8 parameters or an FSDP+TP mesh, which
    optimizer offload refuses as ``shardc.shard`` does."""
    if mode == "never":
        return "optimizer_offload='never'"
    if offload is not None:
        return "the model is already sharded with an OffloadPolicy"
    if fp8:
        return "the model has FP8 parameters, which optimizer offload does not support"
    if tp:
        return "the mesh is FSDP+TP, which optimizer offload does not support"
    if device_type == "cpu" and mode != "simulate":
        return ("the parameters are on the CPU, where the optimizer's state is already in host "
                "memory (optimizer_offload='simulate' runs it there, for tests)")
    return ""


def decision(*, freed_bytes: int, host_bytes: int, n_params: int, param_bytes: int,
             grad_bytes: int, profile: ClusterProfile, floor_bytes: int, peak_bytes: int,
             exact: bool = True, chosen: list[HostUnit] | None = None, of: int = 0,
             tried: int = 0, ran: str = "fused") -> OptimizerDecision:
    """The record of the lever chosen: ``floor_bytes`` the other levers' feasible minimum
    (over the budget; not ``exact``: the optimizer step's peak, which every configuration of
    theirs has), ``peak_bytes`` the chosen plan's predicted peak with the state on the host;
    ``chosen``: the buckets whose state is on the host, of ``of`` that could move (None: every
    parameter's, after ``tried`` subsets that did not meet the budget); the bytes and counts
    (of the parameters on the host) are the largest over the ranks; ``ran``: the host step's
    implementation (:func:`price`)."""
    d2h, step, h2d = price(param_bytes, grad_bytes, n_params, profile, ran)
    total_ms = (d2h + step + h2d) * 1e3
    floor = (f"the other levers' feasible minimum {floor_bytes / _MiB:.1f} MiB is over the "
             "budget" if exact else f"the optimizer step's peak {floor_bytes / _MiB:.1f} MiB "
             "(shards, gradients, state and temporaries, in every configuration of the other "
             "levers) is over the budget")
    if chosen is None:
        what = "every parameter's state" + (
            f" (the {tried} smaller set(s) of buckets tried, largest state first, did not meet "
            "the budget)" if tried else " (the excess over the budget needs every bucket's)")
    else:
        what = (f"the state of {len(chosen)} of {of} bucket(s), largest first "
                f"({', '.join(u.name or str(u.bucket) for u in chosen)}: the fewest whose state "
                "on the host brings the predicted peak within the budget)")
    ran_words = "fused CPU AdamW" if ran == "fused" else "CPU AdamW per tensor"
    reason = (f"on the host: {floor}; {what} on the host frees {freed_bytes / _MiB:.1f} MiB "
              f"of device memory for ~{total_ms:.1f} ms per step ({d2h * 1e3:.1f} ms shards "
              f"and gradients to the host, {step * 1e3:.1f} ms host step ({ran_words}) over "
              f"{n_params} parameters, {h2d * 1e3:.1f} ms shards back); predicted peak "
              f"{peak_bytes / _MiB:.1f} MiB")
    host_params = None if chosen is None else [p for u in chosen for p in u.params]
    buckets = [] if chosen is None else sorted(u.bucket for u in chosen)
    return OptimizerDecision(True, int(freed_bytes), int(host_bytes), int(n_params),
                             d2h * 1e3, step * 1e3, h2d * 1e3, reason, host_params, buckets)


def refusal_hint(offloaded: bool, unavailable: str, device_floor: int | None = None,
                 exact: bool = True) -> str:
    """The sentence a refusal ends with about the optimizer's state: ``offloaded``: the
    minimum already has it on the host (what is left is shards, gradients and activations;
    ``device_floor``: the minimum with it on the device, where the planner tried that first);
    otherwise ``unavailable`` says why the lever was not tried ("" where not applicable)."""
    if offloaded:
        at_least = "" if exact else "at least "
        before = (f" (with it on the device the minimum is {at_least}{device_floor} B, "
                  f"{device_floor / _MiB:.1f} MiB)" if device_floor is not None else "")
        return (" The minimum has the optimizer's state and step on the host "
                f"(optimizer_offload){before}: to go lower, keep the parameter shards and "
                "gradients on the host too: shardc.shard(model, mesh, "
                "offload=shardc.OffloadPolicy(params='auto')) lets the peak budget move them "
                "there where nothing else meets it, OffloadPolicy() places them there from the "
                "start.")
    if unavailable.startswith("optimizer_offload='never'"):
        return (" optimizer_offload='never': with 'auto' the planner may put the optimizer's "
                "state on the host to go lower.")
    return ""
