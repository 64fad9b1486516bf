"""FP8 all-gather (``shardc.shard(..., fp8=Float8Policy())``) on CPU over gloo, world sizes 1-4.

The dequantized path must equal an independent reference quantize-dequantize of the full weight
(bitwise: the global amax is exact), train like an unsharded fake-quantized reference (parity
tolerance) and like the high-precision model within FP8 tolerance, issue one amax all-reduce per
step, halve the all-gather bytes of bf16, and keep master weights, optimizer state and
checkpoints in high precision.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from fp8_workers import (
    POLICIES,
    build_model,
    checkpoint_round_trip,
    fake_quant,
    fp8_budget_run,
    fp8_only_region,
    fp8_run,
    gather_numerics,
    reference,
)
from parity import assert_parity, assert_recomputed_in_backward, max_rel_err
from torch import nn

import shardc
from shardc.sharding.fp8 import Float8Policy, select_fp8_params
from shardc.sharding.te import TE_GEMM_WEIGHTS

WORLD_SIZES = [1, 2, 3, 4]
FP8_LOSS_TOL = 5e-3  # FP8 weights vs the float32 model: relative loss error over 5 steps


@pytest.fixture(scope="module")
def references():
    """Unsharded references: fake-quantized per policy, and the float32 model (policy None)."""
    keys = [(kind, True, policy) for kind in ("llama", "llama1") for policy in POLICIES]
    keys += [("tied", True, "embedding")]
    keys += [(kind, False, None) for kind in ("llama", "llama1", "tied")]
    return {(kind, fake, policy): reference(kind, fake, policy or "linear")
            for kind, fake, policy in keys}


def _world_2(rank: int, world: int, checkpoint_dir: str) -> dict:
    """Every default test's world-2 work in one spawned group (one set of rank processes, each
    run after the other, Dynamo reset between them by each): the gathers' numerics, the
    training runs, the FP8-only region and the checkpoint round trip."""
    out = {"gathered": gather_numerics(rank, world)}
    torch._dynamo.reset()
    out["training"] = _scenarios(rank, world, SCENARIOS[2])
    torch._dynamo.reset()
    out["fp8_only"] = fp8_only_region(rank, world)
    torch._dynamo.reset()
    out["checkpoint"] = checkpoint_round_trip(rank, world, checkpoint_dir)
    return out


@pytest.fixture(scope="module")
def world_2(tmp_path_factory) -> list[dict]:
    """Per rank: ``_world_2``'s results."""
    return run_ranks(_world_2, 2, str(tmp_path_factory.mktemp("fp8") / "ckpt"))


@pytest.fixture(scope="module")
def gathered(world_2):
    """The probes' gathered weights on 2 ranks (eager, planned FX, Inductor) and their full
    weights: ``a`` (45 rows) and ``d`` (37) are uneven, rank 1 holds no row of ``b`` and ``e``."""
    return [per_rank["gathered"] for per_rank in world_2]


def _assert_reference_fake_quant(rank_out: dict, names: tuple[str, ...]) -> None:
    for mode in ("eager", "fx", "inductor"):
        assert set(names) <= set(rank_out[f"{mode} fp8"]), f"{mode}: not all selected"
        for name in names:
            want = fake_quant(rank_out["full"][name])
            got = rank_out[mode][name]
            assert torch.equal(got, want), f"{mode} {name}: not the reference fake-quant"
            assert not torch.equal(got, rank_out["full"][name]), f"{name} was not quantized"


def test_gathered_weight_is_reference_quantize_dequantize(gathered):
    """Eager, planned FX and Inductor at world 2; one rank holds no row of ``b``.
    TransformerEngine-style weight names (``c.fc1_weight``...) are gathered in FP8 alike, the
    norm weight unquantized."""
    for rank_out in gathered:
        _assert_reference_fake_quant(rank_out, ("a.weight", "b.weight", "c.fc1_weight",
                                                "c.fc2_weight"))
        for mode in ("eager", "fx", "inductor"):
            norm = rank_out[mode]["c.layer_norm_weight"]
            assert torch.equal(norm, rank_out["full"]["c.layer_norm_weight"]), mode
    # The tiny value is rounded at the global scale (amax 3.5 from another rank's rows).
    a = gathered[0]["eager"]["a.weight"]
    assert a[0, 0] == -3.5 and a[3, 5] != 0.0123


