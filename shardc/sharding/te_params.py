"""FP8 parameters of TransformerEngine (TE): models built under ``te.quantized_model_init``.

Such a model holds its GEMM weights only as TE ``Float8Tensor`` parameters (FP8 bytes plus a
per-tensor ``scale_inv``); the high-precision master weights live in the optimizer (TE's
``FusedAdam(master_weights=True)``). shardc shards and gathers them without high-precision copies:

- **Shard** (:func:`shard_float8_param`): each rank keeps its ``torch.chunk`` rows of the FP8
  bytes as a ``Float8Tensor`` with the same scale, inside a ``Shard(0)`` DTensor parameter (the
  layout FSDP2 gives TE, which TE's ``FusedAdam`` steps and re-wraps for DCP). Under TE's current
  scaling, the shard's re-quantization after an optimizer step reduces its amax over the
  sharding group, so every shard keeps the scale of the whole weight.
- **Gather** (:func:`gather_float8_param`): inside a module's forward, the FP8 bytes of the
  shards are all-gathered (1 byte per element) and rebuilt into a full ``Float8Tensor`` with the
  shards' common scale, which TE's module computes with as it would with its own parameter. The
  weight gradient TE returns (high precision) is averaged over ranks in ``reduce_dtype`` and
  scattered back as the DTensor parameter's gradient. The gather runs eagerly (a graph break
  under ``torch.compile``: Dynamo cannot build TE's tensor subclass), once per module forward;
  TE saves the gathered FP8 weight for its backward, so these weights stay gathered from the
  forward to the backward (``reshard_after_forward`` does not apply to them).
- **State dict** (:func:`dequantized_value`): ``state_dict()`` holds the FP8 weights dequantized
  to the parameter's nominal dtype (a plain ``Shard(0)`` DTensor), so DCP saves, reshards N -> M
  and loads them like any weight; loading copies them back into the FP8 shard, which TE
  re-quantizes (with the same group amax reduction).

Every use of TE's FP8-tensor internals (``_data``, ``_scale_inv``, the quantizer) is here.
``transformer_engine`` is imported only once a TE tensor is seen.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardc.ops.gather import shard_grad
from shardc.ops.gather_args import ReduceArgs
from shardc.runtime.collectives import all_gather_rows
from shardc.runtime.grad_sync import STASH

# The first gathers of each FP8 parameter also gather every rank's scale and check that they
# agree: a quantizer whose amax is not reduced over the sharding group would give the shards
# different scales, which one gathered Float8Tensor cannot represent.
SCALE_CHECKS = 3
_CACHE = "_shardc_fp8_param_cache"


def is_quantized(p: torch.Tensor) -> bool:
    """Whether ``p`` is a quantized tensor subclass that brings FSDP2 all-gather hooks (TE's
    ``QuantizedTensor`` parameters, torchao's); DTensors (already sharded) are not."""
    return not isinstance(p, DTensor) and hasattr(p, "fsdp_pre_all_gather")


def _float8_classes():
    from transformer_engine.pytorch.tensor import (
        Float8CurrentScalingQuantizer,
        Float8Quantizer,
        Float8Tensor,
    )

    return Float8Tensor, (Float8Quantizer, Float8CurrentScalingQuantizer)


def check_quantized_param(fqn: str, p: torch.Tensor) -> None:
    """Raise a clear error unless ``p`` is an FP8 parameter shardc can shard: a 2-D TE
    ``Float8Tensor`` with per-tensor scaling (delayed or current) that holds its row-wise
    bytes, materialized on a device."""
    kind = type(p).__name__
    if not type(p).__module__.startswith("transformer_engine"):
        raise NotImplementedError(
            f"shardc.shard: parameter {fqn!r} is a quantized tensor ({kind}) with its own "
            "all-gather hooks (fsdp_pre_all_gather); shardc supports TransformerEngine's "
            "Float8Tensor parameters only. Build the model with high-precision parameters and "
            "gather them in FP8 with shardc.shard(model, fp8=shardc.Float8Policy())."
        )
    float8_tensor, quantizers = _float8_classes()
    if not isinstance(p, float8_tensor) or not isinstance(p._quantizer, quantizers):
        raise NotImplementedError(
            f"shardc.shard: parameter {fqn!r} is a TransformerEngine {kind} "
            f"(quantizer {type(getattr(p, '_quantizer', None)).__name__}); shardc shards FP8 "
            "parameters with per-tensor scaling only. Use te.quantized_model_init with a "
            "DelayedScaling or Float8CurrentScaling recipe, or build the model without "
            "quantized_model_init and use shardc.shard(model, fp8=shardc.te_float8_policy())."
        )
    if p.dim() != 2:
        raise NotImplementedError(
            f"shardc.shard: FP8 parameter {fqn!r} is {p.dim()}-D; only 2-D FP8 weights are "
            "supported."
        )
    if p.device.type == "meta" or p._data is None:
        raise ValueError(
            f"shardc.shard: FP8 parameter {fqn!r} has no row-wise FP8 data (a meta-device or "
            "column-only tensor); build it on the GPU under te.quantized_model_init before "
            "sharding."
        )


def shard_float8_param(p: torch.Tensor, start: int, rows: int, device: torch.device
                       ) -> torch.Tensor:
    """Rows ``start:start + rows`` of the FP8 parameter ``p`` as a ``Float8Tensor`` on
    ``device``: the FP8 bytes copied, the scale (``scale_inv``) copied, the quantizer kept (so a
    delayed-scaling quantizer still shares its module's scale and amax). No transpose is kept;
    TE builds one from the bytes where it needs it."""
    float8_tensor, _ = _float8_classes()
    data = p._data.detach().narrow(0, start, rows).to(device).clone()
    shard = float8_tensor(
        shape=data.shape,
        dtype=p.dtype,
        data=data,
        fp8_scale_inv=p._scale_inv.detach().to(device).clone(),
        fp8_dtype=p._fp8_dtype,
        quantizer=p._quantizer,
        requires_grad=False,
        device=device,
    )
    return shard


def bind_shard(param: DTensor, group: dist.ProcessGroup) -> None:
    """Finish the FP8 parameter ``param`` (a ``Shard(0)`` DTensor of an FP8 shard): under
    current scaling its re-quantizations (the optimizer's write-back, ``load_state_dict``'s copy)
    reduce the amax over ``group``, as TE does for FSDP2's shards. Set on the DTensor's own local
    tensor: wrapping makes new Float8Tensor objects, and the attribute is per object."""
    local = param._local_tensor
    if group.size() > 1 and _is_current_scaling(local._quantizer):
        local.amax_reduction_group = group


def _is_current_scaling(quantizer) -> bool:
    from transformer_engine.pytorch.tensor import Float8CurrentScalingQuantizer

    return isinstance(quantizer, Float8CurrentScalingQuantizer)


def _rebuild(shard: torch.Tensor, data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """A ``Float8Tensor`` of the gathered ``data`` (uint8) with ``shard``'s format and quantizer,
    for the forward GEMM (row-wise); TE adds the transpose for its backward."""
    float8_tensor, _ = _float8_classes()
    out = float8_tensor(
        shape=data.shape,
        dtype=shard.dtype,
        data=data,
        fp8_scale_inv=scale_inv,
        fp8_dtype=shard._fp8_dtype,
        quantizer=shard._quantizer,
        requires_grad=False,
        device=data.device,
    )
    out._quantizer.set_usage(rowwise=True, columnwise=False)
    return out


def _check_scales(shard: torch.Tensor, fqn: str, world: int, group_name: str) -> None:
    scale = shard._scale_inv.detach().reshape(1).float()
    every = all_gather_rows(scale, world, world, group_name)
    if not torch.equal(every, every[:1].expand_as(every)):
        raise RuntimeError(
            f"shardc: the shards of FP8 parameter {fqn!r} have different scales on different "
            f"ranks ({every.tolist()}); their quantizer does not reduce its amax over the "
            "sharding group. Use te.quantized_model_init with Float8CurrentScaling or "
            "DelayedScaling and train under shardc.te_autocast(model)."
        )


class _GatherFloat8(torch.autograd.Function):
    """All-gather of an FP8 shard's bytes into a full ``Float8Tensor``; its (high-precision)
    gradient is averaged over ranks and scattered back to the shard."""

    @staticmethod
    def forward(ctx, shard, info, grad_sync: int, sync_key: str, check: bool):
        data = all_gather_rows(shard._data, info.dim0, info.world, info.group_name)
        if check and info.world > 1:
            _check_scales(shard, info.fqn, info.world, info.group_name)
        ctx.info, ctx.grad_sync, ctx.sync_key = info, grad_sync, sync_key
        ctx.shard_meta = (tuple(shard.shape), shard.dtype, shard.device)
        return _rebuild(shard, data, shard._scale_inv.detach().clone())

    @staticmethod
    def backward(ctx, grad):
        info = ctx.info
        shape, dtype, device = ctx.shard_meta
        # A plain tensor shaped like the shard: zeros_like of the FP8 shard would be FP8.
        like = torch.empty(shape, dtype=dtype, device=device) if ctx.grad_sync == STASH else None
        reduce_args = ReduceArgs(None, info.fqn, info.dim0, info.world, info.group_name,
                                 info.reduce_dtype, dtype)
        local = shard_grad(grad, reduce_args, ctx.grad_sync, ctx.sync_key, like)
        return local, None, None, None, None


@torch.compiler.disable
def gather_float8_param(
    module: nn.Module, name: str, param: DTensor, info, grad_sync: int, sync_key: str
) -> torch.Tensor:
    """The full FP8 weight ``name`` of ``module`` for its current forward (gathered once per
    forward: TE reads a weight more than once)."""
    cache = module.__dict__.setdefault(_CACHE, {})
    if name in cache:
        return cache[name][0]
    counts = module.__dict__.setdefault("_shardc_fp8_param_gathers", {})
    counts[name] = counts.get(name, 0) + 1
    full = _GatherFloat8.apply(param.to_local(), info, grad_sync, sync_key,
                               counts[name] <= SCALE_CHECKS)
    cache[name] = (full, full._quantizer)
    return full


def clear_gathered(module: nn.Module, *args) -> None:
    """Forward pre- and post-hook of a module with FP8 parameters: forget the gathered weights
    (autograd keeps what TE saved for the backward).

    TE gives a module's FP8 weights new quantizers during a forward when it rebuilds its FP8
    state (e.g. a recipe with another amax history length): it reads the weights, which inside
    the forward are the gathered ones, and calls their ``update_quantizer``. The shard must
    follow, or the optimizer's FP8 write-back would use the old scale and amax buffers."""
    cache = module.__dict__.pop(_CACHE, None) or {}
    for name, (full, given) in cache.items():
        local = module._parameters[name]._local_tensor
        if full._quantizer is not given and local._quantizer is not full._quantizer:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TE warned when it updated the gathered one
                local.update_quantizer(full._quantizer)


def dequantized_value(value: torch.Tensor) -> torch.Tensor:
    """``value`` (a state-dict entry) with an FP8 local shard replaced by its dequantized values
    in the parameter's nominal dtype, as a DTensor of the same placements; others unchanged."""
    if not isinstance(value, DTensor) or not is_quantized(value._local_tensor):
        return value
    local = value._local_tensor
    with torch.no_grad():
        plain = local.dequantize(dtype=local.dtype)
    return DTensor.from_local(plain, value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def state_dict_hook(names: tuple[str, ...]):
    """A ``state_dict`` post-hook for a module whose parameters ``names`` are FP8 shards."""

    def hook(module, state_dict, prefix, local_metadata) -> None:
        for name in names:
            key = prefix + name
            if key in state_dict:
                state_dict[key] = dequantized_value(state_dict[key])

    return hook


def zero_grad_like(p: torch.Tensor) -> torch.Tensor:
    """A zero gradient for ``p`` that is a plain tensor (a DTensor of plain local) even where
    ``p``'s local shard is FP8, as the backward gives it."""
    if isinstance(p, DTensor) and is_quantized(p._local_tensor):
        local = p._local_tensor
        zeros = torch.zeros(local.shape, dtype=local.dtype, device=local.device)
        return DTensor.from_local(zeros, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return torch.zeros_like(p)


def has_quantized_shards(params) -> bool:
    return any(isinstance(p, DTensor) and is_quantized(p._local_tensor) for p in params)
