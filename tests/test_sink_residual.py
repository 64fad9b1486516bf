"""``sink_block_residual`` (shardc.passes.sink_residual): each compile-once body's final residual
add moved into the next body call. Parity with the unsharded reference (AdamW, uneven shards:
the 37-row vocabulary and 45-row FFN at world 2), the sunk form in the backend's graphs (one body
per block type, partitioned once; each call takes the previous call's pair; under Inductor the
add fused into the next block's norm), nothing changed with the option off, and the fallback,
logged once and noted in the plan, where the pattern does not match."""

from __future__ import annotations

import ast
import json
import logging
import operator
import re

import pytest
import torch
import torch._dynamo
from dist_utils import prestart as prestart_run
from dist_utils import run_prestarted, run_ranks
from parity import assert_parity, build, max_rel_err, reference, sharded_run, train_rank_slice
from torch import nn

import shardc
from shardc.passes.body import body_calls
from shardc.passes.fx_utils import is_call

SINK = {"sink_block_residual": True}


def _forward_calls(gm: torch.fx.GraphModule) -> dict:
    """The forward graph's body calls: their subgraphs, and for each call after the first
    whether it reads exactly the previous call's outputs 0 and 1 (the pair), and what the first
    call's extra operand is."""
    calls = list(body_calls(gm))
    pairs = []
    for prev, nxt in zip(calls, calls[1:]):
        read = sorted(a.args[1] for a in nxt.args[2:]
                      if is_call(a, operator.getitem) and a.args[0] is prev)
        pairs.append(read)
    first = [str(a.target) for a in calls[0].args[2:] if isinstance(a, torch.fx.Node)
             and a.op == "call_function"] if calls else []
    return {"subgraphs": sorted({str(c.args[0].target) for c in calls}), "pairs": pairs,
            "first": first, "calls": len(calls)}


def _region_facts(model) -> list[dict]:
    out = []
    for region in shardc.shard_state(model).regions:
        plan = region.plan
        out.append({
            "hash": plan.hash(),
            "stand_ins": len(region.stand_ins or ()),
            "bodies": [(b.name, tuple(b.blocks), b.partitions) for b in plan.bodies],
            "sink_notes": [n for n in plan.notes if n.startswith("sink_block_residual")],
            "forward": _forward_calls(region.forward) if region.forward is not None else None,
        })
    return out


def _fx_runs(rank: int, world: int) -> dict:
    out = {}
    scenarios = [("llama", "llama", SINK), ("llama_off", "llama", {"sink_block_residual": False}),
                 ("blocks", "blocks", {**SINK, "eval": True})]  # then eval + no_grad
    if world == 1:  # (the lowered graphs' passes; at world 1 to keep world 2 short)
        scenarios += [
            # Every block recomputed in the backward (its sunk body's call copied into the
            # backward, pruned to the outputs read) and its checkpoint, now the pair, offloaded.
            ("recompute", "llama", {**SINK, "activation_offload": ("checkpoint:*",)}),
            # Every block's saved activations offloaded to the host and back.
            ("offload", "llama", {**SINK, "activation_offload": ("*",)})]
    for name, kind, options in scenarios:
        torch._dynamo.reset()
        run = sharded_run(rank, world, kind, "fx", keep_model=True, **options)
        out[name] = {"losses": run["losses"], "params": run["params"], "eval": run["eval"],
                     "regions": _region_facts(run["model"])}
    return out


@pytest.fixture(scope="module")
def references():
    return {kind: reference(kind) for kind in ("llama", "blocks")}


@pytest.fixture(scope="module")
def inductor_reference():
    torch._dynamo.reset()
    return reference("llama", compile_backend="inductor")


