"""Peak-memory prediction from graph liveness, and the communication pool's offsets."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from shardc.memory.peak import liveness_peak
from shardc.memory.pool import comm_buffers
from shardc.tools.cli import parse_model_spec, plan_model
from shardc.tools.planner import PlanSetup


def _graph(fn, *args) -> fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*args)


def test_liveness_frees_after_last_use_and_views_share_storage():
    def f(x):  # x: 1000 floats = 4000 B
        a = x * 2          # 4000 B, dies after b
        b = a.view(10, 100) + 1   # the view shares a's storage; b is 4000 B
        c = b.sum()        # 4 B
        return c

    gm = _graph(f, torch.randn(1000))
    peak, timeline = liveness_peak(gm, skip=set())
    # x dies after a = x * 2; a (through its view) lives until b exists: never three at once.
    assert peak == 8000
    assert timeline[-1] == 4, "only the output is alive at the end"

    def g(x):
        return x * 2, x.sum()

    gm = _graph(g, torch.randn(1000))
    assert liveness_peak(gm, skip=set())[0] == 8004
    skip = set(gm.graph.find_nodes(op="placeholder"))
    assert liveness_peak(gm, skip=skip)[0] == 4004, "skipped placeholders count nothing"


def test_inductor_inlines_loops_into_their_readers():
    def f(logits, target):  # 64 x 100 fp32 = 25600 B, 64 int64 = 512 B
        shifted = logits - logits.amax(1, keepdim=True)  # amax: 64 x 1 fp32 = 256 B
        return shifted.gather(1, target[:, None]).sum()  # 4 B

    gm = _graph(f, torch.randn(64, 100), torch.zeros(64, dtype=torch.long))
    # Inductor computes the subtraction inside the gather and the gather inside the sum: no
    # 25600 B temporary; the inputs are read by the sum's kernel, so they live until it runs.
    assert liveness_peak(gm, skip=set(), fusion=True)[0] == 25600 + 512 + 256 + 4
    assert liveness_peak(gm, skip=set())[0] > 2 * 25600, "without fusion it is materialized"


def test_inductor_defers_a_copy_to_the_matmul_that_reads_it():
    def f(w, a):  # 64 x 64 fp32 each: 16384 B per value
        w_copy = w.clone()  # like an all-gathered parameter's copy out of the gathered buffer
        b = a * 2
        c = torch.mm(b, b)
        return torch.mm(c, w_copy)

    gm = _graph(f, torch.randn(64, 64), torch.randn(64, 64))
    unit = 64 * 64 * 4
    # The copy is made right before its matmul, so w lives until then: at the last matmul w,
    # the copy, c and the result are alive (and at the first one w, a, b and c).
    peak, timeline = liveness_peak(gm, skip=set(), fusion=True)
    assert peak == 4 * unit
    last_mm = list(gm.graph.nodes).index(
        gm.graph.find_nodes(op="call_function", target=torch.ops.aten.mm.default)[-1])
    assert timeline[last_mm] == 4 * unit, "w is still alive at the last matmul"
    assert liveness_peak(gm, skip=set())[0] == 3 * unit, "FX order: the copy frees w early"


def test_inductor_keeps_a_dead_buffer_for_the_next_one_of_its_size():
    def f(x, xx):  # x: 64 x 64 fp32 = 16384 B; xx: 128 x 64 = 32768 B
        t1 = torch.mm(x, x)
        s = t1.sum()  # t1's last use
        y = torch.mm(xx, x)  # 32768 B, born while t1 is dead
        z = y.sum()
        t2 = torch.mm(x, x)  # same dtype and size as t1: Inductor's code reuses t1's buffer
        return s, z, t2

    gm = _graph(f, torch.randn(64, 64), torch.randn(128, 64))
    # t1 is not freed at its last use but kept for t2, so it is alive next to x, xx and y.
    assert liveness_peak(gm, skip=set(), fusion=True)[0] == 16384 + 32768 + 16384 + 32768 + 4
    assert liveness_peak(gm, skip=set())[0] == 16384 + 32768 + 32768 + 4


def _overlaps(a, b) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_plan_pool_offsets_never_overlap_live_buffers():
    # Two layers: 22 buffers at world 4, 47 pairs of them alive together and 38 pairs sharing
    # bytes of the pool at different times (three layers: seconds more of tracing, no more cases).
    plan, _ = plan_model(parse_model_spec("llama-tiny:n_layers=2"), 4, 2, 32, {})
    buffers = comm_buffers(plan)
    offsets = plan.pool_offsets
    assert len(offsets) == len(buffers)
    placed = [(b.start, b.end, offsets[f"{b.collective}.{b.role}"], b.nbytes) for b in buffers]
    for i, (s1, e1, o1, n1) in enumerate(placed):
        assert o1 % 512 == 0 and o1 + n1 <= plan.predicted["pool_bytes"]
        for s2, e2, o2, n2 in placed[i + 1:]:
            if _overlaps((s1, e1), (s2, e2)):
                assert not _overlaps((o1, o1 + n1), (o2, o2 + n2))
    assert plan.predicted["pool_bytes"] >= plan.predicted["pool_lower_bound_bytes"] > 0
    predicted = plan.predicted
    assert predicted["peak_bytes"] >= predicted["param_bytes"] + predicted["optimizer_state_bytes"]
    assert predicted["optimizer_state_bytes"] == 2 * predicted["param_bytes"]


def test_optimizer_step_peak_counts_gradients_state_and_temporaries():
    """With tiny activations the step's peak is the optimizer's: parameter shards, gradient
    shards, optimizer state and its temporaries (plus the static pool, held across steps)."""
    # Small buckets: the step dominates (at four layers by 3% over the backward's peak; at eight,
    # which traced five blocks for a template, by 11%).
    # Per-parameter reads: with packed blocks (the default) the FX graphs' unpack copies of
    # each gathered block (world 2) raise this tiny model's backward peak above the step's
    # (4.46 against 4.14 MB; under Inductor packed blocks peak lower, 3.30 against 3.50 MB).
    spec = parse_model_spec("llama-tiny:n_layers=4")
    foreach, _ = plan_model(spec, 2, 1, 2, {}, setup=PlanSetup(pack_blocks=False))
    p = foreach.predicted
    assert p["grad_bytes"] == p["param_bytes"] > 0  # every shard trains, in its own dtype
    persistent = p["pool_bytes"]  # FX execution: the pool is on
    assert p["optimizer_step_peak_bytes"] == (
        p["param_bytes"] * (1 + 2 + 1) + p["grad_bytes"] + persistent)
    assert p["peak_bytes"] == p["optimizer_step_peak_bytes"] > p["backward_peak_bytes"]
    # (Without the temporaries, a fused step's: tests/test_optimizer_kind.py.)


def test_fp8_prediction_counts_master_shards_and_saved_quantized_shards():
    """FP8 weights (``nn.Linear`` and ``nn.Embedding``): the planner finds their master shards
    through the quantization (parameter and optimizer-state bytes count every shard, not only the
    high-precision ones), counts the quantized shards that the forward saves for the backward's
    re-gather (1 byte per element) as live memory of the backward, and sizes the float8 gathers'
    buffers at 1 byte per element. Expected bytes are computed from the model's shards and the
    plan's buckets."""
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    import shardc
    from shardc.compile.backend import capture_partitioned
    from shardc.memory.peak import lifetimes, param_placeholders
    from shardc.models.llama import Transformer, llama_loss
    from shardc.ops.gather import GATHER_OP
    from shardc.tools.fake_world import fake_world

    cfg = parse_model_spec("llama-tiny:n_layers=1,vocab_size=37")
    policy = shardc.Float8Policy(modules=(nn.Linear, nn.Embedding))
    try:
        with fake_world(3), capture_partitioned() as graphs:
            # A CPU mesh of the fake world (torch 2.14's DTensor cannot propagate on a meta
            # mesh: its redistribute cost asks the meta device for a device count).
            model = Transformer(cfg)
            shardc.shard(model, DeviceMesh.from_group(torch.distributed.group.WORLD, "cpu"),
                         fp8=policy)
            compiled = torch.compile(model, backend=shardc.backend(
                inductor=False, check_plan_consistency=False))
            tokens = torch.zeros(2, 8, dtype=torch.long)
            llama_loss(compiled(tokens), tokens).backward()
            state = shardc.shard_state(model)
            shards = {n: p.to_local() for n, p in model.named_parameters()}
    finally:
        torch._dynamo.reset()
    fp8 = {n for n, info in state.params.items() if info.fp8 is not None}
    assert "tok_embeddings.weight" in fp8 and "output.weight" in fp8
    shard_bytes = sum(s.numel() * s.element_size() for s in shards.values())

    (fw, bw), = graphs
    found = param_placeholders(fw)
    assert len(found) == len(shards), "every parameter shard, FP8 weights' included"
    assert sum(p.meta["val"].nbytes for p in found) == shard_bytes
    predicted = state.regions[0].plan.predicted
    assert predicted["param_bytes"] == shard_bytes
    assert predicted["optimizer_state_bytes"] == 2 * shard_bytes

    # The backward re-gathers FP8 weights from the quantized shards the forward saved: those
    # placeholders are not parameters; each lives from the backward's start to its gather.
    skipped = param_placeholders(bw)
    quantized = [p for p in bw.graph.find_nodes(op="placeholder")
                 if getattr(p.meta.get("val"), "dtype", None) == torch.float8_e4m3fn]
    assert quantized and not skipped & set(quantized)
    # Only weights the backward reads are re-gathered: not the embedding (its weight gradient
    # needs the indices and the output gradient only).
    plan = state.regions[0].plan
    f8 = [c for c in plan.collectives if c.kind == "all_gather" and c.dtype == "float8_e4m3fn"]
    regathered = {p for c in f8 if c.graph == "backward" for p in c.params}
    assert regathered == fp8 - {"tok_embeddings.weight"}
    assert sum(p.meta["val"].numel() for p in quantized) == sum(
        shards[n].numel() for n in regathered)
    lives = {life.node: life for life in lifetimes(bw, skipped)}
    gathers = [n for n in bw.graph.nodes if n.target is GATHER_OP]
    index = {n: i for i, n in enumerate(bw.graph.nodes)}
    for q in quantized:
        assert lives[q].nbytes == q.meta["val"].numel(), "1 byte per element"
        assert lives[q].last >= min(index[g] for g in gathers if g.args[0] is q)

    # Float8 gathers: send the bucket's flat shard and receive world x that, 1 byte each.
    buffers = {(b.collective, b.role): b.nbytes for b in comm_buffers(plan)}
    f8 = [c for c in plan.collectives if c.kind == "all_gather" and c.dtype == "float8_e4m3fn"]
    for c in f8:
        numel = plan.buckets[c.bucket].layout(c.params)[1]
        assert buffers[c.id, "send"] == numel and buffers[c.id, "recv"] == 3 * numel, c.id


