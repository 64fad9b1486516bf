"""Warm restarts: AOTAutograd's cache for shardc's regions, with each entry's plan stored beside it.

A hit in AOTAutograd's cache hands back the compiled forward and backward without tracing the
joint graph, without calling the partitioner (shardc's pipeline, so no plan) and without calling
Inductor's inner compiler (torch reloads Inductor's graphs from its FX graph cache itself), so
without shardc's wrappers around the compiled graphs: the communication pool inserted into their
arguments and collectives named when they fail (``backend._inductor_with_pool``). A region may
therefore use the cache only where a hit loses nothing but the plan, and the plan is kept here:

* Before compiling, :func:`cache_blockers` keeps the cache off (as it always was) for a region
  whose collectives run (a shard or replicate group of more than one rank, or collectives in
  Dynamo's graph such as tensor parallelism's), and for FP8, CPU offload, CUDA graphs, and the
  planning tools that need the partitioned graphs (``plan_only``, ``capture_partitioned``).
* On a miss, once the region is planned, :func:`restorable` checks that the compiled graphs take
  no pool and issue no collective; then :func:`save_plan` writes the plan to
  ``<Inductor cache dir>/shardc/plans/<AOTAutograd key>.json`` with the partitioner's
  ``uuid()`` (shardc's source hash, options, rank, world; the key already covers it, because
  torch keys the Inductor config, ``custom_partitioner_fn`` included).
* On a hit, :func:`load_plan` reads the plan stored under the hit's key and checks it (format,
  key, ``uuid()``, hash, the parameters Dynamo's graph gathers); the backend puts it in the
  region's record, where explain, dumps and the cross-rank plan check find it as after a miss.
  A hit whose plan is missing or fails a check is never used: the backend compiles the region
  again with the cache off (a miss), so shardc's passes always run or their result is restored.

The hit's key is read from AOTAutograd's own log record of the lookup
(``_torch.autograd_cache_lookups``); if it cannot be read, a hit counts as unrestorable.

AOTAutograd's entry also pickles the backward graph itself (for compiled autograd), and loading
the entry unpickles the graph modules inside it at once: the block bodies' subgraphs. FX rebuilds
a pickled graph module by tracing its code, and its tracer runs a call whose arguments are all
constants, such as the ``aten.full`` of zeros a slice's backward starts from, for real, keeping
the result as a tensor constant of the module: on a GPU, a device tensor as large as a block's
activation (600 x 2048 x 16 x 128 float32, 10.07e9 B, at batch 600 of the 1b model; warm
restarts measured +10.1e9 B on an H200) held for as long as the compiled region, which a miss
never allocates. :func:`retrace_on_reload` has those
modules rebuilt by :class:`ReloadTracer`, which keeps such calls as graph nodes.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from torch import fx
from torch.overrides import TorchFunctionMode

from shardc import _torch
from shardc.ops.gather_args import GatherArgs
from shardc.planning.plan import Plan
from shardc.runtime.comm_errors import collective_sites

log = logging.getLogger("shardc")

SIDECAR_FORMAT = 1  # of the stored record around the plan (the plan has its own version)
SWITCH = "SHARDC_AUTOGRAD_CACHE"  # "0": AOTAutograd's cache off for every shardc region


def switched_on(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether shardc may use AOTAutograd's cache (``SHARDC_AUTOGRAD_CACHE`` unset or not
    ``"0"``; torch's own switch, ``torch._functorch.config.enable_autograd_cache``, applies too)."""
    return environ.get(SWITCH, "1") != "0"


def cache_blockers(gathers: Sequence[fx.Node], graph: fx.GraphModule, *, fp8: bool,
                   offload: bool, cudagraphs: bool, needs_partition: bool) -> list[str]:
    """Why this region must keep AOTAutograd's cache off (empty: it may use it). ``gathers``:
    shardc's gather nodes of Dynamo's graph ``graph``."""
    reasons = []
    if any(GatherArgs.of(g).world > 1 or GatherArgs.of(g).replicate > 1 for g in gathers):
        reasons.append("its collectives run (a shard or replicate group of more than one rank): "
                       "the compiled graphs take the communication pool and name failing "
                       "collectives through wrappers that a cache hit does not apply")
    elif any(collective_sites(m) for m in graph.modules() if isinstance(m, fx.GraphModule)):
        reasons.append("Dynamo's graph issues collectives (tensor parallelism)")
    if fp8:
        reasons.append("FP8")
    if offload:
        reasons.append("CPU offload")
    if cudagraphs:
        reasons.append("CUDA graphs")
    if needs_partition:
        reasons.append("plan_only/capture_partitioned need the partitioned graphs")
    return reasons


