"""The optimizer step in chunks (``shardc.runtime.chunked_step``) composed with other shardc
features: a sharded, compiled model (gloo, the parity Llama: a 37-row embedding, uneven shards,
FX unless noted) trained with ``optimizer_step_chunks='always'`` against ``'never'``, AdamW
``foreach=True`` (the implementation whose temporaries the chunks bound), an LR scheduler; each
rank's parameters and optimizer state bitwise equal, the optimizer called once per chunk, the
same warnings (Python's and the ``shardc`` logger's) in both runs:

* ``shardc.optim.local_shard_step`` (its instance step hooks swap the DTensor parameters of the
  groups for their local shards; torch runs the process-wide pre-hook, the chunking's, before
  them and its post-hook after them, so each chunk's call swaps that chunk), world 2;
* ``shardc.no_sync`` gradient accumulation (two micro-batches a step, each a whole batch of
  the rank's rows: the compiled shapes), world 2;
* HSDP on a 2x2 mesh (replicate x shard), world 4;
* a DCP save after step 1 (``shardc.checkpoint.ModelState`` / ``OptimizerState``), loaded into a
  fresh model and optimizer compiled with the chunks, whose step 2 equals the uninterrupted run;
* Inductor, world 2 (slow);
* FP8 all-gathers (`Float8Policy()`), world 2, and FSDP+TP on a 2x2 (dp, tp) mesh, world 4
  (slow).

The default suite's three (world 2) share one spawn and one compiled model (their time): its
baseline is the same compiled model rewound and trained with the chunks withdrawn from the
process-wide registry (one call a step, :func:`_withdrawn`: a ``'never'`` compile differs from
an ``'always'`` one only by that adoption, the graphs are the same). The slow ones compile
``'never'`` and ``'always'`` each.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import pytest
import torch
import torch._dynamo
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from log_lines import LogLines
from mesh_workers import HSDP_CLUSTER
from parity import GLOBAL_BATCH, LR, batches, build
from torch.distributed.device_mesh import init_device_mesh

import shardc
from shardc.checkpoint import ModelState, OptimizerState
from shardc.models.llama import llama_loss
from shardc.runtime import chunked_step


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """A rank's bits: its parameter shards and its optimizer state dict's local tensors."""
    sd = opt.state_dict()
    return {"params": [_local(p).detach().clone() for p in model.parameters()],
            "state": {k: {n: _local(v).clone() if isinstance(v, torch.Tensor) else v
                          for n, v in s.items()} for k, s in sd["state"].items()},
            "groups": sd["param_groups"],
            "group_params": [len(g["params"]) for g in opt.param_groups]}


def _compiled(chunks: str, *, mesh_shape: tuple | None = None, inductor: bool = False,
              kind: str = "llama", fp8: bool = False) -> tuple:
    """A fresh sharded model compiled with ``optimizer_step_chunks=chunks`` (the compile, and
    so the chunks' adoption, at the first forward); ``fp8``: its Linear weights gathered in
    FP8 (``shardc.Float8Policy()``; on a CPU the matmuls run through the dequantized
    fallback)."""
    model = build(kind)
    mesh = (init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
            if mesh_shape else None)
    shardc.shard(model, mesh, fp8=shardc.Float8Policy() if fp8 else None)
    backend = shardc.backend(inductor=inductor, optimizer_step_chunks=chunks,
                             **({"cluster": HSDP_CLUSTER} if mesh_shape else {}))
    return model, torch.compile(model, backend=backend)


def _optimizer(model, local_step: bool = False) -> tuple:
    """AdamW (foreach) with an LR scheduler."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    if local_step:
        shardc.optim.local_shard_step(opt)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


@contextlib.contextmanager
def _withdrawn():
    """The chunks withdrawn (the process-wide registry emptied): ``optimizer.step()`` is one
    call, as with ``optimizer_step_chunks='never'``, whose compile differs from ``'always'``'s
    only by the adoption (and the plan's notes and predictions): the same graphs."""
    saved = dict(chunked_step._CHUNK)
    chunked_step._CHUNK.clear()
    try:
        yield
    finally:
        chunked_step._CHUNK.update(saved)


def _rewind(model, initial: list) -> None:
    with torch.no_grad():
        for p, value in zip(model.parameters(), initial):
            _local(p).copy_(value)


def _train(rank: int, world: int, model, forward, opt, sched, steps: range,
           no_sync: bool = False, loss_of=llama_loss) -> dict:
    """Train ``steps`` (indices into parity's batches) on the rows of data-parallel rank
    ``rank`` of ``world``; the optimizer's calls (a spy on the chunking's narrowing), the
    warnings."""
    tokens, targets = batches()  # the same batches whichever steps are taken
    per = GLOBAL_BATCH // world
    rows = slice(rank * per, (rank + 1) * per)
    narrows = []
    real_narrow = chunked_step._narrow
    chunked_step._narrow = lambda groups, chunk: (narrows.append(1), real_narrow(groups, chunk))
    records = LogLines(logging.WARNING)  # the shardc logger's warnings
    logger = logging.getLogger("shardc")
    logger.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in steps:
                if no_sync:  # two micro-batches: batches 2 step and 2 step + 1, the 1st unsynced
                    for micro, context in ((2 * step, shardc.no_sync(model)),
                                           (2 * step + 1, contextlib.nullcontext())):
                        with context:
                            loss = loss_of(forward(tokens[micro, rows]), targets[micro, rows])
                            (loss / 2).backward()
                else:
                    loss_of(forward(tokens[step, rows]), targets[step, rows]).backward()
                opt.step()
                sched.step()
                opt.zero_grad()
    finally:
        chunked_step._narrow = real_narrow
        logger.removeHandler(records)
    # Each chunked step narrows once per chunk and once more to put the groups back.
    n = len(steps)
    return {"calls": len(narrows) - n if narrows else n,
            "chunks": len(chunked_step.chunks_of(opt)), "steps": n, "lrs": sched.get_last_lr(),
            "warnings": sorted({f"{w.category.__name__}: {w.message}" for w in caught}),
            "logged": sorted(set(records.lines))}


def _run(rank: int, world: int, chunks: str, steps: int = 3, no_sync: bool = False,
         local_step: bool = False, **compile_options) -> dict:
    torch._dynamo.reset()
    model, forward = _compiled(chunks, **compile_options)
    opt, sched = _optimizer(model, local_step)
    out = _train(rank, world, model, forward, opt, sched, range(steps), no_sync)
    out.update(_snapshot(model, opt))
    return out


def _reused(rank: int, world: int, compiled: tuple, steps: int = 2, no_sync: bool = False,
            local_step: bool = False) -> tuple[dict, dict]:
    """A model compiled with the chunks (``compiled``: it and its forward; shared by the
    default suite's scenarios, its time), rewound to its initial shards, trained with the
    chunks, rewound again and trained by a new optimizer with the chunks withdrawn (the same
    compiled graphs). Returns (without chunks, with them)."""
    model, forward, initial = compiled
    results = []
    for withdraw in (False, True):
        _rewind(model, initial)
        opt, sched = _optimizer(model, local_step)
        with _withdrawn() if withdraw else contextlib.nullcontext():
            out = _train(rank, world, model, forward, opt, sched, range(steps), no_sync)
        out.update(_snapshot(model, opt))
        results.append(out)
    chunked, plain = results
    return plain, chunked


def _compare(plain: dict, chunked: dict) -> dict:
    """What the test asserts, computed on the rank (the state's bits compared here)."""
    try:
        torch.testing.assert_close(chunked["state"], plain["state"], rtol=0, atol=0)
        state_diff = "" if chunked["groups"] == plain["groups"] else "param_groups differ"
    except AssertionError as exc:
        state_diff = str(exc)
    return {"state_diff": state_diff,
            "same_params": len(plain["params"]) == len(chunked["params"]) and all(
                torch.equal(a, b) for a, b in zip(plain["params"], chunked["params"])),
            "steps": plain["steps"], "chunks": chunked["chunks"],
            "calls": (plain["calls"], chunked["calls"]), "lrs": (plain["lrs"], chunked["lrs"]),
            "warnings": (plain["warnings"], chunked["warnings"]),
            "logged": (plain["logged"], chunked["logged"]),
            "group_params": (plain["group_params"], chunked["group_params"])}


def _mix_worker(rank: int, world: int, steps: int = 3, **options) -> dict:
    """A real ``'never'`` compile against an ``'always'`` one."""
    plain = _run(rank, world, "never", steps, **options)
    chunked = _run(rank, world, "always", steps, **options)
    return _compare(plain, chunked)


def _compile_once() -> tuple:
    """The default suite's model compiled with ``'always'``, its forward, its initial shards."""
    torch._dynamo.reset()
    model, forward = _compiled("always")
    return model, forward, [_local(p).detach().clone() for p in model.parameters()]


def _check(outs: list[dict]) -> None:
    for out in outs:
        assert not out["state_diff"], out["state_diff"]
        assert out["same_params"], out
        assert out["chunks"] >= 2, out
        assert out["calls"] == (out["steps"], out["steps"] * out["chunks"]), out
        assert out["lrs"][0] == out["lrs"][1]
        assert out["warnings"][0] == out["warnings"][1], out["warnings"]
        assert out["logged"][0] == out["logged"][1], out["logged"]
        assert out["group_params"][0] == out["group_params"][1], out  # groups put back


def _default_worker(rank: int, world: int, where: str) -> dict:
    """The default suite's world-2 scenarios in one spawn (its time: a spawn costs seconds);
    each one's error, if any, returned as its result."""
    compiled = _compile_once()
    out = {}
    for name, run in (("local_step", lambda: _compare(*_reused(rank, world, compiled,
                                                               local_step=True))),
                      ("no_sync", lambda: _compare(*_reused(rank, world, compiled,
                                                            no_sync=True))),
                      ("dcp", lambda: _dcp_worker(rank, world, where, compiled))):
        try:
            out[name] = run()
        except Exception as exc:  # noqa: BLE001 - reported by the scenario's test
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory) -> list[dict]:
    return run_ranks(_default_worker, 2, str(tmp_path_factory.mktemp("chunkmix") / "ckpt"))


