"""Run a function on N gloo ranks in fresh processes and collect per-rank results.

Every multi-process test goes through :func:`run_ranks`. It fails the calling test with the
worker's traceback if any rank raises, and never waits forever: the process group has a short
timeout and the parent joins with a deadline.

Ranks are started by a fork server (``multiprocessing``'s ``forkserver``): one clean process,
started once per test session, imports torch, shardc and the compile stack's modules and then
forks every rank. A rank is still a fresh process (nothing has run a model, compiled a graph or
initialized a process group in it) but skips the seconds of imports each spawned interpreter
paid; the parent's environment at the call is applied in each rank.

Spawned work that depends on nothing a test does before it can be queued when collection ends
(:func:`prestart`, called by a test module's ``prestart(items)`` hook: tests/conftest.py) and run
by one background thread while the tests before it run in this process: the 2-core CI machine's
second core would otherwise idle through the single-process tests. The test then takes the
result (:func:`taken`), or runs the work itself if the queue has not reached it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

# A group's deadline: generous, so a loaded 2-core CI machine (a group's compiles several times
# slower than on a quiet one) does not fail a slow group; a hang still ends (CI: 90 minutes).
_JOIN_TIMEOUT_S = float(os.environ.get("SHARDC_TEST_JOIN_TIMEOUT_S", "1500"))
# SHARDC_TEST_CPU_LOG=path: each call appends the test, the world size, the ranks' CPU seconds
# (summed), the wall seconds and the start and end times (epoch seconds: when the two cores were
# busy), to find where the suite's time goes (ranks started by the fork server are not the test
# process's children: its own CPU time leaves them out).
_CPU_LOG = os.environ.get("SHARDC_TEST_CPU_LOG")
# Imported once by the fork server (imports only: nothing that starts threads or runs kernels).
# transformers' models (tests/real_models.py: seconds of imports in each rank otherwise); the
# fork server skips a module that is not installed.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor",
            "torch.distributed.checkpoint", "torch._dynamo", "functorch.compile",
            "torch._functorch.partitioners", "torch._inductor.compile_fx", "shardc",
            "transformers", "transformers.models.gpt2.modeling_gpt2",
            "transformers.models.qwen2.modeling_qwen2"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, env: dict, fn, args,
            kwargs) -> None:
    import torch
    import torch.distributed as dist

    # The fork server's environment is the one it started with: use the caller's.
    os.environ.clear()
    os.environ.update(env)

    # A rank that dies in native code (a signal, an abort) prints every thread's Python stack to
    # the stderr the test captures: without it the test reports only "exited without a result".
    faulthandler.enable(all_threads=True)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    result_path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
        )
        value = fn(rank, world_size, *args, **kwargs)
        payload = ("ok", value)
    except BaseException as exc:  # report every failure to the parent, then exit non-zero
        payload = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(result_path, "wb") as f:
        pickle.dump((*payload, time.process_time()), f)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    if payload[0] == "error":
        os._exit(1)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    ``fn`` must be importable (module level). Returns the list of per-rank return values.
    Raises ``AssertionError`` with every failing rank's traceback if any rank fails.
    """
    return _run_ranks(fn, world_size, dict(os.environ), args, kwargs)


# Set at the end of the session: background runs still going are ended (their ranks killed).
_STOP = threading.Event()


def _run_ranks(fn: Callable[..., Any], world_size: int, env: dict, args: tuple, kwargs: dict,
               label: str | None = None) -> list[Any]:
    start, started_at = time.monotonic(), time.time()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        _context()
        ctx = mp.start_processes(
            _worker,
            args=(world_size, init_file, tmp, env, fn, args, kwargs),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline or _STOP.is_set():
                    break
        except Exception:
            # One rank failed; give the others a moment to write their own reports.
            end = time.monotonic() + 30
            while any(p.is_alive() for p in ctx.processes) and time.monotonic() < end:
                time.sleep(0.1)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results, errors, cpu = [], [], 0.0
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pkl")
            if not os.path.exists(path):
                code = ctx.processes[rank].exitcode
                how = f"killed by signal {-code}" if code is not None and code < 0 else \
                    f"exit code {code}"
                errors.append(f"rank {rank}: exited without a result ({how})")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value, seconds = pickle.load(f)
            cpu += seconds
            if status == "error":
                errors.append(value)
                results.append(None)
            else:
                results.append(value)
        if _CPU_LOG:
            with open(_CPU_LOG, "a") as f:
                test = label or os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
                f.write(f"{test}\t{world_size}\t{cpu:.1f}\t{time.monotonic() - start:.1f}\t"
                        f"{started_at:.1f}\t{time.time():.1f}\n")
        if errors:
            raise AssertionError("\n".join(errors))
        return results


# The queue of prestarted runs: one background thread, one entry at a time (an entry's groups at
# once), so that at most one entry's ranks share the machine with the test process's own work.
_QUEUE: ThreadPoolExecutor | None = None
_PRESTARTED: dict[str, Future] = {}


def prestart(key: str, *calls: tuple) -> None:
    """Queue ``calls`` (each ``(fn, world_size, *args)``: one :func:`run_ranks`, all of an entry's
    run at once) under ``key``, with this process's environment now (not that of whichever test
    runs when the queue reaches it). :func:`taken` gives the future of the list of their
    results (each the per-rank list)."""
    global _QUEUE
    if _QUEUE is None:
        _QUEUE = ThreadPoolExecutor(1, thread_name_prefix="prestart")
    env = dict(os.environ)

    def entry() -> list[list[Any]]:
        if len(calls) == 1:
            fn, world, *args = calls[0]
            return [_run_ranks(fn, world, env, tuple(args), {}, key)]
        with ThreadPoolExecutor(len(calls)) as pool:
            futures = [pool.submit(_run_ranks, fn, world, env, tuple(args), {}, key)
                       for fn, world, *args in calls]
            return [f.result() for f in futures]

    _PRESTARTED[key] = _QUEUE.submit(entry)


def taken(key: str) -> Future | None:
    """The prestarted entry ``key``'s future, or ``None``: not prestarted, or not started yet
    (then it is taken off the queue and the caller runs it, in parallel with the queue)."""
    future = _PRESTARTED.pop(key, None)
    if future is None or future.cancel():
        return None
    return future


def run_prestarted(key: str, fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """The per-rank results of the prestarted entry ``key`` (one call: ``fn, world_size,
    *args``), or of that call run now (:func:`taken`)."""
    future = taken(key)
    return future.result()[0] if future is not None else run_ranks(fn, world_size, *args)


def stop_background() -> None:
    """End of the session: drop the entries not started, end the running one."""
    for future in _PRESTARTED.values():
        future.cancel()
    _PRESTARTED.clear()
    _STOP.set()
    if _QUEUE is not None:
        _QUEUE.shutdown(wait=True)


@contextlib.contextmanager
def one_rank_mesh():
    """A one-rank gloo default group in this process (no spawn; a ``HashStore``) and its CPU
    mesh, destroyed on exit; the test is skipped if a process group is already initialized
    here."""
    import pytest
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
