"""The one exception type of :mod:`shardc.checkpoint`.

Contract: every failure of a checkpoint that exists but cannot be used (incomplete, corrupt, or
not matching the state it is loaded into), and every disagreement between ranks, is raised as
:class:`CheckpointError`, with the same message on every rank where the cause is shared. Bad
arguments (a negative step, ``keep_last=0``) are ``ValueError``.
"""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, corrupt, or does not match the state it is loaded into."""