def test_gathered_embedding_is_reference_quantize_dequantize(gathered):
    """``Float8Policy(modules=(..., nn.Embedding))``: what ``nn.Embedding``'s own forward looks
    up is the reference quantize-dequantize of the full weight, bitwise, eager, planned FX and
    Inductor at world 2: 37 rows (19 and 18 per rank) with the amax on rank 1, and 1 row (rank 1
    holds none)."""
    for rank_out in gathered:
        _assert_reference_fake_quant(rank_out, ("d.weight", "e.weight"))
    # Rank 0's tiny value is rounded at the global scale, set by rank 1's amax 4.5.
    d = gathered[0]["eager"]["d.weight"]
    assert d[30, 1] == 4.5 and d[2, 3] != 0.0123
    full = gathered[0]["full"]["d.weight"]
    assert not torch.equal(d[:19], fake_quant(full[:19])), "rank 0's own amax was used"


def _scenarios(rank: int, world: int, scenarios: list) -> list[dict]:
    return [fp8_run(rank, world, kind, mode, **dict(options)) for kind, mode, options in scenarios]


def _expected_fp8(kind: str, policy: str) -> set[str]:
    """What ``policy`` must gather in FP8, from the unsharded model: the weight of every
    ``nn.Linear`` (and ``nn.Embedding`` for the ``embedding`` policy) that no other module
    reads (a tied weight keeps the normal gather)."""
    classes = (nn.Linear, nn.Embedding) if policy == "embedding" else (nn.Linear,)
    readers: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, m in build_model(kind).named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            readers.setdefault(id(m.weight), []).append((name, m))
    return {f"{name}.weight" for (name, m), *others in readers.values()
            if not others and isinstance(m, classes)}


def _check_run(run: dict, references: dict, kind: str, mode: str, policy: str,
               where: str) -> None:
    assert torch.isfinite(run["losses"]).all(), where
    try:
        # Same numerics as an unsharded fake-quantized model (tight parity) ...
        assert_parity(run, references[kind, True, policy], tol=1e-4)
    except AssertionError as exc:
        raise AssertionError(f"{where}: {exc}") from exc
    # ... and the float32 model within FP8 tolerance.
    err = max_rel_err(run["losses"], references[kind, False, None]["losses"])
    assert err <= FP8_LOSS_TOL, f"{where}: loss rel err {err:.2e} vs float32"
    assert err > 0, f"{where}: FP8 changed nothing; were the weights quantized?"
    assert set(run["dtypes"].values()) == {torch.float32}, "master shards must stay float32"
    assert set(run["fp8"]) == _expected_fp8(kind, policy), where
    if kind != "tied":
        assert ("tok_embeddings.weight" in run["fp8"]) == (policy == "embedding"), where
    if mode != "eager":
        (fw, bw), = run["collectives"]
        # One amax all-reduce per step: in the forward, none in the backward.
        want = 0 if where.startswith("world 1,") else 1
        assert fw.get("all_reduce", 0) + fw.get("all_reduce_", 0) == want, fw
        assert not bw.get("all_reduce") and not bw.get("all_reduce_"), bw


EMBEDDING = (("policy", "embedding"),)


