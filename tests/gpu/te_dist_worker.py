"""TransformerEngine with shardc across ranks: run by ``torchrun --nproc-per-node N`` (N >= 2
GPUs), from ``tests/gpu/test_te_two_gpus.py``. Each scenario runs on every rank; rank 0 writes
one JSON line per scenario (``ok``, the measured errors, or the error) to ``argv[1]``.

Scenarios:

- ``fp8_params_same_batch[kind-recipe]``: FP8 parameters (``te.quantized_model_init``) sharded
  over the ranks, every rank fed the same batch, against unsharded TE on that batch: losses,
  dequantized parameters and master weights equal (tight); each FP8 gather moves uint8 shards
  of ``ceil(rows / world)`` rows; every rank's FP8 shard has the same scale after each step.
- ``fp8_params_own_batches[recipe]``: every rank its own batch: TE's FP8 scales (module state,
  FP8 shards) equal on every rank, which needs its amax reductions over the sharding group, and
  the losses within FP8 tolerance of unsharded TE on all the batches at once.
- ``float8_policy_same_batch``: high-precision TE weights gathered in FP8 by
  ``shardc.te_float8_policy()`` (current scaling), against unsharded TE.
- ``dcp_fp8_params_2_to_2_and_1``: FP8-parameter model saved by all ranks, loaded by a fresh
  model on all ranks and by one on rank 0 alone (a 1-rank mesh): outputs equal the saved
  model's; on all ranks the next step equals the saved model's.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(__file__))
import te_fp8_common as common  # noqa: E402
from gather_counts import CountGathers  # noqa: E402

import shardc  # noqa: E402
from shardc.checkpoint import ModelState, OptimizerState  # noqa: E402

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
STEPS = 3
TIGHT = 1e-5


def _rank() -> int:
    return dist.get_rank()


def _world() -> int:
    return dist.get_world_size()


def _same_on_every_rank(t: torch.Tensor) -> bool:
    t = t.detach().float().reshape(-1).contiguous()
    every = [torch.empty_like(t) for _ in range(_world())]
    dist.all_gather(every, t)
    return all(torch.equal(e, every[0]) for e in every)


def _shard_scales(model) -> list[torch.Tensor]:
    return [p._local_tensor._scale_inv for n, p in model.named_parameters()
            if n in common.fp8_names(model)]


def _fp8_meta_scales(model) -> list[torch.Tensor]:
    out = []
    for m in model.modules():
        meta = getattr(m, "fp8_meta", None) or {}
        for key in ("scaling_fwd", "scaling_bwd"):
            if key in meta and hasattr(meta[key], "scale"):
                out.append(meta[key].scale)
    return out


def _compare(ref, model, ref_opt, opt, want, got) -> dict[str, float]:
    errors = {"loss": common.rel(torch.tensor(got), torch.tensor(want))}
    ref_values, values = common.values(ref), common.values(model)
    errors["params"] = max(common.rel(values[n], ref_values[n]) for n in values)
    ref_master, master = common.master_weights(ref, ref_opt), common.master_weights(model, opt)
    if master:
        errors["master"] = max(common.rel(master[n], ref_master[n]) for n in master)
    return errors


def fp8_params_same_batch(kind: str, recipe_name: str) -> dict:
    recipe = shardc.te_fp8_recipe(recipe_name)
    ref = common.build(kind, recipe=recipe)
    model = common.build(kind, recipe=recipe)
    shardc.shard(model)
    fp8 = common.fp8_names(model)
    assert fp8, "no FP8 parameter"
    ref_opt, opt = common.optimizer(ref), common.optimizer(model)
    want, got, scales_equal = [], [], True
    with common.recorded_fp8_param_gathers() as moved:
        for s in range(STEPS):
            x = common.batch(s)
            want.append(common.step(ref, ref, ref_opt, common.ref_autocast(recipe), x))
            common.drop_stale_transposes(ref)
            got.append(common.step(model, model, opt, common.shardc_autocast(model, recipe), x))
            scales_equal &= all(_same_on_every_rank(t) for t in _shard_scales(model))
    errors = _compare(ref, model, ref_opt, opt, want, got)
    uint8 = [n for d, n in moved if d == torch.uint8]
    full = {n: p.numel() for n, p in ref.named_parameters() if n in fp8}
    expect = sorted(-(-full[n] // (p.shape[1] * _world())) * p.shape[1]
                    for n, p in ref.named_parameters() if n in fp8)
    assert len(uint8) == STEPS * len(fp8), moved
    assert sorted(uint8[:len(fp8)]) == expect, (uint8, expect)
    assert scales_equal, "FP8 shards' scales differ across ranks"
    assert all(v <= TIGHT for v in errors.values()), errors
    return {"errors": errors, "fp8_params": fp8, "uint8_elements_sent": uint8[:len(fp8)]}


def _forward_backward(model, autocast, x: torch.Tensor) -> float:
    with autocast():
        y = model(x)
    loss = y.float().pow(2).mean()
    loss.backward()
    return loss.item()


def fp8_params_own_batches(recipe_name: str) -> dict:
    """Each rank its own batch; the reference sees them all at once. Asserted: TE's scales
    (the FP8 state of every module and every FP8 shard's scale) equal on every rank, which
    needs the amax reductions over the sharding group (each rank's activations and gradients
    differ), and the losses of 3 steps within FP8 tolerance (measured 3.4e-4 / 1.4e-4).

    Reported, not asserted: the first step's gradients and the parameters after 3 Adam steps.
    They cannot match tightly: the reference quantizes tensors of twice the batch, so its
    per-tensor scales (current scaling) and its output-gradient magnitudes (the loss is a mean
    over twice the elements; delayed scaling starts with scale 1) differ, and FP8's 3-bit
    mantissa rounds each element differently (measured on 2 GPUs: 9 % current, 45 % delayed)."""
    recipe = shardc.te_fp8_recipe(recipe_name)
    ref = common.build("TransformerLayer", recipe=recipe)
    model = common.build("TransformerLayer", recipe=recipe)
    shardc.shard(model)
    ref_opt, opt = common.optimizer(ref), common.optimizer(model)
    want, got, grad_errors = [], [], {}
    for s in range(STEPS):
        xs = [common.batch(s, r) for r in range(_world())]
        want.append(_forward_backward(ref, common.ref_autocast(recipe), torch.cat(xs, dim=1)))
        loss = torch.tensor(_forward_backward(model, common.shardc_autocast(model, recipe),
                                              xs[_rank()]), device="cuda")
        dist.all_reduce(loss)
        got.append(loss.item() / _world())
        if s == 0:
            ref_grads = {n: common.value(p.grad) for n, p in ref.named_parameters()}
            grad_errors = {n: common.rel(common.value(p.grad), ref_grads[n])
                           for n, p in model.named_parameters()}
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        common.drop_stale_transposes(ref)
    errors = {"loss": common.rel(torch.tensor(got), torch.tensor(want)),
              "first_step_grads": max(grad_errors.values())}
    after = _compare(ref, model, ref_opt, opt, want, got)
    scales = _fp8_meta_scales(model) + _shard_scales(model)
    assert all(_same_on_every_rank(t) for t in scales), "TE scales differ across ranks"
    assert errors["loss"] <= 1e-3, (errors, grad_errors)
    return {"errors": errors, "grad_errors": grad_errors, "after_3_adam_steps": after,
            "scales_checked": len(scales)}


def float8_policy_same_batch() -> dict:
    recipe = shardc.te_fp8_recipe("current")
    ref = common.build("TransformerLayer", fp8_params=False)
    model = common.build("TransformerLayer", fp8_params=False)
    shardc.shard(model, fp8=shardc.te_float8_policy())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    want, got = [], []
    counter = CountGathers()
    for s in range(STEPS):
        x = common.batch(s)
        want.append(common.step(ref, ref, ref_opt, common.ref_autocast(recipe), x))
        with counter if s == 0 else contextlib.nullcontext():
            got.append(common.step(model, model, opt, common.shardc_autocast(model, recipe), x))
    errors = {"loss": common.rel(torch.tensor(got), torch.tensor(want))}
    ref_values, values = common.values(ref), common.values(model)
    errors["params"] = max(common.rel(values[n], ref_values[n]) for n in values)
    fp8_gathers = counter.dtypes.count("torch.float8_e4m3fn")
    assert fp8_gathers >= 3, counter.dtypes  # qkv, proj, fc1, fc2 weights
    assert all(v <= 2e-3 for v in errors.values()), errors
    return {"errors": errors, "gather_dtypes": counter.dtypes}


def dcp_fp8_params(path: str) -> dict:
    recipe = shardc.te_fp8_recipe("current")
    model = common.build("TransformerLayer", bias=True, recipe=recipe)
    shardc.shard(model)
    opt = common.optimizer(model)
    for s in range(2):
        common.step(model, model, opt, common.shardc_autocast(model, recipe),
                    common.batch(s, _rank()))
    dcp.save({"model": ModelState(model), "optim": OptimizerState(model, opt)},
             checkpoint_id=path)
    x = common.batch(7)  # the same on every rank
    with torch.no_grad(), shardc.te_autocast(model, recipe):
        want = model(x)
    saved_values = common.values(model)
    loss_saved = common.step(model, model, opt, common.shardc_autocast(model, recipe),
                             common.batch(2, _rank()))
    next_values = common.values(model)

    fresh = common.build("TransformerLayer", bias=True, seed=1, recipe=recipe)
    shardc.shard(fresh)
    fresh_opt = common.optimizer(fresh)
    dcp.load({"model": ModelState(fresh), "optim": OptimizerState(fresh, fresh_opt)},
             checkpoint_id=path)
    with torch.no_grad(), shardc.te_autocast(fresh, recipe):
        got = fresh(x)
    out = {"world_n_output_max_abs": (got - want).abs().max().item()}
    loaded = common.values(fresh)
    out["world_n_params_max_rel"] = max(common.rel(loaded[n], saved_values[n]) for n in loaded)
    loss_loaded = common.step(fresh, fresh, fresh_opt, common.shardc_autocast(fresh, recipe),
                              common.batch(2, _rank()))
    after = common.values(fresh)
    out["next_loss"] = [loss_saved, loss_loaded]
    out["next_params_max_rel"] = max(common.rel(after[n], next_values[n]) for n in after)

    solo_group = dist.new_group([0])  # every rank takes part in creating it
    if _rank() == 0:
        mesh = DeviceMesh.from_group(solo_group, "cuda")
        solo = common.build("TransformerLayer", bias=True, seed=2, recipe=recipe)
        shardc.shard(solo, mesh, allow_partial_mesh=True)
        solo_opt = common.optimizer(solo)
        dcp.load({"model": ModelState(solo), "optim": OptimizerState(solo, solo_opt)},
                 checkpoint_id=path, process_group=solo_group)
        with torch.no_grad(), shardc.te_autocast(solo, recipe):
            got1 = solo(x)
        out["world_1_output_max_abs"] = (got1 - want).abs().max().item()
        solo_values = common.values(solo)
        out["world_1_params_max_rel"] = max(common.rel(solo_values[n], saved_values[n])
                                            for n in solo_values)
        assert isinstance(solo.self_attention.proj.weight, DTensor)
    dist.barrier()
    # Not bitwise: the checkpoint holds dequantized values, and loading re-quantizes them with
    # a scale computed from their amax, which can differ from the saved scale in its last bit
    # (the FP8 bytes come back the same). Measured: weights 8e-8 relative, outputs 5e-7.
    scale = want.abs().max().item()
    assert out["world_n_params_max_rel"] <= 1e-6, out
    assert out["world_n_output_max_abs"] <= 1e-5 * scale, out
    assert abs(loss_saved - loss_loaded) <= 1e-6 * abs(loss_saved), out
    assert out["next_params_max_rel"] <= 1e-4, out
    if _rank() == 0:
        assert out["world_1_params_max_rel"] <= 1e-6, out
        assert out["world_1_output_max_abs"] <= 1e-5 * scale, out
    return out


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", timeout=timedelta(seconds=120),
                            device_id=torch.device("cuda", local))
    report = sys.argv[1]
    scenarios = [(f"fp8_params_same_batch[{k}-{r}]", lambda k=k, r=r: fp8_params_same_batch(k, r))
                 for k in ("Linear", "LayerNormMLP", "TransformerLayer")
                 for r in ("current", "delayed")]
    scenarios += [(f"fp8_params_own_batches[{r}]", lambda r=r: fp8_params_own_batches(r))
                  for r in ("current", "delayed")]
    scenarios.append(("float8_policy_same_batch", float8_policy_same_batch))
    ckpt = tempfile.mkdtemp(prefix="shardc-te-dcp-") if _rank() == 0 else None
    box = [ckpt]
    dist.broadcast_object_list(box, src=0)
    scenarios.append(("dcp_fp8_params_2_to_2_and_1", lambda: dcp_fp8_params(box[0])))
    for name, run in scenarios:
        torch.manual_seed(0)
        try:
            result = {"name": name, "ok": True, **run()}
        except Exception as exc:  # noqa: BLE001 - reported, the next scenario still runs
            result = {"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()[-3000:]}
        flags = [None] * _world()
        dist.all_gather_object(flags, result["ok"])
        result["ok_on_every_rank"] = all(flags)
        if _rank() == 0:
            with open(report, "a") as f:
                f.write(json.dumps(result, default=str) + "\n")
        print(f"[rank {_rank()}] {name}: {'ok' if result['ok'] else result['error']}",
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
