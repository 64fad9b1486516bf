"""The checkpoint protocol of a training loop: :class:`CheckpointManager`.

Contract: every public method is collective over the manager's process group and takes the
same path on every rank. Decisions that lead to a collective are made by rank 0 and broadcast,
or checked for agreement on every rank (:class:`~shardc.checkpoint.group.RankGroup`); any rank's
failure raises :class:`~shardc.checkpoint.CheckpointError` on every rank. A save is complete only
once every rank wrote and checksummed its part and rank 0 wrote the completion marker
(:mod:`~shardc.checkpoint.layout`); a load checks the checkpoint (marker, sizes, CRC-32s) and the
target state (:mod:`~shardc.checkpoint.validation`) on every rank before it touches any value.
This file orders those steps; the steps themselves live in the sibling modules.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful

from shardc.checkpoint.errors import CheckpointError
from shardc.checkpoint.group import RankGroup
from shardc.checkpoint.inspection import Inspection, inspect_step
from shardc.checkpoint.integrity import check_crcs, describe_files
from shardc.checkpoint.layout import remove_step, scan, step_path, write_marker
from shardc.checkpoint.validation import LoadReport, flatten_state, state_dicts_of, validate_state

log = logging.getLogger("shardc")

__all__ = ["CheckpointManager"]


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
        """The directory of ``step`` (whether or not it exists)."""
        return step_path(self.root, step)

    def _group(self, pg: dist.ProcessGroup | None = None) -> RankGroup:
        return RankGroup(pg if pg is not None else self.process_group)

    # ---- queries

    def steps(self) -> list[int]:
        """The complete steps on disk, oldest first (rank 0 looks; every rank gets its answer)."""
        self.wait()
        group = self._group()
        found: list[int] | str | None = None
        if group.rank == 0:
            try:
                found = scan(self.root)[0]
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

    def _prepare_save(self, group: RankGroup, step: int, state: Mapping[str, Any]) -> Path:
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
        complete, incomplete, broken = scan(self.root)
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

    def _write(self, step_dir: Path, state: Mapping[str, Any], group: RankGroup) -> Metadata:
        """Every rank writes its part (DCP); rank 0 writes DCP's ``.metadata``."""
        return dcp.save(dict(state), checkpoint_id=str(step_dir), process_group=group.pg)

    def _commit(self, step: int, step_dir: Path, metadata: Metadata, group: RankGroup) -> None:
        """Checksums (each rank a share of the files), then rank 0 marks the step complete."""
        names = sorted({info.relative_path for info in _storage_data(metadata, step_dir).values()})
        names.append(".metadata")
        mine = names[group.rank :: group.world]
        try:
            part: dict | str = describe_files(mine, step_dir)
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
        write_marker(self.root, step, files, world)
        log.info("shardc: checkpoint step %d complete at %s", step, step_dir)
        self._retain(step)

    def _retain(self, new_step: int) -> None:
        """Delete complete steps beyond ``keep_last``, and incomplete ones before ``new_step``."""
        complete, incomplete, _ = scan(self.root)
        doomed = [s for s in incomplete if s < new_step]
        if self.keep_last is not None:
            doomed += complete[: max(0, len(complete) - self.keep_last)]
        for step in doomed:
            step_dir = self.path(step)
            try:
                remove_step(self.root, step)
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
                found = inspect_step(self.root, step)
            except Exception as exc:  # every rank must learn about it, not wait forever
                found = Inspection(None, error=f"CheckpointManager.load: {exc!r}")
        found = group.broadcast(found)
        if found.error:
            raise CheckpointError(found.error)
        if found.step is None:
            return None
        step_dir = self.path(found.step)
        if self.verify:
            group.raise_if_any(self._verify_share(step_dir, found.marker, group))

        try:
            state_dicts = state_dicts_of(state)
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

    @staticmethod
    def _verify_share(step_dir: Path, marker: dict, group: RankGroup) -> str | None:
        names = sorted(marker["files"])[group.rank :: group.world]
        bad = check_crcs(names, step_dir, marker["files"])
        if not bad:
            return None
        return "CheckpointManager.load: checksum mismatch (corrupt checkpoint; nothing was " \
               "loaded): " + "; ".join(bad)


def _storage_data(metadata: Metadata, step_dir: Path) -> dict:
    """Where each saved item's bytes are (their files), from the metadata ``dcp.save`` returned
    or, where that has none, from the ``.metadata`` it wrote. torch 2.11's filesystem writer
    records them in a copy of the metadata it returns (``dataclasses.replace`` in ``finish``),
    so its ``dcp.save`` returns ``storage_data=None``; 2.13's records them in place. The file
    exists on every rank here: ``dcp.save`` returns only after rank 0 wrote it (its finish is
    the result of a collective) and the manager needs a filesystem every rank reads."""
    if metadata.storage_data is not None:
        return metadata.storage_data
    return dcp.FileSystemReader(str(step_dir)).read_metadata().storage_data
