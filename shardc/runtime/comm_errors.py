"""Name the planned collective when one fails at run time (a timeout: a rank skipped a step).

A collective that never completes surfaces as the process group's own error (gloo: ``Timed out
waiting 3000ms for send operation to complete``) raised by ``wait_tensor``, which says nothing about
which of the plan's collectives it was. The lowering tags every collective's issue and wait node
with the collective's id (:data:`COLLECTIVE_META`). Only when a call of a planned graph raises does
shardc look for the collective, and re-raise :class:`CollectiveError` naming it, its bucket and its
position in the plan, or :class:`PlanMismatchError` when another rank compiled a region this one
did not (see :mod:`shardc.runtime.plan_check`). Nothing runs per step beyond the call itself.

* FX execution (:func:`boxed_with_collective_errors`): the failing line of the graph's generated
  code names the node.
* Inductor (:func:`guard_inductor_graph`): Inductor's generated code names neither the FX node nor
  the collective (its "Source Nodes" comments are empty for nodes shardc inserted), so
  :func:`inductor_failed_collective` - the one place that reads Inductor's generated code - takes
  the failing ``torch.ops._c10d_functional`` call from the traceback, finds the collective it
  issued or waited, and counts which of the module's collective calls it is. The compiled graph's
  collectives, recorded in graph order at compile time (:func:`collective_sites`), give its id:
  post-grad passes never move a collective (a wait's producer), Inductor lowers the graph in its
  order, and its scheduler has kept them in that order in every graph seen so far. The mapping is
  used only if the module holds exactly the graph's collectives (op, process group, count), the
  buffers Inductor named in lowering order appear in that order (a reordering shows there), and
  the waited tensor has the collective's size and dtype; otherwise the process group's error
  surfaces unchanged.
"""

from __future__ import annotations

import ast
import linecache
import logging
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from shardc.runtime.plan_check import PlanMismatchError, recompile_message, recompiled_elsewhere

COLLECTIVE_META = "shardc_collective"  # node.meta key: the id of the planned collective
_ASSIGNED = re.compile(r"\s*(\w+)\s*=")
_NAMESPACE = "_c10d_functional"  # torch's functional collectives, which the lowering emits
_WAIT = "wait_tensor"
_BUFFER = re.compile(r"buf(\d+)$")  # the names Inductor gives the buffers it creates, in order

log = logging.getLogger("shardc")


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


def _raise_named(exc: BaseException, cid: str | None, plan) -> None:
    """Re-raise ``exc`` (raised by collective ``cid`` of ``plan``) as shardc's error; returns
    (so the caller re-raises ``exc`` unchanged) when there is nothing to name."""
    if cid is None or plan is None:
        return
    try:
        ranks = recompiled_elsewhere(plan.group_name)
    except Exception as err:  # noqa: BLE001 - a store that cannot be read: name the collective
        log.debug("shardc: could not look for regions other ranks compiled: %r", err)
        ranks = []
    if ranks:  # the likely cause: those ranks run another region, not this one
        what = f"collective {cid} of compiled region {plan.region} ({exc})"
        raise PlanMismatchError(recompile_message(plan.group_name, ranks, what)) from exc
    raise CollectiveError(describe(cid, plan, exc)) from exc


def boxed_with_collective_errors(gm: fx.GraphModule, plan_of: Callable[[], Any]):
    """``gm.forward`` as a boxed call (``f(args_list)``) that re-raises a failure of one of the
    plan's collectives as :class:`CollectiveError`; ``plan_of()`` gives the region's plan."""
    forward = gm.forward

    def run(args: list) -> Any:
        try:
            return forward(*args)
        except RuntimeError as exc:
            node = failed_node(exc, gm)
            _raise_named(exc, node.meta.get(COLLECTIVE_META) if node is not None else None,
                         plan_of())
            raise

    run._boxed_call = True
    return run


# --- Inductor -------------------------------------------------------------------------------


def _op_name(name: str) -> str:
    """The functional collective an op name stands for: in-place (``all_reduce_``, which Inductor
    turns ``all_reduce`` into) and ``*_out`` variants count as the op itself."""
    name = name.removesuffix("_out")
    return name[:-1] if name.endswith("_") else name


def _group_arg(op, args: list, kwargs: dict):
    """The ``group_name`` argument of a call of the functional collective ``op``."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.name == "group_name":
            return kwargs.get("group_name", args[i] if i < len(args) else None)
    return None


@dataclass(frozen=True)
class Site:
    """One collective a compiled graph issues (graph order): what the generated code must show."""

    op: str  # _op_name of the functional collective
    group: str | None
    cid: str | None  # the plan's collective id (None: not shardc's, e.g. a TP collective)
    numel: int | None  # of the tensor its wait returns (None: symbolic)
    dtype: torch.dtype | None


def collective_sites(gm: fx.GraphModule) -> list[Site]:
    """The collectives ``gm`` issues, in graph order (recorded at compile time)."""
    sites = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or getattr(target, "namespace", None) != _NAMESPACE:
            continue
        name = target._schema.name.split("::")[-1]
        if name == _WAIT:
            continue
        val = node.meta.get("val")
        numel = val.numel() if isinstance(val, torch.Tensor) else None
        sites.append(Site(_op_name(name), _group_arg(target, list(node.args), node.kwargs),
                          node.meta.get(COLLECTIVE_META),
                          numel if isinstance(numel, int) else None,
                          val.dtype if isinstance(val, torch.Tensor) else None))
    return sites


@dataclass
class _Call:
    """A call of a functional collective in Inductor's generated module."""

    line: int
    name: str  # the op's name, e.g. "all_gather_into_tensor", "all_reduce_", "wait_tensor"
    op: Any  # the OpOverload
    args: list
    kwargs: dict
    assigned: str | None  # ``bufN = <call>``

    def written(self) -> str | None:
        """The generated expression of the tensor this collective writes (and its wait reads)."""
        if "out" in self.kwargs:
            return ast.unparse(self.kwargs["out"])
        if self.name.endswith("_") and self.args:  # in place
            return ast.unparse(self.args[0])
        return self.assigned


