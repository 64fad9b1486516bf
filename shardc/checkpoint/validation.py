"""Validation of a target state against a checkpoint's DCP metadata, before anything is loaded.

Contract: these functions only read. :func:`validate_state` compares a flat target state with
the metadata DCP wrote (``.metadata``) and returns a :class:`LoadReport` that lists every
difference: keys on one side only, and for keys on both sides tensor vs non-tensor, global shape
(DTensors compare their global shape) and dtype. Which differences fail a load is the report's
:meth:`LoadReport.problems` (``strict``: all; non-strict: shapes and kinds). The report is one
rank's view; :class:`~shardc.checkpoint.CheckpointManager` gathers every rank's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["LoadReport", "flatten_state", "state_dicts_of", "validate_state"]


def state_dicts_of(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every ``Stateful`` value replaced by its ``state_dict()`` (as DCP does)."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}


def flatten_state(state_dicts: Mapping[str, Any]) -> dict[str, Any]:
    """The flat ``{key: value}`` view DCP stores: nested keys joined by dots (``model.w``)."""
    # DCP's own flattening, so the keys are exactly the checkpoint's metadata keys.
    from shardc._torch import flatten_state_dict

    flat, _ = flatten_state_dict(dict(state_dicts))
    return flat


@dataclass
class LoadReport:
    """What differs between a checkpoint and the state it is loaded into (one rank's view)."""

    missing: list[str] = field(default_factory=list)  # in the target, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint, not in the target
    shape_mismatches: list[str] = field(default_factory=list)
    dtype_mismatches: list[str] = field(default_factory=list)
    kind_mismatches: list[str] = field(default_factory=list)  # tensor vs non-tensor
    target_entries: list[str] = field(default_factory=list)  # top-level names of each side
    saved_entries: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.missing
            or self.unexpected
            or self.shape_mismatches
            or self.dtype_mismatches
            or self.kind_mismatches
        )

    def problems(self, strict: bool) -> list[str]:
        """Lines that make the load fail (``strict``: every difference; else shapes and kinds)."""
        lines = []
        if strict and self.missing:
            keys = _summarize(self.missing, self.saved_entries, "the checkpoint")
            lines.append(f"missing keys ({len(self.missing)}): {keys}")
        if strict and self.unexpected:
            keys = _summarize(self.unexpected, self.target_entries, "the state to load")
            lines.append(f"unexpected keys ({len(self.unexpected)}): {keys}")
        if strict:
            lines += self.dtype_mismatches
        return lines + self.shape_mismatches + self.kind_mismatches

    def __str__(self) -> str:
        lines = self.problems(strict=True)
        return "\n".join(lines) if lines else "state matches the checkpoint"


def _summarize(keys: list[str], other_side: list[str], other_name: str) -> str:
    """Keys joined by commas; a whole top-level entry the other side lacks is named once."""
    by_entry: dict[str, list[str]] = {}
    for key in keys:
        by_entry.setdefault(key.split(".", 1)[0], []).append(key)
    parts = []
    for entry, members in by_entry.items():
        if entry in other_side or len(members) == 1:
            parts += members
        else:
            parts.append(f"{entry}.* (all {len(members)} keys: {other_name} has no {entry!r})")
    return ", ".join(parts)


def validate_state(flat: Mapping[str, Any], metadata: Metadata) -> LoadReport:
    """Compare a flat target state (:func:`flatten_state`) with a checkpoint's DCP metadata.

    Tensors (DTensors compare their global shape) must have the saved shape and dtype; non-tensor
    values must have been saved as non-tensors.
    """
    saved = metadata.state_dict_metadata
    report = LoadReport(
        missing=sorted(k for k in flat if k not in saved),
        unexpected=sorted(k for k in saved if k not in flat),
        target_entries=sorted({k.split(".", 1)[0] for k in flat}),
        saved_entries=sorted({k.split(".", 1)[0] for k in saved}),
    )
    for key in sorted(k for k in flat if k in saved):
        value, meta = flat[key], saved[key]
        is_tensor = isinstance(value, torch.Tensor)
        if is_tensor != isinstance(meta, TensorStorageMetadata):
            what = "a tensor" if isinstance(meta, TensorStorageMetadata) else "a non-tensor value"
            report.kind_mismatches.append(
                f"{key}: the checkpoint holds {what} but the target holds {type(value).__name__}"
            )
            continue
        if not is_tensor:
            continue
        if tuple(value.shape) != tuple(meta.size):
            report.shape_mismatches.append(
                f"{key}: shape mismatch: checkpoint {tuple(meta.size)}, target {tuple(value.shape)}"
            )
        if value.dtype != meta.properties.dtype:
            report.dtype_mismatches.append(
                f"{key}: dtype mismatch: checkpoint {meta.properties.dtype}, target {value.dtype}"
            )
    return report
