"""shardc.memory.gc_pause: the collector is off inside, and back to its earlier state after."""

import gc

import pytest

from shardc.memory import peak
from shardc.memory.gc_pause import collector_paused


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
