"""The compile-time benchmark's first-step record (``benchmarks/compile_time.py``): the step
split into synchronized phases runs the training step's operations, and the table shows the
phases of each row."""

from __future__ import annotations

import sys

import pytest
import torch

import shardc
from benchmarks.compile_time import (
    _first_step,
    _phases,
    _prepare_optimizer,
    _torch_timed_events,
    import_inductor,
    prime,
    render_markdown,
)


class _Setup:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.prepare_optimizer = None

    def loss(self, tokens, targets):
        return torch.nn.functional.mse_loss(self.model(tokens), targets)


def test_first_step_trains_and_times_each_phase():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    before = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with torch.no_grad():
        expected = float(torch.nn.functional.mse_loss(model(x), y))
    syncs = []
    loss, phases = _first_step(_Setup(model), opt, x, y, sync=lambda: syncs.append(1))
    assert loss == expected
    assert list(phases) == ["forward", "backward", "optimizer"] and len(syncs) == 3
    assert all(seconds >= 0 for seconds in phases.values())
    assert not torch.equal(model.weight, before)  # the optimizer stepped
    assert model.weight.grad is None  # and the gradients were cleared, as train_step does
    assert isinstance(_torch_timed_events(), dict)


def test_inductor_is_imported_before_the_first_step():
    """The step's CUDA-graph marker imports Inductor on its first call: done apart, so that no
    mode's first step carries an import another mode's setup paid (fsdp2-compile's)."""
    assert import_inductor() >= 0
    assert "torch._inductor.cudagraph_trees" in sys.modules


def test_table_shows_each_rows_phases():
    meta = {"date": "d", "command": "c", "machine": {"device": "cpu", "torch": "t", "git": "g"},
            "nproc": 1, "model": "1b", "tiny": True, "seq": 32, "batch": 2}
    record = {"first_step_s": 3.0, "steady_step_s": 0.02,
              "first_step_phases_s": {"forward": 2.04, "backward": 0.86, "optimizer": 0.1}}
    runs = [{"depth": 2, "mode": "shardc", "cache": "cold", "record": record},
            {"depth": 4, "mode": "shardc", "cache": "cold",
             "record": {"first_step_s": 4.0, "setup_s": 0.52, "inductor_import_s": 1.23}}]
    table = render_markdown({"meta": meta, "runs": runs})
    assert "| 2 | shardc | cold | 3.0 s | 2.0 / 0.9 / 0.1 s | - | 20 ms |" in table
    assert "| 4 | shardc | cold | 4.0 s | - | 0.5 / 1.2 s | - |" in table
    assert _phases(None) == "-"


def test_prime_runs_a_compile_and_deletes_its_caches(tmp_path):
    """The throwaway process before the rows compiles with Inductor in its own cache
    directories, which it deletes: the rows' caches stay as cold as they were."""
    caches = tmp_path / "prime"
    assert prime("cpu", caches) > 0
    assert not caches.exists()


def test_the_optimizer_is_prepared_as_the_mode_and_the_switch_say(monkeypatch):
    """A mode's own preparation (shardc-localopt's local step) runs, as in train_bench's runner;
    ``--optimizer local`` gives a shardc mode the local step and refuses any other mode;
    ``dtensor`` (``torch``, its old name) turns shardc's default local step off for the mode's
    optimizer; ``default`` leaves shardc's default."""
    setup = _Setup(torch.nn.Linear(2, 2))
    opt = torch.optim.SGD(setup.model.parameters(), lr=0.1)
    local, off = [], []
    monkeypatch.setattr(shardc.optim, "local_shard_step", lambda o: local.append(o))
    monkeypatch.setattr(shardc.optim, "set_default_local_step",
                        lambda enabled, optimizer=None: off.append((enabled, optimizer)))
    _prepare_optimizer(setup, opt, "shardc-packed", "default")
    assert local == [] and off == []
    _prepare_optimizer(setup, opt, "shardc-packed", "dtensor")
    _prepare_optimizer(setup, opt, "fsdp2-compile", "torch")
    assert local == [] and off == [(False, opt), (False, opt)]
    _prepare_optimizer(setup, opt, "shardc-packed", "local")
    assert local == [opt]
    with pytest.raises(ValueError, match="not a shardc mode"):
        _prepare_optimizer(setup, opt, "fsdp2-compile", "local")
    prepared = []
    setup.prepare_optimizer = prepared.append
    _prepare_optimizer(setup, opt, "shardc-localopt", "default")
    assert prepared == [opt] and local == [opt]
