"""``MixedPrecisionPolicy``'s forward casts (``cast_forward_inputs``, ``output_dtype``;
shardc.sharding.forward_casts): a model fed float32 features under a bf16 policy trains like an
unsharded reference that computes in bf16 the way shardc does, eagerly, compiled with FX and
with Inductor, at worlds 1-4 with uneven shards; integer inputs stay as they are, DTensor inputs
are cast, ``cast_forward_inputs=False`` keeps the float32 input (and its dtype error), bad field
values raise ``TypeError``.

Each world's runs share one spawned group (:func:`_world_runs`), queued when collection ends
(:func:`prestart`); the reference is computed here, per world (the ranks' slices, the gradients
summed in float32 as shardc reduces them).
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from dist_utils import one_rank_mesh, run_prestarted
from dist_utils import prestart as prestart_run
from parity import StackBlock, max_rel_err
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

import shardc
from shardc.sharding import forward_casts

# Widths that divide none of the world sizes 2, 3, 4 (the 5-row head leaves world 4's last rank
# an empty shard); the global batch divides all of them.
FEATURES, DIM, HIDDEN, ODD, OUT, VOCAB = 7, 13, 19, 11, 5, 37
GLOBAL_BATCH, SEQ, STEPS, LR = 12, 3, 3, 1e-3
BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


class FloatStack(nn.Module):
    """Float features (positional), token ids (positional) and a nested keyword argument of
    float tensors in; two identical pre-norm blocks (one compiled body, checkpointing inside)
    and an odd one; a dict of float outputs (one nested in a tuple) out. Eager forwards record
    the dtypes they were given (``seen``)."""

    def __init__(self, blocks: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(FEATURES, DIM)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([StackBlock(DIM, HIDDEN) for _ in range(2)]
                                    + [StackBlock(DIM, ODD)] if blocks else [])
        self.head = nn.Linear(DIM, OUT)
        self.seen: dict = {}

    def forward(self, x: torch.Tensor, ids: torch.Tensor, *, extra: dict) -> dict:
        if not torch.compiler.is_compiling():
            self.seen = {"x": x.dtype, "ids": ids.dtype, "shift": extra["shift"].dtype,
                         "scale": extra["scale"][0].dtype}
        h = self.proj(x) + self.embed(ids) + extra["shift"] * extra["scale"][0]
        for block in self.blocks:
            h = block(h)
        return {"out": self.head(h), "aux": (h.mean(),)}


def build(kind: str = "stack") -> FloatStack:
    """``"stack"``: the blocks; ``"flat"``: none (the features' projection, the embedding and the
    head: Inductor's C++ compile of the stack's kernels costs tens of CPU seconds)."""
    torch.manual_seed(0)
    return FloatStack(blocks=kind == "stack")


def batches() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(STEPS, GLOBAL_BATCH, SEQ, FEATURES, generator=g),
            "ids": torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ), generator=g),
            "target": torch.randn(STEPS, GLOBAL_BATCH, SEQ, OUT, generator=g),
            "shift": torch.randn(DIM, generator=g), "scale": torch.tensor(0.5)}


def loss_of(out: dict, target: torch.Tensor) -> torch.Tensor:
    return ((out["out"].float() - target) ** 2).mean()


def _inputs(data: dict, step: int, rows: slice) -> tuple[tuple, dict]:
    return ((data["x"][step, rows], data["ids"][step, rows]),
            {"extra": {"shift": data["shift"], "scale": (data["scale"],)}})


def bf16_reference(world: int, output_dtype: torch.dtype | None, kind: str = "stack",
                   device: str = "cpu") -> dict:
    """What shardc computes at ``world`` under ``MixedPrecisionPolicy(bf16, fp32, output_dtype)``,
    in one process: each step the float32 masters rounded to a bf16 copy of the model, each
    rank's slice of the batch fed to it with its floating inputs cast to bf16 (the outputs to
    ``output_dtype``), each slice's bf16 gradients cast to float32, summed over the slices and
    divided by ``world`` (the reduce-scatter's average), then AdamW on the float32 masters.
    Computed on ``device`` (tests/gpu/test_forward_casts_gpu.py: "cuda"), returned on the CPU."""
    master = build(kind).to(device)
    work = copy.deepcopy(master).to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=LR)
    data = {k: v.to(device) for k, v in batches().items()}
    per = GLOBAL_BATCH // world
    losses = []
    for step in range(STEPS):
        with torch.no_grad():
            for w, m in zip(work.parameters(), master.parameters()):
                w.copy_(m)
        total, grads = 0.0, None
        for rank in range(world):
            work.zero_grad(set_to_none=True)
            args, kwargs = _inputs(data, step, slice(rank * per, (rank + 1) * per))
            out = work(*forward_casts.cast_floating(args, torch.bfloat16),
                       **forward_casts.cast_floating(kwargs, torch.bfloat16))
            if output_dtype is not None:
                out = forward_casts.cast_floating(out, output_dtype)
            loss = loss_of(out, data["target"][step, rank * per:(rank + 1) * per])
            loss.backward()
            total = total + loss.detach()
            these = [w.grad.float() for w in work.parameters()]
            grads = these if grads is None else [a + b for a, b in zip(grads, these)]
        for m, g in zip(master.parameters(), grads):
            m.grad = g / world if world > 1 else g
        opt.step()
        opt.zero_grad()
        losses.append(total / world)
    return {"losses": torch.stack(losses).cpu(),
            "params": {n: p.detach().cpu().clone() for n, p in master.named_parameters()}}


def _sharded_run(rank: int, world: int, mode: str, kind: str = "stack", **policy) -> dict:
    torch._dynamo.reset()
    model = build(kind)
    shardc.shard(model, mp_policy=shardc.MixedPrecisionPolicy(**BF16, **policy))
    forward = model if mode == "eager" else torch.compile(
        model, backend=shardc.backend(inductor=mode == "inductor"))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data, per = batches(), GLOBAL_BATCH // world
    rows = slice(rank * per, (rank + 1) * per)
    losses, dtypes = [], None
    for step in range(STEPS):
        args, kwargs = _inputs(data, step, rows)
        out = forward(*args, **kwargs)
        dtypes = {"out": out["out"].dtype, "aux": out["aux"][0].dtype}
        loss = loss_of(out, data["target"][step, rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    losses = torch.stack(losses)
    dist.all_reduce(losses)
    state = shardc.shard_state(model)
    return {"losses": losses / world,
            "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
            "out_dtypes": dtypes, "seen": model.seen, "regions": len(state.regions),
            "bodies": sum(len(r.plan.bodies) for r in state.regions if r.plan is not None)}


def _uncast_error(rank: int, world: int, mode: str) -> str:
    """``cast_forward_inputs=False``: the float32 features meet the bf16 weight; the error."""
    torch._dynamo.reset()
    model = build()
    shardc.shard(model, mp_policy=shardc.MixedPrecisionPolicy(**BF16, cast_forward_inputs=False))
    forward = model if mode == "eager" else torch.compile(model, backend="shardc")
    args, kwargs = _inputs(batches(), 0, slice(0, GLOBAL_BATCH // world))
    try:
        forward(*args, **kwargs)
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# world -> the runs of its spawned group: name -> (mode, options: the policy's and the model's
# kind, "stack" by default); the modes' output dtypes alternate over the worlds, so that each
# mode trains with and without output_dtype. Inductor: the flat model at world 1 in the default
# tier (its kernels' C++ compile is most of the cost: about 19 CPU s for the stack's, at world
# 1), the stack at 3 (slow).
FP32_OUT = {"output_dtype": torch.float32}
RUNS = {
    1: {"eager": ("eager", {}), "fx": ("fx", FP32_OUT),
        "inductor": ("inductor", {"kind": "flat", **FP32_OUT})},
    2: {"eager": ("eager", FP32_OUT), "fx": ("fx", {})},
    3: {"eager": ("eager", {}), "fx": ("fx", FP32_OUT), "inductor": ("inductor", FP32_OUT)},
    4: {"eager": ("eager", FP32_OUT), "fx": ("fx", {})},
}
# world -> the modes in which its group also checks cast_forward_inputs=False. Compiled only
# in the slow tier: Dynamo's failing trace costs more than a compile (4-9 CPU s a rank).
UNCAST = {1: ("eager",), 2: ("eager",), 3: ("eager", "fx")}
# (losses, parameters) relative errors against the bf16 reference. Eager and FX: the same
# kernels on the same bf16 values (bitwise at worlds 1, 2 and 4 when measured); only the float32
# sums over the ranks (losses, gradients) may add in another order (4e-8 at world 3).
# Inductor fuses the bf16 pointwise ops and keeps their intermediates in float32; with its
# emulate_precision_casts it rounds them as eager does, and the rest is its reductions' order
# (layer norms' bias gradients, which AdamW's normalized steps magnify on those zero-initialized
# parameters: 1.6e-3 measured, the other parameters 4e-5, the losses 2e-5, torch 2.13). Torch
# 2.11's Inductor rounds further from eager: plain torch.compile of the bf16 model (no shardc)
# against its eager run gave losses 3.7e-4 / 5.3e-4 and parameters 9.6e-4 / 3.0e-3 (the flat
# model / the stack, s66), and shardc's Inductor runs 4.6e-4 / 5.1e-4 in losses.
TOL = {"eager": (1e-6, 1e-6), "fx": (1e-6, 1e-6), "inductor": (1e-3, 1e-2)}


def _world_runs(rank: int, world: int) -> dict:
    with torch._inductor.config.patch(emulate_precision_casts=True):
        out = {name: _sharded_run(rank, world, mode, **options)
               for name, (mode, options) in RUNS[world].items()}
    out["uncast"] = {mode: _uncast_error(rank, world, mode) for mode in UNCAST.get(world, ())}
    return out


def prestart(items) -> None:
    """Queue the selected worlds' groups (tests/conftest.py, dist_utils.prestart), world 1
    first: run alone, this module's world-1 process then runs beside world 2's ranks."""
    worlds = {item.callspec.params["world"] for item in items
              if item.originalname == "test_float_inputs_train_like_the_bf16_reference"}
    for world in sorted(worlds):
        prestart_run(f"test_forward_casts[{world}]", (_world_runs, world))


# World 1 last (see prestart).
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow),
                                   pytest.param(4, marks=pytest.mark.slow), 1])
def test_float_inputs_train_like_the_bf16_reference(world):
    runs = run_prestarted(f"test_forward_casts[{world}]", _world_runs, world)
    references = {}
    for name, (mode, options) in RUNS[world].items():
        output_dtype, kind = options.get("output_dtype"), options.get("kind", "stack")
        if (output_dtype, kind) not in references:
            references[output_dtype, kind] = bf16_reference(world, output_dtype, kind)
        ref = references[output_dtype, kind]
        for rank, per_rank in enumerate(runs):
            run = per_rank[name]
            where = f"world {world}, rank {rank}, {name}"
            expected = output_dtype or torch.bfloat16
            assert run["out_dtypes"] == {"out": expected, "aux": expected}, (where, run)
            if mode == "eager":
                # Floating inputs (nested keyword ones too) cast, token ids as they were.
                assert run["seen"] == {"x": torch.bfloat16, "ids": torch.int64,
                                       "shift": torch.bfloat16, "scale": torch.bfloat16}, where
            else:  # one region, the stack's repeated blocks one compiled body
                assert (run["regions"], run["bodies"]) == (1, int(kind == "stack")), (
                    where, run["regions"], run["bodies"])
            loss_tol, param_tol = TOL[mode]
            err = max_rel_err(run["losses"], ref["losses"])
            assert err <= loss_tol, f"{where}: losses rel err {err:.2e}"
            assert run["params"].keys() == ref["params"].keys()
            for pname, value in ref["params"].items():
                err = max_rel_err(run["params"][pname], value)
                assert err <= param_tol, f"{where}: {pname} rel err {err:.2e}"
    for per_rank in runs:  # cast_forward_inputs=False: the float32 features reach the weight
        assert list(per_rank["uncast"]) == list(UNCAST.get(world, ()))
        for mode, error in per_rank["uncast"].items():
            assert error.startswith("RuntimeError: mat1 and mat2 must have the same dtype"), (
                mode, error)


def test_policy_fields_are_type_checked():
    for field, value in (("output_dtype", "float32"), ("param_dtype", torch.float32.itemsize),
                         ("reduce_dtype", "bf16")):
        with pytest.raises(TypeError, match=f"MixedPrecisionPolicy: {field} must be a "
                                            "torch.dtype or None"):
            shardc.MixedPrecisionPolicy(**{field: value})
    for value in (1, None, "yes"):
        with pytest.raises(TypeError, match="cast_forward_inputs must be a bool"):
            shardc.MixedPrecisionPolicy(cast_forward_inputs=value)
    policy = shardc.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    assert policy.cast_forward_inputs is True and policy.output_dtype is None


def test_shard_takes_fsdp2s_policy_and_names_a_wrong_one():
    """``shard(mp_policy=...)``: FSDP2's policy is taken field by field (the checks above
    apply), anything else is a ``TypeError`` naming ``mp_policy``, before any collective."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as Fsdp2Policy

    from shardc.sharding.shard import as_policy

    fsdp2 = Fsdp2Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                        output_dtype=torch.float32, cast_forward_inputs=False)
    assert as_policy(fsdp2) == shardc.MixedPrecisionPolicy(torch.bfloat16, torch.float32,
                                                           torch.float32, False)
    assert as_policy(None) == shardc.MixedPrecisionPolicy()
    with one_rank_mesh():
        for wrong in (torch.bfloat16, {"param_dtype": torch.bfloat16}):
            with pytest.raises(TypeError, match="shardc.shard: mp_policy must be a "
                                                "shardc.MixedPrecisionPolicy"):
                shardc.shard(build("flat"), mp_policy=wrong)
        # FSDP2's defaults (cast_forward_inputs on) and an output dtype, taken over: the float32
        # features reach the forward in bf16, the outputs come back in float32.
        taken = Fsdp2Policy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        model = shardc.shard(build("flat"), mp_policy=taken)
        assert shardc.shard_state(model).mp_policy == as_policy(taken)
        out = model(torch.randn(2, SEQ, FEATURES), torch.zeros(2, SEQ, dtype=torch.long),
                    extra={"shift": torch.zeros(DIM), "scale": (torch.tensor(1.0),)})
        assert model.seen["x"] == torch.bfloat16 and out["out"].dtype == torch.float32