# The training runs of test_fp8_training_parity, by world size.
SCENARIOS = {
    1: [("llama", "eager", ())],
    # (The default policy compiled on its own, ("llama1", "fx", ()), is left out: the
    # EMBEDDING run gathers the same Linear weights in FP8 and adds the embedding's, and
    # the default policy compiles in the activation-offload run below and at world 3.)
    2: [("llama1", "eager", ()),
        ("llama1", "eager", EMBEDDING), ("llama1", "fx", EMBEDDING),
        # Two FP8 blocks (inline) whose saved activations are offloaded to the host
        # (issue 22, activation_offload=("*",)); parity below, the copies checked.
        ("llama", "fx", (("activation_offload", ("*",)),))],
    3: [("llama", "eager", ()),
        # Two layers: blocks whose weights are gathered in FP8 compile inline (said in
        # the plan), not as one body (shardc.sharding.blocks).
        ("llama", "fx", (("reshard_after_forward", False), ("bucket_by", "param"))),
        ("llama", "eager", EMBEDDING)],
    4: [("llama", "eager", ()), ("tied", "eager", EMBEDDING)],
}


# Slow since s35 (suite time: an Inductor compile in the world-2 group): a tied embedding/output
# weight beside FP8 embeddings under Inductor. Where its features stay covered in the default
# tier: the tied weight's float32 gather beside FP8 embeddings at world 4 (eager, _check_tied);
# FP8 gathers under Inductor, bitwise the reference quantize-dequantize, in test_gathered_*
# (world 2, the embedding policy too); Inductor training at parity in
# tests/test_parity_inductor.py.
SLOW_SCENARIOS = {2: [("tied", "inductor", EMBEDDING)]}


# World 3 is slow (suite time, s29): FP8 trains at 1, 2 and 4 here, and uneven FP8 shards stay
# in test_gathered_* (2 ranks, rows of 45 and 37; one rank holds no row of two weights).
@pytest.mark.parametrize("world", [w if w != 3 else pytest.param(3, marks=pytest.mark.slow)
                                   for w in WORLD_SIZES])
def test_fp8_training_parity(world, references, request):
    """Eager at every world size; compiled (planned FX) at 2 and 3 (CPU compiles are slow).
    With FP8 embeddings too (``EMBEDDING``): eager at 3, eager and FX at 2, and a tied
    embedding/output weight beside FP8 embeddings eagerly at 4 (under Inductor at 2: slow,
    SLOW_SCENARIOS)."""
    scenarios = SCENARIOS[world]
    results = (request.getfixturevalue("world_2")[0]["training"] if world == 2
               else run_ranks(_scenarios, world, scenarios)[0])
    for (kind, mode, options), run in zip(scenarios, results):
        policy = dict(options).get("policy", "linear")
        _check_run(run, references, kind, mode, policy,
                   f"world {world}, {kind} {mode} {dict(options)}")
        if kind == "tied":
            _check_tied(run)
        if kind == "llama" and mode != "eager":
            for plan in run["plans"]:
                assert plan.bodies == [], plan.bodies
                reasons = {b.module: b.reason for b in plan.inline_blocks}
                assert sorted(reasons) == ["layers.0", "layers.1"], reasons
                assert all("FP8" in r for r in reasons.values()), reasons
    if world == 2:
        _check_offloaded_activations(results[-1])
        eager, fx = results[1:3]  # FP8 embeddings, eager and planned FX
        assert torch.equal(eager["losses"], fx["losses"]), "eager and compiled FP8 differ"
        _check_plan(fx["plans"][0], "embedding")
        # The default policy's plan: the activation-offload run's (two layers).
        _check_plan(results[-1]["plans"][0], "linear", kind="llama")


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(SLOW_SCENARIOS))
def test_fp8_training_parity_more(world, references):
    """The training runs of SLOW_SCENARIOS, checked as test_fp8_training_parity checks its."""
    scenarios = SLOW_SCENARIOS[world]
    for (kind, mode, options), run in zip(scenarios,
                                          run_ranks(_scenarios, world, scenarios)[0]):
        policy = dict(options).get("policy", "linear")
        _check_run(run, references, kind, mode, policy,
                   f"world {world}, {kind} {mode} {dict(options)}")
        if kind == "tied":
            _check_tied(run)


