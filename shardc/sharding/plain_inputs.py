"""Plain inputs (``shardc.shard(..., plain_inputs=True)``): forwards read each parameter's local
shard as a plain tensor, and its gradient is handed to the DTensor parameter once it exists.

Why: a DTensor a compiled region reads costs host time every step (docs/overhead.md, "What is
left at 32 layers"): Dynamo guards each one (its type, its spec, its local tensor), AOTAutograd's
wrappers unwrap every DTensor input and wrap every DTensor gradient, and autograd accumulates
each gradient into ``param.grad`` through DTensor's dispatch. With plain inputs Dynamo and
AOTAutograd see one plain tensor per parameter (the *leaf*), exactly what a replicated model
hands them, and the DTensor parameters are never read inside a forward.

The leaf is a detached alias of the parameter's local shard (the same storage, so every in-place
update of the parameter (optimizer steps, ``load_state_dict``, DCP loads, ``copy_``) is what the
next forward reads) that requires grad. Autograd accumulates the shard's gradient into
``leaf.grad`` (plain tensors, C++ only); a post-accumulate-grad hook on the leaf then hands it to
the parameter: ``param.grad`` becomes a DTensor of that gradient (no copy), or the gradient is
added to the ``param.grad`` already there (accumulation without ``zero_grad``, ``no_sync``), and
``leaf.grad`` is cleared. So after ``backward()`` the user sees what they see without this
option: DTensor parameters whose ``.grad`` is a DTensor.

What keeps the leaf and the parameter one tensor:

- ``nn.Module._apply`` (``to_empty``, ``.to``, ``.double()``) swaps the parameter's contents:
  shardc's ``_apply`` override rebuilds the leaf (:meth:`PlainInputs.refresh`);
- a parameter replaced by another object (``register_parameter``, attribute assignment,
  ``load_state_dict(assign=True)``): the leaf is dropped and that parameter is read as before
  (the DTensor; a non-DTensor raises shardc's "replaced after sharding" error);
- anything else that gives the parameter new storage without shardc seeing it (``param.data =
  ...``, ``torch.utils.swap_tensors``): the hand-off finds the leaf no longer aliases the
  parameter's shard and raises before the gradient reaches ``param.grad`` (so no optimizer step
  uses a gradient of stale values), naming the parameter.

Which parameters keep the DTensor read (today's path): those gathered in FP8, TransformerEngine
FP8 parameters, tensor-parallel ones, CPU-offloaded ones (any offload policy), parameters frozen
(``requires_grad=False``) when the leaves are built. (``shardc.step_in_backward``, which hooks
the DTensor parameters' accumulation, needs CPU offload, which keeps the DTensor read.)
Hooks a user registers on a DTensor parameter (``register_hook``,
``register_post_accumulate_grad_hook``) run from the hand-off, as autograd would run them for
the DTensor parameter (:func:`give_grad`).
The DTensor parameter is not in the autograd graph, though: ``torch.autograd.grad(loss,
model.parameters())`` and ``backward(inputs=params)`` do not reach it (torch reports it unused,
as it does for FSDP2's sharded parameters); use ``backward()`` and read ``.grad``, or shard
with ``plain_inputs=False``.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardc import _torch

LEAVES_ATTR = "_shardc_leaves"  # on each sharded module: {parameter name: leaf}


class PlainInputs:
    """One sharded model's leaves: which module attributes read them, built and dropped here."""

    def __init__(self) -> None:
        # fqn -> the (module, attribute name) pairs that own the parameter (tied: several).
        self._owners: dict[str, list[tuple[weakref.ref, str]]] = {}
        self.handed = 0  # gradients handed to parameters (tests and benchmarks read it)

    def add_owner(self, fqn: str, module: nn.Module, name: str) -> None:
        self._owners.setdefault(fqn, []).append((weakref.ref(module), name))
        if LEAVES_ATTR not in module.__dict__:
            module.__dict__[LEAVES_ATTR] = {}

    def owners(self, fqn: str) -> list[tuple[nn.Module, str]]:
        return [(m, n) for ref, n in self._owners.get(fqn, []) if (m := ref()) is not None]

    def refresh(self, fqn: str, eligible: bool) -> None:
        """Build ``fqn``'s leaf anew from the parameter its owners hold (all of them the same
        DTensor object), or drop it where that is not so (then forwards read the DTensor)."""
        owners = self.owners(fqn)
        params = {id(m._parameters.get(n)): m._parameters.get(n) for m, n in owners}
        param = next(iter(params.values())) if len(params) == 1 else None
        leaf = None
        if (eligible and isinstance(param, DTensor) and param.requires_grad
                and param.dtype.is_floating_point):
            leaf = _make_leaf(self, fqn, param)
        for module, name in owners:
            leaves = module.__dict__.setdefault(LEAVES_ATTR, {})
            if leaf is None:
                leaves.pop(name, None)
            else:
                leaves[name] = leaf

    def follow(self, fqn: str) -> None:
        """``fqn``'s parameter got new contents from shardc itself (packed blocks move the
        shards into the block's buffer): rebuild its leaf if it has one, so that the leaf
        aliases the new shard."""
        if any(name in module.__dict__.get(LEAVES_ATTR, {}) for module, name in self.owners(fqn)):
            self.refresh(fqn, eligible=True)


