"""The on-disk layout of a :class:`~shardc.checkpoint.CheckpointManager` root.

Contract::

    root/
      latest                      names the newest complete step directory (replaced atomically)
      step_00000042/              one DCP checkpoint per step (8 or more digits)
        .metadata, *.distcp       written by DCP
        shardc_complete.json      the completion marker: written last, by rank 0

A step directory is *complete* when its marker reads as a ``FORMAT`` marker of that step (it
lists every file with its size and CRC-32), *incomplete* without a marker (a save that was
killed: never loaded) and *broken* when its marker is unreadable or wrong (never loaded
silently). These functions touch the file system of one process; none is collective.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import torch

from shardc.checkpoint.errors import CheckpointError
from shardc.checkpoint.integrity import atomic_write, fsync_dir

__all__ = [
    "FORMAT",
    "LATEST_NAME",
    "MARKER_NAME",
    "read_marker",
    "remove_step",
    "scan",
    "step_path",
    "write_marker",
]

MARKER_NAME = "shardc_complete.json"
LATEST_NAME = "latest"
FORMAT = "shardc-checkpoint/1"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def step_path(root: Path, step: int) -> Path:
    """The directory of ``step`` under ``root``."""
    return root / f"step_{step:08d}"


def read_marker(root: Path, step: int) -> dict:
    """The completion marker of ``step``; :class:`CheckpointError` if it is unreadable or not a
    ``FORMAT`` marker of that step."""
    path = step_path(root, step) / MARKER_NAME
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"completion marker {path} is unreadable: {exc}") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise CheckpointError(f"completion marker {path} is not a {FORMAT} marker")
    if marker.get("step") != step or not isinstance(marker.get("files"), dict):
        raise CheckpointError(f"completion marker {path} does not describe step {step}")
    return marker


def scan(root: Path) -> tuple[list[int], list[int], dict[int, str]]:
    """(complete steps, incomplete steps, {broken step: marker error}) under ``root``, sorted."""
    complete, incomplete, broken = [], [], {}
    if not root.is_dir():
        return complete, incomplete, broken
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if not match or not entry.is_dir():
            continue
        step = int(match.group(1))
        marker = entry / MARKER_NAME
        if not marker.exists():
            incomplete.append(step)
            continue
        try:
            read_marker(root, step)
        except CheckpointError as exc:
            broken[step] = str(exc)
            continue
        complete.append(step)
    return sorted(complete), sorted(incomplete), broken


def write_marker(root: Path, step: int, files: dict[str, dict[str, int]], world: int) -> None:
    """Mark ``step`` complete (its marker lists ``files``), then point ``latest`` at it."""
    step_dir = step_path(root, step)
    marker = {
        "format": FORMAT,
        "step": step,
        "world_size": world,
        "created": time.time(),
        "torch": torch.__version__,
        "files": dict(sorted(files.items())),
    }
    atomic_write(step_dir / MARKER_NAME, json.dumps(marker, indent=1).encode())
    atomic_write(root / LATEST_NAME, f"{step_dir.name}\n".encode())


def remove_step(root: Path, step: int) -> None:
    """Delete a step directory, unmarking it first: a deletion cut short leaves an incomplete
    (ignored) directory, never a complete-looking partial one."""
    step_dir = step_path(root, step)
    (step_dir / MARKER_NAME).unlink(missing_ok=True)
    fsync_dir(step_dir)
    shutil.rmtree(step_dir)
