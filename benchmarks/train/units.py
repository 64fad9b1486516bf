"""Formatting of numbers in the report and the log."""

from __future__ import annotations

GIB = float(1 << 30)


def gib(x: float | None) -> str:
    return "–" if x is None else f"{x / GIB:.2f}"


def fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)
