"""What identifies a run: its command, the shardc code measured, git, NCCL.

Contract: every function returns a string (or ``None`` where the fact is unknown) and never
raises for a missing tool.
"""

from __future__ import annotations

import hashlib
import os
import shlex
from collections.abc import Sequence
from pathlib import Path

import torch

import shardc

_REPO = Path(__file__).resolve().parents[2]  # the checkout holding benchmarks/


def launch_command(argv: Sequence[str]) -> str:
    world = os.environ.get("WORLD_SIZE")
    prefix = f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', world)} " if world \
        else "python "
    return prefix + shlex.join(argv)


def shardc_source_hash() -> str:
    """sha256 over the bytes of the imported shardc package's ``*.py`` files, in sorted path
    order (identifies the code measured without git; found from the public ``shardc.__file__``,
    so it is the code this process runs, wherever it is installed)."""
    digest = hashlib.sha256()
    for path in sorted(Path(shardc.__file__).resolve().parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def git_describe() -> str | None:
    """``HEAD`` commit (plus ``-dirty`` if shardc/ has local changes), if git is there."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_REPO, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "shardc"], cwd=_REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # not built with NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
