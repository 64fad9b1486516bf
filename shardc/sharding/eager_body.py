"""A block body run eagerly: a copy of the body's skeleton that holds the call's tensors.

A shared body (``shardc.sharding.blocks``) runs the block's skeleton, a copy of the block whose
parameters and buffers are meta tensors, with the call's gathered weights put in their slots for
the call and taken out after it (``call_substituted``). Traced by Dynamo, that swap is a
trace-time detail. But when Dynamo cannot trace a body (a graph break inside it: for example an
activation checkpoint inside the block, as torch's ``checkpoint_wrapper`` puts there, around a
module that mutates an outside object, which Dynamo refuses inside a checkpoint region, as
transformers' attention does with the ``kernels`` package installed), it runs the body function
eagerly. A checkpoint then keeps the skeleton to run it again in the backward, after the swap
was undone: the recompute met meta weights and failed ("Tensor on device meta is not on the
expected device cpu"). Run eagerly, a body therefore calls :func:`substituted_copy`: a shallow
copy of the skeleton's module tree whose slots keep the call's tensors for as long as anything
(the checkpoint's recompute) holds the copy.
"""

from __future__ import annotations

import copy
import logging
import weakref

import torch
from torch import nn

__all__ = ["substituted_copy"]

log = logging.getLogger("shardc")

# The skeletons whose body ran eagerly: said once each (a group's, per training mode).
_SAID: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def substituted_copy(skeleton: nn.Module, slots: tuple[tuple[dict, str], ...],
                     tensors: tuple) -> nn.Module:
    """A copy of ``skeleton``'s module tree (each module copied shallowly, with dictionaries of
    parameters, buffers and children of its own) in which ``tensors[i]`` fills the copy of slot
    ``slots[i]`` (a ``_parameters`` or ``_buffers`` dictionary of a skeleton module and a name,
    ``blocks.substitution_slots``). The skeleton is left unchanged; its first eager run says so
    in the log (a warning: the blocks no longer share a compiled body)."""
    _say_ran_eagerly(skeleton)
    copies: dict[int, nn.Module] = {}
    tables: dict[int, dict] = {}  # id of a skeleton module's table -> the copy's table
    for module in skeleton.modules():
        twin = copy.copy(module)
        twin._parameters = dict(module._parameters)
        twin._buffers = dict(module._buffers)
        twin._modules = dict(module._modules)
        copies[id(module)] = twin
        tables[id(module._parameters)] = twin._parameters
        tables[id(module._buffers)] = twin._buffers
    for twin in copies.values():
        for name, child in twin._modules.items():
            if child is not None:
                twin._modules[name] = copies[id(child)]
    for (table, name), tensor in zip(slots, tensors):
        tables[id(table)][name] = tensor
    return copies[id(skeleton)]


# Run outside Dynamo: where it compiles the body's region as a frame of its own (the body
# breaks its graph), a traced check of the set was folded at trace time and warned every call.
@torch.compiler.disable
def _say_ran_eagerly(skeleton: nn.Module) -> None:
    if skeleton in _SAID:
        return
    _SAID.add(skeleton)
    log.warning(
        "shardc: the compile-once body of the %s blocks runs eagerly: Dynamo could not trace "
        "it (a graph break inside the block; TORCH_LOGS=graph_breaks shows where). Where the "
        "break is a checkpointed module mutating an outside object (transformers' attention "
        "with the kernels package installed, inside torch's checkpoint_wrapper), setting "
        "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True lets the "
        "blocks compile once.", type(skeleton).__name__)
