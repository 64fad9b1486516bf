"""The peak budget's third lever: offload a block's saved activations to host memory instead of
recomputing them (``shardc.passes.offload_saved`` lowers it).

Freeing a block's saved activations has two prices, and the planner takes the cheaper per byte
freed (then ranks the blocks together, ``shardc.planning.recompute.rank``):

* **recompute**: its forward runs again in the backward, on the compute stream: the forward's
  predicted time (``shardc.planning.recompute.forward_seconds``). It frees the block's saved
  values less its inputs (which become saved).
* **offload**: its saved values are copied to the host in the forward and back in the backward,
  on the copy lane, one copy each way (``d2h_s``, ``h2d_s``: the cluster profile's host link,
  ``ClusterProfile.host_link``, priced by ``HostLink.copy_seconds``; 25 GB/s each way and
  10 us where the profile does not measure it). The copies overlap
  compute and the CPU never waits for them (``shardc.passes.offload_saved``): the device->host
  copy runs beside the next block's forward, at whose end the compute stream waits for it (its
  source is released there), the host->device prefetch (issued one block ahead) beside the
  backward of the block read before it, about twice a forward. Only what the copy lane cannot
  hide costs step time, and on a lane that carries every offloaded block's copies one after
  the other that excess adds up block by block, so a block's price is
  ``max(0, d2h_s - forward_s) + max(0, h2d_s - 2 * forward_s)``. It frees the block's saved
  values (all of them: its inputs are the previous block's saved values, which stay); while
  its copies run, about one block's saved values are still on the device (the verified peak
  counts them).

A block that cannot be recomputed (it draws random numbers, runs collectives or is already
checkpointed: ``shardc.passes.recompute``) can still be offloaded: the copies run nothing again.
Ties go to recompute (no host memory, no traffic on the link). Every input (bytes and forward
times) is the largest over the ranks, so the choice is the same on every rank.
``activation_offload`` (``ShardcOptions``) selects ``"auto"`` (this pricing), ``"never"``
(recompute only) or ``"prefer"`` (offload whatever can be).

**Part of a block** (per saved activation, :func:`hidden_part`): where a block's copies would not
be hidden whole, some of its saved values still can be: those whose copies fit within its
forward (device->host) and twice it (host->device), first fit by decreasing size. Offloading
that part is priced at the copies' exposed time, 0 by construction, so the planner ranks every
block's hidden part (``shardc.planning.plan.part_name``) before recomputing or offloading any
block whole; a block freed whole needs its part no longer, and parts the blocks freed whole make
needless are dropped (``shardc.compile.budget_search.without_needless_parts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardc.planning.profile import ClusterProfile, HostLink

MODES = ("auto", "never", "prefer")


def offload_seconds(copy_s: float, forward_s: float, h2d_s: float | None = None) -> float:
    """The step time a block's offload adds: its two copies' parts not hidden by compute (see
    the module docstring); ``copy_s`` the device->host copy, ``h2d_s`` the host->device one
    (default: the same)."""
    h2d_s = copy_s if h2d_s is None else h2d_s
    return max(0.0, copy_s - forward_s) + max(0.0, h2d_s - 2.0 * forward_s)


@dataclass(frozen=True)
class Lever:
    """How the planner would free one block's activations, and both prices."""

    offload: bool  # True: offload; False: recompute
    cost_s: float  # the chosen lever's predicted step time
    nbytes: int  # the bytes it frees
    recompute_s: float  # its forward's time (recomputing it), 0 if it cannot be recomputed
    offload_s: float  # what offloading it adds (exposed copy time)
    copy_s: float  # one copy's time (the slower direction's)

    @property
    def ratio(self) -> float:
        return self.cost_s / max(self.nbytes, 1)


def choose_lever(*, forward_s: float, recompute_bytes: int, offload_bytes: int,
                 can_recompute: bool, link: HostLink, mode: str = "auto") -> Lever | None:
    """The cheaper way, per byte freed, to free a block's activations (None: neither frees
    anything or is allowed). ``forward_s``: the block's forward time; ``recompute_bytes``: what
    recomputing frees (saved less inputs); ``offload_bytes``: what offloading frees (its saved
    values); ``link``: the cluster profile's host link (:func:`link_of`; the budget planner
    passes the slowest over the ranks), which prices each copy; ``mode``:
    ``activation_offload``."""
    if mode not in MODES:
        raise ValueError(f"shardc: activation_offload mode must be one of {MODES}, got {mode!r}")
    d2h_s = link.copy_seconds(offload_bytes, to_device=False)
    h2d_s = link.copy_seconds(offload_bytes, to_device=True)
    copy_s = max(d2h_s, h2d_s)
    offload_s = offload_seconds(d2h_s, forward_s, h2d_s)
    recompute_s = forward_s if can_recompute else 0.0
    recompute = Lever(False, forward_s, recompute_bytes, recompute_s, offload_s, copy_s) \
        if can_recompute and recompute_bytes > 0 else None
    offload = Lever(True, offload_s, offload_bytes, recompute_s, offload_s, copy_s) \
        if mode != "never" and offload_bytes > 0 else None
    if offload is None or recompute is None:
        return offload or recompute
    if mode == "prefer":
        return offload
    return offload if offload.ratio < recompute.ratio else recompute


def hidden_part(sizes: Sequence[int], forward_s: float, link: HostLink) -> tuple[int, ...]:
    """The indices (ascending) of a block's saved values (their bytes ``sizes``) whose copies
    its forward hides (:func:`offload_seconds` 0, the values' bytes as one copy each way, as a
    whole block is priced): first fit in decreasing size, ties by index. Empty where not even
    the smallest value fits; deterministic in its inputs (the ranks' agreed sizes and times)."""
    chosen: list[int] = []
    total = 0
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        more = total + sizes[i]
        if sizes[i] > 0 and offload_seconds(link.copy_seconds(more, to_device=False), forward_s,
                                            link.copy_seconds(more, to_device=True)) == 0.0:
            chosen.append(i)
            total = more
    return tuple(sorted(chosen))


def link_of(profile: ClusterProfile) -> HostLink:
    """:func:`choose_lever`'s host link: the cluster profile's."""
    return profile.host_link
