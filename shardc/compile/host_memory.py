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
"""

from __future__ import annotations

from shardc.planning.budget import MemoryBudgetError
from shardc.planning.plan import Plan
from shardc.runtime.plan_check import agree_on_largest_each
from shardc.sharding import offload

GIB = float(1 << 30)
_UNKNOWN = 1 << 62  # a host that does not say what it has: no limit from it


def refuse_overcommit(plan: Plan, activation_bytes: int, planner_optimizer_bytes: int,
                      check: bool = True, index: int | None = None,
                      offloads: bool | None = None) -> None:
    """Raise :class:`MemoryBudgetError` if the host cannot hold ``plan.predicted.host_bytes``
    for each of the job's local ranks. Checked only where shardc's own plan puts something on
    the host (``activation_bytes``: the offloaded saved activations; ``planner_optimizer_bytes``:
    the peak budget's share of the optimizer on the host), so plans without those levers, and
    CPU offload alone (checked at ``shardc.shard``), are unchanged; ``check=False`` skips it.
    ``index``: the region's number for the plan check (None: this rank decides alone).
    ``offloads``: whether the plan's decisions put anything there (the same on every rank, so
    that every rank takes part in the exchange or none does; a rank's shards of the chosen
    parameters can be empty); default: whether the bytes are."""
    if offloads is None:
        offloads = bool(activation_bytes or planner_optimizer_bytes)
    if not check or not offloads:
        return
    per_rank = float(plan.predicted.host_bytes or activation_bytes + planner_optimizer_bytes)
    ranks = offload.local_ranks()
    available = offload.host_available_bytes()
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