def _hook_names(module: nn.Module) -> tuple[list[str], list[str]]:
    return ([h.__name__ for h in module._forward_pre_hooks.values()],
            [h.__name__ for h in module._forward_hooks.values()])


def test_casts_are_hooked_on_the_root_only_where_they_have_work():
    """No hook without a cast to make (the graphs of such policies are unchanged); the input
    cast before shardc's forward count, the output cast after its exit; each hook dict's order
    is its insertion order (``dict.keys``), which torch 2.11's Dynamo names hooks by in its
    guards (a prepended hook broke them: :func:`test_a_compiled_loss_function_of_the_model`)."""
    bf16 = torch.bfloat16
    expected = {
        None: ([], []),
        shardc.MixedPrecisionPolicy(reduce_dtype=torch.float32): ([], []),
        shardc.MixedPrecisionPolicy(bf16, cast_forward_inputs=False): ([], []),
        shardc.MixedPrecisionPolicy(bf16): (["cast_forward_inputs"], []),
        shardc.MixedPrecisionPolicy(output_dtype=torch.float32): ([], ["cast_forward_outputs"]),
        shardc.MixedPrecisionPolicy(bf16, output_dtype=torch.float32):
            (["cast_forward_inputs"], ["cast_forward_outputs"]),
    }
    with one_rank_mesh() as mesh:
        for policy, (pre, post) in expected.items():
            model = shardc.shard(build(), mesh, mp_policy=policy)
            assert _hook_names(model) == (pre + ["enter_forward"], ["exit_forward"] + post), policy
            assert _hook_names(model.blocks[2]) == (["enter_forward"], ["exit_forward"]), policy
            for hooks in (model._forward_pre_hooks, model._forward_hooks):
                assert list(dict.keys(hooks)) == list(hooks), policy
        # A pre-hook of the user's, registered before sharding, runs before the cast.
        model = build()
        model.register_forward_pre_hook(lambda module, args: None)
        shardc.shard(model, mesh, mp_policy=shardc.MixedPrecisionPolicy(bf16))
        assert _hook_names(model)[0] == ["<lambda>", "cast_forward_inputs", "enter_forward"]
        assert list(dict.keys(model._forward_pre_hooks)) == list(model._forward_pre_hooks)


