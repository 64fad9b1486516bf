"""Torch-native FP8 for sharded weights (``nn.Linear``, ``nn.Embedding``...): FP8 all-gather, FP8
or dequantized compute.

Contract (``shardc.shard(model, fp8=Float8Policy())``):

- Per step and parameter, a per-tensor scale ``finfo(fp8).max / amax`` is computed from the global
  absolute maximum of the current high-precision weight (current scaling). The global amax is a
  MAX all-reduce of each rank's shard amax (:func:`fp8_amax`); the ``shardc`` backend merges the
  all-reduces of a compiled region into one (``shardc.passes.fp8``), so a step issues one.
  Scales are identical on every rank.
- Each rank quantizes its shard with that scale, and the gather moves the FP8 shards (1 byte per
  element; collectives see a ``uint8`` view, which every backend supports).
- The gathered FP8 weight either feeds ``torch._scaled_mm`` (CUDA, ``Float8Policy.scaled_mm``,
  every dimension a multiple of 16; the activation gets its own per-tensor e4m3 scale and, in
  backward, the output gradient an e5m2 one, both computed locally: forward, input gradient
  and weight gradient all run on FP8 matmuls, as TransformerEngine's recipes do), or is
  dequantized to the
  compute dtype (``mp_policy.param_dtype``, else the parameter's dtype) and used by the
  module's unchanged forward.
- Backward is straight-through: the weight gradient is computed in high precision as if the
  dequantized weight were the weight, averaged over ranks in ``reduce_dtype`` and scattered back
  to the shard. Master shards, optimizer state and checkpoints never hold FP8 values.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from shardc import _torch
from shardc.ops.gather import gather_param, shard_grad
from shardc.ops.gather_args import GatherArgs, ReduceArgs
from shardc.runtime.grad_sync import STASH
from shardc.sharding.scope import gathering

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_EPS = 1e-12  # amax floor: an all-zero weight gets a finite scale and quantizes to zeros


@dataclass(frozen=True)
class Float8Policy:
    """Which weights are gathered in FP8, and how they are computed with.

    ``dtype``: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.
    ``modules``: module classes whose weights are gathered in FP8 (default ``nn.Linear``,
    subclasses included). Modules other than ``nn.Linear`` (``nn.Embedding``: the token
    embedding, ``modules=(nn.Linear, nn.Embedding)``) compute on the dequantized weight; an
    ``nn.Embedding`` with ``sparse=True`` or ``max_norm`` is refused.
    ``weights``: which of a selected module's own parameters are its weights, as regexes that
    must match the whole parameter name (default ``("weight",)``; TransformerEngine's modules
    have several, see ``shardc.sharding.te.te_float8_policy``). Each must be 2-D.
    ``include`` / ``exclude``: regexes on the module's qualified name (``re.search``); a module is
    selected if it matches some ``include`` pattern (all, if empty) and no ``exclude`` pattern.
    ``filter``: optional ``(qualified_name, module) -> bool``, applied last.
    ``scaled_mm``: on CUDA, compute ``nn.Linear`` (exact class or subclasses that keep its
    forward) with ``torch._scaled_mm`` on the FP8 weight where the shapes allow it.
    """

    dtype: torch.dtype = torch.float8_e4m3fn
    modules: tuple[type[nn.Module], ...] = (nn.Linear,)
    weights: tuple[str, ...] = ("weight",)
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    filter: Callable[[str, nn.Module], bool] | None = None
    scaled_mm: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in FP8_DTYPES:
            raise ValueError(
                f"shardc.Float8Policy: dtype must be one of {FP8_DTYPES}, got {self.dtype}"
            )
        object.__setattr__(self, "modules", tuple(self.modules))
        object.__setattr__(self, "weights", tuple(self.weights))
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "exclude", tuple(self.exclude))

    def selects(self, name: str, module: nn.Module) -> bool:
        if not isinstance(module, self.modules):
            return False
        if self.include and not any(re.search(p, name) for p in self.include):
            return False
        if any(re.search(p, name) for p in self.exclude):
            return False
        return self.filter is None or bool(self.filter(name, module))


@dataclass(frozen=True)
class Fp8ParamInfo:
    """How one parameter is gathered in FP8 (constants in the graph)."""

    dtype: torch.dtype  # the FP8 dtype of the gather
    # The dequantized weight's dtype; None: the master shard's dtype when it is gathered (so a
    # later ``.to(dtype)`` / ``.double()`` of the module is followed).
    compute_dtype: torch.dtype | None


def select_fp8_params(
    module: nn.Module, policy: Float8Policy, owners: dict[str, int]
) -> set[str]:
    """Qualified names of the weights ``policy`` gathers in FP8.

    ``owners``: how many (module, name) slots hold each parameter (by canonical fqn). A weight
    shared with another module (tied embeddings) keeps the normal gather: the other reader
    needs the high-precision value, and one parameter has one gather per region.
    """
    chosen = set()
    for name, sub in module.named_modules():
        if not policy.selects(name, sub):
            continue
        for pname, weight in sub._parameters.items():
            if weight is None or not any(re.fullmatch(p, pname) for p in policy.weights):
                continue
            fqn = f"{name}.{pname}" if name else pname
            if fqn not in owners:  # an alias of a parameter registered under another name
                continue
            _check_fp8_weight(fqn, weight)
            if owners[fqn] == 1:
                if isinstance(sub, nn.Embedding):
                    _check_fp8_embedding(fqn, sub)
                chosen.add(fqn)
    return chosen


def _check_fp8_weight(fqn: str, weight: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(
            f"shardc.Float8Policy: {fqn!r} is {weight.dim()}-D; FP8 applies to 2-D weights "
            "(nn.Linear, nn.Embedding). Exclude the module with Float8Policy(exclude=(...,)) or "
            "narrow Float8Policy(weights=...)."
        )
    if not weight.is_floating_point():
        raise ValueError(f"shardc.Float8Policy: {fqn!r} is not floating point")


def _check_fp8_embedding(fqn: str, module: nn.Embedding) -> None:
    """An embedding reads its FP8 weight as a dequantized copy and gets a dense gradient."""
    fix = "exclude it with Float8Policy(exclude=(...,)) or leave nn.Embedding out of modules"
    if module.sparse:
        raise ValueError(
            f"shardc.Float8Policy: {fqn!r} belongs to an nn.Embedding with sparse=True, but the "
            f"FP8 gather reduce-scatters a dense weight gradient. Use sparse=False, or {fix}."
        )
    if module.max_norm is not None:
        # F.embedding renormalizes the rows it reads in place: here the dequantized copy, so
        # the master weight would silently never be renormalized.
        raise ValueError(
            f"shardc.Float8Policy: {fqn!r} belongs to an nn.Embedding with max_norm="
            f"{module.max_norm}, which renormalizes the weight in place, but an FP8 weight is "
            f"read as a dequantized copy. Use max_norm=None, or {fix}."
        )


# ------------------------------------------------------------------------------- numerics


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def local_amax(x: torch.Tensor) -> torch.Tensor:
    """``max(|x|)`` as a float32 0-d tensor; 0 for an empty shard (a rank past the last row).

    One reduction pass over ``x`` (no copy); shard sizes are static per rank, so the branch is
    decided at trace time."""
    if x.numel() == 0:
        return x.new_zeros((), dtype=torch.float32)
    return x.detach().abs().amax().float()


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The per-tensor scale (float32): ``x * scale`` spans the FP8 range."""
    return fp8_max(dtype) / amax.float().clamp(min=_EPS)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` saturated to the FP8 range and rounded to ``dtype``."""
    limit = fp8_max(dtype)
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = q.float() / scale
    # Never ``out.to(torch.float32)``: a no-op ``.to`` returns its input under a second name,
    # and torch 2.11's Dynamo routes the gradient of an autograd.Function whose returned tensor
    # is also one of its named intermediates to the wrong output, so the backward (our
    # reduce-scatter) got zeros: FP8-gathered weights received no gradient under torch.compile
    # (pytorch/pytorch#180642, fixed for 2.12; docs/fp8.md, TE results). Measured on GPU.
    return out if dtype == torch.float32 else out.to(dtype)


@torch.library.custom_op("shardc::fp8_amax", mutates_args=())
def fp8_amax(amax: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """The MAX over the ranks of ``group_name`` of each rank's ``amax`` (a MAX all-reduce).

    Compiled regions never run this op: ``shardc.passes.fp8`` replaces all of a region's
    instances by one all-reduce of the stacked amaxes (same values: MAX is exact)."""
    if world == 1:
        return amax.clone()
    funcol = _torch.funcol
    return funcol.wait_tensor(funcol.all_reduce(amax.contiguous(), "max", group_name))


@fp8_amax.register_fake
def _fp8_amax_fake(amax, group_name, world):
    return torch.empty_like(amax)


FP8_AMAX_OP = torch.ops.shardc.fp8_amax.default


def shard_scale(shard: torch.Tensor, dtype: torch.dtype, group_name: str, world: int):
    """This step's scale of the parameter whose local shard is ``shard`` (same on every rank)."""
    return scale_from_amax(fp8_amax(local_amax(shard), group_name, world), dtype)


# ------------------------------------------------------------------------------- autograd
# The autograd functions take plain constants (names, ints, dtypes) so Dynamo traces them into
# the graph: ``spec`` is (fqn, dim0, world, group_name, reduce_dtype, reshard_after_forward,
# fp8 dtype, compute dtype), see :func:`_spec`.


def _spec(info, shard: torch.Tensor) -> tuple:
    return (info.fqn, info.dim0, info.world, info.group_name, info.reduce_dtype or shard.dtype,
            info.reshard_after_forward, info.fp8.dtype, info.fp8.compute_dtype or shard.dtype)


def _reduce_grad(ctx, grad: torch.Tensor) -> torch.Tensor:
    """The shard's gradient from the full weight gradient, as ``gather_param``'s backward does
    (including gradient accumulation without sync, see ``shardc.runtime.grad_sync``)."""
    shard = ctx.saved_tensors[-1] if ctx.grad_sync == STASH else None
    return shard_grad(grad, ctx.reduce_args, ctx.grad_sync, ctx.sync_key, shard)


def _gather_fp8(shard, scale, spec: tuple, grad_sync: int, sync_key: str) -> torch.Tensor:
    fqn, dim0, world, group_name, reduce_dtype, reshard, fp8_dtype, _ = spec
    q = quantize(shard, scale, fp8_dtype)
    return gather_param(*GatherArgs(q, fqn, dim0, world, group_name, None, reduce_dtype, reshard,
                                    grad_sync, sync_key).args())


def _setup(ctx, shard, spec: tuple, grad_sync: int, sync_key: str, *saved) -> None:
    fqn, dim0, world, group_name, reduce_dtype, _, _, compute_dtype = spec
    ctx.reduce_args = ReduceArgs(None, fqn, dim0, world, group_name, reduce_dtype, shard.dtype)
    ctx.grad_sync, ctx.sync_key, ctx.compute_dtype = grad_sync, sync_key, compute_dtype
    ctx.save_for_backward(*saved, *((shard,) if grad_sync == STASH else ()))


class _GatherDequant(torch.autograd.Function):
    """FP8 gather, then dequantize; straight-through gradient to the high-precision shard."""

    @staticmethod
    def forward(ctx, shard, scale, spec, grad_sync, sync_key):
        full = _gather_fp8(shard, scale, spec, grad_sync, sync_key)
        _setup(ctx, shard, spec, grad_sync, sync_key)
        return dequantize(full, scale, spec[7])

    @staticmethod
    def backward(ctx, grad):
        return _reduce_grad(ctx, grad), None, None, None, None


class _ScaledMMLinear(torch.autograd.Function):
    """``x @ W^T`` on FP8 operands with ``torch._scaled_mm``; high-precision backward."""

    @staticmethod
    def forward(ctx, x, shard, scale, spec, grad_sync, sync_key):
        full = _gather_fp8(shard, scale, spec, grad_sync, sync_key)  # (out, in) FP8
        x2 = x.reshape(-1, x.shape[-1])
        x_scale = scale_from_amax(local_amax(x2), torch.float8_e4m3fn)
        xq = quantize(x2, x_scale, torch.float8_e4m3fn)
        y = _torch.scaled_mm(xq, full.t(), scale_a=x_scale.reciprocal(),
                             scale_b=scale.reciprocal(), out_dtype=spec[7])
        # The FP8 input (1 byte per element) is what backward needs, not x itself.
        _setup(ctx, shard, spec, grad_sync, sync_key, xq, x_scale, full, scale)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        xq, x_scale, full, scale = ctx.saved_tensors[:4]
        g2 = grad.reshape(-1, grad.shape[-1])
        # The output gradient as e5m2 (range over precision), per-tensor scale.
        g_scale = scale_from_amax(local_amax(g2), torch.float8_e5m2)
        gq = quantize(g2, g_scale, torch.float8_e5m2)
        # Input gradient: gq @ W, the e4m3 weight column-major (a 1-byte transpose copy).
        grad_x = _torch.scaled_mm(gq, full.t().contiguous().t(), scale_a=g_scale.reciprocal(),
                                  scale_b=scale.reciprocal(), out_dtype=ctx.compute_dtype)
        grad_x = grad_x.reshape(ctx.x_shape).to(ctx.x_dtype)
        # Weight gradient (straight-through): gq^T @ xq, then reduced in reduce_dtype.
        grad_w = _torch.scaled_mm(gq.t().contiguous(), xq.t().contiguous().t(),
                                  scale_a=g_scale.reciprocal(), scale_b=x_scale.reciprocal(),
                                  out_dtype=ctx.compute_dtype)
        return grad_x, _reduce_grad(ctx, grad_w), None, None, None, None


def gather_fp8_weight(shard: torch.Tensor, info, grad_sync: int, sync_key: str) -> torch.Tensor:
    """The full weight of ``info.fqn`` gathered in FP8 and dequantized (compute dtype)."""
    scale = shard_scale(shard, info.fp8.dtype, info.group_name, info.world)
    return _GatherDequant.apply(shard, scale, _spec(info, shard), grad_sync, sync_key)


# Set while the capacity planner traces a step for a GPU on the CPU (:func:`scaled_mm_as_on_gpu`).
_SCALED_MM_OFF_GPU = False


@contextlib.contextmanager
def scaled_mm_as_on_gpu() -> Iterator[None]:
    """While active, FP8 ``nn.Linear``s take the ``_scaled_mm`` path on CPU tensors too, as
    they do on CUDA: for planning a GPU's step without one (``shardc.tools.planner``), so
    that the plan prices the kernels a GPU runs (the FP8 matmuls, the activations' and
    gradients' amax reductions and casts) and not the dequantized fallback's bf16 matmuls.
    The traced graph is planned, never run (torch's CPU ``_scaled_mm`` computes it anyway)."""
    global _SCALED_MM_OFF_GPU
    before, _SCALED_MM_OFF_GPU = _SCALED_MM_OFF_GPU, True
    try:
        yield
    finally:
        _SCALED_MM_OFF_GPU = before


def _scaled_mm_ok(x: torch.Tensor, weight_shape: torch.Size) -> bool:
    """``torch._scaled_mm`` needs CUDA (or a plan for one, :func:`scaled_mm_as_on_gpu`) and
    every dimension a multiple of 16."""
    if not (x.is_cuda or _SCALED_MM_OFF_GPU) or x.dim() < 2:
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return all(int(d) % 16 == 0 for d in (rows, *weight_shape)) and x.shape[-1] == weight_shape[1]


def fp8_linear_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` of an FP8-sharded linear: ``_scaled_mm`` where possible, else the
    module's own forward on the dequantized weight."""
    param = self._parameters["weight"]
    info = self._shardc_fp8_info
    if not (gathering() and _scaled_mm_ok(x, param.shape)):
        return nn.Linear.forward(self, x)
    grads = self._shardc_fp8_grads
    shard = param.to_local()
    scale = shard_scale(shard, info.fp8.dtype, info.group_name, info.world)
    y = _ScaledMMLinear.apply(x, shard, scale, _spec(info, shard), grads.mode(), grads.key)
    return y if self.bias is None else y + self.bias


def fp8_class_attrs(module: nn.Module, infos: dict, grads, policy: Float8Policy | None) -> dict:
    """Extra class attributes of a swapped module class: the ``_scaled_mm`` forward for an
    FP8 ``nn.Linear`` that keeps ``nn.Linear.forward`` (other forwards are left alone)."""
    info = infos.get("weight")
    if (policy is None or not policy.scaled_mm or info is None or info.fp8 is None
            or not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward):
        return {}
    return {"forward": fp8_linear_forward, "_shardc_fp8_info": info, "_shardc_fp8_grads": grads}
