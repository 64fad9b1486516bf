"""TransformerEngine (TE) modules sharded by shardc, on one CUDA GPU (``pytest -m gpu``).

Setup on the device machine: ``scripts/gpu_te_setup.sh`` (docs/fp8.md). One process, a one-rank
NCCL group: shardc's gathers, amax all-reduces and reduce-scatters run through NCCL at world 1,
so these tests prove that TE's modules work on shardc's parameters (eager and under
``torch.compile``), that the step equals unsharded TE, that TE's amax reductions are given the
sharding group, and the checkpoint round trip. They cannot show cross-rank values (one GPU); the
FP8 gather numerics at world 2-4 are the CPU tests' (tests/test_fp8.py), and they are the same
code for TE's weights. Skipped with the reason where TE or an FP8 GPU is missing.

``SHARDC_TE_REPORT=<file>`` appends what was traced (regions, planned collectives) per test.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gather_counts import CountGathers
from gpu_marks import needs_fp8_gpu
from torch.distributed.tensor import DTensor

import shardc
from shardc.checkpoint import ModelState, OptimizerState

# Deterministic attention kernels (TE reads this when it picks an attention backend), so that
# two models in the same state take bitwise equal steps.
os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

try:  # TE's torch extension cannot be imported without a GPU build (never on the CPU machines)
    import transformer_engine.pytorch as te
    _TE_ERROR = None
except Exception as exc:  # noqa: BLE001 - any import failure means "no usable TE"
    te, _TE_ERROR = None, f"{type(exc).__name__}: {exc}"

pytestmark = [pytest.mark.gpu, needs_fp8_gpu,
              pytest.mark.skipif(te is None, reason=f"TransformerEngine not importable "
                                                    f"({_TE_ERROR})")]

KINDS = ["Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer"]
D, FFN, HEADS, STEPS = 256, 512, 4, 3
# Relative 2-norm over losses and parameters, sharded vs unsharded TE. Eager runs the same
# kernels on the same values. Compiled regions (Inductor) round the traced element-wise ops
# differently in the last bit, and an FP8 scale that moves by one ulp can move an element
# across an FP8 rounding boundary (one FP8 step, ~6 % of that element).
PARITY_TOL = {"eager": 1e-5, "compiled": 2e-3}
FP8_GATHER_TOL = 2e-3  # TE's scale from the dequantized weight may differ by an ulp (see test)


def _model(kind: str, bias: bool, seed: int = 0, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "Linear":
        return te.Linear(D, D, bias=bias, **kwargs).cuda()
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(D, D, bias=bias, **kwargs).cuda()
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(D, FFN, bias=bias, **kwargs).cuda()
    return te.TransformerLayer(D, FFN, HEADS, bias=bias, hidden_dropout=0.0,
                               attention_dropout=0.0, **kwargs).cuda()


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    return torch.randn(32, 2, D, device="cuda", generator=g)  # (seq, batch, hidden)


def _step(model, forward, opt, autocast, step: int) -> float:
    with autocast():
        y = forward(_batch(step))
    loss = y.float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _params(model) -> dict[str, torch.Tensor]:
    return {n: _full(p) for n, p in model.named_parameters()}


def _te_autocast(recipe):
    return lambda: te.autocast(enabled=True, recipe=recipe)


def _report(**fields) -> None:
    path = os.environ.get("SHARDC_TE_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(fields) + "\n")


def _traced(state) -> dict:
    """What shardc planned: regions and their collectives (by kind and dtype)."""
    collectives = [f"{c.kind}:{c.dtype}" for r in state.regions if r.plan is not None
                   for c in r.plan.collectives]
    return {"regions": len(state.regions), "collectives": collectives}


def _parity(kind: str, mode: str, recipe, fp8=None, **model_kwargs):
    """Train unsharded TE and a shardc copy ``STEPS`` steps (SGD with momentum, which does not
    amplify rounding noise as Adam does); return losses, parameters, the sharded model and the
    dtypes of shardc's eager gathers in the first step (eager mode only: a dispatch mode would
    stop Dynamo from compiling)."""
    torch._dynamo.reset()
    ref = _model(kind, bias=False, **model_kwargs)
    model = _model(kind, bias=False, seed=1, **model_kwargs)
    model.load_state_dict(ref.state_dict())
    shardc.shard(model, fp8=fp8)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want = [_step(ref, ref, ref_opt, _te_autocast(recipe), s) for s in range(STEPS)]
    forward = model if mode == "eager" else torch.compile(model, backend=shardc.backend())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    counter = CountGathers()
    got = []
    for s in range(STEPS):
        with counter if (s == 0 and mode == "eager") else contextlib.nullcontext():
            got.append(_step(model, forward, opt, lambda: shardc.te_autocast(model, recipe), s))
    return want, got, _params(ref), _params(model), model, counter.dtypes


def _assert_parity(kind, want, got, ref_params, params, tol):
    loss_err = _rel(torch.tensor(got), torch.tensor(want))
    assert loss_err <= tol, f"{kind}: losses {got} vs unsharded {want} (rel {loss_err:.2e})"
    assert set(params) == set(ref_params)
    for name, value in params.items():
        err = _rel(value, ref_params[name])
        assert err <= tol, f"{kind}: parameter {name} rel err {err:.2e}"


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("kind", KINDS)
def test_te_module_trains_like_unsharded(nccl, kind, mode):
    """Bias-less TE modules (no bias parameter registered), delayed scaling, AdamW: the sharded
    module's losses and parameters equal unsharded TE's; master shards stay float32 DTensors;
    every parameter is gathered by shardc."""
    recipe = shardc.te_fp8_recipe()
    want, got, ref_params, params, model, gathered = _parity(kind, mode, recipe)
    gemm_biases = [n for n in ref_params if n.endswith("bias") and "layer_norm" not in n]
    assert gemm_biases == [], f"a bias-less TE layer registered {gemm_biases}"
    _assert_parity(kind, want, got, ref_params, params, PARITY_TOL[mode])
    assert all(isinstance(p, DTensor) and p.to_local().dtype == torch.float32
               for p in model.parameters())
    state = shardc.shard_state(model)
    traced = _traced(state)
    planned = sum(c.startswith("all_gather") for c in traced["collectives"])
    if mode == "eager":
        assert len(gathered) >= len(params), gathered  # every parameter gathered by shardc
    _report(test="trains_like_unsharded", kind=kind, mode=mode, eager_gathers=len(gathered),
            planned_all_gathers=planned, loss_rel=_rel(torch.tensor(got), torch.tensor(want)),
            **traced)


def test_te_autocast_reduces_amax_over_the_shard_group(nccl):
    """Inside ``shardc.te_autocast`` TE's FP8 state reduces amaxes over the model's group."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    model = _model("LayerNormMLP", bias=True)
    shardc.shard(model)
    group = shardc.shard_state(model).mesh.get_group()
    with shardc.te_autocast(model):
        assert FP8GlobalStateManager.is_fp8_enabled()
        got = FP8GlobalStateManager.get_fp8_group()
        assert got is group or got.group_name == group.group_name, (got, group)
        model(_batch(0)).float().sum().backward()
    with pytest.raises(ValueError, match="not sharded"):
        shardc.te_autocast(_model("Linear", bias=True))


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("kind", KINDS)
def test_te_weights_gathered_in_fp8(nccl, kind, mode):
    """``te_float8_policy``: TE's GEMM weights travel as float8 (1 byte per element), the norms
    in float32; under TE's current scaling the step equals unsharded TE's (the gathered FP8
    values are what TE computes unsharded; the fused QKV weight keeps one scale)."""
    recipe = shardc.te_fp8_recipe("current")
    kwargs = {"fuse_qkv_params": True} if kind == "TransformerLayer" else {}
    want, got, ref_params, params, model, gathered = _parity(
        kind, mode, recipe, fp8=shardc.te_float8_policy(), **kwargs)
    state = shardc.shard_state(model)
    fp8_names = sorted(n for n, i in state.params.items() if i.fp8 is not None)
    assert fp8_names and all("layer_norm" not in n for n in fp8_names), fp8_names
    assert all(state.params[n].fp8 is None for n in params if "layer_norm" in n)
    traced = _traced(state)
    _report(test="weights_gathered_in_fp8", kind=kind, mode=mode, fp8_params=fp8_names,
            eager_gather_dtypes=gathered, loss_rel=_rel(torch.tensor(got), torch.tensor(want)),
            **traced)
    if mode == "eager":
        fp8_gathers = gathered.count("torch.float8_e4m3fn")
        assert fp8_gathers >= len(fp8_names), gathered
        assert len(gathered) - fp8_gathers >= len(params) - len(fp8_names), gathered
    # Planned gathers (the traced parts) of FP8 weights move float8, the others not.
    for r in state.regions:
        for c in r.plan.collectives if r.plan is not None else ():
            if c.kind == "all_gather":
                assert (c.dtype == "float8_e4m3fn") == any(p in fp8_names for p in c.params), c
    _assert_parity(kind, want, got, ref_params, params, FP8_GATHER_TOL)


