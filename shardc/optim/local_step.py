"""``shardc.optim.local_shard_step``: a torch.optim optimizer steps the local shards.

After ``shardc.shard`` every parameter, its gradient and its optimizer state are DTensors. A
torch.optim step over DTensors sends each of its ops (a foreach op over every parameter, or the
fused kernel) through DTensor's dispatch, which costs Python time per parameter and per op on
every step (30-40 us per parameter for AdamW, measured in docs/overhead.md) while the math is the
same elementwise math on each rank's local shard.

``local_shard_step(optimizer)`` registers a step pre-hook and a step post-hook on the optimizer
(torch's public hooks) so that *inside* ``optimizer.step()`` the optimizer sees, for each
parameter, its local shard (the tensor the DTensor wraps, the same object every step: what
``param.to_local()`` returns under no_grad on torch 2.11, where 2.13 returns a view of it) with
the local gradient, and the local tensors of its DTensor state. torch.optim's own code then
picks its foreach or fused kernels over plain tensors, exactly as for an unsharded model. The
post-hook puts everything back:
outside ``step()`` the optimizer holds the DTensor parameters and DTensor state as before, so
``state_dict()``, ``load_state_dict()``, DCP (``get_optimizer_state_dict``), ``zero_grad()``,
learning-rate schedulers and gradient clipping see nothing different. State that the step creates
(the first step's ``exp_avg``...) is wrapped into DTensors laid out like the parameter, as torch
would have created it. The user's optimizer class, arguments and code are unchanged.

Only optimizers whose update is elementwise within each parameter give the same result on the
shards (``ELEMENTWISE``: SGD, Adam, AdamW, ...); any other class is refused with a clear error,
because stepping it per shard would be silently wrong (Adafactor's row and column statistics,
LBFGS's flattening). If ``step()`` raises, the post-hook does not run: the next ``step()`` or
``state_dict()`` puts the DTensor view back first.
"""

from __future__ import annotations

from operator import is_

import torch
from torch.distributed.tensor import DTensor

from shardc._torch import dtensor_local_fast as _local_of
from shardc._torch import dtensor_on_local_device

# torch.optim optimizers whose update of each parameter is elementwise over it, given its
# gradient and its own state (plus scalars): the same on the local shards as on the whole.
ELEMENTWISE: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in (
        "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "ASGD", "NAdam", "RAdam",
        "RMSprop", "Rprop",
    ) if hasattr(torch.optim, name)
)


