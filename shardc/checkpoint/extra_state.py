"""Module extra states that are serialized byte tensors, stored as ``bytes``.

Contract: :func:`extra_state_to_bytes` and :func:`extra_state_from_bytes` are inverses on the
entries they touch, and leave every other entry (parameters, buffers, other extra states) as it
is, the same object. An entry is touched only if its key ends in ``_extra_state`` (the key
``nn.Module`` gives ``get_extra_state()``'s value) and its value is a 1-D ``uint8`` tensor that is
not a DTensor (TransformerEngine's FP8 metadata).

Why: DCP loads a tensor only into a tensor of the saved size, and a module's serialized extra
state changes size with the module's state (TransformerEngine's is empty until the module first
runs in FP8), so a fresh model could not load it. DCP stores other values whole, whatever their
size. The values are small metadata, so the copy to bytes costs nothing that matters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["extra_state_from_bytes", "extra_state_to_bytes"]

_EXTRA_STATE = "_extra_state"  # the key nn.Module gives get_extra_state()'s value


def _is_extra_state_key(key: str) -> bool:
    return key.rsplit(".", 1)[-1] == _EXTRA_STATE


def _is_serialized_extra_state(key: str, value: Any) -> bool:
    return (_is_extra_state_key(key) and isinstance(value, torch.Tensor)
            and not isinstance(value, DTensor) and value.dtype == torch.uint8
            and value.dim() == 1)


def extra_state_to_bytes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each module extra state that is a serialized byte tensor (1-D
    ``uint8``, as TransformerEngine's FP8 metadata) replaced by ``bytes``."""
    return {k: (bytes(v.detach().cpu().tolist()) if _is_serialized_extra_state(k, v) else v)
            for k, v in state_dict.items()}


def extra_state_from_bytes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`extra_state_to_bytes`: ``bytes`` extra states back to byte tensors."""
    def tensor(b: bytes) -> torch.Tensor:
        return torch.tensor(list(b), dtype=torch.uint8)

    return {k: (tensor(v) if _is_extra_state_key(k) and isinstance(v, bytes) else v)
            for k, v in state_dict.items()}
