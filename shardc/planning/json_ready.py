"""Plain data for ``json.dumps``: what ``dataclasses.asdict`` gives, without its copies.

``Plan.to_dict`` serializes a plan that holds tens of thousands of leaves at 64 blocks (each
compute op, each collective's overlapped op names); ``asdict`` deep-copies every leaf and
rebuilds every container before ``json.dumps`` reads them once, which cost more than the
dump itself. :func:`json_ready` builds only the dicts of dataclasses and the lists around
them and hands the leaves over as they are: ``json.dumps`` writes the same text for both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Leaves json writes directly (int/float/str subclasses too, e.g. str enums).
_PLAIN = (str, int, float, bool, type(None))
_FIELDS: dict[type, tuple[str, ...]] = {}  # a dataclass's field names, in order (asdict's)


def json_ready(obj: Any) -> Any:
    """``obj`` as ``json.dumps`` writes ``dataclasses.asdict(obj)`` (for a dataclass; any
    value for the containers inside one): a dataclass instance becomes a dict of its fields in
    order, a list or tuple (namedtuples too) a list, a dict a dict with the same keys; anything
    else is returned itself (never copied: the caller must not change what it serializes
    before the dump, and ``json.dumps``'s ``default`` sees the same objects ``asdict``'s
    copies would be)."""
    if isinstance(obj, _PLAIN):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {name: json_ready(getattr(obj, name)) for name in _field_names(type(obj))}
    if isinstance(obj, (list, tuple)):
        if all(isinstance(v, _PLAIN) for v in obj):  # (e.g. a collective's overlapped ops)
            return obj
        return [json_ready(v) for v in obj]
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    return obj


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names