class LocalShardStep:
    """The hooks of :func:`local_shard_step` on one optimizer; ``remove()`` undoes them.
    ``step_hooks=False``: no step hooks of its own (``shardc.optim.default_local_step`` calls
    :meth:`_pre` and :meth:`_restore` from its process-wide ones), the state-dict hooks that
    put a step's leftovers back all the same."""

    def __init__(self, optimizer: torch.optim.Optimizer, step_hooks: bool = True) -> None:
        self.optimizer = optimizer
        # Set between the pre- and post-hook: per group, its DTensor parameter list.
        self._saved: list[list] | None = None
        # id(local shard) -> (DTensor parameter, its DTensor state dict or None, the local
        # state dict the step sees, [(key, DTensor value, its local tensor)]), for this step.
        self._owner: dict[int, tuple] = {}
        # id(DTensor parameter) -> the same tuple from the last step: its local state dict is
        # reused while the DTensor state dict and its values are the same objects.
        self._cache: dict[int, tuple] = {}
        self._handles = [
            optimizer.register_state_dict_pre_hook(self._restore),
            optimizer.register_load_state_dict_pre_hook(self._restore_before_load),
        ]
        if step_hooks:
            self._handles += [optimizer.register_step_pre_hook(self._pre),
                              optimizer.register_step_post_hook(self._post)]

    def remove(self) -> None:
        self._restore(self.optimizer)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _local_state(self, p: DTensor, held: dict | None) -> tuple:
        """``p``'s entry for this step: ``(p, held, the local state dict the step sees, [(key,
        DTensor value, its local tensor)], held's values, the local dict's values)``; the last
        step's while ``held`` is the same dict holding the same objects (identity, C-level)."""
        cached = self._cache.get(id(p))
        if (cached is not None and cached[0] is p and cached[1] is held and held is not None
                and len(held) == len(cached[4]) and all(map(is_, held.values(), cached[4]))):
            return cached
        if held is None:
            return (p, None, None, [], (), ())
        pairs = [(k, v, _local_of(v)) for k, v in held.items() if isinstance(v, DTensor)]
        local = dict(held)
        local.update((k, loc) for k, _, loc in pairs)
        return (p, held, local, pairs, tuple(held.values()), tuple(local.values()))

    def _pre(self, optimizer, args, kwargs) -> None:
        self._restore(optimizer)  # a step that raised left the local view installed
        saved, owner, state = [], {}, optimizer.state
        with torch.no_grad():
            for group in optimizer.param_groups:
                params = group["params"]
                saved.append(params)
                local_params = []
                for p in params:
                    if not isinstance(p, DTensor):
                        local_params.append(p)
                        continue
                    local = _local_of(p)  # the shard itself: the same object every step
                    grad = p.grad
                    local.grad = _local_of(grad) if isinstance(grad, DTensor) else grad
                    entry = self._local_state(p, state.pop(p, None))
                    if entry[2] is not None:
                        state[local] = entry[2]
                    owner[id(local)] = entry
                    local_params.append(local)
                group["params"] = local_params
        self._saved, self._owner = saved, owner

    def _post(self, optimizer, args, kwargs) -> None:
        self._restore(optimizer)

    def _restore_before_load(self, optimizer, state_dict):
        self._restore(optimizer)
        self._cache.clear()
        return None

    def _restore(self, optimizer) -> None:
        """Put the DTensor parameters and state back (a no-op outside a step)."""
        saved, owner = self._saved, self._owner
        if saved is None:
            return
        self._saved, self._owner = None, {}
        cache: dict[int, tuple] = {}
        with torch.no_grad():
            state = optimizer.state
            for group, params in zip(optimizer.param_groups, saved):
                for local in group["params"]:
                    entry = owner.get(id(local))
                    if entry is None:
                        continue
                    p, held, local_state = entry[0], entry[1], entry[2]
                    local.grad = None
                    stepped = state.pop(local, None)
                    if stepped is None:  # the step did not touch it (no gradient)
                        if held is not None:
                            state[p] = held
                        continue
                    if (stepped is local_state and len(stepped) == len(entry[5])
                            and all(map(is_, stepped.values(), entry[5]))):
                        # Updated in place, nothing rebound: the DTensor state is current.
                        state[p] = held
                        cache[id(p)] = entry
                        continue
                    state[p] = wrap_stepped_state(p, local, held or {}, stepped, optimizer)
                group["params"] = params
        self._cache = cache


def wrap_stepped_state(p: DTensor, local: torch.Tensor, held: dict, stepped: dict,
                       optimizer) -> dict:
    """``p``'s state after a step over its local shard ``local`` (here, and on
    ``shardc.step_in_backward``'s worker): its DTensor state objects (``held``) where the step
    updated their local tensors in place, new tensors shaped like the shard wrapped as DTensors
    like ``p``, where the step made them."""
    out = {}
    for key, value in stepped.items():
        before = held.get(key)
        if isinstance(before, DTensor) and _local_of(before) is value:
            out[key] = before
        elif isinstance(value, DTensor):
            out[key] = value
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape != local.shape:
                raise NotImplementedError(
                    f"shardc.optim.local_shard_step: {type(optimizer).__name__} keeps state "
                    f"{key!r} of shape {tuple(value.shape)} for a parameter shard of shape "
                    f"{tuple(local.shape)}; only elementwise state is supported."
                )
            # Where the step made it: ``DTensor.from_local`` would move a host shard's new
            # state to the mesh's device (CPU offload: host shards on a CUDA mesh).
            out[key] = dtensor_on_local_device(value, p.device_mesh, p.placements, p.shape,
                                               p.stride())
        else:
            out[key] = value  # scalars: step counters, Python numbers
    return out


def local_shard_step(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` run torch.optim's kernels (foreach or fused, as the optimizer
    chooses) over the local shards of its DTensor parameters instead of through DTensor's
    dispatch; returns ``optimizer`` (in place). Everything outside ``step()`` is unchanged (see
    the module's docstring). ``optimizer`` must be one of :data:`ELEMENTWISE`'s classes (or a
    subclass); a second call on the same optimizer raises.
    """
    if not isinstance(optimizer, ELEMENTWISE):
        raise TypeError(
            f"shardc.optim.local_shard_step: {type(optimizer).__name__} is not one of the "
            f"optimizers known to update each parameter elementwise "
            f"({', '.join(c.__name__ for c in ELEMENTWISE)}); stepping it on local shards could "
            "be silently wrong. Use the optimizer as it is (its step goes through DTensor)."
        )
    if getattr(optimizer, "_shardc_local_step", None) is not None:
        raise ValueError("shardc.optim.local_shard_step: already applied to this optimizer.")
    optimizer._shardc_local_step = LocalShardStep(optimizer)
    return optimizer
