"""State dicts of shardc models through torch's own APIs (issue 5, requirements 1, 2, 4, 5, 7).

One spawned gloo group per world size (3 and 4: uneven splits, and ranks with empty shards of the
2- and 3-row parameters of ``Tiny``) runs every check in :func:`state_dict_worker` and returns what
it saw; the tests below assert on it. Compiled models use ``shardc.backend(inductor=False)``.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import shutil
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ckpt_workers import (
    LLAMA,
    adamw,
    diff,
    full,
    full_state,
    llama,
    llama_step,
    tiny,
    tiny_step,
    tokens,
)
from dist_utils import prestart as prestart_run
from dist_utils import run_prestarted
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import shardc
from shardc.checkpoint import ModelState, OptimizerState
from shardc.models.llama import Transformer

WORLD_SIZES = (3, 4)
# The compiled Llama checks run at this world size only (compile time): at 3 its 37-row
# embedding and output are split unevenly (13, 12, 12), and three ranks compile it, not four.
COMPILED_WORLD = 3


def _backend():
    return shardc.backend(inductor=False)


def describe(sd: dict) -> dict:
    """Per key: (type, global shape, dtype, placements, local shape, device type)."""
    out = {}
    for key, v in sd.items():
        if isinstance(v, DTensor):
            out[key] = ("DTensor", tuple(v.shape), v.dtype, tuple(v.placements),
                        tuple(v.to_local().shape), v.device.type)
        else:
            out[key] = (type(v).__name__, tuple(v.shape), v.dtype, None, tuple(v.shape),
                        v.device.type)
    return out


def _error(fn) -> str:
    try:
        fn()
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        return f"{type(exc).__name__}: {exc}"
    return "NO ERROR"


def state_dict_worker(rank: int, world: int, tmp: str) -> dict:
    out: dict = {"errors": {}, "times": {}}
    counts: dict[str, int] = {}
    out["counts"] = counts

    def count(name, fn):
        with CommDebugMode() as mode:
            result = fn()
        counts[name] = mode.get_total_counts()
        return result

    def section(name, fn):
        # Every section fails (or not) on all ranks alike: its collectives stay in step.
        start = time.perf_counter()
        try:
            fn()
        except Exception:
            out["errors"][name] = traceback.format_exc()
        out["times"][name] = time.perf_counter() - start

    ckpt = os.path.join(tmp, f"w{world}")
    ref = {"llama": llama(0, sharded=False).state_dict(),
           "tiny": tiny(0, sharded=False).state_dict()}
    out["plain_keys"] = {name: list(sd) for name, sd in ref.items()}

    # -- 1. eager state dicts, load_state_dict, DCP chunk coverage
    def eager():
        for name, build in (("llama", llama), ("tiny", tiny)):
            model = build(0)
            sd = count(f"{name}.state_dict", model.state_dict)
            out[f"{name}.eager"] = describe(sd)
            out[f"{name}.eager.values"] = diff(full(sd), ref[name])
            fresh = build(7)
            result = count(f"{name}.load_state_dict",
                           lambda fresh=fresh, sd=sd: fresh.load_state_dict(sd))
            out[f"{name}.load_state_dict"] = (
                list(result.missing_keys), list(result.unexpected_keys),
                diff(full(fresh.state_dict()), ref[name]),
            )
            md = dcp.save({"model": sd}, checkpoint_id=f"{ckpt}/chunks_{name}")
            out[f"{name}.chunks"] = {
                k: (tuple(v.size), [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks])
                for k, v in md.state_dict_metadata.items()
                if isinstance(v, TensorStorageMetadata)
            }

    section("eager", eager)

    # -- 2. optimizer state, DCP round trip of model + optimizer (eager models)
    trained, opt = llama(0), None

    def optimizer():
        nonlocal opt
        opt = adamw(trained)
        for step in range(2):
            llama_step(trained, opt, step, rank)
        info = {}
        for name, p in trained.named_parameters():
            s = opt.state[p]
            info[name] = {
                "param": (tuple(p.placements), tuple(p.to_local().shape), tuple(p.shape)),
                "mesh_equal": all(s[k].device_mesh == p.device_mesh
                                  for k in ("exp_avg", "exp_avg_sq")),
                **{k: describe({k: s[k]})[k] for k in ("exp_avg", "exp_avg_sq", "step")},
            }
        out["optim.info"] = info
        before = full_state(trained, opt)
        dcp.save({"model": ModelState(trained), "optim": OptimizerState(trained, opt)},
                 checkpoint_id=f"{ckpt}/rt")
        fresh = llama(7)
        fresh_opt = adamw(fresh)
        dcp.load({"model": ModelState(fresh), "optim": OptimizerState(fresh, fresh_opt)},
                 checkpoint_id=f"{ckpt}/rt")
        out["rt.diff"] = diff(full_state(fresh, fresh_opt), before)
        out["rt.step_types"] = sorted({type(s["step"]).__name__ for s in fresh_opt.state.values()})
        losses = [llama_step(m, o, 2, rank) for m, o in ((trained, opt), (fresh, fresh_opt))]
        out["rt.continue"] = diff(losses[0], losses[1]) + diff(
            full_state(fresh, fresh_opt), full_state(trained, opt)
        )
        out["rt.before"] = before

    section("optimizer", optimizer)

    # -- 2b. the same with the optimizer stepping the local shards (shardc.optim.local_shard_step):
    # the same state, bitwise, laid out the same; a DCP round trip into a fresh local-step
    # optimizer continues exactly.
    def optimizer_local():
        model = llama(0)
        local_opt = shardc.optim.local_shard_step(adamw(model))
        for step in range(2):
            llama_step(model, local_opt, step, rank)
        out["local.vs_dtensor_step"] = diff(full_state(model, local_opt), out["rt.before"])
        out["local.types"] = sorted({(k, type(v).__name__) for s in local_opt.state.values()
                                     for k, v in s.items()})
        dcp.save({"model": ModelState(model), "optim": OptimizerState(model, local_opt)},
                 checkpoint_id=f"{ckpt}/local")
        fresh = llama(7)
        fresh_opt = shardc.optim.local_shard_step(adamw(fresh))
        dcp.load({"model": ModelState(fresh), "optim": OptimizerState(fresh, fresh_opt)},
                 checkpoint_id=f"{ckpt}/local")
        losses = [llama_step(m, o, 2, rank) for m, o in ((model, local_opt), (fresh, fresh_opt))]
        out["local.continue"] = diff(losses[0], losses[1]) + diff(
            full_state(fresh, fresh_opt), full_state(model, local_opt))

    section("optimizer_local", optimizer_local)

    # -- 1. get_state_dict / set_state_dict with options, and their collectives
    def options():
        reference = full_state(trained, opt)
        msd, osd = count("get_state_dict", lambda: get_state_dict(trained, opt))
        out["gsd.model"] = describe(msd)
        out["gsd.optim_types"] = sorted(
            {type(v).__name__ for s in osd["state"].values() for v in s.values()}
        )
        offload = StateDictOptions(full_state_dict=True, cpu_offload=True)
        fmsd, fosd = count("get_state_dict.full_offload",
                           lambda: get_state_dict(trained, opt, options=offload))
        out["full_offload"] = (
            len(fmsd), diff(fmsd, reference["model"]) if rank == 0 else None,
            {type(v).__name__ for v in fmsd.values()}, {v.device.type for v in fmsd.values()},
        )
        amsd, aosd = count("get_state_dict.full",
                           lambda: get_state_dict(trained, opt,
                                                  options=StateDictOptions(full_state_dict=True)))
        out["full_all_ranks"] = diff(amsd, reference["model"])
        fresh = llama(11)
        fresh_opt = adamw(fresh)
        count("set_state_dict.full", lambda: set_state_dict(
            fresh, fresh_opt, model_state_dict=amsd, optim_state_dict=aosd,
            options=StateDictOptions(full_state_dict=True),
        ))
        out["set_full"] = diff(full_state(fresh, fresh_opt), reference)
        fresh = llama(13)
        fresh_opt = adamw(fresh)
        count("set_state_dict.full_offload", lambda: set_state_dict(
            fresh, fresh_opt, model_state_dict=amsd, optim_state_dict=aosd, options=offload))
        out["set_full_offload"] = diff(full_state(fresh, fresh_opt), reference)
        fresh = llama(12)
        fresh_opt = adamw(fresh)
        # broadcast_from_rank0 through set_model_state_dict / set_optimizer_state_dict: torch's
        # set_state_dict(model, optim, ...) takes an empty model_state_dict on ranks > 0 for
        # "optimizer only" and skips the model broadcast there (rank 0 would wait forever).
        broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

        def broadcast_load():
            set_model_state_dict(fresh, fmsd if rank == 0 else {}, options=broadcast)
            set_optimizer_state_dict(fresh, fresh_opt, fosd if rank == 0 else {},
                                     options=broadcast)

        count("set_state_dict.broadcast", broadcast_load)
        out["set_broadcast"] = diff(full_state(fresh, fresh_opt), reference)
        count("set_state_dict.sharded", lambda: set_state_dict(
            fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd))
        out["set_sharded"] = diff(full_state(fresh, fresh_opt), reference)

    section("options", options)

    # -- 1 + 4. compiled models: names, and a load after a compiled step is used by the next one
    def compiled():
        rt = f"{ckpt}/rt"
        used = llama(3, reshard_after_forward=False)  # keeps gathered params: cache-prone
        used.compile(backend=_backend())  # in place: the module keeps its names
        used_opt = adamw(used)
        llama_step(used, used_opt, 0, rank)
        probe = tokens(9, rank)
        stale = used(probe).detach()  # with grad: reuses the compiled training graph
        out["compiled.inplace"] = describe(used.state_dict())
        dcp.load({"model": ModelState(used), "optim": OptimizerState(used, used_opt)},
                 checkpoint_id=rt)
        plain = llama(4)
        wrapper = torch.compile(plain, backend=_backend())
        wrapper_opt = adamw(plain)
        dcp.load({"model": ModelState(wrapper), "optim": OptimizerState(wrapper, wrapper_opt)},
                 checkpoint_id=rt)
        after_used, after_fresh = used(probe).detach(), wrapper(probe).detach()
        out["compiled.forward"] = (diff(after_used, after_fresh), torch.equal(stale, after_used))
        losses = [llama_step(used, used_opt, 9, rank), llama_step(wrapper, wrapper_opt, 9, rank)]
        out["compiled.step"] = diff(losses[0], losses[1]) + diff(
            full_state(used, used_opt), full_state(plain, wrapper_opt)
        )
        out["compiled.wrapper.orig"] = describe(plain.state_dict())
        out["compiled.wrapper.keys"] = list(wrapper.state_dict())
        out["compiled.wrapper.get_state_dict"] = describe(get_state_dict(wrapper, wrapper_opt)[0])

    if world == COMPILED_WORLD:  # Llama compiles cost ~10 s per rank on 2 cores: one world
        section("compiled", compiled)

    def compiled_tiny():
        model = tiny(0)
        call = torch.compile(model, backend=_backend())
        tiny_step(call, adamw(model), 0, rank)
        out["tiny.compiled"] = describe(model.state_dict())

    section("compiled_tiny", compiled_tiny)

    # -- 5. async_save stages a copy; dcp_to_torch_save gives one file for the plain model
    def async_and_convert():
        model = llama(0)
        model_opt = adamw(model)
        llama_step(model, model_opt, 0, rank)
        before = full_state(model, model_opt)
        msd, osd = get_state_dict(model, model_opt)
        group = dist.new_group(backend="gloo")  # async collectives off the training group
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=f"{ckpt}/async",
                                process_group=group)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
            for s in model_opt.state.values():
                s["exp_avg"].mul_(-3.0)
        mutated = full_state(model, model_opt)
        future.result()
        fresh = llama(5)
        fresh_opt = adamw(fresh)
        dcp.load({"model": ModelState(fresh), "optim": OptimizerState(fresh, fresh_opt)},
                 checkpoint_id=f"{ckpt}/async")
        out["async"] = (type(future).__name__, diff(full_state(fresh, fresh_opt), before),
                        len(diff(mutated, before)))
        dist.barrier()
        if rank == 0:
            target = f"{ckpt}/single.pt"
            dcp_to_torch_save(f"{ckpt}/rt", target)
            saved = torch.load(target, weights_only=True)
            plain = llama(8, sharded=False)
            result = plain.load_state_dict(saved["model"], strict=True)
            reference = out["rt.before"]
            out["torch_save"] = (
                sorted(saved), list(result.missing_keys), list(result.unexpected_keys),
                diff(plain.state_dict(), reference["model"]),
                diff({k: v for k, v in sorted(saved["optim"]["state"].items())},
                     reference["optim"]),
            )
        dist.barrier()

    section("async", async_and_convert)

    # -- 7. torch's own errors
    def errors():
        good = llama(0)
        sd = dict(good.state_dict())
        del sd["norm.weight"], sd["output.weight"]
        sd["bogus.weight"] = good.state_dict()["norm.weight"]
        errs = {"lsd.keys": _error(lambda: llama(1).load_state_dict(sd))}
        torch.manual_seed(0)
        wide = shardc.shard(Transformer(dataclasses.replace(LLAMA, vocab_size=38)))
        errs["lsd.shape"] = _error(lambda: wide.load_state_dict(good.state_dict()))
        torch.manual_seed(0)
        double = shardc.shard(Transformer(LLAMA).double())
        errs["lsd.dtype"] = _error(lambda: double.load_state_dict(good.state_dict()))
        errs["lsd.dtype.after"] = str(double.state_dict()["norm.weight"].dtype)
        errs["lsd.plain_tensors"] = _error(lambda: llama(1).load_state_dict(
            llama(0, sharded=False).state_dict()))
        rt = f"{ckpt}/rt"
        errs["dcp.shape"] = _error(lambda: dcp.load({"model": wide.state_dict()},
                                                    checkpoint_id=rt))
        extra = dict(llama(1).state_dict())
        extra["bogus.a"] = torch.zeros(2)
        extra["bogus.b"] = torch.zeros(2)
        errs["dcp.missing"] = _error(lambda: dcp.load({"model": extra}, checkpoint_id=rt))
        double_sd = double.state_dict()
        errs["dcp.dtype"] = _error(lambda: dcp.load({"model": double_sd}, checkpoint_id=rt))
        errs["dcp.dtype.after"] = str(double_sd["norm.weight"].dtype)
        os.makedirs(f"{ckpt}/empty", exist_ok=True)
        errs["dcp.no_metadata"] = _error(lambda: dcp.load({"model": llama(1).state_dict()},
                                                          checkpoint_id=f"{ckpt}/empty"))
        out["torch_errors"] = errs

    section("errors", errors)
    return out


# The groups' checkpoint directory, each world under its own ``w{world}``: made by the test
# process when first asked for (at collection, where :func:`prestart` queues the groups; not at
# import, which each spawned rank does too) and removed at the session's end.
@functools.cache
def _checkpoints_dir() -> str:
    path = tempfile.mkdtemp(prefix="shardc-test-state-dict-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def prestart(items) -> None:
    """Queue the two groups (tests/conftest.py, dist_utils.prestart), one entry per world (one
    group's ranks at a time): in the whole suite they run in the background while the tests
    before this module run, after the other modules' entries."""
    if any("results" in item.fixturenames for item in items):
        for world in WORLD_SIZES:
            prestart_run(f"test_state_dict[{world}]",
                         (state_dict_worker, world, _checkpoints_dir()))


@pytest.fixture(scope="module")
def results():
    return {world: run_prestarted(f"test_state_dict[{world}]", state_dict_worker, world,
                                  _checkpoints_dir())
            for world in WORLD_SIZES}


def _sections_ok(results, *names):
    for world, ranks in results.items():
        for rank, out in enumerate(ranks):
            for name in names:
                assert name not in out["errors"], f"world {world} rank {rank}:\n" + out["errors"][
                    name]


def _chunk_rows(dim0: int, world: int) -> list[int]:
    chunk = -(-dim0 // world)
    return [max(0, min(chunk, dim0 - r * chunk)) for r in range(world)]


def _check_state_dict(views: list[dict], plain: dict, world: int) -> None:
    """Every rank's described state dict against the plain model's (``plain``: key -> tensor)."""
    for rank, view in enumerate(views):
        assert list(view) == list(plain), f"rank {rank}: keys differ from the unsharded model"
        for key, (kind, shape, dtype, placements, local, _) in view.items():
            assert shape == tuple(plain[key].shape) and dtype == plain[key].dtype, key
            if key.endswith(("weight", "bias")):
                assert kind == "DTensor" and placements == (torch.distributed.tensor.Shard(0),)
            else:  # buffers stay plain tensors
                assert kind == "Tensor" and local == shape, key
    for key, (kind, shape, *_rest) in views[0].items():
        if kind != "DTensor":
            continue
        rows = [view[key][4][0] for view in views]
        assert rows == _chunk_rows(shape[0], world), (key, rows)
        assert all(view[key][4][1:] == shape[1:] for view in views), key


@pytest.mark.parametrize("name", ["llama", "tiny"])
def test_eager_state_dict_is_dtensors_with_original_names(results, name):
    _sections_ok(results, "eager")
    for world, ranks in results.items():
        plain_keys = ranks[0]["plain_keys"][name]
        plain = {k: v for k, v in (llama if name == "llama" else tiny)(
            0, sharded=False).state_dict().items()}
        assert list(plain) == plain_keys
        _check_state_dict([r[f"{name}.eager"] for r in ranks], plain, world)
        for out in ranks:
            assert out[f"{name}.eager.values"] == []
            missing, unexpected, values = out[f"{name}.load_state_dict"]
            assert (missing, unexpected, values) == ([], [], [])
    if name == "llama":  # bias-less: no phantom parameters, non-persistent rope tables absent
        assert not any("bias" in k or "rope" in k for k in plain_keys)
    else:
        assert "scale" in plain_keys and "scratch" not in plain_keys
        assert {"fc1.bias", "fc2.bias"} <= set(plain_keys)
    # empty shards really happen: 2 rows over 3 or 4 ranks
    assert 0 in [r["tiny.eager"]["fc2.weight"][4][0] for r in results[3]]


def test_dcp_chunks_cover_each_tensor_exactly(results):
    _sections_ok(results, "eager")
    for world, ranks in results.items():
        for name in ("llama", "tiny"):
            chunks = ranks[0][f"{name}.chunks"]
            assert chunks == ranks[-1][f"{name}.chunks"]
            for key, (size, pieces) in chunks.items():
                covered = torch.zeros(size, dtype=torch.int32)
                for offsets, sizes in pieces:
                    bounds = zip(offsets, sizes, size, strict=True)
                    assert all(o + s <= d for o, s, d in bounds), key
                    index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
                    covered[index] += 1
                assert bool((covered == 1).all()), f"world {world}: {key} chunks {pieces}"


def test_compiled_model_state_dict_keeps_names(results):
    _sections_ok(results, "compiled")
    plain = llama(0, sharded=False).state_dict()
    for world in (COMPILED_WORLD,):
        ranks = results[world]
        views = ("compiled.inplace", "compiled.wrapper.orig", "compiled.wrapper.get_state_dict")
        for view in views:
            _check_state_dict([r[view] for r in ranks], plain, world)
        # torch.compile's wrapper module itself prefixes its child (torch behaviour, any model)
        assert ranks[0]["compiled.wrapper.keys"] == [f"_orig_mod.{k}" for k in plain]


def test_compiled_tiny_model_with_biases_and_buffer(results):
    _sections_ok(results, "compiled_tiny")
    plain = tiny(0, sharded=False).state_dict()
    for world, ranks in results.items():
        _check_state_dict([r["tiny.compiled"] for r in ranks], plain, world)


def test_get_and_set_state_dict_options(results):
    _sections_ok(results, "optimizer", "options")
    plain = llama(0, sharded=False).state_dict()
    for world, ranks in results.items():
        _check_state_dict([r["gsd.model"] for r in ranks], plain, world)
        for rank, out in enumerate(ranks):
            assert out["gsd.optim_types"] == ["DTensor", "Tensor"]
            n, values, kinds, devices = out["full_offload"]
            if rank == 0:
                assert n == len(plain) and values == [] and kinds == {"Tensor"}
                assert devices == {"cpu"}
            else:  # cpu_offload + full_state_dict: only rank 0 keeps the full tensors
                assert n == 0
            assert out["full_all_ranks"] == []
            assert out["set_full"] == [] and out["set_broadcast"] == []
            assert out["set_full_offload"] == []
            assert out["set_sharded"] == []


def test_state_dict_collectives_are_the_same_on_every_rank(results):
    _sections_ok(results, "eager", "options")
    for ranks in results.values():
        counts = [r["counts"] for r in ranks]
        assert all(c == counts[0] for c in counts), counts
        for name in ("llama", "tiny"):  # reading or loading a sharded state dict never talks
            assert counts[0][f"{name}.state_dict"] == 0
            assert counts[0][f"{name}.load_state_dict"] == 0
        assert counts[0]["get_state_dict"] == 0
        assert counts[0]["get_state_dict.full"] > 0  # gathers run on every rank alike


def test_optimizer_state_is_dtensor_like_its_parameter(results):
    _sections_ok(results, "optimizer")
    for ranks in results.values():
        for out in ranks:
            assert set(out["optim.info"]) == set(llama(0, sharded=False).state_dict())
            for info in out["optim.info"].values():
                placements, local, shape = info["param"]
                for key in ("exp_avg", "exp_avg_sq"):
                    kind, gshape, dtype, place, loc, _ = info[key]
                    assert (kind, gshape, place, loc) == ("DTensor", shape, placements, local)
                assert info["mesh_equal"]
                kind, gshape, dtype, place, *_ = info["step"]
                assert (kind, gshape, dtype, place) == ("Tensor", (), torch.float32, None)


def test_dcp_roundtrip_of_model_and_optimizer(results):
    _sections_ok(results, "optimizer")
    for ranks in results.values():
        for out in ranks:
            assert out["rt.diff"] == []
            assert out["rt.step_types"] == ["Tensor"]
            assert out["rt.continue"] == []


def test_local_shard_step_state_and_dcp_roundtrip(results):
    """shardc.optim.local_shard_step leaves the optimizer's state exactly as torch's DTensor step
    does (bitwise, DTensor moments, a plain step counter), and DCP saves and loads it."""
    _sections_ok(results, "optimizer", "optimizer_local")
    for ranks in results.values():
        for out in ranks:
            assert out["local.vs_dtensor_step"] == []
            assert out["local.types"] == [("exp_avg", "DTensor"), ("exp_avg_sq", "DTensor"),
                                          ("step", "Tensor")]
            assert out["local.continue"] == []


def test_load_into_model_that_ran_a_compiled_step(results):
    _sections_ok(results, "compiled")
    for ranks in (results[COMPILED_WORLD],):
        for out in ranks:
            forward_diff, unchanged = out["compiled.forward"]
            assert forward_diff == [] and not unchanged
            assert out["compiled.step"] == []


def test_async_save_stages_a_copy_and_converts_to_one_file(results):
    _sections_ok(results, "async")
    for ranks in results.values():
        for out in ranks:
            kind, values, mutated = out["async"]
            assert values == [] and mutated > 0, (kind, values)
        names, missing, unexpected, model_diff, optim_diff = ranks[0]["torch_save"]
        assert names == ["model", "optim"]
        assert (missing, unexpected, model_diff, optim_diff) == ([], [], [], [])


def test_torch_errors(results):
    _sections_ok(results, "errors")
    errs = results[3][0]["torch_errors"]
    # load_state_dict lists every missing and unexpected key at once
    for key in ("norm.weight", "output.weight", "bogus.weight"):
        assert key in errs["lsd.keys"]
    assert "size mismatch for tok_embeddings.weight" in errs["lsd.shape"]
    assert "torch.Size([37, 24])" in errs["lsd.shape"] and "torch.Size([38, 24])" in errs[
        "lsd.shape"]
    # dtype: torch casts silently (CheckpointManager.load checks it)
    assert errs["lsd.dtype"] == "NO ERROR" and errs["lsd.dtype.after"] == "torch.float64"
    assert "tok_embeddings.weight" in errs["lsd.plain_tensors"]
    assert "mixed torch.Tensor and DTensor" in errs["lsd.plain_tensors"]
    # DCP names the key and both shapes
    assert "Size mismatch between saved torch.Size([37, 24]) and current: torch.Size([38, 24]) " \
           "for model.tok_embeddings.weight" in errs["dcp.shape"]
    # DCP names only the first missing key, and casts dtypes silently
    assert "Missing key in checkpoint state_dict: model.bogus.a" in errs["dcp.missing"]
    assert "model.bogus.b" not in errs["dcp.missing"]
    assert errs["dcp.dtype"] == "NO ERROR" and errs["dcp.dtype.after"] == "torch.float64"
    # A directory without DCP's .metadata: torch 2.13+ names the file, 2.11 only says that the
    # metadata is None.
    assert (".metadata" in errs["dcp.no_metadata"]
            or "metadata is None" in errs["dcp.no_metadata"]), errs["dcp.no_metadata"]