# Slow (suite time, s29): the sunk bodies train at parity under Inductor at world 1 below.
@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_sunk_bodies_train_at_parity_fx(world, references):
    runs = run_ranks(_fx_runs, world)[0]
    for name, run in runs.items():
        kind = "blocks" if name == "blocks" else "llama"
        try:
            assert_parity(run, references[kind], tol=1e-5)
        except AssertionError as exc:
            raise AssertionError(f"world {world}, {name}: {exc}") from exc
    if world == 1:
        for name in ("recompute", "offload"):  # the same values as the plain sunk run
            assert torch.equal(runs[name]["losses"], runs["llama"]["losses"]), name
        # (Recomputed, each call reads the boundary copies of the previous call's pair.)
        assert runs["offload"]["regions"][0]["forward"]["pairs"] == [[0, 1]]
    # The same ops on the same values, moved: bit for bit the run without the option.
    assert torch.equal(runs["llama"]["losses"], runs["llama_off"]["losses"])
    assert all(torch.equal(value, runs["llama_off"]["params"][name])
               for name, value in runs["llama"]["params"].items())
    on, off = runs["llama"]["regions"], runs["llama_off"]["regions"]
    # The same collectives (plan hash), one body partitioned once, with the option on or off.
    assert [r["hash"] for r in on] == [r["hash"] for r in off]
    assert on[0]["bodies"] == off[0]["bodies"] == [("subgraph_0", ("layers.0", "layers.1"), 1)]
    # On: the body's calls run one (sunk) subgraph; the second reads the first's pair; the
    # first takes zeros beside the hidden state. Off: as before (one output, no zeros).
    fwd = on[0]["forward"]
    assert fwd["calls"] == 2 and len(fwd["subgraphs"]) == 1, fwd
    assert fwd["pairs"] == [[0, 1]], fwd
    assert any("zeros" in t for t in fwd["first"]), fwd
    assert off[0]["forward"]["pairs"] == [[0]], off[0]["forward"]
    assert not any("zeros" in t for t in off[0]["forward"]["first"])
    assert len(on[0]["sink_notes"]) == 1 and "computed by the next of its 2 calls" in \
        on[0]["sink_notes"][0], on[0]["sink_notes"]
    assert off[0]["sink_notes"] == []
    # Checkpointing inside the blocks (BlockStack): four blocks sunk, the odd one inline.
    # The eval region (no_grad) runs the sunk body too, unpartitioned.
    stack = tuple(f"blocks.{i}" for i in range(4))
    training, evaluating = runs["blocks"]["regions"]
    assert training["bodies"] == [("subgraph_0", stack, 1)]
    assert evaluating["bodies"] == [("subgraph_0", stack, 0)]
    for region in (training, evaluating):
        assert region["forward"]["pairs"] == [[0, 1]] * 3, region["forward"]
        assert len(region["sink_notes"]) == 1, region["sink_notes"]
    err = max_rel_err(runs["blocks"]["eval"], references["blocks"]["eval"])
    assert err <= 1e-5, f"eval outputs: rel err {err:.2e}"


def _inductor_run(rank: int, world: int) -> dict:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = build("llama")
    shardc.shard(model)
    forward = torch.compile(model, backend=shardc.backend(**SINK))
    losses, code = run_and_get_code(train_rank_slice, model, forward, rank, world)
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "code": code,
            "regions": _region_facts(model)}


def _kernel_calls(source: str) -> list[tuple[str, str]]:
    """(kernel, its arguments) of each generated kernel call (C++ on the CPU, Triton on CUDA)."""
    return re.findall(r"^\s+(cpp_fused_\w+|triton_\w+)\((.*)\)\s*$", source, flags=re.M)


def _input_shapes(code: str) -> dict[str, tuple]:
    """Each input's shape from the checks Inductor's code starts with: one
    ``assert_size_stride(name, shape, ...)`` per input, or (torch 2.14) one
    ``assert_size_stride_grouped((names...), (shapes...), ...)`` for several."""
    shapes: dict[str, tuple] = {}
    for line in code.splitlines():
        line = line.strip()
        if not line.startswith("assert_size_stride"):
            continue
        call = ast.parse(line).body[0].value
        if call.func.id == "assert_size_stride":
            shapes[call.args[0].id] = ast.literal_eval(call.args[1])
        elif call.func.id == "assert_size_stride_grouped":
            names = [e.id for e in call.args[0].elts]
            shapes.update(zip(names, ast.literal_eval(call.args[1]), strict=True))
    return shapes


def _named(args: str, names) -> set[str]:
    return {n for n in names if re.search(rf"\b{n}\b", args)}