@pytest.mark.parametrize("how", ["sync", "async"])
def test_te_dcp_round_trip(nccl, tmp_path, monkeypatch, how):
    """A TransformerLayer with biases trained 2 steps under delayed scaling, saved with its
    optimizer through DCP (``dcp.save`` / ``dcp.async_save``) and loaded into a fresh model:
    parameters, optimizer state and TE's FP8 metadata equal, outputs equal, and the next step
    (loss, parameters) equals the saved model's next step.

    The saved model takes its next step before the fresh model runs at all, as after a restart
    (where the fresh model lives in a new process). TE keeps delayed scaling's amax histories
    and scales in process-global buffers keyed by recipe and amax group; every autocast exit
    with grad enabled (and the backward of an autocast's first FP8 module) updates the scales
    of every module registered under that key, so two models alive in one process with equal
    recipes and the same group update each other's scales. Interleaved, the saved model's step
    would update the fresh model's forward scales from the amaxes of its no-grad forward (TE
    updates nothing under ``no_grad``) before the fresh model's own step: a different scale,
    not a missing piece of state (docs/bench/te_gpu_diag.log, ``two_models``)."""
    # Delayed scaling keeps its amax history as a pickle, which TE loads only when told the
    # checkpoint is trusted (it is ours).
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    recipe = shardc.te_fp8_recipe()
    model = _model("TransformerLayer", bias=True)
    shardc.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for s in range(2):
        _step(model, model, opt, lambda: shardc.te_autocast(model, recipe), s)
    state = {"model": ModelState(model), "optim": OptimizerState(model, opt)}
    saved_meta = _fp8_meta(state["model"].state_dict())
    assert saved_meta, "no FP8 metadata to save"
    saved_params = {n: _full(p).clone() for n, p in model.named_parameters()}
    saved_opt = _opt_state(OptimizerState(model, opt))
    if how == "sync":
        dcp.save(state, checkpoint_id=str(tmp_path))
    else:
        gloo = dist.new_group(backend="gloo")
        dcp.async_save(state, checkpoint_id=str(tmp_path), process_group=gloo).result()
    # The saved model goes on: an inference forward, then its next training step.
    x = _batch(7)
    with torch.no_grad(), shardc.te_autocast(model, recipe):
        want = model(x)
    loss_saved = _step(model, model, opt, lambda: shardc.te_autocast(model, recipe), 2)
    params_saved = _params(model)

    fresh = _model("TransformerLayer", bias=True, seed=1)
    shardc.shard(fresh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    dcp.load({"model": ModelState(fresh), "optim": OptimizerState(fresh, fresh_opt)},
             checkpoint_id=str(tmp_path))
    loaded_meta = _fp8_meta(ModelState(fresh).state_dict())
    assert loaded_meta.keys() == saved_meta.keys()
    for key, tensors in saved_meta.items():
        for name, value in tensors.items():
            assert torch.equal(loaded_meta[key][name], value), f"{key} {name}"
    for name, p in fresh.named_parameters():
        assert torch.equal(_full(p), saved_params[name]), name
    loaded_opt = _opt_state(OptimizerState(fresh, fresh_opt))
    assert loaded_opt.keys() == saved_opt.keys()
    for fqn, entries in saved_opt.items():
        assert entries.keys() == loaded_opt[fqn].keys(), fqn
        for k, v in entries.items():
            assert torch.equal(loaded_opt[fqn][k], v), f"optimizer {fqn} {k}"
    with torch.no_grad(), shardc.te_autocast(fresh, recipe):
        got = fresh(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The next step: same loss, same parameters (optimizer state and FP8 scales restored).
    loss_loaded = _step(fresh, fresh, fresh_opt, lambda: shardc.te_autocast(fresh, recipe), 2)
    assert loss_loaded == loss_saved, (loss_loaded, loss_saved)
    for name, p in fresh.named_parameters():
        torch.testing.assert_close(_full(p), params_saved[name], rtol=1e-6, atol=1e-7,
                                   msg=lambda m, name=name: f"after the next step, {name}: {m}")


def _opt_state(optim_state: OptimizerState) -> dict[str, dict[str, torch.Tensor]]:
    """Copies of the optimizer state by parameter (full tensors; the step count too)."""
    return {fqn: {k: _full(v).clone() for k, v in entries.items()}
            for fqn, entries in optim_state.state_dict()["state"].items()}


def _fp8_meta(model_state: dict) -> dict[str, dict[str, torch.Tensor]]:
    """TE's delayed-scaling state (scales, amax histories) from a ``ModelState`` state dict,
    whose extra states are bytes (``shardc.checkpoint.extra_state_to_bytes``)."""
    out = {}
    for key, value in model_state.items():
        if key.endswith("_extra_state") and value:
            meta = pickle.loads(value)  # our own checkpoint: trusted
            tensors = {k: meta[k] for k in ("scale_fwd", "amax_history_fwd", "scale_bwd",
                                            "amax_history_bwd") if k in meta}
            if tensors:  # modules without delayed-scaling tensors (attention) keep none
                out[key] = tensors
    return out
