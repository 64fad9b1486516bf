"""Inductor's Triton compile workers started when a model is sharded for a GPU.

Inductor compiles each Triton kernel in a pool of worker processes. The pool takes seconds to
start (each worker imports torch and Triton), and until it answers ready Inductor compiles every
kernel one after the other in the training process itself (torch's ``async_compile.precompile``
timer). torch's Inductor backend starts the pool when Dynamo hands it its first graph; shardc's
backend reached it only when ``compile_fx`` began, after Dynamo had traced the model and a few
seconds before the first kernel: on one H200 the first step of the 1b config compiled its first
kernels serially for 1.1-2.7 s at 8 and 32 layers (``docs/bench/compile_time/s46``).

:func:`start_for` starts the pool from ``shardc.shard`` on a CUDA mesh, so it warms while the
model is sharded, the optimizer built and the data loaded. The cost is torch's: the workers'
processes exist from then on, also in a process that never compiles (their pages are mostly
shared with the pool's parent, which forks them). torch's switches apply: ``TORCH_WARM_POOL=0``
leaves the start to the first compile, ``TORCHINDUCTOR_COMPILE_THREADS=1`` compiles in process.
"""

from __future__ import annotations

import logging

from shardc import _torch

log = logging.getLogger("shardc")

# Device types whose kernels Inductor compiles with Triton in its worker pool (the ones whose
# inputs make ``compile_fx`` wake the pool).
TRITON_DEVICE_TYPES = frozenset({"cuda", "xpu"})


def start_for(device_type: str) -> bool:
    """Start Inductor's compile workers if a model sharded over ``device_type`` compiles its
    kernels with Triton; returns whether it asked torch to (torch starts one pool per process
    and ignores the request while it has one, or where its switches keep it off)."""
    if device_type not in TRITON_DEVICE_TYPES:
        return False
    _torch.warm_inductor_compile_pool()
    log.debug("shardc: Inductor's compile workers started for a %s mesh", device_type)
    return True