def _collective_calls(source: str) -> list[_Call]:
    """Every ``torch.ops._c10d_functional.<op>.<overload>(...)`` call of ``source``, in order."""
    tree = ast.parse(source)
    assigned = {id(node.value): node.targets[0].id for node in ast.walk(tree)
                if isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)}
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        parts, f = [], node.func
        while isinstance(f, ast.Attribute):
            parts.append(f.attr)
            f = f.value
        parts.append(getattr(f, "id", ""))
        parts.reverse()  # torch, ops, _c10d_functional, <op>, <overload>
        if len(parts) != 5 or parts[:3] != ["torch", "ops", _NAMESPACE]:
            continue
        op = getattr(getattr(getattr(torch.ops, _NAMESPACE), parts[3]), parts[4])
        calls.append(_Call(node.lineno, parts[3], op, list(node.args),
                           {k.arg: k.value for k in node.keywords if k.arg},
                           assigned.get(id(node))))
    calls.sort(key=lambda c: c.line)
    return calls


def _literal(node) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return None


def inductor_failed_collective(exc: BaseException, sites: list[Site]) -> str | None:
    """The plan id of the collective whose call in Inductor's generated code raised ``exc``, or
    None when it cannot be told for sure (the caller then re-raises ``exc`` unchanged).

    Everything shardc assumes about Inductor's generated Python is here: it calls functional
    collectives as ``torch.ops._c10d_functional.<op>.<overload>(...)``, a wait's argument is the
    expression of the tensor its collective wrote (assigned, ``out=``, or the first argument of an
    in-place op), the buffers it creates are named ``buf<N>`` in lowering (graph) order, and one
    module holds one graph. A failure here never replaces ``exc``.
    """
    try:
        frame = lineno = None
        for f, line in traceback.walk_tb(exc.__traceback__):
            if f".{_NAMESPACE}." in linecache.getline(f.f_code.co_filename, line):
                frame, lineno = f, line  # the innermost such frame: the generated code
        if frame is None:
            return None
        source = "".join(linecache.getlines(frame.f_code.co_filename))
        calls = _collective_calls(source)
        failing = next((c for c in calls if c.line == lineno), None)
        if failing is None:
            return None
        issues = [c for c in calls if c.name != _WAIT]
        if failing.name == _WAIT:
            if not failing.args:
                return None
            waited = ast.unparse(failing.args[0])
            issued = [c for c in issues if c.line < lineno and c.written() == waited]
            if not issued:
                return None
            failing = issued[-1]
        # The module must hold exactly the graph's collectives, in the graph's order.
        if len(issues) != len(sites):
            return None
        numbers = []
        for call, site in zip(issues, sites):
            group = _literal(_group_arg(call.op, call.args, call.kwargs))
            if _op_name(call.name) != site.op or group != site.group:
                return None
            named = _BUFFER.match(call.assigned or "")
            if named:
                numbers.append(int(named.group(1)))
        if numbers != sorted(numbers):  # Inductor reordered collectives
            return None
        site = sites[issues.index(failing)]
        tensor = frame.f_locals.get(failing.written() or "")
        if isinstance(tensor, torch.Tensor) and site.numel is not None and (
                tensor.numel() != site.numel or tensor.dtype != site.dtype):
            return None
        return site.cid
    except Exception as err:  # noqa: BLE001 - never a worse error than the process group's
        log.debug("shardc: could not map a failed collective in Inductor's code: %r", err)
        return None


def guard_inductor_graph(compiled: Any, gm: fx.GraphModule, plan_of: Callable[[], Any]) -> Any:
    """``compiled`` (Inductor's compiled ``gm``, a boxed callable) re-raising a failure of one of
    the plan's collectives as :class:`CollectiveError` (or :class:`PlanMismatchError`).

    ``gm`` is the graph handed to Inductor, read after compiling (post-grad passes change it in
    place; they never reorder collectives). The wrapper replaces the callable inside Inductor's
    compiled-graph object where there is one, so the object keeps its type and metadata (graph
    partitions, CUDA graph info); otherwise it wraps ``compiled`` as a boxed function.
    """
    return guard_sites(compiled, collective_sites(gm), plan_of)


def guard_sites(compiled: Any, sites: list[Site], plan_of: Callable[[], Any]) -> Any:
    """:func:`guard_inductor_graph` for a graph whose collectives are ``sites``."""
    if not any(site.cid for site in sites):
        return compiled

    def guard(call: Callable[[list], Any]) -> Callable[[list], Any]:
        def run(args: list) -> Any:
            try:
                return call(args)
            except RuntimeError as exc:
                _raise_named(exc, inductor_failed_collective(exc, sites), plan_of())
                raise

        return run

    inner = getattr(compiled, "current_callable", None)  # Inductor's CompiledFxGraph
    if callable(inner) and getattr(compiled, "_boxed_call", False):
        compiled.current_callable = guard(inner)
        return compiled
    run = guard(compiled if getattr(compiled, "_boxed_call", False)
                else lambda args: compiled(*args))
    run._boxed_call = True
    return run
