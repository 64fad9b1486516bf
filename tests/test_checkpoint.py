"""DCP checkpoints of shardc models: resharding, CheckpointManager, crashes, bad input, FSDP2.

Issue 5, requirements 3, 6, 7 and 8. Three spawned jobs run in order and leave their checkpoints
in one temporary directory:

* job A, 3 gloo ranks: saves the N=3 source of the resharding matrix, the FSDP2 interop in both
  directions, and every ``CheckpointManager`` check (retention, resume, incomplete directories,
  async save, disagreeing ranks, strict / non-strict mismatches, corrupt and partial checkpoints).
* job B, 2 ranks: saves the N=2 source (and records its uninterrupted continuation), then a
  ``CheckpointManager`` save in which rank 1 dies between the DCP write and the completion barrier.
* job C, 4 ranks: saves the N=4 source, loads the crashed manager's previous step on a new group,
  and runs the resharding matrix. Groups of N < 4 ranks are process groups of the first N ranks
  (``dist.new_group``): DCP, shardc and the optimizer only ever see that group (sharded with
  ``allow_partial_mesh=True``: such a group stands for a whole job of N ranks).

Resharding, what is compared (bitwise, ``torch.equal``): (1) after loading on M ranks a checkpoint
saved on N ranks, every parameter, ``exp_avg``, ``exp_avg_sq`` and ``step`` equals the state the N
ranks held when they saved; (2) training continued for J steps on M ranks after that load equals
training continued on M ranks from the same state put in place by hand (no checkpoint API): the
uninterrupted run at world size M. Comparing with the N-rank run itself is only meaningful for
N == M (shardc averages gradients over the ranks, so the rounding of the mean depends on the world
size); that is checked for (2, 2) against job B's own uninterrupted continuation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ckpt_workers import (
    LLAMA,
    adamw,
    diff,
    full_state,
    llama,
    llama_step,
    run_group,
    state_from_full,
)
from dist_utils import run_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import shardc
from shardc.checkpoint import (
    MARKER_NAME,
    CheckpointManager,
    ModelState,
    OptimizerState,
)
from shardc.models.llama import Transformer

K, J = 2, 2  # training steps before the checkpoint, and after it
PAIRS = [(2, 4), (4, 2), (3, 2), (1, 3), (2, 1)]
# CPU offload (issue 21; simulated on the CPU mesh: the copies are real separate tensors).
OFFLOAD = shardc.OffloadPolicy(simulate_on_cpu=True)
# Optimizer-only offload (the optimizer steps on host copies, its state on the host).
OPT_OFFLOAD = shardc.OffloadPolicy(params=False, simulate_on_cpu=True)
# (saved as, loaded at world M with offload? True: all, "opt": optimizer only): offloaded 3 ->
# offloaded 2, offloaded 3 -> plain 4, plain 4 -> offloaded 3, plain 2 -> offloaded 2;
# optimizer-only 3 -> plain 2, plain 4 -> optimizer-only 3.
OFFLOAD_LOADS = [("n3off", 2, True), ("n3off", 4, False), ("n4", 3, True), ("n2", 2, True),
                 ("n3opt", 2, False), ("n4", 3, "opt"),
                 # pack_blocks (issue 18): packed to packed, packed to per-parameter, and back.
                 ("n3packed", 2, "packed"), ("n3packed", 4, False), ("n4", 3, "packed")]


def _policy(offload: bool | str) -> shardc.OffloadPolicy | None:
    return OPT_OFFLOAD if offload == "opt" else OFFLOAD if offload is True else None


def _sharded(seed: int, mesh, offload: bool | str) -> tuple[nn.Module, Callable]:
    """A llama sharded on ``mesh`` as ``offload`` says (True / "opt": offloaded; "packed":
    ``pack_blocks=True``, trained compiled, where the packed read is), and what to call."""
    model = llama(seed, mesh=mesh, allow_partial_mesh=True, offload=_policy(offload),
                  pack_blocks=offload == "packed")
    if offload != "packed":
        return model, model
    torch._dynamo.reset()  # one model of the class per compile (the recompile limit)
    return model, torch.compile(model, backend=shardc.backend(inductor=False))


def _error(fn) -> str:
    try:
        fn()
    except BaseException as exc:
        return f"{type(exc).__name__}: {exc}"
    return "NO ERROR"


def _states(model, opt) -> dict:
    return {"model": ModelState(model), "optim": OptimizerState(model, opt)}


def _tree_digest(root: str) -> dict[str, str]:
    out = {}
    for base, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


# --------------------------------------------------------------------------------------------
# Resharding sources and loads


def reshard_save(group, name: str, tmp: str, record_continuation: bool = False,
                 offload: bool | str = False) -> None:
    """Train K steps on ``group`` and save; rank 0 keeps the gathered state next to it."""
    grank = dist.get_rank(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    model, call = _sharded(0, mesh, offload)
    opt = adamw(model)
    for step in range(K):
        llama_step(call, opt, step, grank)
    state = full_state(model, opt)
    where = os.path.join(tmp, "reshard", name)
    dcp.save(_states(model, opt), checkpoint_id=where, process_group=group)
    if grank == 0:
        torch.save(state, f"{where}.state.pt")
    if record_continuation:
        losses = [llama_step(call, opt, K + j, grank) for j in range(J)]
        torch.save({"losses": losses, "final": full_state(model, opt)},
                   f"{where}.continued.rank{grank}.pt")


def reshard_load(group, name: str, tmp: str, same_world: bool,
                 offload: bool | str = False) -> dict:
    """Load ``name`` on ``group``; continue J steps; the same from the state put in by hand."""
    grank = dist.get_rank(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    where = os.path.join(tmp, "reshard", name)
    saved = torch.load(f"{where}.state.pt", weights_only=False)
    model, call = _sharded(123, mesh, offload)
    opt = adamw(model)
    before = full_state(model, opt)
    dcp.load(_states(model, opt), checkpoint_id=where, process_group=group)
    out = {"loaded": diff(full_state(model, opt), saved),
           "changed": bool(diff(before, saved))}
    losses = [llama_step(call, opt, K + j, grank) for j in range(J)]
    final = full_state(model, opt)
    ref, ref_call = _sharded(321, mesh, offload)
    ref_opt = adamw(ref)
    state_from_full(ref, ref_opt, saved)
    out["reference_start"] = diff(full_state(ref, ref_opt), saved)
    ref_losses = [llama_step(ref_call, ref_opt, K + j, grank) for j in range(J)]
    out["continued"] = diff(losses, ref_losses) + diff(final, full_state(ref, ref_opt))
    if same_world:  # against the saving run's own continuation
        run = torch.load(f"{where}.continued.rank{grank}.pt", weights_only=False)
        out["uninterrupted"] = diff(losses, run["losses"]) + diff(final, run["final"])
    out["world"] = dist.get_world_size(group)
    return out


# --------------------------------------------------------------------------------------------
# Job A: 3 ranks


def fsdp2_checks(rank: int, tmp: str, offload: bool = False) -> dict:
    """``offload``: FSDP2 with CPUOffloadPolicy (unpinned: it runs on a CPU mesh too) against
    shardc with offload."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}

    def fsdp_model(seed: int) -> Transformer:
        torch.manual_seed(seed)
        model = Transformer(LLAMA)
        for layer in model.layers:
            fully_shard(layer, **policy)
        return fully_shard(model, **policy)

    def shardc_model(seed: int) -> Transformer:
        return llama(seed, offload=OFFLOAD if offload else None)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.double(), b.double()
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    out = {}
    for direction, make_src, make_dst in (("fsdp2->shardc", fsdp_model, shardc_model),
                                          ("shardc->fsdp2", shardc_model, fsdp_model)):
        ckpt = os.path.join(tmp, "fsdp2" + ("_offload" if offload else ""),
                            direction.replace(">", ""))
        src = make_src(0)
        src_opt = adamw(src)
        for step in range(K):
            llama_step(src, src_opt, step, rank)
        saved = full_state(src, src_opt)
        dcp.save(_states(src, src_opt), checkpoint_id=ckpt)
        src_losses = [llama_step(src, src_opt, K + j, rank) for j in range(J)]
        src_final = full_state(src, src_opt)
        dst = make_dst(77)
        dst_opt = adamw(dst)
        dcp.load(_states(dst, dst_opt), checkpoint_id=ckpt)
        loaded = diff(full_state(dst, dst_opt), saved)
        dst_losses = [llama_step(dst, dst_opt, K + j, rank) for j in range(J)]
        dst_final = full_state(dst, dst_opt)
        params = {k: rel(dst_final["model"][k], v) for k, v in src_final["model"].items()}
        moments = {f"{k}.{m}": rel(dst_final["optim"][k][m], v[m])
                   for k, v in src_final["optim"].items() for m in ("exp_avg", "exp_avg_sq")}
        out[direction] = {
            "loaded": loaded,
            "losses": [rel(a, b) for a, b in zip(dst_losses, src_losses, strict=True)],
            "params": max(params.values()),
            "moments": max(moments.values()),
            "step": all(torch.equal(dst_final["optim"][k]["step"], v["step"])
                        for k, v in src_final["optim"].items()),
            "keys": sorted(src_final["model"]) == sorted(dst_final["model"]),
        }
    return out