def _world_1(rank: int, world: int) -> dict:
    """Both default tests' one-rank runs in one spawned process: the Inductor run, then the
    fallback runs (each after a Dynamo reset; the fallback's log handler added after the
    Inductor run)."""
    return {"inductor": _inductor_run(rank, world), "fallback": _fallback_run(rank, world)}


def prestart(items) -> None:
    """Queue the world-1 group and the auto option's budget group where selected
    (tests/conftest.py, dist_utils.prestart): in the whole suite they run in the background
    while the tests before this module run."""
    names = {item.originalname for item in items}
    if any("world_1" in item.fixturenames for item in items):
        prestart_run("test_sink_residual[world_1]", (_world_1, 1))
    if "test_auto_compiles_again_unsunk_where_the_budget_recomputes_a_sunk_block" in names:
        prestart_run("test_sink_residual[auto]", (_auto_budget_runs, 2))


@pytest.fixture(scope="module")
def world_1() -> dict:
    return run_prestarted("test_sink_residual[world_1]", _world_1, 1)[0]


# World 2 (real collectives, uneven shards under Inductor): about twice world 1's time.
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_sunk_bodies_under_inductor_fuse_the_add_into_the_next_norm(world, references,
                                                                     request):
    run = (request.getfixturevalue("world_1")["inductor"] if world == 1
           else run_ranks(_inductor_run, world)[0])
    assert_parity(run, references["llama"], tol=1e-5)
    region = run["regions"][0]
    assert region["bodies"] == [("subgraph_0", ("layers.0", "layers.1"), 1)]
    assert region["forward"]["pairs"] == [[0, 1]]
    # The first call (hidden state and zeros) stands in for the second: one call traced.
    assert region["stand_ins"] == 1, region
    code = next(c for c in run["code"] if "def partitioned_fw_subgraph" in c)
    # The body (one function, called per block): its first kernel reads both halves of the
    # pair (two inputs of the hidden state's shape) and computes the norm's mean: the add
    # fused into the norm. (Without the option it reads one: the add ends the body.)
    body = code.split("def partitioned_fw_subgraph", 1)[1].split("\ndef ", 1)[0]
    shapes = _input_shapes(body)
    # The hidden state's shape: the 3-D one most inputs have (the pair's two halves; the first
    # input is the packed blocks' gathered buffer).
    three_d = [s for s in shapes.values() if len(s) == 3]
    hidden_shape = max(set(three_d), key=three_d.count)
    hidden = [n for n, s in shapes.items() if s == hidden_shape]
    kernel, args = _kernel_calls(body)[0]
    assert "mean" in kernel and len(_named(args, hidden)) == 2, (kernel, args, hidden)
    if world > 1:
        # The final norm's weight is waited for between the last call and the norm, which
        # keeps the region's one final add (once per step, not per block) a kernel of its own.
        return
    # The region's forward adds the last call's pair inside the final norm's kernel.
    outer = code.split("def call(", 1)[1]
    last = re.findall(r"(\w+) = partitioned_fw_subgraph_\w+\(", outer)[-1]
    pair = set(re.findall(rf"(\w+) = {last}\[[01]\]", outer))
    assert len(pair) == 2, outer
    for new, old in re.findall(r"(\w+) = (\w+); del \2  # reuse", outer):
        if old in pair:
            pair.add(new)  # a buffer reused in place for the sum
    norms = [(k, _named(a, pair)) for k, a in _kernel_calls(outer) if "mean" in k]
    assert any(len(read) == 2 for _, read in norms), norms


