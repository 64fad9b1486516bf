"""A logging handler that keeps the messages it sees (tests and scripts read shardc's log lines
from spawned ranks, where pytest's ``caplog`` does not reach)."""

from __future__ import annotations

import logging


class LogLines(logging.Handler):
    """Collects ``record.getMessage()`` of every record at ``level`` (default INFO) or above in
    ``lines``."""

    def __init__(self, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