def test_a_compiled_loss_function_of_the_model():
    """``torch.compile(functools.partial(loss_fn, model))`` (the model an argument of the
    compiled function, as the benchmarks compile their loss) under a bf16 policy: Dynamo traces
    the root's hooks and guards them; the float32 features are cast, and the loss and gradients
    are the model's compiled as a module. On torch 2.11 the guards failed to build while the
    input cast was a prepended hook (s67)."""
    data = batches()
    args, kwargs = _inputs(data, 0, slice(None))
    policy = shardc.MixedPrecisionPolicy(**BF16)
    with one_rank_mesh() as mesh:
        results = []
        for as_argument in (True, False):
            torch._dynamo.reset()
            model = shardc.shard(build("flat"), mesh, mp_policy=policy)
            backend = shardc.backend(inductor=False)

            def loss_fn(m: nn.Module, *a, **k) -> torch.Tensor:
                return loss_of(m(*a, **k), data["target"][0])

            if as_argument:
                compiled = torch.compile(functools.partial(loss_fn, model), backend=backend)
                loss = compiled(*args, **kwargs)
            else:
                loss = loss_of(torch.compile(model, backend=backend)(*args, **kwargs),
                               data["target"][0])
            loss.backward()
            results.append((loss.detach(), {n: p.grad.full_tensor()
                                            for n, p in model.named_parameters()}))
            assert len(shardc.shard_state(model).regions) == 1  # planned by shardc, no fallback
        (loss_a, grads_a), (loss_m, grads_m) = results
        assert torch.equal(loss_a, loss_m)
        assert grads_a.keys() == grads_m.keys()
        assert all(torch.equal(grads_a[n], grads_m[n]) for n in grads_m)


