"""Checkpoints of shardc models through standard ``torch.distributed.checkpoint`` (DCP).

A model sharded by :func:`shardc.shard` already has a DCP-ready state dict: every parameter is a
``Shard(0)`` DTensor with its original name and global shape, and optimizers built on
``model.parameters()`` keep DTensor state. So plain ``dcp.save`` / ``dcp.load`` work, reshard to any
world size, and interoperate with ``fully_shard`` (FSDP2) checkpoints of the same model. This module
adds what a training loop needs on top:

* :class:`ModelState` and :class:`OptimizerState`: ``Stateful`` wrappers around
  ``get_state_dict`` / ``set_state_dict`` (the recipe DCP recommends; the optimizer wrapper keys its
  state by parameter name and initializes empty optimizer state before a load).
* :class:`CheckpointManager`: one directory per step, marked complete only after every rank wrote
  its part, a ``latest`` pointer, retention of the last ``keep_last`` complete checkpoints, resume
  from the newest complete one, and validation (keys, shapes, dtypes, file sizes and checksums)
  before anything is loaded. Every decision that leads to a collective is made by rank 0 and
  broadcast, or checked for agreement on every rank, so all ranks always take the same path.

See ``docs/checkpoints.md``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import warnings
import zlib
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from shardc.sharding import te_params

log = logging.getLogger("shardc")

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "LoadReport",
    "ModelState",
    "OptimizerState",
    "flatten_state",
    "validate_state",
]

MARKER_NAME = "shardc_complete.json"
LATEST_NAME = "latest"
FORMAT = "shardc-checkpoint/1"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_HASH_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, corrupt, or does not match the state it is loaded into."""


# --------------------------------------------------------------------------------------------
# Stateful wrappers


_EXTRA_STATE = "_extra_state"  # the key nn.Module gives get_extra_state()'s value


def _is_serialized_extra_state(key: str, value: Any) -> bool:
    return (key.rsplit(".", 1)[-1] == _EXTRA_STATE and isinstance(value, torch.Tensor)
            and not isinstance(value, DTensor) and value.dtype == torch.uint8
            and value.dim() == 1)


def extra_state_to_bytes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each module extra state that is a serialized byte tensor (1-D
    ``uint8``, as TransformerEngine's FP8 metadata) replaced by ``bytes``.

    DCP loads a tensor only into a tensor of the saved size, and a module's serialized extra
    state changes size with the module's state (TE's is empty until the module first runs in
    FP8), so a fresh model could not load it. DCP stores other values whole, whatever their
    size. The values are small metadata, so the copy to bytes costs nothing that matters."""
    return {k: (bytes(v.detach().cpu().tolist()) if _is_serialized_extra_state(k, v) else v)
            for k, v in state_dict.items()}


def extra_state_from_bytes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`extra_state_to_bytes`: ``bytes`` extra states back to byte tensors."""
    def tensor(b: bytes) -> torch.Tensor:
        return torch.tensor(list(b), dtype=torch.uint8)

    return {k: (tensor(v) if k.rsplit(".", 1)[-1] == _EXTRA_STATE and isinstance(v, bytes)
                else v) for k, v in state_dict.items()}


class ModelState(Stateful):
    """``Stateful`` for a model through ``get_model_state_dict`` / ``set_model_state_dict``.

    Works for shardc models (eager or ``torch.compile`` wrappers: the ``_orig_mod.`` prefix is
    stripped), FSDP2 models and plain modules. ``options`` are DCP's ``StateDictOptions``.
    Serialized module extra states (TransformerEngine's FP8 metadata) are stored as bytes, so a
    fresh model loads them whatever their size (:func:`extra_state_to_bytes`).
    """

    def __init__(self, model: nn.Module, options: StateDictOptions | None = None) -> None:
        self.model, self.options = model, options

    def state_dict(self) -> dict[str, Any]:
        return extra_state_to_bytes(get_model_state_dict(self.model, options=self.options))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, extra_state_from_bytes(state_dict), options=self.options)