def test_block_bodies_predict_the_peak_of_inline_blocks():
    """A compiled-once block body (an ``invoke_subgraph`` call) runs the ops of an inline block:
    the peak prediction walks them where the body runs them (its temporaries, each output with
    its own lifetime), so it predicts the peak and the memory by category of the same model
    with ``compile_blocks_once=False``. (It once counted the call's whole tuple of outputs, the
    saved weights included, as one value alive to the end of the forward.)"""
    from shared_plans import bodies_and_inline

    plans = bodies_and_inline()  # llama-tiny, two layers, world 1 (also read by test_planner)
    assert plans[True].bodies and not plans[False].bodies
    bodies, inline = (plans[k].predicted for k in (True, False))
    for key in ("forward_peak_bytes", "backward_peak_bytes", "peak_bytes"):
        assert abs(bodies[key] - inline[key]) <= 0.01 * inline[key], key
    at_peak = [plans[k].memory_by_category["peak"] for k in (True, False)]
    assert at_peak[0]["graph"] == at_peak[1]["graph"]
    for category, nbytes in at_peak[1]["bytes"].items():
        assert abs(at_peak[0]["bytes"][category] - nbytes) <= 0.01 * inline["peak_bytes"], category


@pytest.mark.slow  # suite time (s29): bodies' peaks against inline blocks stay in the test above
def test_block_bodies_predict_the_step_time_of_inline_blocks():
    """The time model prices a compiled-once body's call (``invoke_subgraph``) by its body's
    kernels, run where the call runs: the same step as inline blocks (priced as one opaque op,
    a 4-layer body once predicted a sixth of it)."""
    spec = parse_model_spec("llama-tiny:n_layers=4")
    plans = {once: plan_model(spec, 1, 2, 32, {"compile_blocks_once": once}, template=False)[0]
             for once in (True, False)}
    assert plans[True].bodies and not plans[False].bodies
    bodies, inline = (plans[k].predicted.step_time_s for k in (True, False))
    assert abs(bodies - inline) <= 0.02 * inline, (bodies, inline)