def manager_checks(rank: int, tmp: str) -> dict:
    out: dict = {}
    root = os.path.join(tmp, "mgr")
    mgr = CheckpointManager(root, keep_last=2)
    model = llama(0)
    opt = adamw(model)
    state = _states(model, opt)
    out["empty"] = (mgr.steps(), mgr.latest_step(), mgr.load(state))
    saved = {}
    for step in range(1, 5):
        llama_step(model, opt, step, rank)
        mgr.save(step, state)
        saved[step] = full_state(model, opt)
    out["steps"] = (mgr.steps(), mgr.latest_step(), sorted(os.listdir(root)))
    with open(os.path.join(root, "latest")) as f:
        out["latest_file"] = f.read()
    with open(os.path.join(root, "step_00000004", MARKER_NAME)) as f:
        out["marker"] = json.load(f)
    out["files"] = sorted(os.listdir(os.path.join(root, "step_00000004")))

    fresh = llama(5)
    fresh_opt = adamw(fresh)
    fresh_state = _states(fresh, fresh_opt)
    out["resume"] = (mgr.load(fresh_state), diff(full_state(fresh, fresh_opt), saved[4]))
    out["resume3"] = (mgr.load(fresh_state, step=3), diff(full_state(fresh, fresh_opt), saved[3]))

    # an incomplete newer directory (a killed save) is ignored
    if rank == 0:
        os.makedirs(os.path.join(root, "step_00000009"))
        with open(os.path.join(root, "step_00000009", "__0_0.distcp"), "wb") as f:
            f.write(b"half a checkpoint")
    dist.barrier()
    out["ignore_incomplete"] = (mgr.steps(), mgr.load(fresh_state),
                                diff(full_state(fresh, fresh_opt), saved[4]))
    out["load_incomplete"] = _error(lambda: mgr.load(fresh_state, step=9))
    out["load_absent"] = _error(lambda: mgr.load(fresh_state, step=7))
    out["save_existing"] = _error(lambda: mgr.save(4, state))
    out["save_older"] = _error(lambda: mgr.save(2, state))
    out["save_disagree"] = _error(lambda: mgr.save(5 + rank, state))
    out["save_bad_step"] = _error(lambda: mgr.save(-1, state))
    llama_step(model, opt, 9, rank)
    mgr.save(9, state)  # replaces the incomplete directory
    saved[9] = full_state(model, opt)
    out["after9"] = (mgr.steps(), sorted(os.listdir(root)))

    # async save: the state is staged when async_save returns
    llama_step(model, opt, 10, rank)
    before = full_state(model, opt)
    future = mgr.async_save(10, state)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    path = future.result()
    out["async"] = (os.path.basename(path), mgr.steps(),
                    os.path.exists(os.path.join(path, MARKER_NAME)))
    out["async_load"] = (mgr.load(fresh_state), diff(full_state(fresh, fresh_opt), before))
    saved[10] = before

    # ---- bad input (requirement 7): every failed load leaves the target and the files alone
    target = llama(6)
    target_opt = adamw(target)
    # get_optimizer_state_dict gives a never-stepped optimizer its (zero) state on the first call,
    # load or not (torch's recipe); take the reference after that.
    OptimizerState(target, target_opt).state_dict()
    untouched = full_state(target, target_opt)
    digest = _tree_digest(root)

    def unchanged() -> list[str]:
        return diff(full_state(target, target_opt), untouched) + (
            [] if _tree_digest(root) == digest else ["checkpoint files changed"])

    sd = dict(target.state_dict())
    del sd["norm.weight"], sd["output.weight"]
    sd["bogus.a"] = torch.zeros(2)
    sd["bogus.b"] = torch.zeros(3)
    keys_state = {"model": sd, "optim": OptimizerState(target, target_opt)}
    out["strict_keys"] = (_error(lambda: mgr.load(keys_state)), unchanged())

    torch.manual_seed(0)
    wide = shardc.shard(Transformer(dataclasses.replace(LLAMA, vocab_size=38)))
    out["shape"] = (_error(lambda: mgr.load({"model": ModelState(wide)})),
                    _error(lambda: mgr.load({"model": ModelState(wide)}, strict=False)))
    torch.manual_seed(0)
    double = shardc.shard(Transformer(LLAMA).double())
    double_opt = adamw(double)
    out["dtype"] = _error(lambda: mgr.load(_states(double, double_opt)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = mgr.load(_states(double, double_opt), strict=False)
    cast = {k: v.double() if v.is_floating_point() else v for k, v in saved[10]["model"].items()}
    out["dtype_nonstrict"] = (step, [str(w.message) for w in caught],
                              diff(full_state(double, None)["model"], cast),
                              str(mgr.last_report))

    # ranks disagree about the state: every rank fails, naming the rank
    odd = dict(target.state_dict())
    if rank == 1:
        odd["only.on.rank1"] = torch.zeros(1)
    out["rank_disagree"] = (
        _error(lambda: mgr.load({"model": odd, "optim": OptimizerState(target, target_opt)})),
        unchanged(),
    )

    # non-strict: the keys both sides have are loaded, the rest is reported
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = mgr.load(keys_state, strict=False)
    caught = [w for w in caught if "non-strict" in str(w.message)]
    report = mgr.last_report
    loaded = full_state(target, target_opt)
    dropped = ("norm.weight", "output.weight")
    out["nonstrict"] = (
        step, report.missing, report.unexpected, len(caught),
        diff({k: v for k, v in loaded["model"].items() if k not in dropped},
             {k: v for k, v in saved[10]["model"].items() if k not in dropped}),
        diff(loaded["model"]["norm.weight"], untouched["model"]["norm.weight"]),
        diff(loaded["optim"], saved[10]["optim"]),
    )

    # corrupt and partial checkpoints, each on its own copy of step 10
    damage = {
        "flipped_byte": ("__1_0.distcp", "flip"),
        "truncated": ("__0_0.distcp", "truncate"),
        "no_metadata": (".metadata", "delete"),
        "no_marker": (MARKER_NAME, "delete"),
        "bad_marker": (MARKER_NAME, "garbage"),
    }
    victim = llama(8)
    victim_opt = adamw(victim)
    OptimizerState(victim, victim_opt).state_dict()
    victim_before = full_state(victim, victim_opt)
    for kind, (name, how) in damage.items():
        broken_root = os.path.join(tmp, f"broken_{kind}")
        if rank == 0:
            shutil.copytree(os.path.join(root, "step_00000010"),
                            os.path.join(broken_root, "step_00000010"))
            path = os.path.join(broken_root, "step_00000010", name)
            if how == "flip":
                with open(path, "r+b") as f:
                    f.seek(40)
                    byte = f.read(1)
                    f.seek(40)
                    f.write(bytes([byte[0] ^ 0xFF]))
            elif how == "truncate":
                with open(path, "r+b") as f:
                    f.truncate(os.path.getsize(path) - 7)
            elif how == "delete":
                os.remove(path)
            else:
                with open(path, "w") as f:
                    f.write("{not json")
        dist.barrier()
        broken = CheckpointManager(broken_root)
        before_files = _tree_digest(broken_root)
        victim_state = _states(victim, victim_opt)
        result = {"auto": _error(lambda b=broken, s=victim_state: b.load(s)),
                  "explicit": _error(lambda b=broken, s=victim_state: b.load(s, step=10))}
        if kind == "no_marker":
            result["auto_value"] = broken.load(victim_state)
        result["unchanged"] = diff(full_state(victim, victim_opt), victim_before) + (
            [] if _tree_digest(broken_root) == before_files else ["checkpoint files changed"])
        out[f"broken.{kind}"] = result
    # Plain dcp.load of a copy with a flipped byte: no error, wrong values (torch's DCP keeps no
    # checksums; docs/checkpoints.md).
    flipped = os.path.join(tmp, "plain_flipped", "step_00000010")
    if rank == 0:  # one byte in the middle of rank 0's data file: tensor bytes
        shutil.copytree(os.path.join(root, "step_00000010"), flipped)
        path = os.path.join(flipped, "__0_0.distcp")
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(os.path.getsize(path) // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    plain = llama(8)
    plain_opt = adamw(plain)
    OptimizerState(plain, plain_opt).state_dict()
    out["plain_dcp_flipped"] = {
        "error": _error(lambda: dcp.load(_states(plain, plain_opt), checkpoint_id=flipped)),
        "differs": diff(full_state(plain, plain_opt), saved[10]),
    }
    return out


def _host_locals(model: nn.Module) -> dict[str, tuple[str, int]]:
    """Each parameter's local shard: its device and storage address (loads go in place)."""
    return {n: (p.to_local().device.type, p.to_local().data_ptr())
            for n, p in model.named_parameters()}


def _cloned(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _cloned(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cloned(v) for v in tree)
    return tree


def offload_state_checks(rank: int, tmp: str) -> dict:
    """CPU offload (issue 21): torch's get_state_dict / set_state_dict on an offloaded model and
    its AdamW state, and dcp.async_save staged from the host shards while training goes on."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = llama(0, offload=OFFLOAD)
    opt = adamw(model)
    for step in range(K):
        llama_step(model, opt, step, rank)
    # Copies, as a load from elsewhere gives (get_state_dict returns the live tensors, and
    # set_state_dict may keep the optimizer's: the two optimizers would share moments).
    msd, osd = _cloned(get_state_dict(model, opt))
    out = {"global": all(isinstance(msd[n], DTensor) and msd[n].shape == p.shape
                         for n, p in model.named_parameters())
           and all(isinstance(v, DTensor) and v.to_local().device.type == "cpu"
                   for s in osd["state"].values() for k, v in s.items() if k != "step")}
    fresh = llama(7, offload=OFFLOAD)
    fresh_opt = adamw(fresh)
    where = _host_locals(fresh)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    out["set"] = diff(full_state(fresh, fresh_opt), full_state(model, opt))
    out["in_place"] = _host_locals(fresh) == where
    # The step after the load is the step after the save, bit for bit.
    out["continued"] = diff(llama_step(fresh, fresh_opt, K, rank), llama_step(model, opt, K, rank))
    out["continued_state"] = diff(full_state(fresh, fresh_opt), full_state(model, opt))

    ckpt = os.path.join(tmp, "offload_async")
    before = full_state(model, opt)
    future = dcp.async_save(_states(model, opt), checkpoint_id=ckpt)
    with torch.no_grad():  # the host shards change while the save may still be writing
        for p in model.parameters():
            p.add_(1.0)
    future.result()
    target = llama(9, offload=OFFLOAD)
    target_opt = adamw(target)
    dcp.load(_states(target, target_opt), checkpoint_id=ckpt)
    out["async"] = diff(full_state(target, target_opt), before)
    out["async_host"] = {d for d, _ in _host_locals(target).values()} == {"cpu"}
    return out


def job_a(rank: int, world: int, tmp: str) -> dict:
    reshard_save(dist.group.WORLD, "n3", tmp)
    reshard_save(dist.group.WORLD, "n3off", tmp, offload=True)
    reshard_save(dist.group.WORLD, "n3opt", tmp, offload="opt")
    reshard_save(dist.group.WORLD, "n3packed", tmp, offload="packed")
    return {"fsdp2": fsdp2_checks(rank, tmp), "manager": manager_checks(rank, tmp),
            "fsdp2_offload": fsdp2_checks(rank, tmp, offload=True),
            "offload_state": offload_state_checks(rank, tmp)}


# --------------------------------------------------------------------------------------------
# Job B: 2 ranks, one of which dies mid-save


def job_b(rank: int, world: int, tmp: str) -> None:
    reshard_save(dist.group.WORLD, "n2", tmp, record_continuation=True)
    mgr = CheckpointManager(os.path.join(tmp, "crash"), keep_last=1)
    model = llama(0)
    opt = adamw(model)
    llama_step(model, opt, 0, rank)
    mgr.save(1, _states(model, opt))
    state = full_state(model, opt)
    if rank == 0:
        torch.save(state, os.path.join(tmp, "crash_step1.pt"))
    llama_step(model, opt, 1, rank)
    if rank == 1:
        def die(*args, **kwargs):  # after DCP wrote everything, before the completion barrier
            os._exit(17)

        mgr._commit = die
    mgr.save(2, _states(model, opt))
    raise AssertionError("unreachable: the save of step 2 must fail on every rank")


# --------------------------------------------------------------------------------------------
# Job C: 4 ranks


def job_c(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    reshard_save(dist.group.WORLD, "n4", tmp)
    groups = {n: dist.new_group(list(range(n))) for n in (1, 2, 3)}
    groups[4] = dist.group.WORLD

    # a new group resumes from the step before the crash (on 4 ranks, resharded from 2)
    crash = CheckpointManager(os.path.join(tmp, "crash"), keep_last=1)
    model = llama(50)
    opt = adamw(model)
    out["crash.steps"] = crash.steps()
    out["crash.load"] = crash.load(_states(model, opt))
    out["crash.values"] = diff(full_state(model, opt),
                               torch.load(os.path.join(tmp, "crash_step1.pt"), weights_only=False))
    crash.save(2, _states(model, opt))  # the incomplete step 2 is replaced; step 1 retired
    out["crash.after"] = (crash.steps(), sorted(os.listdir(os.path.join(tmp, "crash"))))

    if rank == 0:
        reshard_save(groups[1], "n1", tmp)
    dist.barrier()
    for n, m in PAIRS + [(2, 2)]:
        if rank < m:
            out[f"reshard.{n}->{m}"] = reshard_load(groups[m], f"n{n}", tmp, n == m)
        dist.barrier()
    for name, m, offload in OFFLOAD_LOADS:
        if rank < m:
            out[f"offload.{name}->{m}.{offload}"] = reshard_load(groups[m], name, tmp, False,
                                                                 offload=offload)
        dist.barrier()
    return out


# --------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("checkpoint"))
    a = run_ranks(job_a, 3, tmp)
    b = run_group(job_b, 2, tmp)
    c = run_ranks(job_c, 4, tmp)
    return {"a": a, "b": b, "c": c, "tmp": tmp}


@pytest.mark.parametrize("pair", PAIRS + [(2, 2)], ids=lambda p: f"{p[0]}to{p[1]}")
def test_reshard_values_and_continued_training_bitwise(jobs, pair):
    n, m = pair
    outs = [r[f"reshard.{n}->{m}"] for r in jobs["c"][:m]]
    for grank, out in enumerate(outs):
        assert out["world"] == m
        assert out["changed"], "the fresh model must differ from the checkpoint before loading"
        assert out["loaded"] == [], f"rank {grank}: loaded state differs: {out['loaded'][:5]}"
        assert out["reference_start"] == []
        assert out["continued"] == [], f"rank {grank}: {out['continued'][:5]}"
        if n == m:
            assert out["uninterrupted"] == [], f"rank {grank}: {out['uninterrupted'][:5]}"


@pytest.mark.parametrize("load", OFFLOAD_LOADS, ids=lambda x: f"{x[0]}to{x[1]}" + (
    x[2] if isinstance(x[2], str) else "off" if x[2] else ""))
def test_offloaded_checkpoints_reshard_to_and_from_plain_runs_bitwise(jobs, load):
    """CPU offload (issue 21): model and AdamW state saved from an offloaded run load into an
    offloaded or plain run of another world size (and plain into offloaded) with the same bits
    in global coordinates, and training continues exactly as from the state put in by hand;
    the same for optimizer-only offload (its host optimizer state is saved and loaded in global
    coordinates like any other), and for packed blocks (``pack_blocks=True``, trained compiled:
    DCP loads into the parameters, views of the blocks' buffers, which the next forward
    reads)."""
    name, m, offload = load
    for grank, r in enumerate(jobs["c"][:m]):
        out = r[f"offload.{name}->{m}.{offload}"]
        assert out["world"] == m and out["changed"]
        assert out["loaded"] == [], f"rank {grank}: {out['loaded'][:5]}"
        assert out["reference_start"] == []
        assert out["continued"] == [], f"rank {grank}: {out['continued'][:5]}"


def test_crash_between_write_and_completion_leaves_previous_step(jobs):
    (code0, status0, value0), (code1, status1, _) = jobs["b"]
    assert (code1, status1) == (17, "died")
    assert status0 == "error", value0  # rank 0 learns at the completion barrier
    assert "CheckpointError: CheckpointManager.save: step 2" in value0
    assert "was not completed: a rank failed before the completion barrier" in value0
    crash = os.path.join(jobs["tmp"], "crash")
    out = jobs["c"][0]
    # job C saw the directory the crash left: step 2 written by DCP but never marked complete
    assert out["crash.steps"] == [1]
    assert out["crash.load"] == 1 and out["crash.values"] == []
    steps, listing = out["crash.after"]
    assert steps == [2] and listing == ["latest", "step_00000002"]
    with open(os.path.join(crash, "latest")) as f:
        assert f.read() == "step_00000002\n"


def test_manager_save_retention_and_resume(jobs):
    for rank, r in enumerate(jobs["a"]):
        out = r["manager"]
        assert out["empty"] == ([], None, None)
        steps, latest, listing = out["steps"]
        assert steps == [3, 4] and latest == 4
        assert listing == ["latest", "step_00000003", "step_00000004"]
        assert out["latest_file"] == "step_00000004\n"
        marker = out["marker"]
        assert marker["step"] == 4 and marker["world_size"] == 3
        assert sorted(marker["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                           "__2_0.distcp"]
        assert out["files"] == sorted([*marker["files"], MARKER_NAME])
        assert out["resume"] == (4, []) and out["resume3"] == (3, [])
        assert out["ignore_incomplete"] == ([3, 4], 4, [])
        assert "step 9" in out["load_incomplete"] and "incomplete" in out["load_incomplete"]
        assert "step 7" in out["load_absent"] and "does not exist" in out["load_absent"]
        assert "already exists" in out["save_existing"]
        assert "newer complete step(s) [3, 4]" in out["save_older"]
        assert "ranks disagree" in out["save_disagree"]
        assert "rank 0: step 5" in out["save_disagree"] and "rank 2: step 7" in out["save_disagree"]
        assert "step must be an int >= 0" in out["save_bad_step"]
        assert out["after9"] == ([4, 9], ["latest", "step_00000004", "step_00000009"]), rank
        assert out["async"] == ("step_00000010", [9, 10], True)
        assert out["async_load"] == (10, [])


def test_manager_strict_key_errors_list_everything_and_load_nothing(jobs):
    for r in jobs["a"]:
        error, unchanged = r["manager"]["strict_keys"]
        assert error.startswith("CheckpointError")
        assert "nothing was loaded" in error
        assert "missing keys (2): model.bogus.a, model.bogus.b" in error
        assert "unexpected keys (2): model.norm.weight, model.output.weight" in error
        assert unchanged == []


def test_manager_non_strict_loads_the_common_keys_and_reports(jobs):
    for r in jobs["a"]:
        step, missing, unexpected, warned, common, kept, optim = r["manager"]["nonstrict"]
        assert step == 10 and warned == 1, warned
        assert missing == ["model.bogus.a", "model.bogus.b"]
        assert unexpected == ["model.norm.weight", "model.output.weight"]
        assert common == [] and kept == [] and optim == []


def test_manager_shape_and_dtype_mismatches(jobs):
    for r in jobs["a"]:
        out = r["manager"]
        assert "optim.* (all 48 keys: the state to load has no 'optim')" in out["shape"][0]
        for error in out["shape"]:  # strict and non-strict alike
            assert "model.tok_embeddings.weight: shape mismatch: checkpoint (37, 24), " \
                   "target (38, 24)" in error
            assert "model.output.weight: shape mismatch" in error
        assert "model.norm.weight: dtype mismatch: checkpoint torch.float32, target " \
               "torch.float64" in out["dtype"]
        assert "optim.state.norm.weight.exp_avg: dtype mismatch" in out["dtype"]
        step, warned, values, report = out["dtype_nonstrict"]
        assert step == 10 and any("dtype mismatch" in w for w in warned)
        assert values == [] and "model.norm.weight: dtype mismatch" in report


def test_manager_ranks_that_disagree_fail_together(jobs):
    for r in jobs["a"]:  # only rank 1's state has the extra key; every rank raises the same
        error, unchanged = r["manager"]["rank_disagree"]
        assert error.startswith("CheckpointError")
        assert "[rank 1] missing keys (1): model.only.on.rank1" in error
        assert unchanged == []


def test_manager_corrupt_or_partial_checkpoints(jobs):
    for r in jobs["a"]:
        out = r["manager"]
        flipped = out["broken.flipped_byte"]
        for key in ("auto", "explicit"):
            assert "checksum mismatch" in flipped[key] and "__1_0.distcp" in flipped[key]
        truncated = out["broken.truncated"]
        for key in ("auto", "explicit"):
            assert "__0_0.distcp has" in truncated[key] and "the marker says" in truncated[key]
        no_metadata = out["broken.no_metadata"]
        for key in ("auto", "explicit"):
            assert ".metadata is missing" in no_metadata[key]
        no_marker = out["broken.no_marker"]
        assert no_marker["auto"] == "NO ERROR" and no_marker["auto_value"] is None
        assert "incomplete" in no_marker["explicit"]
        bad_marker = out["broken.bad_marker"]
        assert "corrupt" in bad_marker["auto"] and "unreadable" in bad_marker["auto"]
        assert "unreadable" in bad_marker["explicit"]
        for kind in ("flipped_byte", "truncated", "no_metadata", "no_marker", "bad_marker"):
            assert out[f"broken.{kind}"]["unchanged"] == [], kind
        # The same flipped byte through plain dcp.load: loaded without an error, wrong values.
        plain = out["plain_dcp_flipped"]
        assert plain["error"] == "NO ERROR", plain["error"]
        assert plain["differs"], "the flipped byte should change a loaded value"


def test_fsdp2_checkpoints_load_into_shardc_and_back(jobs):
    for r in jobs["a"]:
        for direction in ("fsdp2->shardc", "shardc->fsdp2"):
            out = r["fsdp2"][direction]
            assert out["keys"]
            assert out["loaded"] == [], (direction, out["loaded"][:5])
            assert max(out["losses"]) <= 1e-6, (direction, out["losses"])
            assert out["params"] <= 1e-6 and out["moments"] <= 1e-6, (direction, out)
            assert out["step"] is True, out["step"]


def test_fsdp2_cpu_offload_checkpoints_load_into_offloaded_shardc_and_back(jobs):
    """FSDP2 with CPUOffloadPolicy (unpinned, on the gloo CPU mesh) <-> shardc with offload."""
    for r in jobs["a"]:
        for direction in ("fsdp2->shardc", "shardc->fsdp2"):
            out = r["fsdp2_offload"][direction]
            assert out["keys"]
            assert out["loaded"] == [], (direction, out["loaded"][:5])
            assert max(out["losses"]) <= 1e-6, (direction, out["losses"])
            assert out["params"] <= 1e-6 and out["moments"] <= 1e-6, (direction, out)
            assert out["step"] is True, out["step"]


def test_offloaded_state_dicts_and_async_save_round_trip_bitwise(jobs):
    """CPU offload: get_state_dict gives DTensors in global coordinates (optimizer state on the
    host); set_state_dict loads them bitwise into the host shards in place and training goes on
    identically; dcp.async_save stages the host state before returning (changing the shards
    right after does not reach the checkpoint) and loads back bitwise."""
    for grank, r in enumerate(jobs["a"]):
        out = r["offload_state"]
        assert out["global"], grank
        assert out["set"] == [], (grank, out["set"][:5])
        assert out["in_place"], grank
        assert out["continued"] == [] and out["continued_state"] == [], grank
        assert out["async"] == [], (grank, out["async"][:5])
        assert out["async_host"], grank


def test_manager_without_torch_distributed(tmp_path):
    """One process, no process group, a plain model: the same protocol, no collectives."""
    model = llama(0, sharded=False)
    opt = adamw(model)
    llama_step(model, opt, 0, 0)
    mgr = CheckpointManager(tmp_path, keep_last=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        mgr.save(1, _states(model, opt))
        llama_step(model, opt, 1, 0)
        saved = full_state(model, opt)
        future = mgr.async_save(2, _states(model, opt))
        with torch.no_grad():
            model.norm.weight.add_(1.0)
        assert os.path.basename(future.result()) == "step_00000002"
        fresh = llama(3, sharded=False)
        fresh_opt = adamw(fresh)
        assert mgr.load(_states(fresh, fresh_opt)) == 2
    assert diff(full_state(fresh, fresh_opt), saved) == []
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000002"]


def test_manager_reads_the_files_from_metadata_without_storage_data(tmp_path, monkeypatch):
    """torch 2.11's ``dcp.save`` returns its metadata without ``storage_data`` (its writer fills
    a copy): the manager then reads the files from the ``.metadata`` the save wrote, and the
    step is marked complete with every file listed, as with torch 2.13's metadata."""
    from shardc.checkpoint import manager as manager_module

    real_save = dcp.save

    def save_as_torch_2_11(*args, **kwargs):
        return dataclasses.replace(real_save(*args, **kwargs), storage_data=None)

    model = llama(0, sharded=False)
    opt = adamw(model)
    llama_step(model, opt, 0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        full = CheckpointManager(tmp_path / "full", keep_last=1)
        full.save(1, _states(model, opt))
        monkeypatch.setattr(manager_module.dcp, "save", save_as_torch_2_11)
        bare = CheckpointManager(tmp_path / "bare", keep_last=1)
        bare.save(1, _states(model, opt))
    assert bare.steps() == [1]
    listed = {root: set(json.loads(
        (tmp_path / root / "step_00000001" / MARKER_NAME).read_text())["files"])
        for root in ("full", "bare")}
    assert listed["bare"] == listed["full"] and ".metadata" in listed["bare"], listed


class _SerializedMeta(nn.Module):
    """Keeps serialized metadata whose size depends on its state in ``_extra_state``, as
    TransformerEngine's modules keep their FP8 scaling state (empty until they ran in FP8)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.meta = b""

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor(list(self.meta), dtype=torch.uint8)

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.meta = bytes(state.tolist())


def test_extra_state_of_another_size_loads_into_a_fresh_model(tmp_path):
    """A fresh model's extra state has another size than the saved one; ``ModelState`` stores
    it as bytes, so DCP loads it (as a tensor DCP would refuse the size), through plain DCP and
    through the ``CheckpointManager``'s validation."""
    torch.manual_seed(0)
    model = nn.Sequential(_SerializedMeta(), _SerializedMeta())
    model[0].meta, model[1].meta = b"amax history", b"\x00\xff" * 300
    assert isinstance(ModelState(model).state_dict()["0._extra_state"], bytes)
    mgr = CheckpointManager(tmp_path / "mgr", keep_last=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"model": ModelState(model)}, checkpoint_id=str(tmp_path / "plain"))
        mgr.save(1, {"model": ModelState(model)})
        for load in (lambda s: dcp.load(s, checkpoint_id=str(tmp_path / "plain")), mgr.load):
            torch.manual_seed(1)
            fresh = nn.Sequential(_SerializedMeta(), _SerializedMeta())
            load({"model": ModelState(fresh)})
            assert (fresh[0].meta, fresh[1].meta) == (model[0].meta, model[1].meta)
            for (name, p), q in zip(fresh.named_parameters(), model.parameters()):
                assert torch.equal(p, q), name
