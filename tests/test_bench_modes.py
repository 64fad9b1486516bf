"""The benchmark's mode names (``benchmarks/train/modes.py``): FSDP2 modes with a compiled loss
(``-closs``) are known and split into their base mode; the suffix is refused where it means
nothing."""

from __future__ import annotations

import argparse
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


RSWAIT = "reduce_scatter_wait_past_small_buckets"


def _setup_options(monkeypatch, mode: str) -> tuple[dict, object]:
    """What ``setup_mode(mode)`` hands ``setup_shardc`` (its options and ``compile_mode``),
    and the setup it returns (``setup_shardc`` faked: nothing is compiled)."""
    from train import modes

    from shardc.models.llama import LlamaConfig

    seen = {}

    def fake_setup(model, mesh, loss_in_graph, compile_mode=None, **options):
        seen.update(options, compile_mode=compile_mode)
        return modes.Setup(loss=lambda tokens, targets: None, params=[])

    monkeypatch.setattr(modes, "setup_shardc", fake_setup)
    monkeypatch.setattr(modes.bench_mesh, "parallelize_llama", lambda model, mesh: model)
    cfg = LlamaConfig(vocab_size=16, dim=8, n_layers=1, n_heads=2, ffn_dim=16, max_seq_len=8)
    return seen, modes.setup_mode(mode, cfg, torch.device("cpu"), mesh=None)


@pytest.mark.parametrize("mode, sink, budget, rswait", [
    ("shardc-fast", False, False, False), ("shardc-fast-sink", True, False, False),
    ("shardc-fast-budget-sink", True, True, False), ("shardc-fast-rswait", False, False, True)])
def test_the_fast_modes_options(monkeypatch, mode, sink, budget, rswait):
    """What each fast mode compiles with: CUDA graphs, plain inputs and the local-shard step
    always; the sunk residual, the peak budget and the reduce-scatter waits past small buckets
    as named (``-fast-sink`` has no budget, so every bucket is resharded as in default
    shardc); the report names the options."""
    seen, setup = _setup_options(monkeypatch, mode)
    assert seen["compile_mode"] == "reduce-overhead" and seen["plain_inputs"] is True
    assert setup.cudagraphs and setup.prepare_optimizer is not None
    assert seen.get("sink_block_residual", False) is sink
    assert ("peak_memory_budget_bytes" in seen) is budget
    assert seen.get(RSWAIT, False) is rswait
    assert (f"{RSWAIT}=True" in setup.info["options"]) is rswait


def test_the_rswait_mode_is_default_shardc_with_the_option(monkeypatch):
    """``shardc-rswait``: default shardc (no CUDA graphs, no other option) plus the option,
    named in the report."""
    assert mode_name("shardc-rswait") == "shardc-rswait"
    seen, setup = _setup_options(monkeypatch, "shardc-rswait")
    assert seen == {RSWAIT: True, "compile_mode": None}
    assert not setup.cudagraphs and setup.info["options"] == f"{RSWAIT}=True"


def test_predict_step_backend_options_parse_and_name_the_fields():
    """``predict_step.py --backend-option NAME=VALUE`` (repeatable): bools, ints, floats and
    text; an unknown name or a missing ``=`` is refused listing ``ShardcOptions``' fields, a
    value the options refuse at parsing; the report names the options."""
    import predict_step

    args = predict_step._args([
        "--backend-option", f"{RSWAIT}=true", "--backend-option", "prefetch_depth=2",
        "--backend-option", "peak_memory_margin=0.05", "--backend-option", "bucket_by=param"])
    options = dict(args.backend_option)
    assert options == {RSWAIT: True, "prefetch_depth": 2, "peak_memory_margin": 0.05,
                       "bucket_by": "param"}
    assert predict_step._args([]).backend_option == []
    assert predict_step.backend_options_line({"backend_options": options})[0].startswith(
        "- backend options (every row): `bucket_by='param'`")
    assert predict_step.backend_options_line({}) == []
    for bad, match in (("no_such_option=1", "not a ShardcOptions field"),
                       (RSWAIT, "not NAME=VALUE")):
        with pytest.raises(argparse.ArgumentTypeError, match=match) as info:
            predict_step.parse_backend_option(bad)
        assert RSWAIT in str(info.value) and "one_op_bucket_copies" in str(info.value)
    with pytest.raises(SystemExit):  # a value ShardcOptions refuses: before any compile
        predict_step._args(["--backend-option", "bucket_by=layer"])


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