class OptimizerState(Stateful):
    """``Stateful`` for an optimizer of ``model``, keyed by parameter name (FQN).

    ``get_optimizer_state_dict`` initializes the state of an optimizer that never stepped, so a
    fresh optimizer can be the target of a load. AdamW's ``exp_avg`` / ``exp_avg_sq`` of a shardc
    parameter are DTensors with the parameter's placements; ``step`` is the plain scalar tensor
    torch keeps (identical on every rank; DCP stores one copy).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        options: StateDictOptions | None = None,
    ) -> None:
        self.model, self.optimizer, self.options = model, optimizer, options

    def state_dict(self) -> dict[str, Any]:
        _init_state_of_fp8_params(self.optimizer)
        return get_optimizer_state_dict(self.model, self.optimizer, options=self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self.options)


def _init_state_of_fp8_params(optimizer: torch.optim.Optimizer) -> None:
    """Initialize an optimizer that never stepped and holds FP8 parameter shards
    (``te.quantized_model_init``), as ``get_optimizer_state_dict`` would: one step at learning
    rate 0 on zero gradients. torch makes those gradients with ``zeros_like(param)``, which for an
    FP8 shard is an FP8 tensor; the backward gives such parameters plain gradients, and so does
    this."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if optimizer.state or not te_params.has_quantized_shards(params):
        return
    if any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = te_params.zero_grad_like(p)
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------
# Validation of a target state against a checkpoint's metadata


def _to_state_dicts(state: Mapping[str, Any]) -> dict[str, Any]:
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


