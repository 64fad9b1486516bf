"""CUDA graphs for shardc's compiled regions (``torch.compile(..., mode="reduce-overhead")``).

Inductor's CUDA graph trees record a compiled graph once and replay it, so a step issues no
kernel from Python. shardc's lowered graphs hold only tensor work: its collectives are torch's
functional collectives (NCCL can be captured), its buffers come from the caching allocator or
from the region's static communication pool (a static input of the graph). What breaks a
capture, and makes shardc compile the region without CUDA graphs and say so (a warning on the
``shardc`` logger and a note in the region's plan), is decided here from the graph alone, so it
is the same on every rank:

- collectives on a process group that is not NCCL (gloo runs them on the CPU: nothing for a CUDA
  graph to replay), or a region on the CPU;
- dynamic shapes (a symbolic size among the region's inputs: each new size would be another
  recording; shardc does not pass them to CUDA graphs);
- gradient accumulation without synchronization (``shardc.no_sync``): its gradient store is
  Python state, which a replay would skip;
- FP8 gathers (``Float8Policy``, TransformerEngine parameters): not verified under CUDA graphs.

Inductor may still decline a graph for its own reasons (it counts them in
``torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]`` and logs them under
``TORCH_LOGS=perf_hints``); shardc warns when that count grows during a region's compile.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardc import _torch
from shardc.ops.gather_args import GatherArgs
from shardc.runtime.grad_sync import REDUCE

log = logging.getLogger("shardc")

CUDAGRAPHS = "triton.cudagraphs"


def inductor_patches(mode: str | None) -> dict[str, Any]:
    """Inductor config patches for ``torch.compile``'s ``mode`` (None or ``"default"``: none)."""
    if mode in (None, "default"):
        return {}
    return _torch.inductor_mode_options(mode)


def wants_cudagraphs(patches: dict[str, Any]) -> bool:
    return bool(patches.get(CUDAGRAPHS, _torch.inductor_cudagraphs_on()))


def blockers(gathers: Iterable[GatherArgs], example_inputs: Sequence[object],
             fp8: bool, offload: bool = False) -> list[str]:
    """Why the region cannot be recorded into a CUDA graph (empty: it can)."""
    out = []
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if any(isinstance(x, torch.SymInt) for x in example_inputs) or any(
            isinstance(s, torch.SymInt) for t in tensors for s in t.shape):
        out.append("dynamic shapes (a symbolic size among the region's inputs)")
    if tensors and not any(t.device.type == "cuda" for t in tensors):
        out.append("the region runs on the CPU")
    backends = set()
    syncs = set()
    for args in gathers:
        syncs.add(args.grad_sync)
        for name in (args.group_name, args.replicate_group):
            if name:
                backends.add(str(dist.get_backend(_torch.resolve_process_group(name))))
    cpu_side = sorted(b for b in backends if "nccl" not in b.lower())
    if cpu_side:
        out.append(f"collectives on a {'/'.join(cpu_side)} process group (run on the CPU side)")
    if syncs - {REDUCE}:
        out.append("gradient accumulation without synchronization (shardc.no_sync keeps its "
                   "gradient store in Python)")
    if fp8:
        out.append("FP8 gathers (not verified under CUDA graphs)")
    if offload:
        out.append("CPU offload (its gradients are copied to fresh host tensors and the CPU "
                   "waits for them: not recordable in a CUDA graph)")
    return out


def fallback_note(reasons: list[str]) -> str:
    return ("CUDA graphs requested (mode='reduce-overhead' or triton.cudagraphs) but this region "
            "is compiled without them: " + "; ".join(reasons))


def warn(region_index: int, note: str) -> None:
    log.warning("shardc: compiled region %d: %s", region_index, note)
