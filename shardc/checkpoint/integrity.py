"""Durable writes and checksums of checkpoint files.

Contract: :func:`atomic_write` leaves readers seeing either the old file or the whole new one,
never a part, and returns only after the data and the directory entry are on disk (``fsync``).
:func:`describe_files` records each file's size and CRC-32 (what the completion marker lists);
:func:`check_crcs` reads files again and names every one whose CRC-32 differs from a record.
Nothing here is collective: callers split the files between ranks.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from pathlib import Path

__all__ = ["atomic_write", "check_crcs", "crc32", "describe_files", "fsync_dir"]

_HASH_CHUNK = 8 << 20


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries to disk (best effort: some file systems refuse)."""
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


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` so that readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def crc32(path: Path) -> int:
    """CRC-32 of a file's bytes, read in chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def describe_files(files: list[str], root: Path) -> dict[str, dict[str, int]]:
    """``{name: {"size": bytes, "crc32": crc}}`` of the files ``root / name``."""
    return {name: {"size": (root / name).stat().st_size, "crc32": crc32(root / name)}
            for name in files}


def check_crcs(names: list[str], root: Path, records: Mapping[str, Mapping[str, int]]
               ) -> list[str]:
    """One line per file of ``names`` that cannot be read or whose CRC-32 is not its record's."""
    bad = []
    for name in names:
        try:
            crc = crc32(root / name)
        except OSError as exc:
            bad.append(f"{root / name}: {exc}")
            continue
        if crc != records[name]["crc32"]:
            bad.append(f"{root / name}: CRC-32 {crc:#010x}, the marker says "
                       f"{records[name]['crc32']:#010x}")
    return bad