def _scenario(runs: list[dict], name: str) -> list:
    outs = [run[name] for run in runs]
    for out in outs:
        assert not isinstance(out, str), out
    return outs


# Slow (suite time, s29): the default_runs group (58 rank-CPU s); chunked steps stay in
# test_optimizer_chunks
@pytest.mark.slow
def test_chunks_with_local_shard_step(default_runs):
    """``shardc.optim.local_shard_step`` under the chunked step (world 2): each chunk's call
    steps that chunk's local shards; bitwise the same as one call (itself local-shard)."""
    _check(_scenario(default_runs, "local_step"))


@pytest.mark.slow  # suite time (s29): default_runs' group
def test_chunks_with_no_sync_accumulation(default_runs):
    """Two micro-batches a step, the first under ``shardc.no_sync`` (world 2)."""
    _check(_scenario(default_runs, "no_sync"))


def _dcp_worker(rank: int, world: int, where: str, compiled: tuple) -> dict:
    """The model compiled with the chunks (``compiled``), rewound: step 1, a DCP save, step 2
    (the chunked run continued); rewound, the same 2 steps with the chunks withdrawn (the
    uninterrupted run without chunks, see :func:`_withdrawn`); a fresh model and optimizer
    compiled with the chunks load the save and take step 2 in chunks."""
    model, forward, initial = compiled
    _rewind(model, initial)
    opt, sched = _optimizer(model)
    first = _train(rank, world, model, forward, opt, sched, range(1))
    dcp.save({"model": ModelState(model), "optim": OptimizerState(model, opt)},
             checkpoint_id=where)
    sched_state = sched.state_dict()  # the scheduler (not under test) by hand
    second = _train(rank, world, model, forward, opt, sched, range(1, 2))
    continued = {**second, **_snapshot(model, opt)}
    _rewind(model, initial)
    opt, sched = _optimizer(model)
    with _withdrawn():
        plain = _train(rank, world, model, forward, opt, sched, range(2))
    plain.update(_snapshot(model, opt))
    torch._dynamo.reset()
    fresh, fresh_forward = _compiled("always")
    fresh_opt, fresh_sched = _optimizer(fresh)
    # Compiled (its chunks adopted) before the load, as by an evaluation first: the load's
    # zero-lr step that gives the never-stepped optimizer its state goes in chunks too.
    tokens, targets = batches()
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    llama_loss(fresh_forward(tokens[0, rows]), targets[0, rows]).backward()
    fresh.zero_grad(set_to_none=True)
    narrows = []
    real_narrow = chunked_step._narrow
    chunked_step._narrow = lambda groups, chunk: (narrows.append(1), real_narrow(groups, chunk))
    try:
        dcp.load({"model": ModelState(fresh), "optim": OptimizerState(fresh, fresh_opt)},
                 checkpoint_id=where)
    finally:
        chunked_step._narrow = real_narrow
    fresh_sched.load_state_dict(sched_state)
    resumed = _train(rank, world, fresh, fresh_forward, fresh_opt, fresh_sched, range(1, 2))
    resumed.update(_snapshot(fresh, fresh_opt))
    # The whole run's optimizer calls and warnings: step 1 and step 2 together.
    for part in (continued, resumed):
        part["calls"] += first["calls"]
        part["steps"] += first["steps"]
        part["warnings"] = sorted(set(part["warnings"]) | set(first["warnings"]))
        part["logged"] = sorted(set(part["logged"]) | set(first["logged"]))
    return {"continued": _compare(plain, continued), "resumed": _compare(plain, resumed),
            "load_narrows": len(narrows)}


