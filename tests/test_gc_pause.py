"""shardc.memory.gc_pause: the collector is off inside, and back to its earlier state after."""

import dataclasses
import gc
import weakref

import pytest
import torch
import torch._dynamo
from torch import nn

import shardc
from shardc.compile import backend, pipeline
from shardc.memory import peak
from shardc.memory.gc_pause import collector_paused, free_young_garbage
from shardc.tools.fake_world import fake_world


@pytest.fixture
def restore_gc():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_off_inside_and_as_before_after(restore_gc, enabled):
    (gc.enable if enabled else gc.disable)()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled() is enabled


def test_the_collector_is_restored_when_the_body_raises(restore_gc):
    gc.enable()
    with pytest.raises(ValueError, match="inside"):
        with collector_paused():
            raise ValueError("raised inside")
    assert gc.isenabled()


def test_the_peak_prediction_runs_with_the_collector_off(restore_gc, monkeypatch):
    # predict_peak is decorated: whatever it calls sees the collector off, the caller's state
    # is back after it, also when it raises.
    seen = []

    def flat(*args):
        seen.append(gc.isenabled())
        raise RuntimeError("stop after the first walk")

    monkeypatch.setattr(peak, "_flat", flat)
    gc.enable()
    with pytest.raises(RuntimeError, match="first walk"):
        peak.predict_peak(None, None, None, set(), set())
    assert seen == [False]
    assert gc.isenabled()


def _one_step(**backend_options) -> bool:
    """Shard a tiny model at world 1, compile it with these backend options and run one
    training step; returns whether the collector was on after the step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    try:
        with fake_world(1):
            shardc.shard(model)
            step = torch.compile(model, backend=shardc.backend(**backend_options))
            step(torch.randn(2, 4)).sum().backward()
            return gc.isenabled()
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("inductor", [False, True])
def test_a_region_compiles_with_the_collector_off(restore_gc, monkeypatch, inductor):
    # The backend holds the collector off while it plans and compiles a region (the
    # partitioner's passes, the plan) and while Inductor compiles its graphs, the backward's at
    # the first backward too; the step runs with it on again.
    seen = {"plan": [], "inductor": []}

    def spy(key, original):
        def wrapper(*args, **kwargs):
            seen[key].append(gc.isenabled())
            return original(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(pipeline, "plan_and_lower", spy("plan", pipeline.plan_and_lower))
    monkeypatch.setattr(backend, "_inductor_with_pool",
                        spy("inductor", backend._inductor_with_pool))
    gc.enable()
    enabled_after_step = _one_step(inductor=inductor)
    assert seen["plan"] == [False]
    assert seen["inductor"] == ([False, False] if inductor else [])  # forward, backward
    assert enabled_after_step


def test_young_garbage_is_freed_with_the_collector_off(restore_gc):
    class Cyclic:
        pass

    with collector_paused():
        garbage = Cyclic()
        garbage.self = garbage
        alive = weakref.ref(garbage)
        del garbage
        assert alive() is not None  # a cycle: only the collector frees it
        free_young_garbage()
        assert alive() is None
        assert not gc.isenabled()


def test_each_budget_trial_frees_its_young_garbage(restore_gc, monkeypatch):
    # Under a peak budget the search's trials run inside the paused region compile: each one
    # ends with a young collection, so the garbage of all of them is never held at once.
    freed = []
    monkeypatch.setattr(pipeline, "free_young_garbage", lambda: freed.append(gc.isenabled()))
    trials = []
    original = pipeline.search_inputs

    def counted(*args, **kwargs):
        inputs = original(*args, **kwargs)

        def counting(*a, **k):
            trials.append(len(freed))
            return inputs.trial(*a, **k)
        return dataclasses.replace(inputs, trial=counting)

    monkeypatch.setattr(pipeline, "search_inputs", counted)
    _one_step(inductor=False, peak_memory_budget_bytes=1 << 30)
    assert trials, "the budget search ran no trial"
    assert trials == list(range(len(trials)))  # each trial started after the last one freed
    assert freed == [False] * len(trials)
