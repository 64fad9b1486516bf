"""Compile progress: one ``INFO`` line per stage of a region's compilation, with its seconds.

Lines go to the ``"shardc"`` logger, e.g.::

    shardc: region 0: Dynamo trace: 1.84 s
    shardc: region 0: AOTAutograd joint graph: 1.10 s
    shardc: region 0: joint passes + partition: 0.61 s
    shardc: region 0: planning: 0.03 s
    shardc: region 0: lowering: 0.02 s
    shardc: region 0: Inductor forward: 12.40 s
    shardc: region 0: Inductor backward: 9.87 s
    shardc: region 0: compiled in 25.87 s

Applications configure logging as usual; the environment variable ``SHARDC_LOG=info`` (or
``debug``) does it for them: it sets the ``"shardc"`` logger's level and, if the logger has no
handler yet, gives it one that writes to stderr (:func:`configure_from_env`, called by the
backend each time it compiles a region). Nothing here keeps state but the logger.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping

from shardc import _torch

log = logging.getLogger("shardc")

ENV_VAR = "SHARDC_LOG"
_LEVELS = {"info": logging.INFO, "debug": logging.DEBUG}
_HANDLER_NAME = "shardc-env"  # the handler SHARDC_LOG adds, found again by name


def configure_from_env(environ: Mapping[str, str] = os.environ) -> None:
    """Apply ``SHARDC_LOG`` (``info`` or ``debug``; unset or empty: leave logging alone)."""
    value = environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return
    if value not in _LEVELS:
        raise ValueError(
            f"shardc: {ENV_VAR}={environ[ENV_VAR]!r} is not a log level shardc knows; "
            f"set it to one of {sorted(_LEVELS)} or unset it")
    log.setLevel(_LEVELS[value])
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
        log.addHandler(handler)


def log_stage(region: int, name: str, seconds: float) -> None:
    log.info("shardc: region %d: %s: %.2f s", region, name, seconds)


@contextlib.contextmanager
def stage(region: int, name: str) -> Iterator[None]:
    """Log how long the body took as one stage of ``region``'s compilation (also on error)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        log_stage(region, name, time.perf_counter() - start)


def dynamo_seconds() -> float | None:
    """Seconds since Dynamo began compiling the current frame (its trace, up to the backend),
    or None where this torch does not tell."""
    started = _torch.dynamo_compile_start_ns()
    return None if started is None else (time.time_ns() - started) / 1e9


class Stopwatch:
    """Seconds since it was made, and since the last :meth:`lap` (stages that begin in one hook
    and end in another, such as AOTAutograd's joint trace between the backend and the
    partitioner)."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds

    def total(self) -> float:
        return time.perf_counter() - self.start
