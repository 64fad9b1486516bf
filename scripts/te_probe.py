"""Diagnostics behind docs/fp8.md's TE results (one GPU, TE importable; run from the checkout:
``PYTHONPATH=$PWD:/tmp/te-site python3 scripts/te_probe.py``). Prints one JSON line per
experiment.

1. FP8 gather of TE's weights, eager vs compiled: 3 SGD steps of ``te.Linear`` (and
   ``te.TransformerLayer``) under TE's current scaling, unsharded TE as the reference, in
   several configurations (shardc's region detection before its fix, planned with Inductor,
   planned without Inductor, Inductor with eager-rounded divisions, no FP8 gather). For
   ``te.Linear`` the weight TE receives in each step is compared with an eager reference
   quantize-dequantize of the master weight at that step.
2. TE delayed scaling with two models in one process: whether one model's training step
   changes the other model's forward scales (TE's process-global amax buffers).
"""

from __future__ import annotations

import json
import os
import tempfile

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
os.environ.setdefault("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")  # our own in-memory state

import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402
import transformer_engine.pytorch.module.linear as te_linear  # noqa: E402

import shardc  # noqa: E402
import shardc.compile.backend  # noqa: E402,F401

shardc_backend = sys.modules["shardc.backend"]  # shardc.backend is also a function
from shardc.checkpoint import ModelState, OptimizerState  # noqa: E402
from shardc.ops.gather import GATHER_OP  # noqa: E402
from shardc.passes.fx_utils import is_call  # noqa: E402

D, FFN, HEADS, STEPS = 256, 512, 4, 3
FP8 = torch.float8_e4m3fn


def emit(**fields) -> None:
    print("PROBE " + json.dumps(fields), flush=True)


def build(kind: str, seed: int = 0, bias: bool = False, **kw):
    torch.manual_seed(seed)
    if kind == "Linear":
        return te.Linear(D, D, bias=bias, **kw).cuda()
    return te.TransformerLayer(D, FFN, HEADS, bias=bias, hidden_dropout=0.0,
                               attention_dropout=0.0, **kw).cuda()