@pytest.mark.slow
def test_fp8_peak_budget_frees_blocks_activations(references):
    """Issue 22's peak budget with FP8 weights, world 2 (two FP8 blocks, inline; FX): a budget
    a byte below the fixed policy's predicted peak makes the planner free blocks' activations
    (recompute or offload: its choice); training keeps parity with the fake-quantized
    reference, the predicted peak is within the budget, and both ranks' plans hash the same.
    Slow: two compiles and the search's trials (its own spawn)."""
    _check_budget_runs([per_rank[0] for per_rank in run_ranks(_budget_scenarios, 2)],
                       references, "fx")


@pytest.mark.slow
def test_fp8_peak_budget_frees_blocks_activations_under_inductor(references):
    """The same under Inductor (world 2); a block the planner recomputes runs its forward's
    matrix products again in the backward graph Inductor compiles."""
    _check_budget_runs([per_rank[0] for per_rank in run_ranks(_budget_scenarios, 2, True)],
                       references, "inductor")


def _budget_scenarios(rank: int, world: int, inductor: bool = False) -> list[dict]:
    return [fp8_budget_run(rank, world, "llama", inductor)]


def _check_budget_runs(runs: list[dict], references: dict, mode: str) -> None:
    for rank, run in enumerate(runs):
        _check_run(run, references, "llama", mode, "linear",
                   f"rank {rank}, FP8 under a budget ({mode})")
        record = run["budget"]
        assert record.budget_bytes == run["fixed_peak"] - 1, (rank, record.budget_bytes)
        assert record.offloaded or record.recomputed, (rank, record.blocks)
        assert record.peak_bytes <= record.budget_bytes and run["peak"] <= record.budget_bytes
        assert_recomputed_in_backward(record, run["bodies"], run["backward_ops"])
    assert runs[0]["hash"] == runs[1]["hash"]


def _check_offloaded_activations(run: dict) -> None:
    """FP8 with activation offload forced on every block: the saved activations (here products
    of the dequantized weights; on CUDA the float8 operands too) go to the host in the forward
    and come back before their readers (parity.activation_copies); the run's parity with the
    fake-quantized reference is checked with the others. (Bitwise equal to the same run without
    offload: checked by hand at world 2, not here, for the suite's time.)"""
    copies = run["activation_copies"]
    assert copies["d2h"] > 0 and copies["d2h"] == copies["h2d"] == copies["saved_on_host"], copies
    assert copies["misplaced"] == 0 and copies["release_waits"] == copies["d2h"], copies
    notes = [n for plan in run["plans"] for n in plan.notes if "activation offload" in n]
    assert notes and all("['layers.0', 'layers.1']" in n for n in notes), notes


def _check_tied(run: dict) -> None:
    """The tied token embedding / output weight keeps the normal (float32) gather."""
    assert "tok.weight" not in run["fp8"] and "pos.weight" in run["fp8"]
    for plan in run["plans"]:
        tok = [c for c in plan.collectives if c.kind == "all_gather" and "tok.weight" in c.params]
        assert tok and all(c.dtype == "float32" for c in tok), tok


def _check_plan(plan, policy: str, kind: str = "llama1") -> None:
    """The Linear weights (and with the ``embedding`` policy the token embedding) travel as
    float8 (1 byte per element: half of bf16, a quarter of float32), the Linears in forward
    and again in backward (reshard; the embedding's backward needs no weight), and the plan
    dump says so."""
    from shardc.tools.render import plan_table

    f8 = [c for c in plan.collectives if c.kind == "all_gather" and c.dtype == "float8_e4m3fn"]
    assert f8, "no float8 all-gather"
    for c in f8:
        bucket = plan.buckets[c.bucket]
        numel = bucket.layout(c.params)[1] * bucket.world
        assert bucket.dtype == "float8_e4m3fn" and c.buffer_bytes == numel, c.id
        assert set(c.params) <= _expected_fp8(kind, policy), c.params
    fw = {p for c in f8 if c.graph == "forward" for p in c.params}
    bw = {p for c in f8 if c.graph == "backward" for p in c.params}
    assert fw == _expected_fp8(kind, policy)
    assert bw == fw - {"tok_embeddings.weight"}, (fw, bw)
    others = [c for c in plan.collectives if c.kind == "all_gather" and c not in f8]
    assert others and all(c.dtype == "float32" for c in others)  # norms (embedding)
    assert any("tok_embeddings.weight" in c.params for c in others) == (policy == "linear")
    text = plan_table(plan)
    assert "amax all-reduce" in text and "all-gather bytes by dtype: float32" in text
    assert "float8_e4m3fn" in text


