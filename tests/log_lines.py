"""A logging handler that keeps the messages it sees (tests and scripts read shardc's log lines
from spawned ranks, where pytest's ``caplog`` does not reach)."""

from __future__ import annotations

import logging


class LogLines(logging.Handler):
    """Collects ``record.getMessage()`` of every record at INFO or above in ``lines``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