def test_inductor_writes_a_pointwise_output_into_its_last_inputs_buffer():
    """Inductor's in-place update (``shardc.memory.inplace``): a generated pointwise kernel
    that is the last reader of a computed input of its dtype, shape and layout writes its output
    into that input's buffer, so the two are never alive together."""
    def f(a):  # a: 64 x 64 fp32 = 16384 B, read to the end
        b = torch.mm(a, a)
        c = b * 2 + 1  # one kernel (the multiplication inlined), b's last reader: written into b
        return c, a.sum()

    gm = _graph(f, torch.randn(64, 64))
    unit = 64 * 64 * 4
    peak, timeline = liveness_peak(gm, skip=set(), fusion=True)
    assert peak == 2 * unit + 4, "a and b, then a and c in b's buffer, then a's sum"
    add = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor)[0]
    assert timeline[list(gm.graph.nodes).index(add)] == 2 * unit
    assert liveness_peak(gm, skip=set())[0] == 3 * unit, "FX execution allocates c apart"

    def g(a):  # b also read as a row vector (broadcast): another index, no in-place update
        b = torch.mm(a, a)
        return b[:1] + b, a.sum()

    assert liveness_peak(_graph(g, torch.randn(64, 64)), skip=set(), fusion=True)[0] == 3 * unit

    def h(a):  # a graph's input (not a backward's saved value) is never overwritten
        return torch.mm(a, a), a * 2

    assert liveness_peak(_graph(h, torch.randn(64, 64)), skip=set(), fusion=True)[0] == 3 * unit