def leaf_for(module: nn.Module, name: str) -> torch.Tensor | None:
    """The plain leaf a forward of ``module`` reads for its parameter ``name``, or None."""
    leaves = module.__dict__.get(LEAVES_ATTR)
    return None if leaves is None else leaves.get(name)


def _make_leaf(plain: PlainInputs, fqn: str, param: DTensor) -> torch.Tensor:
    with torch.no_grad():
        local = param.to_local()
    leaf = local.detach().requires_grad_(True)
    # The parameter is found through its (first) owner, never held: a weak reference to it
    # would make torch.utils.swap_tensors (nn.Module._apply) refuse it.
    owner_ref, name = plain._owners[fqn][0]

    def hand_off(leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        owner = owner_ref()
        if owner is None or grad is None:
            return
        target = owner._parameters.get(name)
        _check_current(fqn, target, leaf)
        if not target.requires_grad:  # frozen after the leaf was built: no gradient, as before
            return
        give_grad(target, grad)
        plain.handed += 1

    leaf.register_post_accumulate_grad_hook(hand_off)
    return leaf


def give_grad(param: DTensor, grad: torch.Tensor) -> None:
    """Hand ``grad`` (a plain tensor of ``param``'s local shape) to the DTensor ``param`` as
    autograd's accumulation into a DTensor parameter would: its ``.grad`` becomes a DTensor of
    it (no copy), or it is added into the ``.grad`` already there. The parameter's own hooks
    run as they would there: each ``register_hook`` hook on the DTensor gradient before it is
    accumulated (a tensor it returns replaces the gradient), each
    ``register_post_accumulate_grad_hook`` hook on the parameter afterwards (FSDP2 runs the
    latter on its sharded parameters too). Called from autograd's post-accumulate-grad hooks,
    which run with grad mode off (create_graph aside, which a sharded parameter's gathered
    gradient does not support): no autograd on these tensors."""
    pre, post = _torch.grad_hooks(param)
    if pre:
        grad = _torch.dtensor_with_spec_of(grad, param)
        for hook in pre:
            out = hook(grad)
            grad = grad if out is None else out
    held = param.grad
    if held is None:
        param.grad = grad if pre else _torch.dtensor_with_spec_of(grad, param)
    elif pre:  # a hook's result may be any DTensor of the parameter's shape
        held.add_(grad)
    else:  # accumulation without zero_grad (micro-batches): in place, as autograd does
        _torch.dtensor_local(held).add_(grad)
    for hook in post:
        if hook(param) is not None:  # what autograd says of such a hook on the DTensor read
            raise RuntimeError("Tensor post accumulate grad hooks should return None.")


def _check_current(fqn: str, param, leaf: torch.Tensor) -> None:
    """The leaf must still alias the shard of the parameter the model holds."""
    local = _torch.dtensor_local(param) if isinstance(param, DTensor) else None
    if (local is None or local.data_ptr() != leaf.data_ptr() or local.shape != leaf.shape
            or local.dtype != leaf.dtype):
        raise RuntimeError(
            f"shardc: parameter {fqn!r} got new storage after shardc.shard without shardc "
            "seeing it (param.data = ..., torch.utils.swap_tensors, or a parameter put "
            "directly into _parameters), so this forward read its old values "
            "(plain_inputs=True reads an alias of the shard); its gradient is refused. Change "
            "values in place (param.to_local().copy_(...) under torch.no_grad(), "
            "load_state_dict, DCP), move the model with to_empty() / .to(), or shard with "
            "plain_inputs=False."
        )