def lookup_outcome(seen: list[tuple[str, str]], hits: int) -> tuple[str, str | None]:
    """``("hit" | "miss" | "none", key)`` of a compile's AOTAutograd cache lookups (``seen``, as
    logged; ``hits``: how many hits Dynamo's counters added). A hit whose key is unknown, or any
    disagreement between the two, is ``("hit", None)``: restorable never, used never."""
    if hits:
        keys = [key for outcome, key in seen if outcome == "hit"]
        return "hit", keys[0] if hits == 1 and len(seen) == 1 and len(keys) == 1 else None
    misses = [key for outcome, key in seen if outcome == "miss"]
    if len(seen) == 1 and len(misses) == 1:
        return "miss", misses[0]
    return "none", None


def restorable(forward: fx.GraphModule | None, backward: fx.GraphModule | None,
               plan: Plan | None, pool: object) -> str | None:
    """Why a hit on this planned region could not run exactly as this miss does, or None."""
    if plan is None:
        return "no plan"
    if pool is not None:
        return "its graphs take the communication pool"
    if any(collective_sites(g) for g in (forward, backward) if g is not None):
        return "its graphs issue collectives"
    return None


def plan_path(key: str) -> Path | None:
    """Where the plan of AOTAutograd's entry ``key`` is stored (None: no cache directory)."""
    root = _torch.inductor_cache_dir()
    if root is None or not key or os.sep in key or key.startswith("."):
        return None
    return Path(root) / "shardc" / "plans" / f"{key}.json"


def save_plan(key: str, partitioner: str, plan: Plan) -> Path | None:
    """Store ``plan`` for AOTAutograd's entry ``key`` (written whole or not at all)."""
    path = plan_path(key)
    if path is None:
        return None
    record = {"format": SIDECAR_FORMAT, "key": key, "partitioner": partitioner,
              "plan": plan.to_dict()}
    written = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False,
                                         suffix=".tmp") as out:
            written = out.name
            out.write(json.dumps(record))  # dumps: the C encoder (dump streams in Python)
        os.replace(written, path)
    except OSError as exc:  # a cache write must never break training; the next start misses
        if written is not None and os.path.exists(written):
            os.unlink(written)
        log.warning("shardc: could not store the plan for AOTAutograd's cache entry %s: %s",
                    key, exc)
        return None
    return path


def load_plan(key: str | None, partitioner: str, gathered: set[str]) -> tuple[Plan | None, str]:
    """The plan stored for AOTAutograd's entry ``key``, checked against this compile (the
    partitioner's ``uuid()``, the parameters Dynamo's graph gathers), or None and why not."""
    if key is None:
        return None, "the cache key could not be read"
    path = plan_path(key)
    if path is None or not path.is_file():
        return None, "no plan is stored for the entry"
    try:
        record = json.loads(path.read_text())
        plan = Plan.from_dict(record["plan"])
        stored_hash = record["plan"]["hash"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"the stored plan cannot be read ({exc})"
    if record.get("format") != SIDECAR_FORMAT or record.get("key") != key:
        return None, "the stored record is of another format or entry"
    if record.get("partitioner") != partitioner:
        return None, "the stored plan was made by another partitioner (options, rank, source)"
    if plan.hash() != stored_hash:
        return None, "the stored plan does not match its hash"
    planned = {p for bucket in plan.buckets for p in bucket.params}
    if planned != gathered:
        return None, "the stored plan's parameters are not the ones this graph gathers"
    return plan, ""


class ReloadTracer(fx.Tracer):
    """The tracer FX rebuilds a pickled graph module of shardc's with (see the module docstring):
    :class:`fx.Tracer`, except that every call of a torch op becomes a graph node, as it was in
    the pickled graph: one whose arguments hold no traced value would run when the module is
    loaded (FX's tracer runs it and keeps its result as a tensor constant), one with a traced
    value nested in a list would fail."""

    def trace(self, root: object, concrete_args: dict | None = None) -> fx.Graph:
        with _ConstantCallsAsNodes(self):
            return super().trace(root, concrete_args)


class _ConstantCallsAsNodes(TorchFunctionMode):
    """While ``tracer`` traces: every op call is recorded as a node, not run. Ops called on
    constants only would run (FX keeps the result as a tensor constant); ops with a traced value
    nested in a list (a size symbol in ``full``'s size under dynamic shapes) fail to run on it
    ("Expected List[int]"; FX's own tracer fails the same way), which made the cache entry
    unloadable (s72)."""

    def __init__(self, tracer: fx.Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, _torch.OpOverload):
            # What a traced argument's own __torch_function__ records (fx.Proxy's).
            return self.tracer.create_proxy("call_function", func, args, kwargs)
        return func(*args, **kwargs)


def retrace_on_reload(gm: fx.GraphModule) -> int:
    """Have ``gm`` and every graph module under it rebuilt by :class:`ReloadTracer` when
    unpickled (a cache hit loads no tensor that the miss did not allocate); returns how many
    modules. Run on the backward graph a training region hands to AOTAutograd."""
    modules = [m for m in gm.modules() if isinstance(m, fx.GraphModule)]
    for module in modules:
        _torch.set_unpickle_tracer(module, ReloadTracer)
    return len(modules)
