"""The benchmark's mode names (``benchmarks/train/modes.py``): FSDP2 modes with a compiled loss
(``-closs``) are known and split into their base mode; the suffix is refused where it means
nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from train.modes import mode_name, split_compiled_loss  # noqa: E402


@pytest.mark.parametrize("mode, base", [("fsdp2-compile-ac-closs", "fsdp2-compile-ac"),
                                        ("fsdp2-closs", "fsdp2"),
                                        ("fsdp2-compile-amb0.5-closs", "fsdp2-compile-amb0.5")])
def test_fsdp2_modes_take_a_compiled_loss(mode, base):
    assert mode_name(mode) == mode
    assert split_compiled_loss(mode) == (base, True)
    assert split_compiled_loss(base) == (base, False)


@pytest.mark.parametrize("mode, match", [("shardc-closs", "FSDP2 modes only"),
                                         ("fsdp2-compile-xyz-closs", "unknown mode"),
                                         ("fsdp2-compile-amb2-closs", "ratio")])
def test_a_compiled_loss_is_refused_where_it_means_nothing(mode, match):
    with pytest.raises(ValueError, match=match):
        mode_name(mode)


@pytest.mark.parametrize("mode, sink, budget", [("shardc-fast", False, False),
                                                ("shardc-fast-sink", True, False),
                                                ("shardc-fast-budget-sink", True, True)])
def test_the_fast_modes_options(monkeypatch, mode, sink, budget):
    """What each fast mode compiles with: CUDA graphs, plain inputs and the local-shard step
    always; the sunk residual and the peak budget as named (``-fast-sink`` has no budget, so
    every bucket is resharded as in default shardc)."""
    from train import modes

    from shardc.models.llama import LlamaConfig

    seen = {}

    def fake_setup(model, mesh, loss_in_graph, compile_mode=None, **options):
        seen.update(options, compile_mode=compile_mode)
        return modes.Setup(loss=lambda tokens, targets: None, params=[])

    monkeypatch.setattr(modes, "setup_shardc", fake_setup)
    monkeypatch.setattr(modes.bench_mesh, "parallelize_llama", lambda model, mesh: model)
    cfg = LlamaConfig(vocab_size=16, dim=8, n_layers=1, n_heads=2, ffn_dim=16, max_seq_len=8)
    setup = modes.setup_mode(mode, cfg, torch.device("cpu"), mesh=None)
    assert seen["compile_mode"] == "reduce-overhead" and seen["plain_inputs"] is True
    assert setup.cudagraphs and setup.prepare_optimizer is not None
    assert seen.get("sink_block_residual", False) is sink
    assert ("peak_memory_budget_bytes" in seen) is budget


@pytest.mark.parametrize("impl", ["default", "foreach", "fused"])
def test_each_optimizer_impl_steps_adamw_as_asked(impl):
    """``--optim-impl`` (train_bench, step_overhead): each choice is AdamW's own argument and
    steps as torch's default does (fused and foreach agree with the for-loop to rounding)."""
    from train.runner import OPTIM_IMPLS

    torch.manual_seed(0)
    base = torch.randn(4, 3)
    grad = torch.randn(4, 3)
    params, opts = [], []
    for kwargs in ({"foreach": False}, OPTIM_IMPLS[impl]):
        p = torch.nn.Parameter(base.clone())
        opts.append(torch.optim.AdamW([p], lr=1e-2, **kwargs))
        p.grad = grad.clone()
        opts[-1].step()
        params.append(p.detach())
    if impl != "default":
        assert opts[1].defaults[impl] is True
    assert not torch.equal(params[1], base)
    torch.testing.assert_close(params[1], params[0])