def _budget_run(rank: int, world: int) -> dict:
    """The parity Llama under Inductor with sunk bodies and a peak budget a byte below the
    fixed policy's predicted peak (recompute the only lever), as
    tests/test_recompute_inductor.py runs it without the option."""
    import torch.distributed as dist

    options = dict(comm_pool=False, prefetch=False, **SINK)
    fixed = sharded_run(rank, world, "llama", "inductor", **options)
    peak = torch.tensor([int(fixed["plans"][0].predicted.peak_bytes)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    torch._dynamo.reset()
    run = sharded_run(rank, world, "llama", "inductor", peak_memory_budget_bytes=int(peak) - 1,
                      peak_memory_margin=0.0, activation_offload="never",
                      optimizer_offload="never", **options)
    plan = run["plans"][0]
    return {"losses": run["losses"], "params": run["params"],
            "recomputed": [b.block for b in plan.budget.blocks if b.recomputed],
            "sink_notes": [n for n in plan.notes if n.startswith("sink_block_residual")]}


@pytest.mark.slow
def test_planner_recomputes_sunk_bodies_under_inductor(inductor_reference):
    """The recomputed first block takes zeros made again in the backward: with AOTAutograd's
    donated buffers on, Inductor reused a body's gradient buffer for them while the body's
    backward result (written into that buffer) was still to be read (backend
    ``_no_donated_buffers``)."""
    run = run_ranks(_budget_run, 1)[0]
    assert run["recomputed"], run["recomputed"]
    assert len(run["sink_notes"]) == 1 and "computed by the next" in run["sink_notes"][0]
    assert_parity(run, inductor_reference, tol=1e-5)


def _auto_budget_runs(rank: int, world: int) -> dict:
    """The parity Llama (FX) with the default ``sink_block_residual="auto"`` and a peak budget
    a byte below the fixed policy's predicted peak, so the planner recomputes; and the same
    with the option off."""
    import torch.distributed as dist

    options = dict(comm_pool=False, prefetch=False)
    fixed = sharded_run(rank, world, "llama", "fx", sink_block_residual=False, **options)
    peak = torch.tensor([int(fixed["plans"][0].predicted.peak_bytes)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    budget = dict(peak_memory_budget_bytes=int(peak) - 1, peak_memory_margin=0.0,
                  activation_offload="never", optimizer_offload="never")
    out = {}
    for name, sink in (("auto", "auto"), ("off", False), ("forced", True)):
        torch._dynamo.reset()
        run = sharded_run(rank, world, "llama", "fx", keep_model=True,
                          sink_block_residual=sink, **options, **budget)
        plan = run["plans"][0]
        out[name] = {"losses": run["losses"], "params": run["params"],
                     "recomputed": [b.block for b in plan.budget.blocks if b.recomputed],
                     "regions": _region_facts(run["model"]),
                     "plan": json.loads(plan.to_json())}
    return out


def test_auto_compiles_again_unsunk_where_the_budget_recomputes_a_sunk_block(references):
    """Where the peak budget's planner recomputes a sunk block, its checkpoint would be the
    pair (both addends): with the default ``"auto"`` the region is compiled again with the
    residual adds where they were traced, noted in the plan, and its plan is the one compiled
    without the option; ``True`` keeps the sunk form. Two ranks (uneven shards), at parity."""
    runs = run_prestarted("test_sink_residual[auto]", _auto_budget_runs, 2)[0]
    auto, off, forced = runs["auto"], runs["off"], runs["forced"]
    for name, run in runs.items():
        assert run["recomputed"], (name, run["recomputed"])
        assert_parity(run, references["llama"], tol=1e-5)
    # The forward as compiled without the option (no zeros for the first call); True's sunk.
    assert auto["regions"][0]["forward"] == off["regions"][0]["forward"]
    assert not any("zeros" in t for t in auto["regions"][0]["forward"]["first"])
    assert any("zeros" in t for t in forced["regions"][0]["forward"]["first"]), forced["regions"]
    notes = auto["regions"][0]["sink_notes"]
    assert len(notes) == 1 and "not sunk in region" in notes[0] and "recomputes layers." in \
        notes[0], notes
    # The same plan as without the option, but its options and notes (and the region number:
    # the second attempt is announced anew).
    a, b = auto["plan"], off["plan"]
    for plan in (a, b):
        plan.pop("options"), plan.pop("notes")
    assert auto["regions"][0]["hash"] == off["regions"][0]["hash"]
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert torch.equal(auto["losses"], off["losses"])


class AccumulatingStack(nn.Module):
    """Residual blocks whose every output is also summed by the model (read by more than the
    next block): the pattern does not match."""

    def __init__(self, dim: int = 13, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim)) for _ in range(depth))
        self.head = nn.Linear(dim, 37, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        total = torch.zeros_like(h)
        for block in self.blocks:
            h = h + block(h)  # the add is outside the blocks' bodies here
            total = total + h
        return self.head(total)


class ResidualMlp(nn.Module):
    def __init__(self, dim: int = 13) -> None:
        super().__init__()
        self.norm, self.up = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(self.norm(x))


class TappedStack(nn.Module):
    """Residual blocks (each ending in its add) whose outputs the model also reads."""

    def __init__(self, dim: int = 13, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, dim)
        self.blocks = nn.ModuleList(ResidualMlp(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 37, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        taps = []
        for block in self.blocks:
            h = block(h)
            taps.append(h)
        return self.head(h + taps[0])


def _fallback_run(rank: int, world: int) -> dict:
    from parity import batches

    from shardc.models.llama import llama_loss

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("shardc")
    logger.addHandler(Collect())
    logger.setLevel(logging.INFO)
    out = {}
    tokens, targets = batches(2)
    for name, cls in (("accumulating", AccumulatingStack), ("tapped", TappedStack)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, ref = cls(), cls()
        ref.load_state_dict(model.state_dict())
        shardc.shard(model)
        forward = torch.compile(model, backend=shardc.backend(inductor=False, **SINK))
        losses = []
        for step in range(2):  # the second step must not log the fallback again
            loss = llama_loss(forward(tokens[step]), targets[step])
            loss.backward()
            expected = llama_loss(ref(tokens[step]), targets[step])
            expected.backward()
            losses.append((loss.item(), expected.item()))
        out[name] = {"losses": losses, "regions": _region_facts(model)}
    out["lines"] = [line for line in lines if "sink_block_residual" in line]
    return out


def test_non_matching_blocks_keep_their_calls_with_the_reason_logged_once(world_1):
    run = world_1["fallback"]
    for name in ("accumulating", "tapped"):
        for got, expected in run[name]["losses"]:
            assert got == pytest.approx(expected, rel=1e-6), (name, run[name]["losses"])
    # Blocks without their own residual add: the body's output is no add.
    acc = run["accumulating"]["regions"][0]
    assert acc["forward"]["pairs"] == [[], []], acc["forward"]  # the adds are outside
    assert not any("zeros" in t for t in acc["forward"]["first"]), acc["forward"]
    assert len(acc["sink_notes"]) == 1 and "not a residual add" in acc["sink_notes"][0]
    # Outputs read beyond the next block: left as they were.
    tapped = run["tapped"]["regions"][0]
    assert tapped["forward"]["pairs"] == [[0], [0]], tapped["forward"]
    assert not any("zeros" in t for t in tapped["forward"]["first"]), tapped["forward"]
    assert len(tapped["sink_notes"]) == 1 and "read by more than the next call" in \
        tapped["sink_notes"][0], tapped["sink_notes"]
    # Each reason in the log once, though each model compiled once and stepped twice.
    assert len(run["lines"]) == 2, run["lines"]
    assert "keeps its residual add" in run["lines"][0]


def test_the_option_is_auto_by_default_and_named_by_the_benchmark_modes():
    """On by default ("auto"), but not where ``activation_offload`` names checkpoints (a sunk
    block recomputed would save both addends); a bad value is refused by name."""
    assert shardc.ShardcOptions().sink_block_residual == "auto"
    assert shardc.ShardcOptions().sinks_residuals()
    assert not shardc.ShardcOptions(activation_offload=("checkpoint:*",)).sinks_residuals()
    assert shardc.ShardcOptions(activation_offload=("layers.0",)).sinks_residuals()
    assert shardc.ShardcOptions(sink_block_residual=True,
                                activation_offload=("checkpoint:*",)).sinks_residuals()
    assert not shardc.ShardcOptions(sink_block_residual=False).sinks_residuals()
    assert shardc.ShardcOptions(sink_block_residual=True).as_dict()["sink_block_residual"]
    with pytest.raises(ValueError, match="sink_block_residual must be True, False or 'auto'"):
        shardc.ShardcOptions(sink_block_residual="yes")
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parent.parent / "benchmarks")
    sys.path.insert(0, bench)
    try:
        from train.modes import EXTRA_MODES
    finally:
        sys.path.remove(bench)
    assert "shardc-fast-budget-sink" in EXTRA_MODES and "shardc-nosink" in EXTRA_MODES
    source = (Path(bench) / "step_overhead.py").read_text()
    assert '"shardc-fast-budget-sink"' in source