@pytest.mark.slow  # suite time (s29): default_runs' group
def test_chunks_across_a_dcp_save_and_load(default_runs):
    """A DCP save after step 1 of a chunked run, loaded into a fresh model and optimizer
    (compiled with the chunks before the load, so the load's zero-lr init step is chunked
    too), then step 2 in chunks: bitwise the uninterrupted run without chunks (world 2), as
    is the chunked run continued after its save."""
    outs = _scenario(default_runs, "dcp")
    _check([out[k] for out in outs for k in ("continued", "resumed")])
    for out in outs:  # the load's init step in chunks: each narrowed once, then put back
        assert out["load_narrows"] == out["resumed"]["chunks"] + 1, out


@pytest.mark.slow  # 25 s on a loaded 2-core machine (4 ranks, two compiles)
def test_chunks_with_hsdp():
    """HSDP on a 2x2 mesh (replicate x shard, world 4): the buckets' chunks step the shards of
    the shard dimension, the gradients all-reduced over the replicas first."""
    _check(run_ranks(_mix_worker, 4, mesh_shape=(2, 2)))


@pytest.mark.slow  # 17 s (warm Inductor caches) to 195 s (cold, a loaded machine) on 2 cores
def test_chunks_with_inductor():
    """Inductor (world 2, the one-block Llama: its compiles are slow)."""
    _check(run_ranks(_mix_worker, 2, inductor=True, kind="llama1"))


