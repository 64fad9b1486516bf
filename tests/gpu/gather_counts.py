"""What shardc's eager parameter gathers move, for the GPU tests (torch only, no TE)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountGathers(TorchDispatchMode):
    """Records the dtype (as a string) of every ``shardc::gather_param`` it sees run."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.shardc.gather_param.default:
            self.dtypes.append(str(args[0].dtype))
        return func(*args, **(kwargs or {}))
