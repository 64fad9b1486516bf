"""Group sharded parameters into communication buckets.

A bucket is gathered by one flat all-gather and its gradients reduced by one flat reduce-scatter.
Default grouping: one bucket per repeated block (the parameters under ``<name>.<index>.``, e.g.
``layers.3.``, which is how ``nn.ModuleList`` transformer blocks are named), and the remaining
parameters grouped by runs of consecutive first use (the embedding, then the final norm and head).
The order of parameters inside a bucket is their order of first use in the forward graph, which
is the same on every rank, so bucket contents and results are reproducible.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamComm:
    """What bucketing needs of one gathered parameter."""

    fqn: str
    dim0: int
    padded_rows: int
    row_numel: int
    dtype: str  # all-gather dtype
    reduce_dtype: str
    group_name: str
    world: int
    itemsize: int
    replicate: int = 1  # HSDP replicas (the gradient is all-reduced over them)
    replicate_group: str = ""

    @property
    def gathered_bytes(self) -> int:
        return self.padded_rows * self.world * self.row_numel * self.itemsize


def block_key(fqn: str, patterns: Sequence[str] = ()) -> str | None:
    """Bucket key of ``fqn``: a user pattern's match, else its repeated-block prefix, or None."""
    for pattern in patterns:
        m = re.match(pattern, fqn)
        if m and m.group(0) and (len(m.group(0)) == len(fqn) or fqn[len(m.group(0))] == "."):
            return m.group(0)
    if patterns:
        return None
    parts = fqn.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit() and i > 0:
            return ".".join(parts[: i + 1])
    return None


def assign_buckets(
    params: Sequence[ParamComm],
    *,
    by: str = "module",
    patterns: Sequence[str] = (),
    cap_bytes: int = 0,
) -> list[list[ParamComm]]:
    """Split ``params`` (in first-use order) into buckets; returns buckets in first-use order."""
    if by == "param":
        return [[p] for p in params]
    groups: dict[tuple, list[ParamComm]] = {}
    rest_run = 0
    previous_key: str | None = "<start>"
    for p in params:
        key = block_key(p.fqn, patterns)
        if key is None:
            if previous_key is not None:
                rest_run += 1
            key_t = ("rest", rest_run)
        else:
            key_t = ("block", key)
        previous_key = key
        groups.setdefault((key_t, p.dtype, p.reduce_dtype, p.group_name, p.replicate_group),
                          []).append(p)
    buckets: list[list[ParamComm]] = []
    for members in groups.values():
        buckets.extend(_split_by_cap(members, cap_bytes))
    return buckets


def _split_by_cap(members: list[ParamComm], cap_bytes: int) -> list[list[ParamComm]]:
    if cap_bytes <= 0:
        return [members]
    out: list[list[ParamComm]] = [[]]
    size = 0
    for p in members:
        if out[-1] and size + p.gathered_bytes > cap_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.gathered_bytes
    return out


def bucket_name(members: Sequence[ParamComm], patterns: Sequence[str] = ()) -> str:
    keys = {block_key(p.fqn, patterns) for p in members}
    if len(keys) == 1 and None not in keys:
        return keys.pop()
    first, last = members[0].fqn, members[-1].fqn
    return first if first == last else f"{first}..{last}"
