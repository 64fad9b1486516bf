"""Name the planned collective when one fails at run time (a timeout: a rank skipped a step).

A collective that never completes surfaces as the process group's own error (gloo: ``Timed out
waiting 3000ms for send operation to complete``) raised by ``wait_tensor``, which says nothing about
which of the plan's collectives it was. The lowering tags every collective's issue and wait node
with the collective's id (:data:`COLLECTIVE_META`); :func:`boxed_with_collective_errors` runs a
planned FX graph like ``make_boxed_func`` does and, only when a call raises, maps the failing line
of the graph's generated code back to its node and re-raises :class:`CollectiveError` naming the
collective, its bucket and its position in the plan, or :class:`PlanMismatchError` when another
rank compiled a region this one did not (see :mod:`shardc.runtime.plan_check`). Nothing runs per
step beyond the call itself.

Inductor compiles the planned graph into its own code, where the node is no longer known, so
there the process group's error surfaces unchanged (see docs/support.md).
"""

from __future__ import annotations

import linecache
import re
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import fx

from shardc.runtime.plan_check import PlanMismatchError, recompile_message, recompiled_elsewhere

COLLECTIVE_META = "shardc_collective"  # node.meta key: the id of the planned collective
_ASSIGNED = re.compile(r"\s*(\w+)\s*=")


class CollectiveError(RuntimeError):
    """A planned collective failed on this rank (typically its process group's timeout, because
    another rank did not issue it); the message names the collective, its bucket and its position
    in the plan. The process group's own error is the ``__cause__``."""


def failed_node(exc: BaseException, gm: fx.GraphModule) -> fx.Node | None:
    """The node of ``gm`` whose line of FX's generated code raised ``exc``, if any."""
    # The generated forward, looked up now: FX may generate it lazily, at the first call.
    code = getattr(type(gm).forward, "__code__", None)
    lineno = None
    for frame, line in traceback.walk_tb(exc.__traceback__):
        if frame.f_code is code:
            lineno = line  # the innermost frame of the graph's code
    if lineno is None:
        return None
    match = _ASSIGNED.match(linecache.getline(code.co_filename, lineno))
    if match is None:
        return None
    return next((n for n in gm.graph.nodes if n.name == match.group(1)), None)


def describe(collective_id: str, plan, error: BaseException) -> str:
    """The message of :class:`CollectiveError` for the collective ``collective_id`` of ``plan``."""
    index, c = next(((i, c) for i, c in enumerate(plan.collectives) if c.id == collective_id),
                    (None, None))
    rank = dist.get_rank() if dist.is_initialized() else 0
    lines = [f"shardc: collective {collective_id} failed on rank {rank}: "
             f"{type(error).__name__}: {error}"]
    if c is not None:
        ops = plan.graphs.get(c.graph, [])

        def op(pos: int) -> str:
            name = ops[pos].name if pos < len(ops) else "the end"
            return f"{c.graph} op {pos} ({name})"

        shown = ", ".join(c.params[:4]) + (", ..." if len(c.params) > 4 else "")
        what = (f"bucket {c.bucket} {plan.buckets[c.bucket].name!r} [{shown}]" if c.bucket >= 0
                else f"the traced graph over the {c.group} group ({', '.join(c.nodes)})")
        lines.append(
            f"  {c.kind} of {what}, "
            f"{c.buffer_bytes} B {c.dtype}; collective #{index} of {len(plan.collectives)} in "
            f"compiled region {plan.region}'s plan, issued before {op(c.issue_pos)}, waited "
            f"before {op(c.wait_pos)}.")
    lines.append(
        "  Every rank must run the same compiled steps: a rank that skipped a step, stopped "
        "early, or runs another plan leaves the others waiting here until the process group's "
        "timeout.")
    return "\n".join(lines)


def boxed_with_collective_errors(gm: fx.GraphModule, plan_of: Callable[[], Any]):
    """``gm.forward`` as a boxed call (``f(args_list)``) that re-raises a failure of one of the
    plan's collectives as :class:`CollectiveError`; ``plan_of()`` gives the region's plan."""
    forward = gm.forward

    def run(args: list) -> Any:
        try:
            return forward(*args)
        except RuntimeError as exc:
            node = failed_node(exc, gm)
            cid = node.meta.get(COLLECTIVE_META) if node is not None else None
            plan = plan_of()
            if cid is None or plan is None:
                raise
            ranks = recompiled_elsewhere(plan.group_name)
            if ranks:  # the likely cause: those ranks run another region, not this one
                what = f"collective {cid} of compiled region {plan.region} ({exc})"
                raise PlanMismatchError(recompile_message(plan.group_name, ranks, what)) from exc
            raise CollectiveError(describe(cid, plan, exc)) from exc

    run._boxed_call = True
    return run
