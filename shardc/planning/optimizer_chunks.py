"""The peak budget's device lever on the optimizer step: the step in chunks.

Where the peak is the optimizer step's (parameter shards, gradients, the optimizer's state and
the step's temporaries; ``shardc.memory.peak``'s "optimizer step" column), torch's ``foreach``
Adam/AdamW holds parameter-sized temporary lists over a whole parameter group at once (1 byte
per shard byte, ``shardc.planning.optimizer_kind``). The elementwise optimizers give bitwise
the same update stepped in several calls, each over a chunk of the parameters
(``shardc.runtime.chunked_step``), and the temporaries then are the largest chunk's:

* **chunks**: the plan's buckets (:func:`chunks`: a parameter in two buckets counts in the
  first; the parameters in no bucket form one more chunk), the order ``optimizer.step()``
  steps them in;
* **when**: under a peak budget, where the optimizer step's peak is over it (the device
  levers' search exits on it, or their feasible minimum is the step's) and before the
  optimizer's state goes to the host (``shardc.planning.optimizer_offload``, the last lever:
  copies over the host link and a host step, about 10x the step on one H200 pair); the device
  levers are then chosen again with the step's temporaries the largest chunk's. Not where the
  optimizer's step runs fused or per tensor (no group-sized temporaries), nor where its state is
  on the host (offload, ``step_in_backward``) or part of it is (an earlier region's partial
  offload): :func:`why_not`;
* **price** (:func:`price`): each chunk beyond the first is one more ``optimizer.step()`` call,
  which launches one more kernel per foreach op (each op launches at least one kernel per
  call: ``kernel_gpu_s`` or ``kernel_launch_s``, the larger, as
  ``shardc.planning.estimate.optimizer_step_seconds`` prices a launch). The bytes it moves and
  the per-parameter host work are the same. The call's fixed host work
  (``ClusterProfile.optimizer_fixed_s``) is not charged again: the host does it while the
  device still runs the previous chunk's kernels. Measured on one H200 (1b config, 10 chunks,
  docs/memory_budget.md "The chunks' price measured"): 0.85 ms per step against one call, where
  the fixed work charged per call priced 10.6 ms and this prices 0.96 ms.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from shardc.planning import optimizer_kind
from shardc.planning.estimate import optimizer_kernel_ops
from shardc.planning.plan import Bucket, OptimizerChunksDecision
from shardc.planning.profile import ClusterProfile

MODES = ("auto", "never", "always")
_MiB = float(1 << 20)


def chunks(buckets: Sequence[Bucket], names: Collection[str]) -> list[tuple[str, ...]]:
    """The parameters of each chunk, in the order they are stepped: each bucket's (a parameter
    in two buckets in the first), then those of ``names`` in no bucket; empty chunks left out.
    The same on every rank (the plans' buckets are)."""
    seen: set[str] = set()
    out = []
    for b in buckets:
        params = tuple(p for p in dict.fromkeys(b.params) if p not in seen)
        seen.update(params)
        if params:
            out.append(params)
    rest = tuple(p for p in names if p not in seen)
    return out + [rest] if rest else out


def largest_chunk_bytes(parts: Sequence[tuple[str, ...]], bytes_of: Callable[[str], int]) -> int:
    """The most bytes of shards in one chunk (``bytes_of``: a parameter's shard bytes, as the
    caller counts them)."""
    return max((sum(bytes_of(p) for p in part) for part in parts), default=0)


def why_not(mode: str, impl: str, temp_factor: float, on_host: bool,
            host_params: Collection[str], n_chunks: int) -> str:
    """Why the lever is not available to a region ("" where it is): ``mode`` the option
    ``optimizer_step_chunks``; ``impl`` / ``temp_factor`` the options ``optimizer_impl`` /
    ``optimizer_temp_factor``; ``on_host``: every parameter's optimizer state is on the host
    (``OffloadPolicy``, an earlier region's choice); ``host_params``: some are (an earlier
    region's partial choice); ``n_chunks``: the chunks the plan's buckets make."""
    if mode == "never":
        return "optimizer_step_chunks='never'"
    if on_host:
        return "the optimizer's state and step are on the host"
    if host_params:
        return "part of the optimizer's state and step is on the host (an earlier region's choice)"
    ran = optimizer_kind.ran(impl, temp_factor)
    if ran != "foreach":
        return (f"the optimizer runs {optimizer_kind.describe(ran)}: its step holds no "
                "parameter group-sized temporaries")
    if n_chunks < 2:
        return "the parameters make one chunk (one bucket)"
    return ""


def price(n_chunks: int, profile: ClusterProfile, state_factor: float = 2.0,
          temp_factor: float = 1.0) -> float:
    """Seconds the step in ``n_chunks`` calls adds to one call over every parameter: per extra
    call, one more kernel per foreach op (see the module docstring: the call's fixed host work
    overlaps the previous chunk's kernels)."""
    _, ops = optimizer_kernel_ops(state_factor, max(temp_factor, 1.0))
    per_call = ops * max(profile.kernel_gpu_s, profile.kernel_launch_s)
    return max(n_chunks - 1, 0) * per_call


def decision(*, n_chunks: int, chunk_bytes: int, saved_bytes: int, seconds: float,
             peak_bytes: int, floor_bytes: int, exact: bool, mode: str = "auto"
             ) -> OptimizerChunksDecision:
    """The record of the step in chunks chosen: ``floor_bytes`` the device levers' feasible
    minimum with one call (not ``exact``: the optimizer step's peak, under every configuration
    of theirs), ``peak_bytes`` the chosen plan's predicted peak; every number the largest over
    the ranks."""
    if mode == "always":
        why = "optimizer_step_chunks='always'"
    elif exact:
        why = (f"the other levers' feasible minimum with one optimizer call "
               f"{floor_bytes / _MiB:.1f} MiB is over the budget")
    else:
        why = (f"the optimizer step's peak with one call {floor_bytes / _MiB:.1f} MiB (shards, "
               "gradients, state and foreach temporaries, in every configuration of the other "
               "levers) is over the budget")
    reason = (f"in {n_chunks} chunks (one per bucket): {why}; foreach temporaries of the "
              f"largest chunk ({chunk_bytes / _MiB:.1f} MiB of shards) instead of every shard's "
              f"free {saved_bytes / _MiB:.1f} MiB for ~{seconds * 1e3:.2f} ms per step "
              f"({n_chunks - 1} more optimizer call(s)), before any optimizer state goes to the "
              f"host; predicted peak {peak_bytes / _MiB:.1f} MiB")
    return OptimizerChunksDecision(True, int(n_chunks), int(chunk_bytes), int(saved_bytes),
                                   seconds * 1e3, reason, mode)