def test_region_of_fp8_weights_only_is_planned(world_2):
    """A region whose sharded parameters are all FP8 weights (no bias, no norm: TE's bias-less
    ``te.Linear`` alone) is planned like any other: its gathers are float8 collectives of the
    plan, its amax all-reduce merged, and it trains like eager. (Its gathers sit inside the
    FP8 ``autograd.Function``'s subgraph, where the backend once did not look, compiling the
    region like an unsharded graph.)"""
    for rank_out in (per_rank["fp8_only"] for per_rank in world_2):
        eager, fx = rank_out["eager"], rank_out["fx"]
        assert fx["regions"] == 1, fx
        assert {p for _, params in fx["gathers"] for p in params} == {"0.weight", "2.weight"}
        assert {dtype for dtype, _ in fx["gathers"]} == {"float8_e4m3fn"}
        (fw, bw), = fx["collectives"]
        assert fw.get("all_reduce", 0) == 1 and not bw.get("all_reduce"), (fw, bw)
        assert torch.equal(eager["losses"], fx["losses"])


def test_checkpoint_holds_high_precision(world_2):
    out = [per_rank["checkpoint"] for per_rank in world_2]
    for rank_out in out:
        assert set(rank_out["dtypes"].values()) == {torch.float32}
        assert rank_out["optim_dtypes"] == ["torch.float32"]
        assert rank_out["outputs_equal"]
        for name, value in rank_out["full"].items():
            assert torch.equal(rank_out["loaded"][name], value), name
        w = rank_out["full"]["layers.0.attention.wq.weight"]
        assert not torch.equal(fake_quant(w), w), "the checkpoint holds FP8-rounded values"


def test_policy_validation_and_selection():
    with pytest.raises(ValueError, match="dtype must be one of"):
        Float8Policy(dtype=torch.bfloat16)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight
            self.proj = nn.Linear(8, 8)
            self.skip = nn.Linear(8, 8)

    model = Tied()
    owners = {"emb.weight": 2, "proj.weight": 1, "proj.bias": 1, "skip.weight": 1,
              "skip.bias": 1}
    chosen = select_fp8_params(model, Float8Policy(exclude=("skip",)), owners)
    assert chosen == {"proj.weight"}  # tied head keeps the normal gather; skip excluded
    chosen = select_fp8_params(model, Float8Policy(filter=lambda n, m: n == "skip"), owners)
    assert chosen == {"skip.weight"}
    assert isinstance(shardc.Float8Policy(), Float8Policy)
    # Embeddings: selected by class; the tied one keeps the normal gather.
    with_emb = Float8Policy(modules=(nn.Linear, nn.Embedding))
    assert select_fp8_params(model, with_emb, owners) == {"proj.weight", "skip.weight"}
    owners["emb.weight"] = 1
    model.head.weight = nn.Parameter(torch.randn(10, 8))  # untied
    assert select_fp8_params(model, with_emb, owners) == {"emb.weight", "proj.weight",
                                                          "skip.weight"}
    # An embedding FP8 cannot serve is refused, naming the weight and the way out.
    for kwargs, what in (({"sparse": True}, "sparse=True"), ({"max_norm": 1.0}, "max_norm=1.0")):
        emb = nn.Sequential(nn.Embedding(10, 8, **kwargs))
        with pytest.raises(ValueError, match=rf"'0.weight'.*{what}.*exclude="):
            select_fp8_params(emb, with_emb, {"0.weight": 1})
        assert select_fp8_params(emb, Float8Policy(), {"0.weight": 1}) == set()