# --------------------------------------------------------------------------------------------
# Files


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` so that readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _describe(files: list[str], root: Path) -> dict[str, dict[str, int]]:
    return {name: {"size": (root / name).stat().st_size, "crc32": _crc32(root / name)}
            for name in files}


# --------------------------------------------------------------------------------------------
# Process-group helpers: everything degrades to a single process when torch.distributed is off.


class _Group:
    def __init__(self, pg: dist.ProcessGroup | None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.pg = pg
        self.rank = dist.get_rank(pg) if self.distributed else 0
        self.world = dist.get_world_size(pg) if self.distributed else 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed or self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.pg, group_src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed or self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (``None`` elsewhere); waits for every rank's part."""
        if not self.distributed or self.world == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, group=self.pg, group_dst=0)
        return out

    def raise_if_any(self, error: str | None, exc_type: type[Exception] = CheckpointError) -> None:
        """Raise on every rank if any rank has an error (the same message everywhere)."""
        errors = self.all_gather(error)
        found = [(r, e) for r, e in enumerate(errors) if e]
        if not found:
            return
        if len({e for _, e in found}) == 1 and len(found) == self.world:
            raise exc_type(found[0][1])
        raise exc_type("\n".join(f"[rank {r}] {e}" for r, e in found))

    def raise_from_rank0(self, error: str | None, exc_type: type[Exception] = CheckpointError):
        error = self.broadcast(error)
        if error:
            raise exc_type(error)


# --------------------------------------------------------------------------------------------
# The manager


@dataclass
class _Inspection:
    step: int | None
    marker: dict | None = None
    metadata: Metadata | None = None
    error: str | None = None


class CheckpointManager:
    """Step-numbered DCP checkpoints under ``root`` for a training loop.

    ``root/step_{k:08d}/`` holds one DCP checkpoint plus ``shardc_complete.json``, the completion
    marker rank 0 writes after every rank finished writing (it lists each file with its size and
    CRC-32). ``root/latest`` names the newest complete step directory (replaced atomically). A
    directory without a marker is incomplete (a save that was killed) and is never loaded.

    Every method is collective over ``process_group`` (default: the default group; without
    ``torch.distributed`` a single process works alone): call it on every rank, in the same order.
    ``state`` arguments are what ``dcp.save`` / ``dcp.load`` take: a dict of name -> ``Stateful``
    (e.g. :class:`ModelState`, :class:`OptimizerState`) or state dict.

    keep_last: complete checkpoints to keep (older ones are deleted after a new one is complete);
        ``None`` keeps all.
    verify: check every file's CRC-32 (each rank reads a share of the files) before a load; file
        sizes are always checked.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep_last: int | None = 3,
        process_group: dist.ProcessGroup | None = None,
        verify: bool = True,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"CheckpointManager: keep_last must be >= 1 or None, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.process_group = process_group
        self.verify = verify
        self.last_report: LoadReport | None = None
        self._pending: Future | None = None
        self._async_pg: dist.ProcessGroup | None = None

    # ---- layout

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def _group(self, pg: dist.ProcessGroup | None = None) -> _Group:
        return _Group(pg if pg is not None else self.process_group)

    def _scan(self) -> tuple[list[int], list[int], dict[int, str]]:
        """(complete steps, incomplete steps, {step: marker error}) found on disk (rank 0)."""
        complete, incomplete, broken = [], [], {}
        if not self.root.is_dir():
            return complete, incomplete, broken
        for entry in self.root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if not match or not entry.is_dir():
                continue
            step = int(match.group(1))
            marker = entry / MARKER_NAME
            if not marker.exists():
                incomplete.append(step)
                continue
            try:
                self._read_marker(step)
            except CheckpointError as exc:
                broken[step] = str(exc)
                continue
            complete.append(step)
        return sorted(complete), sorted(incomplete), broken

    def _read_marker(self, step: int) -> dict:
        path = self.path(step) / MARKER_NAME
        try:
            marker = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"completion marker {path} is unreadable: {exc}") from None
        if not isinstance(marker, dict) or marker.get("format") != FORMAT:
            raise CheckpointError(f"completion marker {path} is not a {FORMAT} marker")
        if marker.get("step") != step or not isinstance(marker.get("files"), dict):
            raise CheckpointError(f"completion marker {path} does not describe step {step}")
        return marker

    # ---- queries

    def steps(self) -> list[int]:
        """The complete steps on disk, oldest first (rank 0 looks; every rank gets its answer)."""
        self.wait()
        group = self._group()
        found: list[int] | str | None = None
        if group.rank == 0:
            try:
                found = self._scan()[0]
            except OSError as exc:
                found = f"CheckpointManager: cannot list {self.root}: {exc}"
        found = group.broadcast(found)
        if isinstance(found, str):
            raise CheckpointError(found)
        return found

    def latest_step(self) -> int | None:
        """The newest complete step, or ``None`` (rank 0 looks; every rank gets its answer)."""
        steps = self.steps()
        return steps[-1] if steps else None

    # ---- save

    def save(self, step: int, state: Mapping[str, Any]) -> Path:
        """Save ``state`` as step ``step`` on every rank; returns once the step is complete."""
        self.wait()
        group = self._group()
        step_dir = self._prepare_save(group, step, state)
        metadata = self._write(step_dir, state, group)
        self._commit(step, step_dir, metadata, group)
        return step_dir

    def async_save(self, step: int, state: Mapping[str, Any]) -> Future:
        """Start saving ``state`` as step ``step``; the returned future completes with its path.

        The state is staged (copied to CPU memory) before this returns, so training may go on and
        change the parameters at once. Writing and the completion protocol run in a background
        thread on a separate gloo process group (created at the first call, collectively). At most
        one save is in flight: the next :meth:`save`, :meth:`async_save` or :meth:`load` waits for
        it (also :meth:`wait`). Errors surface from ``future.result()`` / :meth:`wait`.
        """
        self.wait()
        group = self._group()
        step_dir = self._prepare_save(group, step, state)
        if group.distributed and self._async_pg is None:
            ranks = None
            if self.process_group is not None:
                ranks = dist.get_process_group_ranks(self.process_group)
            self._async_pg = dist.new_group(ranks=ranks, backend="gloo")
        bg_group = self._group(self._async_pg) if group.distributed else group
        upload = dcp.async_save(
            dict(state),
            checkpoint_id=str(step_dir),
            process_group=self._async_pg if group.distributed else None,
        )
        done: Future = Future()

        def finish() -> None:
            try:
                metadata = upload.result()
                self._commit(step, step_dir, metadata, bg_group)
                done.set_result(step_dir)
            except BaseException as exc:  # surfaced through the future
                done.set_exception(exc)

        threading.Thread(target=finish, name=f"shardc-ckpt-{step}", daemon=True).start()
        self._pending = done
        return done

    def wait(self) -> Path | None:
        """Wait for an :meth:`async_save` in flight; returns its path (``None`` if none)."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def _prepare_save(self, group: _Group, step: int, state: Mapping[str, Any]) -> Path:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"CheckpointManager.save: step must be an int >= 0, got {step!r}")
        views = group.all_gather((step, sorted(map(str, state))))
        if any(v != views[0] for v in views):
            detail = "; ".join(f"rank {r}: step {s}, keys {k}" for r, (s, k) in enumerate(views))
            raise CheckpointError(
                f"CheckpointManager.save: ranks disagree on the step or the state's keys ({detail})"
            )
        step_dir = self.path(step)
        error = None
        if group.rank == 0:
            try:
                error = self._prepare_dir(step)
            except OSError as exc:
                error = f"CheckpointManager.save: cannot prepare {step_dir}: {exc}"
        group.raise_from_rank0(error)
        return step_dir

    def _prepare_dir(self, step: int) -> str | None:
        complete, incomplete, broken = self._scan()
        step_dir = self.path(step)
        if step in complete or step in broken:
            return (
                f"CheckpointManager.save: step {step} already exists at {step_dir}; refusing to "
                "overwrite it (delete it first to save this step again)"
            )
        newer = [s for s in complete if s > step]
        if newer:
            return (
                f"CheckpointManager.save: {self.root} already holds newer complete step(s) "
                f"{newer}; saving step {step} would leave them as the resume point. Delete them "
                "(or use another root) to restart from an older step."
            )
        if step in incomplete:
            log.warning("shardc: removing the incomplete checkpoint %s (a killed save)", step_dir)
            shutil.rmtree(step_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        step_dir.mkdir()
        return None

    def _write(self, step_dir: Path, state: Mapping[str, Any], group: _Group) -> Metadata:
        """Every rank writes its part (DCP); rank 0 writes DCP's ``.metadata``."""
        return dcp.save(dict(state), checkpoint_id=str(step_dir), process_group=group.pg)

    def _commit(self, step: int, step_dir: Path, metadata: Metadata, group: _Group) -> None:
        """Checksums (each rank a share of the files), then rank 0 marks the step complete."""
        names = sorted({info.relative_path for info in metadata.storage_data.values()})
        names.append(".metadata")
        mine = names[group.rank :: group.world]
        try:
            part: dict | str = _describe(mine, step_dir)
        except OSError as exc:
            part = f"rank {group.rank} cannot read back {step_dir}: {exc}"
        # gather = the barrier: rank 0 goes on only once every rank has written and hashed.
        try:
            parts = group.gather(part)
        except Exception as exc:
            raise CheckpointError(
                f"CheckpointManager.save: step {step} at {step_dir} was not completed: a rank "
                f"failed before the completion barrier ({exc}); the directory stays incomplete "
                "and the previous complete step remains the resume point"
            ) from exc
        error = None
        if group.rank == 0:
            errors = [p for p in parts if isinstance(p, str)]
            if errors:
                error = "CheckpointManager.save: " + "; ".join(errors)
            else:
                try:
                    self._mark_complete(step, step_dir, parts, group.world)
                except OSError as exc:
                    error = f"CheckpointManager.save: cannot complete {step_dir}: {exc}"
        group.raise_from_rank0(error)

    def _mark_complete(self, step: int, step_dir: Path, parts: list[dict], world: int) -> None:
        files: dict[str, dict[str, int]] = {}
        for part in parts:
            files.update(part)
        marker = {
            "format": FORMAT,
            "step": step,
            "world_size": world,
            "created": time.time(),
            "torch": torch.__version__,
            "files": dict(sorted(files.items())),
        }
        _atomic_write(step_dir / MARKER_NAME, json.dumps(marker, indent=1).encode())
        _atomic_write(self.root / LATEST_NAME, f"{step_dir.name}\n".encode())
        log.info("shardc: checkpoint step %d complete at %s", step, step_dir)
        self._retain(step)

    def _retain(self, new_step: int) -> None:
        """Delete complete steps beyond ``keep_last``, and incomplete ones before ``new_step``."""
        complete, incomplete, _ = self._scan()
        doomed = [s for s in incomplete if s < new_step]
        if self.keep_last is not None:
            doomed += complete[: max(0, len(complete) - self.keep_last)]
        for step in doomed:
            step_dir = self.path(step)
            try:
                # Unmark first: a deletion cut short leaves an incomplete (ignored) directory.
                (step_dir / MARKER_NAME).unlink(missing_ok=True)
                _fsync_dir(step_dir)
                shutil.rmtree(step_dir)
            except OSError as exc:
                log.warning("shardc: could not delete old checkpoint %s: %s", step_dir, exc)

    # ---- load

    def load(
        self, state: Mapping[str, Any], *, step: int | None = None, strict: bool = True
    ) -> int | None:
        """Load ``state`` in place from step ``step`` (default: the newest complete step).

        Returns the step loaded, or ``None`` when ``step`` is ``None`` and no complete checkpoint
        exists (incomplete directories are ignored). Before any value is touched, the checkpoint
        is checked (completion marker, file sizes, CRC-32 with ``verify``) and the target's keys,
        shapes and dtypes are compared with it on every rank; any problem raises
        :class:`CheckpointError` on every rank and leaves the state as it was. ``strict=False``
        loads the keys both sides have, warns about the rest (``self.last_report``) and casts
        dtypes; shape mismatches always fail.
        """
        self.wait()
        group = self._group()
        found = None
        if group.rank == 0:
            try:
                found = self._inspect(step)
            except Exception as exc:  # every rank must learn about it, not wait forever
                found = _Inspection(None, error=f"CheckpointManager.load: {exc!r}")
        found = group.broadcast(found)
        if found.error:
            raise CheckpointError(found.error)
        if found.step is None:
            return None
        step_dir = self.path(found.step)
        if self.verify:
            group.raise_if_any(self._verify_share(step_dir, found.marker, group))

        try:
            state_dicts = _to_state_dicts(state)
            report: LoadReport | str = validate_state(flatten_state(state_dicts), found.metadata)
        except Exception as exc:  # fail on every rank rather than leave the others waiting
            report = f"CheckpointManager.load: cannot build the state to load: {exc!r}"
        reports = group.all_gather(report)
        failed = [f"[rank {r}] {rep}" for r, rep in enumerate(reports) if isinstance(rep, str)]
        if failed:
            raise CheckpointError("\n".join(failed))
        self.last_report = report
        lines: list[str] = []
        for rank, rep in enumerate(reports):
            for line in rep.problems(strict):
                everywhere = all(line in other.problems(strict) for other in reports)
                lines.append(line if everywhere else f"[rank {rank}] {line}")
        lines = list(dict.fromkeys(lines))
        if lines:
            raise CheckpointError(
                f"CheckpointManager.load: {step_dir} does not match the state to load "
                f"({'strict' if strict else 'non-strict'}); nothing was loaded:\n  "
                + "\n  ".join(lines)
            )
        if not report.ok:
            warnings.warn(
                f"CheckpointManager.load (non-strict) from {step_dir}: loading the keys both "
                f"sides have; differences:\n{report}",
                stacklevel=2,
            )
        planner = DefaultLoadPlanner(allow_partial_load=not strict)
        dcp.load(state_dicts, checkpoint_id=str(step_dir), process_group=group.pg, planner=planner)
        for key, value in state.items():
            if isinstance(value, Stateful):
                value.load_state_dict(state_dicts[key])
        log.info("shardc: loaded checkpoint step %d from %s", found.step, step_dir)
        return found.step

    def _inspect(self, step: int | None) -> _Inspection:
        """Rank 0: pick the step to load and check its marker, files and metadata."""
        try:
            complete, incomplete, broken = self._scan()
        except OSError as exc:
            return _Inspection(None, error=f"cannot list {self.root}: {exc}")
        if step is None:
            if broken and (not complete or max(broken) > complete[-1]):
                bad = max(broken)
                return _Inspection(None, error=(
                    f"CheckpointManager.load: the newest checkpoint, step {bad}, is corrupt: "
                    f"{broken[bad]}. Pass step= to load an older one explicitly."
                ))
            if not complete:
                if incomplete:
                    log.warning("shardc: no complete checkpoint in %s (ignoring incomplete "
                                "steps %s)", self.root, incomplete)
                return _Inspection(None)
            step = complete[-1]
        elif step in broken:
            return _Inspection(None, error=f"CheckpointManager.load: {broken[step]}")
        elif step not in complete:
            what = "is incomplete (no completion marker: its save never finished)" if (
                step in incomplete
            ) else "does not exist"
            return _Inspection(None, error=(
                f"CheckpointManager.load: checkpoint step {step} at {self.path(step)} {what}; "
                f"complete steps: {complete}"
            ))
        step_dir = self.path(step)
        marker = self._read_marker(step)
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
            return _Inspection(None, error=(
                f"CheckpointManager.load: checkpoint step {step} is corrupt or partial; nothing "
                "was loaded:\n  " + "\n  ".join(problems)
            ))
        return _Inspection(step, marker, metadata)

    @staticmethod
    def _verify_share(step_dir: Path, marker: dict, group: _Group) -> str | None:
        names = sorted(marker["files"])[group.rank :: group.world]
        bad = []
        for name in names:
            try:
                crc = _crc32(step_dir / name)
            except OSError as exc:
                bad.append(f"{step_dir / name}: {exc}")
                continue
            if crc != marker["files"][name]["crc32"]:
                bad.append(f"{step_dir / name}: CRC-32 {crc:#010x}, the marker says "
                           f"{marker['files'][name]['crc32']:#010x}")
        if not bad:
            return None
        return "CheckpointManager.load: checksum mismatch (corrupt checkpoint; nothing was " \
               "loaded): " + "; ".join(bad)