@pytest.mark.slow  # two compiles of the FP8 Llama (world 2)
def test_chunks_with_fp8_gathers():
    """FP8 all-gathers (``Float8Policy()``, world 2): the chunks step the fp32 master shards
    bucket by bucket, whatever dtype the buckets gather in."""
    _check(run_ranks(_mix_worker, 2, fp8=True))


def _tp_run(chunks: str, shape: tuple[int, int]) -> dict:
    """FSDP+TP (``mesh_models.TPBlocks`` on a (dp, tp) mesh, ``parallelize_blocks``) compiled
    with ``optimizer_step_chunks=chunks``, trained 3 steps on its dp rank's rows."""
    from mesh_models import TPBlocks, loss_fn, parallelize_blocks

    torch._dynamo.reset()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    model = shardc.shard(parallelize_blocks(TPBlocks(), mesh["tp"]), mesh)
    forward = torch.compile(model, backend=shardc.backend(optimizer_step_chunks=chunks))
    opt, sched = _optimizer(model)
    out = _train(mesh["dp"].get_local_rank(), shape[0], model, forward, opt, sched, range(3),
                 loss_of=loss_fn)
    out.update(_snapshot(model, opt))
    return out


def _tp_worker(rank: int, world: int, shape: tuple[int, int]) -> dict:
    return _compare(_tp_run("never", shape), _tp_run("always", shape))


@pytest.mark.slow  # 4 ranks, two compiles
def test_chunks_with_fsdp_and_tp():
    """FSDP+TP on a 2x2 (dp, tp) mesh (world 4): the chunks step the 2-D sharded parameters
    bucket by bucket; bitwise the same as one call."""
    _check(run_ranks(_tp_worker, 4, (2, 2)))
