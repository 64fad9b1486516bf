"""The plan's host memory fits the host.

Activation offload (chosen by the peak budget, or forced by ``activation_offload``) keeps
saved activations in pinned host memory from the forward to the backward, and the budget's
optimizer lever keeps part of the optimizer's state and masters there: at batch 600 of the 1b
config one rank pinned about 30 GB (docs/memory_budget.md). The device budget does not bound
that. A host that cannot hold it for every rank on it would fail at an allocation in the middle
of a step (or be killed by the kernel's out-of-memory killer), so such a plan is refused when
it is made, naming what it needs, what the host has and what to change.

As ``shardc.shard``'s check of CPU offload (``shardc.sharding.offload.check_host_memory``)
does, it reads the host's available memory and the job's local ranks; ``check_host_memory=False``
skips it where the host's available memory is not what the process may use (containers that
report the machine's memory, memory that grows on demand). The ranks agree on the outcome
through the plan check's store (the most any host needs, the least any host has), so that all
of them refuse or none does: a refusal on one rank alone would leave the others waiting at
their first collective.

Under a peak budget the host is also a constraint of the search (``shardc.compile.
budget_search``): before it, the ranks agree once per region on the host memory the plan may
fill (:func:`agree_capacity`: the least, over the ranks, of the available memory divided by the
local ranks), and the search chooses the host-side levers (a block's activations or checkpoint
offloaded, the optimizer's share on the host) only while the predicted host bytes fit it,
recomputing instead where the host is full (:class:`HostCapacity` words the reason). The
refusal below is then the final safety net, against the same agreed capacity (no second
reading, so the search's choice and the check cannot disagree).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.planning.budget import MemoryBudgetError
from shardc.planning.plan import Plan
from shardc.runtime.plan_check import agree_on_largest, agree_on_largest_each
from shardc.sharding import offload

GIB = float(1 << 30)
_UNKNOWN = 1 << 62  # a host that does not say what it has: no limit from it


def size(nbytes: float) -> str:
    """``nbytes`` in GiB, or in MiB where under a tenth of one (tests' tiny hosts)."""
    return (f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= GIB / 10
            else f"{nbytes / (1 << 20):.2f} MiB")


@dataclass(frozen=True)
class HostCapacity:
    """The host memory a region's plan may fill, the same on every rank of its group
    (:func:`agree_capacity`). ``per_rank``: the bytes one rank may keep there (the least, over
    the ranks, of the host's available memory divided by its local ranks); ``available`` and
    ``ranks``: the least available memory and the most local ranks any rank reported (for
    the messages)."""

    per_rank: int
    available: int
    ranks: int

    def fits(self, per_rank_bytes: float) -> bool:
        """Whether one rank's ``per_rank_bytes`` (the largest over the ranks) fit."""
        return per_rank_bytes <= self.per_rank

    def full(self, per_rank_bytes: float) -> str:
        """Why a host lever needing ``per_rank_bytes`` per rank in all was not chosen."""
        return (f"host full: would need {size(per_rank_bytes * self.ranks)} "
                f"({self.ranks} local rank(s) x {size(per_rank_bytes)}), host has "
                f"{size(self.available)}")

    def describe(self) -> str:
        """The capacity, for the plan's notes."""
        return (f"host memory: {size(self.per_rank)} per rank for the peak budget's host "
                f"levers ({size(self.available)} available / {self.ranks} local rank(s), the "
                "least over the ranks); the blocks' reasons say which it left out")


def host_levers_possible(options) -> bool:
    """Whether a region's peak-budget search may put anything on the host (activation or
    checkpoint offload, the optimizer's share): then, and only where ``check_host_memory`` is
    on, the ranks agree on a :class:`HostCapacity` before it. Depends on the options alone, so
    every rank of the group takes part in the exchange or none does."""
    if not options.check_host_memory or not options.peak_memory_budget_bytes:
        return False
    return options.activation_offload != "never" or options.optimizer_offload != "never"


def agree_capacity(group_name: str, index: int | None) -> HostCapacity | None:
    """The :class:`HostCapacity` of region ``index`` over ``group_name``: every rank's reading
    of ``offload.host_available_bytes()`` and ``offload.local_ranks()`` exchanged in one store
    exchange (``agree_on_largest_each``, negated for the least), so every rank plans against
    the same figure. None (no limit) where no host says what it has. Call once per region,
    on every rank of the group alike."""
    ranks = offload.local_ranks()
    available = offload.host_available_bytes()
    mine = _UNKNOWN if available is None else available
    per_rank = _UNKNOWN if available is None else available // ranks
    least_per_rank, least_available, most_ranks = agree_on_largest_each(
        group_name, index, "host_capacity", [-per_rank, -mine, ranks])
    if -least_per_rank >= _UNKNOWN:
        return None
    return HostCapacity(-least_per_rank, -least_available, most_ranks)


def refuse_overcommit(plan: Plan, activation_bytes: int, planner_optimizer_bytes: int,
                      check: bool = True, index: int | None = None,
                      offloads: bool | None = None,
                      capacity: HostCapacity | None = None) -> None:
    """Raise :class:`MemoryBudgetError` if the host cannot hold ``plan.predicted.host_bytes``
    for each of the job's local ranks. Checked only where shardc's own plan puts something on
    the host (``activation_bytes``: the offloaded saved activations; ``planner_optimizer_bytes``:
    the peak budget's share of the optimizer on the host), so plans without those levers, and
    CPU offload alone (checked at ``shardc.shard``), are unchanged; ``check=False`` skips it.
    ``index``: the region's number for the plan check (None: this rank decides alone).
    ``offloads``: whether the plan's decisions put anything there (the same on every rank, so
    that every rank takes part in the exchange or none does; a rank's shards of the chosen
    parameters can be empty); default: whether the bytes are. ``capacity``: the capacity the
    ranks agreed on before the budget search (:func:`agree_capacity`): checked against it, not
    a new reading, so a plan the search made fit passes (same exchange either way)."""
    if offloads is None:
        offloads = bool(activation_bytes or planner_optimizer_bytes)
    if not check or not offloads:
        return
    per_rank = float(plan.predicted.host_bytes or activation_bytes + planner_optimizer_bytes)
    if capacity is not None:  # the search's capacity: per rank, as the search compared
        need = agree_on_largest(plan.group_name, index, "host_memory", int(per_rank))
        if capacity.fits(need):
            return
        ranks, available, need = capacity.ranks, capacity.available, need * capacity.ranks
    else:
        ranks, available = offload.local_ranks(), offload.host_available_bytes()
        need, negated = agree_on_largest_each(
            plan.group_name, index, "host_memory",
            [int(per_rank * ranks), -(_UNKNOWN if available is None else available)])
        if -negated >= _UNKNOWN or need <= -negated:
            return
        available = -negated
    parts = [f"saved activations {activation_bytes / GIB:.2f} GiB"] if activation_bytes else []
    if planner_optimizer_bytes:
        parts.append(f"optimizer masters, gradients and state {planner_optimizer_bytes / GIB:.2f}"
                     " GiB")
    rest = per_rank - activation_bytes - planner_optimizer_bytes
    if rest > 0:
        parts.append(f"CPU offload's shards, gradients and state {rest / GIB:.2f} GiB")
    raise MemoryBudgetError(
        f"shardc: the plan keeps {per_rank / GIB:.2f} GiB per rank in host memory "
        f"({', '.join(parts)}); {ranks} local rank(s) need {per_rank * ranks / GIB:.2f} GiB "
        f"(the most of any host: {need / GIB:.2f} GiB), but a host has {available / GIB:.2f} "
        "GiB available. Raise "
        "peak_memory_budget_bytes (less offload), turn the levers off "
        "(activation_offload='never', optimizer_offload='never'), run fewer ranks per host or "
        "free host memory; check_host_memory=False skips this check.")
