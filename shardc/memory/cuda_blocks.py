"""What the CUDA caching allocator counts for one request: sizes only, nothing of sharding.

``torch.cuda.max_memory_allocated`` (what a peak budget is measured by) counts the *block* each
request got, not the bytes requested. :func:`block_bytes` is that block for a request served
from a fresh segment:

- 0 bytes: no block;
- up to ``kSmallSize`` (1 MiB): the small pool, the request rounded up to ``kMinBlockSize``
  (512 B);
- above 1 MiB and below ``kMinLargeAlloc`` (10 MiB): carved out of a 20 MiB segment, which is
  split right after the request rounded up to 512 B (the rest is far more than 1 MiB);
- ``kMinLargeAlloc`` and above: a segment of the request (rounded up to 512 B) rounded up to
  ``kRoundLarge`` (2 MiB), split only where the remainder is more than ``kSmallSize`` (the large
  pool's split rule, ``remaining > kSmallSize``); otherwise the whole segment is the block. So an
  11 MiB request counts 12 MiB, and 131,072,000 B count 132,120,576 B.

A request that reuses a cached block gets it split at the request where a fresh segment
would not be (an 11 MiB request in a cached 20 MiB block counts 11 MiB): the fresh-segment rule
then over-counts, on a budget's safe side. Measured on an H200
(docs/bench/budget/optoff_peak_s23), the rule over the trace's live requests gave 9 MB more
than the allocator's own peak. The other way round is possible too and not modelled: a cached
block at most 1 MiB larger than the request is not split and counts whole (up to 1 MiB more
than the rule, per such request); the budget's margin (``peak_memory_margin``) covers it.
Expandable segments and ``roundup_power2_divisions`` change the rule; neither is modelled.

The constants mirror torch's (``c10/cuda/CUDACachingAllocator.cpp``; recent torch declares
them in ``c10/core/CachingAllocator.h``): kMinBlockSize 512, kSmallSize 1 MiB, kMinLargeAlloc
10 MiB, kRoundLarge 2 MiB, and the large pool's split rule. Checked on 2026-11-30 against the
copies of that header and of the allocator in the stored code search (their torch versions not
recorded there: 2.x); the installed torch here is a CPU build (2.13) without the CUDA source.
The H200's allocator history (docs/bench/budget/optoff_peak_s23) shows the two large cases
above as the rule gives them.

The runtime's own device memory (cuBLAS workspaces, allocated through the caching allocator
and held for the process's life) is not a request of the graphs: the peak model adds it per
phase from the cluster profile (``ClusterProfile.runtime_bytes``); its default estimate is here
(:data:`DEFAULT_CUDA_RUNTIME_BYTES`).
"""

from __future__ import annotations

MIN_BLOCK = 512  # kMinBlockSize: every request rounds up to this
SMALL_SIZE = 1 << 20  # kSmallSize: the largest small-pool request, and the large pool's split
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from here a request gets a segment of its own
ROUND_LARGE = 2 << 20  # kRoundLarge: such a segment's granularity
# torch's default cuBLAS workspace on sm90 (CUBLAS_WORKSPACE_CONFIG unset): 32 MiB per handle,
# one handle for the forward's thread and one for autograd's backward thread. Measured on an
# H200 (docs/bench/budget/optoff_peak_s23): two 32 MiB blocks live from the first matmul on.
DEFAULT_CUDA_RUNTIME_BYTES = 2 * (32 << 20)
ALLOCATORS = ("cuda", "exact")  # the peak model's: the caching allocator's blocks, or requests


SMALL_SEGMENT = 2 << 20  # kSmallBuffer: a small request's segment
LARGE_SEGMENT = 20 << 20  # kLargeBuffer: the segment of a request below MIN_LARGE_ALLOC


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def round_request(nbytes: int) -> int:
    """The bytes the allocator hands out for a request of ``nbytes`` (at least 512 B)."""
    return _round_up(max(nbytes, 1), MIN_BLOCK)


def segment_bytes(rounded: int) -> int:
    """The size of the segment a new request of ``rounded`` bytes makes: 2 MiB for the small
    pool, 20 MiB below ``MIN_LARGE_ALLOC``, else the request rounded up to 2 MiB."""
    if rounded <= SMALL_SIZE:
        return SMALL_SEGMENT
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return _round_up(rounded, ROUND_LARGE)


def block_bytes(nbytes: int) -> int:
    """Bytes the CUDA caching allocator counts as allocated for one request of ``nbytes``,
    served from a fresh segment (the module docstring's rule); 0 for 0."""
    if nbytes <= 0:
        return 0
    rounded = round_request(nbytes)
    if rounded < MIN_LARGE_ALLOC:
        return rounded  # small pool, or split off a 20 MiB segment right after the request
    segment = segment_bytes(rounded)
    # the large pool splits a block only where more than kSmallSize would remain
    return segment if 0 < segment - rounded <= SMALL_SIZE else rounded


def sized(allocator: str):
    """The function giving one request's counted bytes under ``allocator``
    (:data:`ALLOCATORS`): ``"cuda"``, :func:`block_bytes`; ``"exact"``, the request itself."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"shardc: allocator must be one of {ALLOCATORS}, got {allocator!r}")
    return block_bytes if allocator == "cuda" else int