@dataclasses.dataclass(frozen=True)
class Features:
    """A forward argument that pytree does not know (FSDP2's cast enters such dataclasses)."""
    x: torch.Tensor
    ids: torch.Tensor
    extra: dict
    note: str = "kept"


class TakesDataclass(nn.Module):
    """FloatStack behind a dataclass argument; records the dataclass it was given (eagerly)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = build("flat")
        self.given: Features | None = None

    def forward(self, feats: Features) -> dict:
        if not torch.compiler.is_compiling():
            self.given = feats
        return self.inner(feats.x, feats.ids, extra=feats.extra)


def test_cast_floating_walks_nested_arguments():
    """Floating tensors of another dtype are cast; integer, boolean and complex tensors, tensors
    already in the dtype and non-tensors are the objects they were (a torch.Size too, not a
    tuple); DTensors stay DTensors with their placements."""
    bf16 = torch.bfloat16
    ids, mask = torch.arange(3), torch.ones(2, dtype=torch.bool)
    same, cplx = torch.ones(2, dtype=bf16), torch.ones(2, dtype=torch.complex64)
    size = torch.Size([2, 3])
    tree = ({"a": [torch.ones(2), ids], "b": (mask, 3.0, "s", size)}, same, cplx,
            torch.ones(1).double())
    out = forward_casts.cast_floating(tree, bf16)
    assert out[0]["a"][0].dtype == bf16 and out[3].dtype == bf16
    assert out[0]["a"][1] is ids and out[0]["b"][0] is mask and out[1] is same and out[2] is cplx
    assert out[0]["b"][1:3] == (3.0, "s") and out[0]["b"][3] is size  # not rebuilt as a tuple
    feats = Features(torch.ones(2), ids, {"f": [torch.ones(1)]})
    cast = forward_casts.cast_floating([feats], bf16)[0]
    assert type(cast) is Features and cast.x.dtype == bf16 and cast.ids is ids
    assert cast.extra["f"][0].dtype == bf16 and feats.x.dtype == torch.float32
    with one_rank_mesh() as mesh:
        d = DTensor.from_local(torch.randn(4, 3), mesh, [Replicate()])
        (cast,) = forward_casts.cast_floating((d,), bf16)
        assert isinstance(cast, DTensor) and cast.dtype == bf16 and cast.placements == d.placements
        assert torch.equal(cast.to_local(), d.to_local().to(bf16))


def test_a_dataclass_argument_is_cast_as_fsdp2_casts_it():
    """A dataclass among the root's arguments (not registered with pytree): its floating
    fields, nested ones too, reach the forward in ``param_dtype`` (a copy; the caller's object
    is unchanged), integer fields and strings as they were, eagerly and compiled (FX); the
    outputs equal those of the same model fed the fields directly."""
    data = batches()
    (x, ids), kwargs = _inputs(data, 0, slice(None))
    policy = shardc.MixedPrecisionPolicy(**BF16)
    feats = Features(x, ids, kwargs["extra"])
    with one_rank_mesh() as mesh:
        model = shardc.shard(TakesDataclass(), mesh, mp_policy=policy)
        direct = model.inner(x.bfloat16(), ids, extra=forward_casts.cast_floating(
            kwargs["extra"], torch.bfloat16))
        eager = model(feats)
        given = model.given
        assert given is not feats and feats.x.dtype == torch.float32  # the caller's is intact
        assert (given.x.dtype, given.ids.dtype, given.note) == (torch.bfloat16, torch.int64,
                                                                "kept")
        assert given.extra["shift"].dtype == given.extra["scale"][0].dtype == torch.bfloat16
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=shardc.backend(inductor=False))(feats)
        assert len(shardc.explain_all(model)) == 1
        for out in (eager, compiled):
            assert out.keys() == direct.keys()
            assert torch.equal(out["out"], direct["out"]), out["out"].dtype


def test_root_checkpointed_whole_and_dtensor_input():
    """One rank, eager: the whole root under non-reentrant activation checkpointing (its hooks,
    casts included, run again in the recomputation) gives the gradients of the plain call; a
    tensor-parallel model (1x1 ("dp", "tp") mesh) takes a float32 DTensor input."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    policy = shardc.MixedPrecisionPolicy(**BF16, output_dtype=torch.float32)
    data = batches()
    args, kwargs = _inputs(data, 0, slice(0, GLOBAL_BATCH))
    with one_rank_mesh() as mesh:
        model = shardc.shard(build(), mesh, mp_policy=policy)
        grads = []
        for wrapped in (False, True):
            out = checkpoint(model, *args, use_reentrant=False, **kwargs) if wrapped else \
                model(*args, **kwargs)
            loss_of(out, data["target"][0]).backward()
            grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
            model.zero_grad(set_to_none=True)
        assert all(torch.equal(grads[0][n], g) for n, g in grads[1].items())

        tp_mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        net = nn.Sequential(nn.Linear(FEATURES, 10), nn.ReLU(), nn.Linear(10, OUT))
        parallelize_module(net, tp_mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel(
            use_local_output=False)})
        shardc.shard(net, tp_mesh, mp_policy=policy)
        x = DTensor.from_local(data["x"][0], tp_mesh["tp"], [Replicate()])
        out = net(x)
        assert isinstance(out, DTensor) and out.dtype == torch.float32
        out.to_local().sum().backward()
        assert all(p.grad is not None for p in net.parameters())