def test_policy_selects_every_named_weight_of_a_module():
    """TransformerEngine's modules hold several GEMM weights under other names than ``weight``
    (``fc1_weight``, ``query_weight``...) beside a 1-D ``layer_norm_weight``;
    ``shardc.te_float8_policy`` selects them by name (TE itself is only imported on GPU)."""

    class LayerNormMLP(nn.Module):  # the parameter layout of te.LayerNormMLP
        def __init__(self) -> None:
            super().__init__()
            self.layer_norm_weight = nn.Parameter(torch.ones(8))
            self.fc1_weight = nn.Parameter(torch.randn(16, 8))
            self.fc1_bias = nn.Parameter(torch.zeros(16))
            self.fc2_weight = nn.Parameter(torch.randn(8, 16))

    model = nn.Sequential(LayerNormMLP(), nn.Linear(8, 8))
    owners = {n: 1 for n, _ in model.named_parameters()}
    te_like = Float8Policy(modules=(LayerNormMLP,), weights=TE_GEMM_WEIGHTS)
    assert select_fp8_params(model, te_like, owners) == {"0.fc1_weight", "0.fc2_weight"}
    # The default selects `weight` only: the Linear, never the norm.
    assert select_fp8_params(model, Float8Policy(modules=(nn.Module,)), owners) == {"1.weight"}
    with pytest.raises(ValueError, match=r"'0.layer_norm_weight' is 1-D.*weights="):
        select_fp8_params(model, Float8Policy(modules=(LayerNormMLP,), weights=(".*weight",)),
                          owners)


def _fp8_bench():
    """``benchmarks/fp8_bench.py`` as a module (benchmarks/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fp8_bench.py"
    spec = importlib.util.spec_from_file_location("fp8_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Slow (suite time, s29): the bench's FP8 mode compiled twice; FP8 plans are checked by
# test_fp8_training_parity
@pytest.mark.slow
def test_bench_fp8_mode_halves_planned_all_gather_bytes(capsys):
    """The benchmark's default ``fp8`` mode (FP8 Linears and token embedding) gathers every 2-D
    weight in float8: its plan moves the bf16 plan's elements, the float8 ones at 1 byte instead
    of 2, and only the norms stay bf16, so the step's all-gather bytes are half of bf16's plus
    half the norms' share (``--plan-only``: the benchmark's ``--tiny`` shapes, meta device)."""
    import json

    bench = _fp8_bench()
    args = bench._args(["--tiny"])
    assert args.modes == ["bf16", "fp8"], "the default benchmark reports the fp8 mode"
    assert bench.MODES["fp8"].selects("tok_embeddings", nn.Embedding(3, 2))
    capsys.readouterr()
    assert bench.main(["--tiny", "--plan-only"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    bf16 = results["bf16"]["all_gather_bytes_by_dtype"]
    fp8 = results["fp8"]["all_gather_bytes_by_dtype"]
    assert set(bf16) == {"bfloat16"}
    assert 2 * fp8["float8_e4m3fn"] + fp8["bfloat16"] == bf16["bfloat16"]
    norms = (2 * args.layers + 1) * args.dim * 2  # every 1-D weight, bf16, once
    assert 0 < fp8["bfloat16"] <= 2 * norms, "only the norms (forward, backward) stay bf16"
    ratio = results["fp8"]["all_gather_bytes"] / results["bf16"]["all_gather_bytes"]
    assert ratio == 0.5 + fp8["bfloat16"] / (2 * bf16["bfloat16"]) < 0.502
    assert results["fp8"]["all_gather_ratio_vs_bf16"] == round(ratio, 6)
