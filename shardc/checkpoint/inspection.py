"""Rank 0's choice of the step to load, and its checks of that step before any rank reads it.

Contract: :func:`inspect_step` reads the root's layout and the chosen step's marker, file sizes
and DCP metadata, and never raises for a bad checkpoint: it returns an :class:`Inspection` that
either names a loadable step (with its marker and metadata), or no step (nothing to load), or an
error message, so that :class:`~shardc.checkpoint.CheckpointManager` can broadcast the outcome to
every rank. CRC-32s are checked later, by every rank on its share of the files.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from shardc.checkpoint.layout import read_marker, scan, step_path

log = logging.getLogger("shardc")

__all__ = ["Inspection", "inspect_step"]


@dataclass
class Inspection:
    """What rank 0 found: a step to load, nothing (``step`` and ``error`` ``None``), or an
    error."""

    step: int | None
    marker: dict | None = None
    metadata: Metadata | None = None
    error: str | None = None


def _pick_step(root: Path, step: int | None) -> Inspection:
    """The step to load (``step``, or the newest complete one), not yet checked."""
    try:
        complete, incomplete, broken = scan(root)
    except OSError as exc:
        return Inspection(None, error=f"cannot list {root}: {exc}")
    if step is None:
        if broken and (not complete or max(broken) > complete[-1]):
            bad = max(broken)
            return Inspection(None, error=(
                f"CheckpointManager.load: the newest checkpoint, step {bad}, is corrupt: "
                f"{broken[bad]}. Pass step= to load an older one explicitly."
            ))
        if not complete:
            if incomplete:
                log.warning("shardc: no complete checkpoint in %s (ignoring incomplete "
                            "steps %s)", root, incomplete)
            return Inspection(None)
        return Inspection(complete[-1])
    if step in broken:
        return Inspection(None, error=f"CheckpointManager.load: {broken[step]}")
    if step not in complete:
        what = "is incomplete (no completion marker: its save never finished)" if (
            step in incomplete
        ) else "does not exist"
        return Inspection(None, error=(
            f"CheckpointManager.load: checkpoint step {step} at {step_path(root, step)} {what}; "
            f"complete steps: {complete}"
        ))
    return Inspection(step)


def inspect_step(root: Path, step: int | None) -> Inspection:
    """Pick the step to load under ``root`` and check its marker, file sizes and metadata."""
    picked = _pick_step(root, step)
    if picked.step is None:
        return picked
    step = picked.step
    step_dir = step_path(root, step)
    marker = read_marker(root, step)
    problems = []
    for name, info in marker["files"].items():
        path = step_dir / name
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif path.stat().st_size != info["size"]:
            problems.append(
                f"{path} has {path.stat().st_size} bytes, the marker says {info['size']}"
            )
    metadata = None
    if not problems:
        try:
            metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
        except Exception as exc:  # a damaged pickle can raise almost anything
            problems.append(f"{step_dir / '.metadata'} is unreadable: {exc!r}")
    if metadata is not None:
        listed = {info.relative_path for info in metadata.storage_data.values()}
        for name in sorted(listed - set(marker["files"])):
            problems.append(f"{step_dir / name} is listed in .metadata but not in the marker")
    if problems:
        return Inspection(None, error=(
            f"CheckpointManager.load: checkpoint step {step} is corrupt or partial; nothing "
            "was loaded:\n  " + "\n  ".join(problems)
        ))
    return Inspection(step, marker, metadata)