def batch(step: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    return torch.randn(32, 2, D, device="cuda", generator=g)


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()


def fake_quant(w: torch.Tensor) -> torch.Tensor:
    """Eager CUDA (IEEE division, as TE's __fdiv_rn) per-tensor current-scaling round trip."""
    scale = 448.0 / w.abs().max().float()
    return (w * scale).clamp(-448, 448).to(FP8).float() / scale


# The weight te.Linear hands its GEMM (probe only: records it, then calls TE's function).
CAPTURED: list[torch.Tensor] = []
GRADS: list[torch.Tensor] = []  # the gradients TE returns for those weights
_linear_eager = te_linear._linear_eager


@torch._dynamo.disable
def _capturing_linear_eager(weight_tensor, inp, bias, fwd_args, is_grad_enabled):
    CAPTURED.append(weight_tensor.detach().float().clone())
    if weight_tensor.requires_grad:
        weight_tensor.register_hook(lambda g: GRADS.append(g.detach().float().clone()))
    return _linear_eager(weight_tensor, inp, bias, fwd_args, is_grad_enabled)


te_linear._linear_eager = _capturing_linear_eager

_fixed_detection = shardc_backend.has_sharded_params


def _old_detection(gm) -> bool:  # shardc before e07df58: top-level nodes only
    return any(is_call(n, GATHER_OP) for n in gm.graph.nodes)


def capture_stats(master: torch.Tensor, got: torch.Tensor) -> dict:
    want = fake_quant(master)
    rel = (got - want).abs() / want.abs().clamp(min=1e-30)
    return {"bitwise": bool(torch.equal(got, want)),
            "ulp_diffs": int((got != want).sum()),
            "fp8_step_diffs": int((rel > 1e-3).sum()),  # an FP8 step is >= 6 %
            "is_master": bool(torch.equal(got, master))}


def train(kind: str, variant: str, fp8_gather: bool, **kw) -> dict:
    torch._dynamo.reset()
    model = build(kind, **kw)
    recipe = shardc.te_fp8_recipe("current")
    probe = (lambda m: m) if kind == "Linear" else (lambda m: m.self_attention.proj)
    sharded = variant != "reference"
    if sharded:
        ref = build(kind, **kw)
        model.load_state_dict(ref.state_dict())
        shardc.shard(model, fp8=shardc.te_float8_policy() if fp8_gather else None)
    options = {"inductor": variant != "fx"}
    forward = model
    if variant not in ("reference", "eager"):
        forward = torch.compile(model, backend=shardc.backend(**options))
    shardc_backend.has_sharded_params = (_old_detection if variant == "old-detection"
                                         else _fixed_detection)
    patch = {}
    if variant == "div-rn":
        patch = {"eager_numerics.division_rounding": True}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, stats = [], []
    with torch._inductor.config.patch(patch):
        for s in range(STEPS):
            master = full(probe(model).weight)
            CAPTURED.clear()
            ctx = (shardc.te_autocast(model, recipe) if sharded
                   else te.autocast(enabled=True, recipe=recipe))
            with ctx:
                y = forward(batch(s))
            loss = y.float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            stats.append(capture_stats(master, CAPTURED[-1]) if CAPTURED else None)
    shardc_backend.has_sharded_params = _fixed_detection
    state = shardc.shard_state(model) if sharded else None
    return {"losses": losses, "params": {n: full(p) for n, p in model.named_parameters()},
            "captured": stats,
            "regions": len(state.regions) if state else None,
            "collectives": [f"{c.graph}:{c.kind}:{c.dtype}:{','.join(c.params)}"
                            for r in (state.regions if state else ()) if r.plan is not None
                            for c in r.plan.collectives]}


def rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def fp8_gather_experiments() -> None:
    has_div_rn = hasattr(torch._inductor.config, "eager_numerics")
    for kind, kw in (("Linear", {}), ("TransformerLayer", {"fuse_qkv_params": True})):
        ref = train(kind, "reference", False, **kw)
        emit(exp="fp8_gather", kind=kind, variant="reference", losses=ref["losses"],
             captured=ref["captured"])
        variants = [("eager", True), ("old-detection", True), ("inductor", True),
                    ("fx", True), ("div-rn", True), ("inductor-no-fp8-gather", False)]
        if kind != "Linear":  # device time: the variants that separate the causes
            variants = [v for v in variants if v[0] in ("eager", "inductor", "fx", "div-rn")]
        for variant, fp8_gather in variants:
            if variant == "div-rn" and not has_div_rn:
                emit(exp="fp8_gather", kind=kind, variant=variant, skipped="no eager_numerics")
                continue
            try:
                run = train(kind, variant, fp8_gather, **kw)
            except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
                emit(exp="fp8_gather", kind=kind, variant=variant,
                     error=f"{type(exc).__name__}: {exc}"[:500])
                continue
            errs = {n: rel(v, ref["params"][n]) for n, v in run["params"].items()}
            worst = sorted(errs.items(), key=lambda kv: -kv[1])[:3]
            emit(exp="fp8_gather", kind=kind, variant=variant, losses=run["losses"],
                 loss_rel=rel(run["losses"], ref["losses"]), worst_params=worst,
                 captured=run["captured"], regions=run["regions"],
                 collectives=run["collectives"])


def two_models_in_one_process() -> None:
    """The DCP test's original order, with the checkpoint loaded in memory."""
    recipe = shardc.te_fp8_recipe()
    torch._dynamo.reset()

    def step(m, opt, s):
        with shardc.te_autocast(m, recipe):
            loss = m(batch(s)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    model = build("TransformerLayer", bias=True)
    shardc.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for s in range(2):
        step(model, opt, s)
    fresh = build("TransformerLayer", seed=1, bias=True)
    shardc.shard(fresh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    ModelState(fresh).load_state_dict(ModelState(model).state_dict())
    OptimizerState(fresh, fresh_opt).load_state_dict(OptimizerState(model, opt).state_dict())
    with torch.no_grad():
        for m in (model, fresh):
            with shardc.te_autocast(m, recipe):
                m(batch(7))

    def scales(m):
        return {n: sub.fp8_meta["scaling_fwd"].scale.clone() for n, sub in m.named_modules()
                if hasattr(sub, "fp8_meta") and "scaling_fwd" in sub.fp8_meta}

    before_model, before_fresh = scales(model), scales(fresh)
    same_before = all(torch.equal(before_model[n], before_fresh[n]) for n in before_model)
    loss_saved = step(model, opt, 2)
    after_fresh = scales(fresh)
    changed = sorted(n for n in before_fresh if not torch.equal(before_fresh[n], after_fresh[n]))
    loss_loaded = step(fresh, fresh_opt, 2)
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    buffers = {k: len(v) for k, v in
               FP8GlobalStateManager.quantization_state.global_amax_buffer.items()}
    emit(exp="two_models", scales_equal_before=same_before,
         fresh_forward_scales_changed_by_saved_models_step=changed,
         loss_saved=loss_saved, loss_loaded=loss_loaded, global_amax_buffers=buffers)


def fp8_gradients() -> None:
    """Two SGD steps of te.Linear with its weight gathered in FP8 (current scaling), per step:
    the weight TE is handed, the gradient TE returns for it, the gradient the master shard
    receives (straight-through: equal to TE's at world 1) and the master after the step, for
    each variant compared with eager; the compiled regions' graphs go to $OUT."""
    import shardc.sharding.fp8 as fp8_runtime

    recipe = shardc.te_fp8_recipe("current")
    out_dir = os.environ.get("OUT", ".")
    gather_fp8 = fp8_runtime._gather_fp8

    def detached(shard, *args):
        return gather_fp8(shard.detach(), *args)

    runs = {}
    for variant in ("eager", "inductor", "fx", "inductor-detached-shard"):
        torch._dynamo.reset()
        model = build("Linear")
        shardc.shard(model, fp8=shardc.te_float8_policy())
        forward = model if variant == "eager" else torch.compile(
            model, backend=shardc.backend(inductor=variant != "fx"))
        fp8_runtime._gather_fp8 = detached if variant.endswith("detached-shard") else gather_fp8
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        steps = []
        try:
            for s in range(2):
                CAPTURED.clear()
                GRADS.clear()
                with shardc.te_autocast(model, recipe):
                    y = forward(batch(s))
                loss = y.float().pow(2).mean()
                loss.backward()
                shard_grad = full(model.weight.grad)
                opt.step()
                opt.zero_grad()
                steps.append({"loss": loss.item(), "weight": CAPTURED[-1],
                              "captured": len(CAPTURED), "te_grads": len(GRADS),
                              "te_grad": GRADS[-1] if GRADS else None,
                              "shard_grad": shard_grad, "master": full(model.weight)})
        except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
            emit(exp="fp8_gradients", variant=variant, error=f"{type(exc).__name__}: {exc}"[:600])
            continue
        finally:
            fp8_runtime._gather_fp8 = gather_fp8
        runs[variant] = steps
        state = shardc.shard_state(model)
        with open(os.path.join(out_dir, f"region_{variant}.txt"), "w") as f:
            for i, r in enumerate(state.regions):
                for name in ("forward", "backward"):
                    gm = getattr(r, name)
                    f.write(f"# region {i} {name}\n{gm.code if gm is not None else None}\n")
    eager = runs.get("eager")
    for variant, steps in runs.items():
        rows = []
        for s, step in enumerate(steps):
            row = {"loss": step["loss"], "captured": step["captured"], "te_grads": step["te_grads"]}
            if step["te_grad"] is not None:
                row["shard_over_te_grad"] = (step["shard_grad"].norm()
                                             / step["te_grad"].norm()).item()
                row["shard_grad_is_te_grad"] = bool(torch.equal(step["shard_grad"],
                                                                step["te_grad"]))
            if eager is not None and variant != "eager":
                for key in ("weight", "te_grad", "shard_grad", "master"):
                    a, b = step[key], eager[s][key]
                    row[f"{key}_vs_eager"] = (None if a is None or b is None else
                                              "equal" if torch.equal(a, b) else rel(a, b))
            rows.append(row)
        emit(exp="fp8_gradients", variant=variant, steps=rows)


EXPERIMENTS = {"two_models": "two_models_in_one_process", "gradients": "fp8_gradients",
               "gather": "fp8_gather_experiments"}


def main() -> None:
    torch.cuda.set_device(0)
    init = os.path.join(tempfile.mkdtemp(), "pg")
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1)
    emit(exp="versions", torch=torch.__version__,
         te=__import__("importlib.metadata").metadata.version("transformer_engine"))
    import sys

    names = sys.argv[1:] or list(EXPERIMENTS)
    for experiment in (globals()[EXPERIMENTS[n]] for n in names):
        try:
            experiment()
        except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
            emit(exp=experiment.__name__, error=f"{type(exc).__name__}: {exc}"[:800])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
