"""Checkpoints of shardc models through standard ``torch.distributed.checkpoint`` (DCP).

A model sharded by :func:`shardc.shard` already has a DCP-ready state dict: every parameter is a
``Shard(0)`` DTensor with its original name and global shape, and optimizers built on
``model.parameters()`` keep DTensor state. So plain ``dcp.save`` / ``dcp.load`` work, reshard to any
world size, and interoperate with ``fully_shard`` (FSDP2) checkpoints of the same model. This
package adds what a training loop needs on top. One concern per file, protocols first (as
``torch.distributed.checkpoint`` is laid out):

``stateful``
    :class:`ModelState` and :class:`OptimizerState`: the ``Stateful`` wrappers DCP saves and
    loads (``get_state_dict`` / ``set_state_dict``, the recipe DCP recommends; the optimizer
    wrapper keys its state by parameter name).
``optimizer_init``
    :func:`init_optimizer_state`: the explicit step that gives an optimizer that never stepped
    its zero state (one step at learning rate 0), so that it can be loaded into.
``extra_state``
    :func:`extra_state_to_bytes` / :func:`extra_state_from_bytes`: serialized module extra
    states (TransformerEngine's FP8 metadata) stored as bytes, loadable whatever their size.
``validation``
    :func:`flatten_state`, :func:`validate_state`, :class:`LoadReport`: a target state compared
    with a checkpoint's metadata (keys, shapes, dtypes) before anything is loaded.
``integrity``
    fsync'd atomic writes and CRC-32 checksums of the files.
``layout``
    the on-disk layout of a manager's root: step directories, the completion marker
    (:data:`MARKER_NAME`, :data:`FORMAT`), the ``latest`` pointer (:data:`LATEST_NAME`).
``group``
    the collectives the protocol needs, degrading to a single process without
    ``torch.distributed``.
``inspection``
    rank 0's choice of the step to load and its checks of the marker, sizes and metadata.
``manager``
    :class:`CheckpointManager`: one directory per step, marked complete only after every rank
    wrote its part, retention of the last ``keep_last`` complete checkpoints, resume from the
    newest complete one, and validation before anything is loaded. Every decision that leads to
    a collective is made by rank 0 and broadcast, or checked for agreement on every rank.
``errors``
    :class:`CheckpointError`.

Every name below is importable from ``shardc.checkpoint``; the modules are the layout, not the
API. See ``docs/checkpoints.md``.
"""

from shardc.checkpoint.errors import CheckpointError
from shardc.checkpoint.extra_state import extra_state_from_bytes, extra_state_to_bytes
from shardc.checkpoint.layout import FORMAT, LATEST_NAME, MARKER_NAME
from shardc.checkpoint.manager import CheckpointManager
from shardc.checkpoint.optimizer_init import init_optimizer_state
from shardc.checkpoint.stateful import ModelState, OptimizerState
from shardc.checkpoint.validation import LoadReport, flatten_state, validate_state

__all__ = [
    "FORMAT",
    "LATEST_NAME",
    "MARKER_NAME",
    "CheckpointError",
    "CheckpointManager",
    "LoadReport",
    "ModelState",
    "OptimizerState",
    "extra_state_from_bytes",
    "extra_state_to_bytes",
    "flatten_state",
    "init_optimizer_state",
    "validate_state",
]
