"""Which ``torch.optim`` implementation steps a parameter group, and what it allocates.

``torch.optim``'s Adam/AdamW (SGD alike) has three implementations, and the option
``optimizer_impl`` (:data:`IMPLEMENTATIONS`) names the one the user's optimizer runs:

- ``"auto"``: ``foreach`` and ``fused`` left unset (``torch.optim.AdamW(params)``). torch picks
  per parameter group at each step (``torch.optim.optimizer._default_to_fused_or_foreach``):
  ``foreach`` where every tensor of the group is on a device with foreach kernels (CUDA), the
  per-tensor implementation where any is on the host. So the group the peak budget's partial
  optimizer offload mixes (host masters beside device shards,
  ``shardc.runtime.offload_optimizer``) steps its device part per tensor, and a group of host
  masters only (CPU offload) steps per tensor on the host.
- ``"foreach"`` (``foreach=True``): the multi-tensor kernels, one device/dtype group at a time.
- ``"fused"`` (``fused=True``): one fused kernel per device/dtype group, no temporaries.
- ``"per_tensor"`` (``foreach=False``): the per-tensor loop (``_single_tensor_adam``).

The predictions read from this (a plan is made for a GPU run: ``"auto"`` takes the device for
a CUDA one, also when the plan is made on a CPU mesh):

- device temporaries of the step (:func:`step_temp_bytes`): ``foreach``: ``temp_factor`` bytes
  per stepped byte (Adam's ``_foreach_sqrt`` of the second moments, one list as large as the
  stepped shards); ``fused``: none; per tensor: ``denom = (exp_avg_sq.sqrt() / c).add_(eps)``:
  a tensor's square root and quotient exist together, and the previous tensor's ``denom``
  lives on until the next one replaces it, so the most of ``2 * shard + previous shard``
  (:func:`per_tensor_temp_bytes`; the shards in the order the graph gathers them, the
  optimizer's being ``model.parameters()``'s, nearly the same). Measured on CPU tensors
  with a dispatch-mode count of the live tensors the step creates
  (tests/test_optimizer_kind.py): exactly these.
- the host step's rate (``shardc.planning.estimate.host_optimizer_seconds``): fused: the
  profile's ``host_adamw_params_per_s``; the others: ``host_adamw_per_tensor_params_per_s``
  (profile version 7, else the fused rate over :data:`DEFAULT_PER_TENSOR_HOST_SLOWDOWN`).
- the device step's kernels (``shardc.planning.estimate.optimizer_step_seconds``): per tensor,
  each op is a kernel per tensor instead of one per chunk of tensors.
"""

from __future__ import annotations

IMPLEMENTATIONS = ("auto", "foreach", "fused", "per_tensor")
RAN = ("foreach", "fused", "per_tensor")
# The per-tensor CPU AdamW's rate against the fused one where a profile has not measured it
# (profile versions before 7): on a 2-core test host 4.3x (2 threads) and 5.9x (1 thread)
# slower; docs/cost_model.md. Conservative: a slower host step than the memory-bound passes'
# 20/7 would give.
DEFAULT_PER_TENSOR_HOST_SLOWDOWN = 6.0


def check(impl: str) -> str:
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"shardc: optimizer_impl must be one of {IMPLEMENTATIONS}, got "
                         f"{impl!r}")
    return impl


def ran(impl: str, temp_factor: float = 1.0, *, host_in_group: bool = False) -> str:
    """The implementation that steps a group (:data:`RAN`): ``impl`` where the user chose one;
    ``"auto"``: per tensor where the group holds host tensors (``host_in_group``: host masters,
    alone or beside device shards), else foreach. A ``temp_factor`` of 0 with ``"auto"`` reads
    as the fused implementation (what ``optimizer_temp_factor=0`` meant before
    ``optimizer_impl``)."""
    check(impl)
    if impl != "auto":
        return impl
    if temp_factor <= 0:
        return "fused"
    return "per_tensor" if host_in_group else "foreach"


def step_temp_bytes(ran_as: str, stepped_bytes: float, per_tensor_bytes: float,
                    temp_factor: float = 1.0) -> int:
    """Device bytes of temporaries the optimizer's step holds at its peak over
    ``stepped_bytes`` of shards on the device, implementation ``ran_as``;
    ``per_tensor_bytes``: the per-tensor loop's (:func:`per_tensor_temp_bytes`). See the
    module docstring."""
    if stepped_bytes <= 0 or temp_factor <= 0 or ran_as == "fused":
        return 0
    if ran_as == "foreach":
        return int(stepped_bytes * temp_factor)
    return int(per_tensor_bytes)


def per_tensor_temp_bytes(shards, state_factor: float = 2.0) -> int:
    """The most device bytes of temporaries the per-tensor loop holds, over ``shards``: the
    group's shards' bytes in the order it steps them (as the allocator counts them: the
    caller's, e.g. the CUDA caching allocator's blocks, ``shardc.memory.cuda_blocks``), ``None``
    for one stepped on the host.
    Adam/AdamW (``state_factor`` 2): a tensor's square root and quotient, beside the previous
    tensor's ``denom`` where that one is on the device (``_single_tensor_adam``); SGD: one
    shard (weight decay's ``grad.add(param)``)."""
    most, before = 0.0, None
    for size in shards:
        if size is not None:
            here = 2 * size + (before or 0.0) if state_factor >= 2 else size
            most = max(most, here)
        before = size
    return int(most)


def describe(ran_as: str, *, mixed: bool = False) -> str:
    """A few words for a plan's notes and reports."""
    what = {"foreach": "foreach (multi-tensor kernels)", "fused": "fused",
            "per_tensor": "per tensor"}[ran_as]
    return what + (" (a parameter group mixing host- and device-stepped parameters, foreach "
                   "unset)" if mixed and ran_as == "per_tensor" else "")


def from_optimizer(optimizer) -> dict:
    """The backend options describing a ``torch.optim`` optimizer: ``optimizer_impl`` from its
    ``foreach`` / ``fused`` defaults, and ``optimizer_state_factor`` /
    ``optimizer_temp_factor`` for Adam/AdamW and SGD (others: the Adam defaults).
    ``torch.compile(model, backend=shardc.backend(**from_optimizer(opt)))``."""
    defaults = getattr(optimizer, "defaults", {}) or {}
    fused, foreach = defaults.get("fused"), defaults.get("foreach")
    impl = "fused" if fused else "foreach" if foreach else \
        "per_tensor" if foreach is False else "auto"
    name = type(optimizer).__name__
    if name == "SGD":
        state = 1.0 if defaults.get("momentum") else 0.0
        return {"optimizer_impl": impl, "optimizer_state_factor": state,
                "optimizer_temp_factor": 1.0}
    # Adam's L2 weight decay (not AdamW's decoupled one) and ``maximize`` each add a gradient-
    # sized foreach list (``_foreach_add(grads, params)``, ``_foreach_neg(grads)``).
    temp = 1.0 + (name == "Adam" and bool(defaults.get("weight_decay"))
                  and not defaults.get("decoupled_weight_decay")) \
        + bool(defaults.get("maximize"))
    return {"optimizer_impl": impl, "optimizer_state_factor": 2.0,
            "optimizer_temp_factor": float(temp)}
