"""shardc's compiled regions under CUDA graphs (``mode="reduce-overhead"``), one H100, world 1.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_cudagraphs_gpu.py``.

A small Llama in fp32, sharded over a one-rank NCCL group and compiled through shardc with
``mode="reduce-overhead"`` (Inductor's CUDA graph trees), trains like the same unsharded model
compiled by Inductor without CUDA graphs (same data, AdamW; torch's DTensor step and
``shardc.optim.local_shard_step``, the latter also with ``plain_inputs=True``), and the regions
really were recorded: shardc added no fallback note, Inductor counted no skipped graph, and the
CUDA graph tree manager holds recorded functions. Where capture cannot work (dynamic shapes)
shardc compiles the region without CUDA graphs, says so in the plan, and still trains at parity.
See docs/overhead.md.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees
from torch.nn.attention import SDPBackend, sdpa_kernel

import shardc
from shardc.models.llama import LlamaConfig, Transformer, llama_loss

pytestmark = pytest.mark.gpu

CFG = LlamaConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, max_seq_len=64)
STEPS, BATCH, SEQ, LR = 4, 4, 32, 1e-3
TOL = 1e-4  # relative 2-norm; fp32, Inductor's kernels on both sides


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _data(seq: int = SEQ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, CFG.vocab_size, (BATCH, seq + 1), generator=g).cuda()
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _model() -> Transformer:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(CFG)
    model.init_weights(buffer_device=torch.device("cuda"))
    return model


def _train(model, forward, data, local_step=False) -> tuple[torch.Tensor, dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if local_step:
        shardc.optim.local_shard_step(opt)
    losses = []
    for tokens, targets in data:
        torch.compiler.cudagraph_mark_step_begin()
        loss = llama_loss(forward(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in model.named_parameters()}
    return torch.stack(losses), params


def _reference(data) -> tuple[torch.Tensor, dict]:
    torch._dynamo.reset()
    model = _model()
    return _train(model, torch.compile(model), data)


def _assert_parity(got, ref, where: str) -> None:
    assert _rel_err(got[0], ref[0]) <= TOL, (where, got[0], ref[0])
    for name, value in ref[1].items():
        assert _rel_err(got[1][name], value) <= TOL, (where, name)


@pytest.mark.parametrize("local_step, plain", [(False, False), (True, False), (True, True)])
def test_reduce_overhead_records_and_trains_at_parity(nccl, local_step, plain):
    data = _data()
    ref = _reference(data)
    torch._dynamo.reset()
    skips = counters["inductor"]["cudagraph_skips"]
    model = shardc.shard(_model(), plain_inputs=plain)
    compiled = torch.compile(model, backend="shardc", mode="reduce-overhead")
    got = _train(model, compiled, data, local_step)
    plans = shardc.explain_all(compiled)
    assert plans, "shardc planned no region"
    assert not [n for p in plans for n in p.notes if "CUDA graphs" in n], [p.notes for p in plans]
    assert counters["inductor"]["cudagraph_skips"] == skips, "Inductor skipped a graph"
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(),
                                          create_if_none_exists=False)
    assert manager is not None and len(manager.ids_to_funcs) > 0, "nothing was recorded"
    _assert_parity(got, ref, f"local_step={local_step}, plain_inputs={plain}")


def test_reduce_overhead_with_dynamic_shapes_falls_back_loudly(nccl, caplog):
    data = _data()
    ref = _reference(data)
    torch._dynamo.reset()
    model = shardc.shard(_model())
    compiled = torch.compile(model, backend="shardc", mode="reduce-overhead", dynamic=True)
    with caplog.at_level("WARNING", logger="shardc"):
        got = _train(model, compiled, data)
    notes = [n for p in shardc.explain_all(compiled) for n in p.notes]
    assert any("dynamic shapes" in n and "without them" in n for n in notes), notes
    assert "dynamic shapes" in caplog.text
    _assert_parity(got, ref, "dynamic")


def test_one_rank_casts_record_and_train_like_casts_per_parameter(nccl):
    """bf16 compute: a one-rank group's casts are one ``shardc::cast_into`` per bucket by
    default (``one_op_local_casts``; the two blocks are one body). Under CUDA graphs the regions
    are recorded (no skipped graph, no fallback note) and train to the same bits as with a cast
    per parameter. The two runs differed in the last bits in one of two runs on an H200 (s48):
    the cuDNN attention's backward is not deterministic (torch warns so). Both therefore run
    SDPA's math kernel, with deterministic algorithms for the rest (the embedding's backward)."""
    data = _data()
    runs = {}
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            _train_both_cast_kinds(data, runs)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert torch.equal(runs[True][0], runs[False][0])
    assert all(torch.equal(runs[True][1][n], p) for n, p in runs[False][1].items())


def _train_both_cast_kinds(data: list, runs: dict) -> None:
    for one_op in (True, False):
        torch._dynamo.reset()
        skips = counters["inductor"]["cudagraph_skips"]
        # Per-parameter reads: a packed block (the default) casts its buffer as one tensor,
        # so the per-parameter twin would have nothing to compare.
        model = shardc.shard(_model(), mp_policy=shardc.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32), pack_blocks=False)
        compiled = torch.compile(model, backend=shardc.backend(one_op_local_casts=one_op),
                                 mode="reduce-overhead")
        runs[one_op] = _train(model, compiled, data)
        assert counters["inductor"]["cudagraph_skips"] == skips, "Inductor skipped a graph"
        plans = shardc.explain_all(compiled)
        assert plans and not [n for p in plans for n in p.notes if "CUDA graphs" in n]
        (region,) = shardc.shard_state(model).regions
        ops = [str(n.target) for g in (region.forward, region.backward) for n in g.graph.nodes]
        assert ops.count("shardc.cast_into.default") == (6 if one_op else 0), one_op
