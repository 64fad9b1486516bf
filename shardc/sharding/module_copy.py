"""``copy.deepcopy`` of a sharded module: refused for users, allowed for shardc's own copies.

A copy of a sharded model would not be a sharded model. Its class is the original's (shardc's
swapped class, whose records name the original's parameters), its plain leaves are copies
without the hooks that hand their gradients to the parameters, and its blocks' compiled bodies
and packed buffers are the original's. Trained, the copy left every ``.grad`` None with no error
(s74's probes). So ``copy.deepcopy`` of a sharded module (``torch.optim.swa_utils.AveragedModel``,
an EMA copy) is refused, naming the module and what to do instead.

shardc copies its blocks itself, into unsharded skeletons whose parameters are meta tensors
(:func:`shardc.sharding.blocks._skeleton`); those copies go through :func:`internal_deepcopy`.
"""

from __future__ import annotations

import copy

from torch import nn

# A key of the deepcopy memo (which maps ``id``s to copies) that only shardc's own copies set;
# the object is kept alive by this module, so its ``id`` is never another object's.
_INTERNAL = object()


def internal_deepcopy(module: nn.Module, memo: dict[int, object] | None = None) -> nn.Module:
    """``copy.deepcopy(module, memo)`` that shardc's own sharded modules allow."""
    memo = {} if memo is None else memo
    memo[id(_INTERNAL)] = _INTERNAL
    return copy.deepcopy(module, memo)


def deepcopy_sharded(self: nn.Module, memo: dict[int, object]) -> nn.Module:
    """The ``__deepcopy__`` of shardc's sharded module classes: the default copy inside
    :func:`internal_deepcopy`, else refused (see the module's docstring)."""
    if memo.get(id(_INTERNAL)) is not _INTERNAL:
        raise RuntimeError(
            f"shardc: copy.deepcopy of the sharded module {_name(self)!r} is not supported: "
            "the copy would not be sharded (it would share the original's records and hand no "
            "gradient to its own parameters). For an EMA or torch.optim.swa_utils.AveragedModel "
            "copy, deepcopy the model before shardc.shard and shard the copy too, or build "
            "and shard a second model and load_state_dict() into it; "
            "copy.deepcopy(model.state_dict()) works.")
    # What copy.deepcopy does for an object without __deepcopy__ (nn.Module's reduction:
    # a new instance of the class, its __dict__ copied, through nn.Module.__setstate__).
    new = type(self).__new__(type(self))
    memo[id(self)] = new
    new.__setstate__(copy.deepcopy(self.__dict__, memo))
    return new


def _name(module: nn.Module) -> str:
    """The module's path in its model, from its first sharded parameter's recorded name."""
    infos = getattr(type(module), "_shardc_infos", None) or {}
    for name, info in infos.items():
        path = info.fqn[:-len(name)].rstrip(".")
        return path or f"the model's root {type(module).__name__}"
    return type(module).__name__
