"""The benchmark's mode names (``benchmarks/train/modes.py``): FSDP2 modes with a compiled loss
(``-closs``) are known and split into their base mode; the suffix is refused where it means
nothing. ``--fp8`` (train_bench, step_overhead) shards the shardc modes with FP8 weights and
refuses the others."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks

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


def _setup_options(monkeypatch, mode: str, fp8: bool = False) -> tuple[dict, object]:
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
    return seen, modes.setup_mode(mode, cfg, torch.device("cpu"), mesh=None, fp8=fp8)


@pytest.mark.parametrize("mode, sink, budget, rswait, pcasts", [
    ("shardc-fast", False, False, False, False), ("shardc-fast-sink", True, False, False, False),
    ("shardc-fast-budget-sink", True, True, False, False),
    ("shardc-fast-rswait", False, False, True, False),
    ("shardc-fast-sink-pcasts", True, False, False, True)])
def test_the_fast_modes_options(monkeypatch, mode, sink, budget, rswait, pcasts):
    """What each fast mode compiles with: CUDA graphs, plain inputs and the local-shard step
    always; the sunk residual, the peak budget, the reduce-scatter waits past small buckets and
    the per-parameter one-rank casts as named (``-fast-sink`` has no budget, so every bucket
    is resharded as in default shardc); the report names the options."""
    seen, setup = _setup_options(monkeypatch, mode)
    assert seen["compile_mode"] == "reduce-overhead" and seen["plain_inputs"] is True
    assert setup.cudagraphs and setup.prepare_optimizer is not None
    assert seen.get("sink_block_residual", False) is sink
    assert ("peak_memory_budget_bytes" in seen) is budget
    assert seen.get(RSWAIT, False) is rswait
    assert (f"{RSWAIT}=True" in setup.info["options"]) is rswait
    assert seen.get("one_op_local_casts", True) is not pcasts
    assert ("one_op_local_casts=False" in setup.info["options"]) is pcasts


def test_the_rswait_mode_is_default_shardc_with_the_option(monkeypatch):
    """``shardc-rswait``: default shardc (no CUDA graphs, no other option) plus the option,
    named in the report."""
    assert mode_name("shardc-rswait") == "shardc-rswait"
    seen, setup = _setup_options(monkeypatch, "shardc-rswait")
    assert seen == {RSWAIT: True, "compile_mode": None}
    assert not setup.cudagraphs and setup.info["options"] == f"{RSWAIT}=True"


@pytest.mark.parametrize("mode", ["shardc", "shardc-rswait", "shardc-fast", "shardc-fast-rswait",
                                  "shardc-budget", "shardc-plain"])
def test_fp8_reaches_every_shardc_mode_with_its_options(monkeypatch, mode):
    """``setup_mode(..., fp8=True)``: the mode's own options, and ``fp8=True`` on top (off
    unless asked)."""
    seen, _ = _setup_options(monkeypatch, mode, fp8=True)
    assert seen.pop("fp8") is True
    plain, _ = _setup_options(monkeypatch, mode)
    assert seen == plain and "fp8" not in plain


def _fp8_mode_run(rank: int, world: int, mode: str) -> dict:
    """``setup_mode(mode, fp8=True)`` on a tiny Llama, one compiled step: what it sharded in
    FP8 and the plan's all-gather dtypes (on CPU the FP8 gathers compute through the dequantized
    fallback; ``_scaled_mm`` is for CUDA)."""
    import bench_mesh
    from train.modes import setup_mode
    from train.workload import synthetic_batches

    import shardc
    from shardc.models.llama import LlamaConfig

    torch._dynamo.reset()
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, ffn_dim=64, max_seq_len=16)
    cpu = torch.device("cpu")
    mesh = bench_mesh.build_mesh("cpu", world, None, 1)
    setup = setup_mode(mode, cfg, cpu, mesh, fp8=True)
    state = shardc.shard_state(setup.keep[0])
    tokens, targets = synthetic_batches(1, 2, 16, cfg.vocab_size, rank, cpu)[0]
    loss = setup.loss(tokens, targets)
    loss.backward()
    plans = setup.after_first_step().pop("_plans")
    return {"modules": state.fp8.modules, "info": dict(setup.info), "loss": loss.item(),
            "fp8": sorted(fqn for fqn, i in state.params.items() if i.fp8 is not None),
            "params": sorted(state.params),
            "gathers": sorted({(b.dtype, p) for plan in plans for b in plan.buckets
                               for p in b.params})}


@pytest.mark.slow  # a benchmark harness's mode, 30 CPU s: the FP8 training paths have their own
def test_fp8_shards_a_shardc_mode_with_float8_gathers():
    """``--fp8``: the shardc mode shards with ``Float8Policy(modules=(nn.Linear,
    nn.Embedding))`` (predict_step's ``:fp8``): every Linear weight and the token embedding are
    gathered in FP8 in the compiled plan, the norms in bf16; the report names the policy."""
    from torch import nn

    out = run_ranks(_fp8_mode_run, 1, "shardc-rswait")[0]
    assert out["modules"] == (nn.Linear, nn.Embedding)
    assert out["info"]["fp8"] == "shardc.Float8Policy(modules=(nn.Linear, nn.Embedding))"
    assert torch.isfinite(torch.tensor(out["loss"]))
    two_d = [n for n in out["params"] if "norm" not in n]
    assert out["fp8"] == two_d and "tok_embeddings.weight" in two_d, out["fp8"]
    assert sorted(name for _, name in out["gathers"]) == out["params"], out["gathers"]
    for dtype, name in out["gathers"]:
        assert (dtype == "float8_e4m3fn") is ("norm" not in name), (name, dtype)


@pytest.mark.parametrize("script", ["train_bench", "step_overhead"])
def test_fp8_refuses_the_modes_without_an_fp8_path(script, capsys):
    """``--fp8`` with FSDP2, its memory baselines, SimpleFSDP or the bound is refused before
    anything runs, naming the mode (never a bf16 run under an FP8 label); without ``--modes``
    it runs the default list's shardc modes; the report's header says FP8 on or off."""
    import importlib

    from train.modes import setup_mode

    bench = importlib.import_module(script)
    for mode in ("fsdp2-compile", "bound", "simplefsdp", "fsdp2-compile-ac"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--fp8", "--modes", "shardc", mode])
        err = capsys.readouterr().err
        assert mode in err and "applies to the shardc modes only" in err, err
    assert bench.parse_args(["--modes", "shardc", "bound"]).fp8 is False
    default = bench.parse_args(["--fp8"]).modes
    assert "shardc" in default and all(m.startswith("shardc") for m in default), default
    assert not all(m.startswith("shardc") for m in bench.parse_args([]).modes)
    with pytest.raises(ValueError, match="shardc modes only; refused: fsdp2"):
        setup_mode("fsdp2", None, torch.device("cpu"), None, fp8=True)


def test_reports_record_fp8_on_or_off():
    import step_overhead
    from train.report import render_markdown

    meta = {"command": "x", "date": "d", "gpu": "cpu", "world_size": 1, "device": "cpu",
            "torch": "t", "python": "p", "peak_flops": 1e12, "steps": 1, "warmup": 1,
            "profile_steps": 0, "lr": 1e-4}
    assert "- FP8 weights (`--fp8`): off" in render_markdown({"meta": meta, "models": {}})
    on = render_markdown({"meta": {**meta, "fp8": "POLICY"}, "models": {}})
    assert "- FP8 weights (`--fp8`): `POLICY` in every shardc mode" in on
    so = {"command": "x", "device": "cpu", "world": 1, "torch": "t", "git": "g"}
    assert "FP8 weights (`--fp8`): off" in step_overhead.render({"meta": so, "rows": []})
    assert "FP8 weights (`--fp8`): POLICY" in step_overhead.render(
        {"meta": {**so, "fp8": "POLICY"}, "rows": []})


def test_step_overhead_takes_the_rswait_modes_and_any_bench_mode():
    """``step_overhead.py --modes``: its own list (the rswait pair included), any other
    ``train_bench.py`` mode through ``mode_name``; an unknown one is refused; ``--fp8`` and
    ``--rounds`` pass through."""
    import step_overhead

    modes = ["shardc", "shardc-rswait", "shardc-fast", "shardc-fast-rswait"]
    args = step_overhead.parse_args(["--fp8", "--modes", *modes, "--rounds", "3"])
    assert args.modes == modes and args.fp8 and args.rounds == 3
    assert {"shardc-rswait", "shardc-fast-rswait"} <= set(step_overhead.MODES)
    assert step_overhead.parse_args(["--modes", "fsdp2-compile", "shardc-oneop"]).modes == [
        "fsdp2-compile", "shardc-oneop"]
    with pytest.raises(SystemExit):
        step_overhead.parse_args(["--modes", "shardc-nope"])


def test_step_overhead_rounds_reset_dynamo_after_the_last_mode_only(monkeypatch):
    """``--rounds``: every mode compiled first; finishing a row frees its mode, but Dynamo's
    caches (every mode's compiled code) are reset after the last row only, so the modes after
    the first do not recompile in their issue-timed steps."""
    import step_overhead

    freed = []
    monkeypatch.setattr(step_overhead, "prepare", lambda mode, *a: {
        "mode": mode, "setup": None, "opt": None, "it": iter(range(100))})
    monkeypatch.setattr(step_overhead, "whole_step_ms", lambda *a: 1.0)

    def finish_row(state, args, device, free=True):
        freed.append((state["mode"], free))
        return {"mode": state["mode"]}

    monkeypatch.setattr(step_overhead, "finish_row", finish_row)
    args = step_overhead.parse_args(["--modes", "shardc", "shardc-rswait", "--rounds", "3",
                                     "--steps", "2"])
    rows = step_overhead.run_interleaved("1b", 1, 1, args, None, torch.device("cpu"))
    assert [r["mode"] for r in rows] == ["shardc", "shardc-rswait"]
    assert all(len(r["step_ms_rounds"]) == 3 for r in rows)
    assert freed == [("shardc", False), ("shardc-rswait", True)]


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