def test_inductor_writes_the_logits_gradient_into_the_saved_logits():
    """The loss in the compiled graph (``F.cross_entropy`` of the bf16 logits cast to fp32):
    Inductor's backward computes the logits' gradient in one kernel that reads the saved logits
    last and writes the gradient into their buffer (``bufN = mm; del mm  # reuse`` in its
    generated code; the saved logits are a donated input), so the backward never holds both. The
    peak prediction follows: the two lifetimes do not overlap and the predicted backward peak
    holds one logits-sized tensor, not two (it held two, 20% over the measured peak of the 1b
    config on an H200; docs/memory_budget.md)."""
    import re

    from torch import nn

    import shardc
    from shardc import _torch
    from shardc.memory.peak import lifetimes
    from shardc.models.llama import llama_loss
    from shardc.passes.body import flattened
    from shardc.tools.fake_world import fake_world

    batch, seq, vocab, dim = 2, 64, 4096, 32  # the logits: 2 x 64 x 4096 bf16 = 1 MiB
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, vocab, bias=False))
    tokens = torch.randint(0, vocab, (batch, seq))
    try:
        with fake_world(1):
            shardc.shard(model, mp_policy=shardc.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
            step = torch.compile(lambda t: llama_loss(model(t), t),
                                 backend=shardc.backend(inductor=True))
            _, codes = _torch.run_and_get_inductor_code(lambda: step(tokens).backward())
            (region,) = shardc.shard_state(model).regions
    finally:
        torch._dynamo.reset()
    backward = flattened(region.backward)[0]
    logits_bytes = batch * seq * vocab * 2
    saved = [p for p in backward.graph.find_nodes(op="placeholder")
             if getattr(p.meta.get("val"), "nbytes", 0) == logits_bytes]
    assert len(saved) == 1, "the bf16 logits are saved for the backward"
    (logits,) = saved
    reuse = re.compile(rf"^\s*(buf\d+) = {logits.name}; del {logits.name}  # reuse$", re.M)
    written = [m.group(1) for code in codes for m in reuse.finditer(code)]
    assert len(written) == 1, "Inductor writes the logits' gradient into the saved logits"

    lives = {life.node: life for life in lifetimes(backward, set(), fusion=True)}
    grads = [life for node, life in lives.items() if node is not logits
             and life.nbytes == logits_bytes and node.meta["val"].dtype == torch.bfloat16]
    assert len(grads) == 1, "the logits' gradient"
    (grad,) = grads
    assert lives[logits].last < grad.born, "one buffer: never both alive"
    p = region.plan.predicted
    activations = p["backward_peak_bytes"] - p["param_bytes"] - p["optimizer_state_bytes"]
    assert logits_bytes <= activations < 2 * logits_bytes


def _swiglu_like(x, w, s1, s2):
    """Two pointwise kernels over one iteration space reading the same buffers (``g`` and
    ``a``): the SwiGLU backward's pair of gradients in small. Each is read by two matmuls
    (realized, not inlined), whose outputs are small."""
    a = torch.mm(x, w)
    g = torch.mm(w, x)
    u = g * torch.sigmoid(a)
    p = torch.mm(u, s1).sum() + torch.mm(s2, u).sum()
    v = g * a  # reads g and a, as u's kernel does: Inductor computes it in that kernel
    q = torch.mm(v, s1).sum() + torch.mm(s2, v).sum()
    return p, q, x.sum() + w.sum()  # x and w alive to the end


def test_inductor_fuses_pointwise_kernels_that_share_inputs_horizontally():
    """Inductor's scheduler fuses two pointwise kernels of one iteration space that read a
    common buffer and do not depend on each other (``shardc.memory.peak._horizontal``): the
    later one's output exists from the earlier kernel on, and their common inputs die there.
    Both outputs and both inputs are then alive together, as at the 1b config's measured peak
    (the SwiGLU backward's kernel writes both gradients while the FFN's hidden activations and
    the output's gradient are alive; docs/memory_budget.md, peak13)."""
    from shardc.memory import peak as memory_peak
    from shardc.memory.peak import lifetimes

    unit = 64 * 64 * 4
    gm = _graph(_swiglu_like, torch.randn(64, 64), torch.randn(64, 64), torch.randn(64, 1),
                torch.randn(1, 64))
    lives = {life.node.name: life for life in lifetimes(gm, set(), fusion=True)}
    nodes = [n.name for n in gm.graph.nodes]
    assert lives["mul_1"].born == lives["mul"].born == nodes.index("mul"), "v runs in u's kernel"
    assert lives["mm"].last < nodes.index("mm_2") and lives["mm_1"].last < nodes.index("mm_2"), \
        "a and g are read last by that kernel"
    peak, timeline = liveness_peak(gm, skip=set(), fusion=True)
    # x, w, s1, s2 (2 x 256 B), a, g, u and v at the fused kernel
    assert peak == timeline[nodes.index("mul")] == 6 * unit + 512
    original = memory_peak._horizontal
    memory_peak._horizontal = lambda *args: {}
    try:  # in the FX order, v is computed after u's first matmul and sum (256 + 4 B) ran
        assert liveness_peak(gm, skip=set(), fusion=True)[0] == 5 * unit + 512 + 256 + 4
    finally:
        memory_peak._horizontal = original


def test_inductor_writes_both_pointwise_outputs_in_one_kernel():
    """The same function compiled by Inductor (CPU): one generated kernel writes u and v (two
    64 x 64 buffers allocated before it), and the matmuls' inputs a and g are freed right after
    it, as the peak model predicts (test above)."""
    import re

    from torch._inductor.utils import run_and_get_code

    args = (torch.randn(64, 64), torch.randn(64, 64), torch.randn(64, 1), torch.randn(1, 64))
    _, (code,) = run_and_get_code(torch.compile(_swiglu_like, backend="inductor"), *args)
    lines = [line.strip() for line in code[code.index("def call"):].splitlines()
             if not line.strip().startswith("#")]
    (kernel,) = [i for i, line in enumerate(lines) if re.match(r"cpp_fused_mul_sigmoid_\d+\(",
                                                               line)]
    assert len(re.findall(r"buf\d+", lines[kernel])) == 4, "reads a and g, writes u and v"
    allocated = [line for line in lines[:kernel] if "empty_strided_cpu((64, 64)" in line]
    assert len(allocated) == 4, "a, g, and the kernel's two outputs"
    assert lines[kernel + 1].startswith("del buf") and lines[kernel + 2].startswith("del buf")


def test_a_block_body_keeps_dead_buffers_for_its_own_allocations_only():
    """Each block-body call runs as a function of its own in Inductor's generated code, with its
    own buffer reuse (``shardc.passes.body.BODY_SCOPE``, ``peak.held_for_reuse``): a temporary
    of a body is not held for a same-sized allocation after the call returns, and a body's
    output passed into another body (the recompute's activations, read by the backward's body)
    is freed where that body last reads it. Without the scopes, the flattened graph's single
    pool held the FFN's hidden activations of a recomputed block until the next block's, through
    the attention's backward: 13% over the measured peak (docs/memory_budget.md, peak13)."""
    from shardc.passes.body import BODY_SCOPE

    unit = 64 * 64 * 4

    def f(x, x2):
        t = torch.mm(x, x)         # in body A: its temporary, or its output read by body B
        u = torch.mm(t, x)         # in body A (or B): t's last reader
        z = torch.mm(u, x2)        # the caller: 64 x 128, not t's size
        y = torch.mm(x, u)         # the caller: t's size, would take t's buffer
        return z, y

    def peak(scope_t: tuple, scope_u: tuple) -> int:
        gm = _graph(f, torch.randn(64, 64), torch.randn(64, 128))
        for node in gm.graph.nodes:
            if node.name in ("mm", "mm_1"):
                node.meta[BODY_SCOPE] = scope_t if node.name == "mm" else scope_u
        return liveness_peak(gm, skip=set(), fusion=True)[0]

    # one pool: t (dead after u) is held until y reuses its buffer, across z: x, x2, u, t, z
    assert peak((), ()) == 7 * unit
    assert peak(("call_a",), ("call_a",)) == 6 * unit, "body A's temporary, freed at its return"
    assert peak(("call_a",), ("call_b",)) == 6 * unit, "body A's output, freed in body B"
