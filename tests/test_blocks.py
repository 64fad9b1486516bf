"""Which children of an ``nn.ModuleList`` share one compiled body (shardc.sharding.blocks), and
that every block that does not is named, with its reason, once in the log. No process group:
the grouping is decided from the unsharded modules, before any parameter is replaced (the parity
runs in tests/test_parity.py, tests/test_real_models.py and tests/test_mesh.py compile them)."""

from __future__ import annotations

import functools
import logging
import operator
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from shardc import _torch
from shardc.sharding.blocks import seal, wrap_repeated_blocks


class Mlp(nn.Module):
    def __init__(self, dim: int = 6, hidden: int = 10, checkpointed: bool = False) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.checkpointed = checkpointed

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return x + checkpoint(self.inner, x, use_reentrant=False)
        return x + self.inner(x)


class GeluMlp(Mlp):
    """Same parameters as :class:`Mlp`, another module type (another forward)."""

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def test_non_identical_blocks_get_their_own_body_or_fall_back_said_once(caplog):
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList([
        Mlp(), Mlp(),                                      # 0, 1: one body
        Mlp(checkpointed=True), Mlp(checkpointed=True),    # 2, 3: checkpointed: their own body
        Mlp(hidden=7),                                     # 4: another shape: inline
        GeluMlp(),                                         # 5: another module type: inline
        Mlp(checkpointed=True, hidden=5),                  # 6: checkpointed, other shape
    ])
    hooked = Mlp()
    hooked.up.register_forward_hook(lambda *_: None)
    model.layers.append(hooked)                            # 7: a module hook: inline
    with caplog.at_level(logging.INFO, logger="shardc"):
        bodies = wrap_repeated_blocks(model, {}, shared=set(), special=set())
    assert [g.members for g in bodies.groups] == [("layers.0", "layers.1"),
                                                  ("layers.2", "layers.3")]
    assert [g.index for g in bodies.groups] == [0, 1]
    reasons = {f.module: f.reason for f in bodies.fallbacks}
    assert sorted(reasons) == ["layers.4", "layers.5", "layers.6", "layers.7"], reasons
    for module in ("layers.4", "layers.5", "layers.6"):
        assert "no identical sibling" in reasons[module], reasons[module]
    assert "module hooks" in reasons["layers.7"] and "'up'" in reasons["layers.7"]
    # Each decision in the log exactly once: one line per group, one per fallback.
    lines = [r.getMessage() for r in caplog.records if r.name == "shardc"]
    for module in reasons:
        assert sum(f"block {module} compiles inline" in line for line in lines) == 1, lines
    assert sum("share one compiled body" in line for line in lines) == 2, lines
    # The grouped blocks' classes were swapped (their forward calls the body when compiling);
    # the others keep their own classes.
    assert all(getattr(type(model.layers[i]), "_shardc_block", False) for i in range(4))
    assert not any(getattr(type(model.layers[i]), "_shardc_block", False) for i in range(4, 8))
    # Outside compilation a wrapped block runs its own forward.
    x = torch.randn(3, 6)
    assert torch.equal(model.layers[0](x), Mlp.forward(model.layers[0], x))


def test_parameters_gathered_specially_or_shared_fall_back_with_the_parameter_named(caplog):
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList([Mlp() for _ in range(3)])
    model.layers[2].down.weight = model.layers[1].down.weight  # shared between two blocks
    special = {id(model.layers[0].up.weight)}  # as shard() marks FP8 / tensor-parallel ones
    shared = {id(model.layers[1].down.weight)}
    with caplog.at_level(logging.INFO, logger="shardc"):
        bodies = wrap_repeated_blocks(model, {}, shared=shared, special=special)
    assert bodies.groups == []
    reasons = {f.module: f.reason for f in bodies.fallbacks}
    assert "'up.weight'" in reasons["layers.0"] and "FP8 or tensor-parallel" in reasons["layers.0"]
    assert "'down.weight'" in reasons["layers.1"] and "shared" in reasons["layers.1"]
    assert "'down.weight'" in reasons["layers.2"] and "shared" in reasons["layers.2"]
    lines = [r.getMessage() for r in caplog.records if r.name == "shardc"]
    assert len([line for line in lines if "compiles inline" in line]) == 3, lines


def test_hf_decoder_layers_differ_in_layer_idx_only_and_form_one_group():
    """transformers' decoder layers keep their index (``self_attn.layer_idx``, the KV cache's
    slot): a scalar whose value differs per layer, the only difference, so the layers form one
    group whose calls share the body where the prober sees the index unread (trained at parity
    in tests/test_real_models.py's hf_packed)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=37, hidden_size=16, intermediate_size=24,
                                      num_hidden_layers=3, num_attention_heads=2,
                                      num_key_value_heads=1)
    model = transformers.Qwen2ForCausalLM(config)
    bodies = wrap_repeated_blocks(model, {}, shared=set(), special=set())
    assert [g.members for g in bodies.groups] == [tuple(f"model.layers.{i}" for i in range(3))]
    assert bodies.groups[0].varying == {("self_attn", "layer_idx")}
    assert bodies.fallbacks == []


class ActMlp(Mlp):
    """An MLP whose activation is a callable each instance makes for itself: a partial of one
    function (transformers' ``GELUTanh``) or a method bound to the block itself."""

    def __init__(self, approximate: str = "tanh", bound: bool = False) -> None:
        super().__init__()
        self.act = self._act if bound else functools.partial(F.gelu, approximate=approximate)

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


@pytest.mark.parametrize("bound", [False, True], ids=["partial", "own_method"])
def test_blocks_whose_callables_are_equal_form_one_group(bound):
    """A partial of the same function with the same plain arguments, or a method bound to each
    block itself, makes no difference between blocks (before s55 each instance's own callable
    object kept every transformers Gemma3 layer inline); a partial with other arguments does,
    and the blocks train as eager does."""
    model = Stack(lambda: ActMlp(bound=bound), n=3)
    bodies = wrap_repeated_blocks(model, {}, shared=set(), special=set())
    assert [g.members for g in bodies.groups] == [("blocks.0", "blocks.1", "blocks.2")]
    assert bodies.fallbacks == []
    seal(bodies, model)
    x = torch.randn(3, 6, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    torch.testing.assert_close(compiled(x), model(x))
    if not bound:
        mixed = Stack(lambda: ActMlp(), n=3)
        mixed.blocks[2] = ActMlp(approximate="none")
        mixed_bodies = wrap_repeated_blocks(mixed, {}, shared=set(), special=set())
        assert [g.members for g in mixed_bodies.groups] == [("blocks.0", "blocks.1")]
        assert [f.module for f in mixed_bodies.fallbacks] == ["blocks.2"]


def test_hf_gemma3_layers_form_one_group():
    """transformers' Gemma3 decoder layers: each MLP's GELUTanh makes its own
    ``partial(F.gelu, approximate="tanh")``; the layers form one group (trained at parity in
    tests/test_real_models.py's hf_gemma3)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig(vocab_size=37, hidden_size=16, intermediate_size=24,
                                           num_hidden_layers=3, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=8)
    model = transformers.Gemma3ForCausalLM(config)
    bodies = wrap_repeated_blocks(model, {}, shared=set(), special=set())
    assert [g.members for g in bodies.groups] == [tuple(f"model.layers.{i}" for i in range(3))]
    assert bodies.fallbacks == []


def _cached_keys_values(output) -> list:
    """Each layer's cached keys and values of a transformers output (the cache is ``cache``
    since transformers 5.25, ``past_key_values`` before; per layer ``layers[i].keys`` in 5.x,
    ``key_cache[i]`` in 4.x)."""
    cache = getattr(output, "cache", None)
    cache = output.past_key_values if cache is None else cache
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


# The second length (a dynamic-shape recompile: its own region) is slow (suite time, s64).
@pytest.mark.parametrize("lengths", [(9,), pytest.param((9, 7), marks=pytest.mark.slow)])
def test_hf_decoder_with_its_default_cache_shares_one_body_and_fills_the_cache(lengths):
    """transformers' decoder called as users call it (``use_cache`` left on: each layer gets the
    ``DynamicCache``, which the prober cannot describe): the layers call the group's member body
    (a skeleton of each layer, its own ``layer_idx``), one body in the static region and in the
    dynamic one of a second length; the logits and the cache's keys and values equal the eager
    model's (before, every layer compiled inline)."""
    transformers = pytest.importorskip("transformers")
    from dist_utils import one_rank_mesh

    import shardc

    config = transformers.Qwen2Config(vocab_size=37, hidden_size=16, intermediate_size=24,
                                      num_hidden_layers=3, num_attention_heads=2,
                                      num_key_value_heads=1, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    reference = transformers.Qwen2ForCausalLM(config)
    reference.load_state_dict(model.state_dict())
    layers = tuple(f"model.layers.{i}" for i in range(3))
    with one_rank_mesh() as mesh:
        shardc.shard(model, mesh)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=shardc.backend(inductor=False))
        for seq in lengths:  # a second length: a dynamic-shape recompile
            ids = torch.randint(0, 37, (2, seq))
            got, expected = compiled(input_ids=ids), reference(input_ids=ids)
            torch.testing.assert_close(got.logits, expected.logits)
            torch.testing.assert_close(_cached_keys_values(got), _cached_keys_values(expected))
        plans = shardc.explain_all(compiled)
    assert [[tuple(b.blocks) for b in p.bodies] for p in plans] == [[layers]] * len(lengths)
    assert [p.inline_blocks for p in plans] == [[]] * len(lengths)


def test_data_dependent_size_check_is_traced_without_a_graph_break():
    """The check in a block's wrapped forward is answered while Dynamo traces, on every torch
    (torch 2.11's Dynamo breaks the graph on ``has_free_unbacked_symbols``: one break per
    block); it tells a size known only at run time from a static or dynamic one."""
    from shardc import _torch

    check = _torch.data_dependent_size_check()

    def fn(x, n):
        picked = x[x > 0]  # unbacked size
        return torch.tensor([check((picked,), {}), check((x,), {"n": n}), check((), {"x": x})])

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(fn, backend="eager", fullgraph=True, dynamic=True)
        answers = compiled(torch.tensor([1.0, -1.0, 2.0]), 3)
    assert answers.tolist() == [True, False, False]


def test_draws_random_numbers_names_random_ops_only():
    """Which bodies compile inline for drawing random numbers (shardc.passes.body): dropout with
    p > 0 in training, random tensor methods and factories; not dropout with p = 0 or in eval,
    nor deterministic ops whose names merely contain a random op's (``F.normalize``)."""
    import torch.nn.functional as F
    from torch import fx

    from shardc.passes.body import draws_random_numbers

    cases = {
        "dropout": (lambda x: F.dropout(x, 0.1, True), True),
        "dropout_p0": (lambda x: F.dropout(x, 0.0, True), False),
        "dropout_eval": (lambda x: F.dropout(x, 0.1, False), False),
        "bernoulli_": (lambda x: x.clone().bernoulli_(), True),
        "rand_like": (lambda x: x + torch.rand_like(x), True),
        "normalize": (lambda x: F.normalize(x, dim=-1), False),
        "layer_norm": (lambda x: F.layer_norm(x, x.shape[-1:]), False),
    }
    for name, (fn, random) in cases.items():
        assert draws_random_numbers(fx.symbolic_trace(fn)) is random, name


_CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def test_draws_nothing_reads_the_attention_kernels_dropout_p():
    """Which recomputed ops keep a shared body without torch's generator-state wrappers
    (shardc.passes.body_rng.draws_nothing): an attention kernel whose ``dropout_p`` (wherever
    its schema puts it, positional, keyword or defaulted) is the constant 0; not one with
    dropout, a symbolic ``dropout_p``, nor another random op."""
    from shardc.passes.body_rng import draws_nothing

    aten = torch.ops.aten
    cpu, efficient = _CPU_ATTENTION, aten._scaled_dot_product_efficient_attention.default
    q = torch.empty(0)
    symbolic = fx.Graph().placeholder("dropout_p")
    cases = {
        "cpu, positional 0": (cpu, (q, q, q, 0.0, True), {}, True),
        "cpu, defaulted": (cpu, (q, q, q), {}, True),
        "cpu, keyword 0": (cpu, (q, q, q), {"dropout_p": 0.0}, True),
        "cpu, dropout": (cpu, (q, q, q, 0.1), {}, False),
        "cpu, symbolic": (cpu, (q, q, q, symbolic), {}, False),
        "efficient, 0": (efficient, (q, q, q, None, True, 0.0, True), {}, True),
        "efficient, dropout": (efficient, (q, q, q, None, True, 0.5), {}, False),
        "native_dropout, p 0": (aten.native_dropout.default, (q, 0.0, True), {}, False),
        "rand_like": (aten.rand_like.default, (q,), {}, False),
    }
    for name, (op, args, kwargs, drawless) in cases.items():
        assert draws_nothing(op, args, kwargs) is drawless, name


def _graphsafe_graph(prefix: str, dropouts: tuple[float, ...]) -> fx.GraphModule:
    """A graph in CUDA's graph-safe form (torch's ``apply_graphsafe_rng_functionalization``):
    an attention call for each of ``dropouts``, each through ``graphsafe_run_with_rng_state``
    with a generator placeholder of its own, named as torch names them."""
    from shardc import _torch

    _, _, graphsafe = _torch.rng_state_wrappers()
    graph = fx.Graph()
    q = graph.placeholder("q")
    states = [graph.placeholder(f"{prefix}_rng_state_{i}") for i in range(len(dropouts))]
    outs = [graph.call_function(operator.getitem, (graph.call_function(
        graphsafe, (_CPU_ATTENTION, q, q, q, p, True), {"rng_state": state}), 0))
        for p, state in zip(dropouts, states)]
    graph.output(tuple(outs))
    return fx.GraphModule(nn.Module(), graph)


def test_graphsafe_wrappers_of_drawless_attention_are_undone():
    """CUDA's graph-safe form, built by hand (no GPU here): the wrapper of attention without
    dropout becomes a plain call, its generator placeholder gone, in the forward and the
    backward alike; the one with dropout keeps both. The unwrapped graph computes attention."""
    from shardc import _torch
    from shardc.passes.body_rng import unwrap_drawless_ops

    _, _, graphsafe = _torch.rng_state_wrappers()
    fw, bw = _graphsafe_graph("fwd", (0.0, 0.5)), _graphsafe_graph("bwd", (0.0, 0.5))
    assert unwrap_drawless_ops(fw, bw) == 2
    for gm, prefix in ((fw, "fwd"), (bw, "bwd")):
        assert [p.name for p in gm.graph.find_nodes(op="placeholder")] == [
            "q", f"{prefix}_rng_state_1"]
        calls = [n for n in gm.graph.nodes if n.op == "call_function"
                 and n.target in (graphsafe, _CPU_ATTENTION)]
        q = calls[0].args[0]
        assert [(n.target, n.args, n.kwargs) for n in calls] == [
            (_CPU_ATTENTION, (q, q, q, 0.0, True), {}),
            (graphsafe, (_CPU_ATTENTION, q, q, q, 0.5, True),
             {"rng_state": gm.graph.find_nodes(op="placeholder")[1]})]
    # Torch leaves the graph-safe wrappers without a value: the plain call gets one from its
    # operands' fake values.
    from torch._subclasses.fake_tensor import FakeTensorMode

    fw, bw = _graphsafe_graph("fwd", (0.0,)), _graphsafe_graph("bwd", (0.0,))
    q = torch.randn(1, 2, 4, 8)
    fake = FakeTensorMode()
    for gm in (fw, bw):
        gm.graph.find_nodes(op="placeholder")[0].meta["val"] = fake.from_tensor(q)
    assert unwrap_drawless_ops(fw, bw) == 2
    for gm in (fw, bw):
        call = next(n for n in gm.graph.nodes if n.target is _CPU_ATTENTION)
        assert call.meta["val"][0].shape == q.shape
    torch.testing.assert_close(fw(q)[0], F.scaled_dot_product_attention(q, q, q, is_causal=True))


def test_flattened_inlines_every_body_call_nested_ones_too():
    """``flattened`` (what the peak prediction and the cost model walk) replaces every body call,
    a body's call of another body included, by the body's ops, and computes what the graph
    with the calls computes."""
    from shardc.passes.body import body_calls, flattened

    @torch.compiler.nested_compile_region
    def inner(x, w):
        return torch.tanh(x @ w)

    @torch.compiler.nested_compile_region
    def outer(x, w):
        return inner(x, w) + inner(x * 2, w)

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(x, w):
        for _ in range(5):
            x = outer(x, w)
        return x

    x, w = torch.randn(3, 4), torch.randn(4, 4)
    torch._dynamo.reset()
    expected = torch.compile(fn, backend=capture, fullgraph=True)(x, w)
    (gm,) = graphs
    assert len(list(body_calls(gm))) == 5
    flat, mapping = flattened(gm)
    assert next(body_calls(flat), None) is None
    assert set(mapping) == {n for n in gm.graph.nodes if n.op != "output"}
    assert sum(n.target is torch.tanh for n in flat.graph.nodes) == 10
    torch.testing.assert_close(flat(x, w)[0], expected)


def test_flattened_keeps_a_body_constant_as_a_buffer_without_warnings():
    """A body that reads a tensor constant (AOTAutograd's ``_tensor_constant0``, as
    transformers' cache initialization gives a decoder layer's body): ``flattened`` copies it
    into the flat graph's module as a buffer, so torch.fx finds what the ``get_attr`` reads
    (before, a plain attribute: a UserWarning at every inlined call)."""
    import warnings

    from torch import fx

    from shardc.passes.body import INVOKE_SUBGRAPH, flattened

    body_graph = fx.Graph()
    x = body_graph.placeholder("x")
    body_graph.output((body_graph.call_function(
        torch.add, (x, body_graph.get_attr("_tensor_constant0"))),))
    body = fx.GraphModule({"_tensor_constant0": torch.tensor([1.0, 2.0])}, body_graph)
    graph = fx.Graph()
    x = graph.placeholder("x")
    for _ in range(2):
        call = graph.call_function(INVOKE_SUBGRAPH, (graph.get_attr("subgraph_0"),
                                                     "subgraph_0", x))
        x = graph.call_function(operator.getitem, (call, 0))
    graph.output((x,))
    gm = fx.GraphModule({"subgraph_0": body}, graph)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flat, _ = flattened(gm)
    buffers = dict(flat.named_buffers(remove_duplicate=False))
    assert sum(n.op == "get_attr" and n.target in buffers for n in flat.graph.nodes) == 2
    torch.testing.assert_close(flat(torch.zeros(2))[0], torch.tensor([2.0, 4.0]))


# Dynamo's traces of block bodies, counted the same way on every torch release: a counted
# block's forward calls ``_note_trace`` while Dynamo traces it (an assume_constant_result
# function runs at trace time; a stamped-out call of a keyed body runs nothing), never in eager
# runs nor in the keyed bodies' meta-device probe.
_TRACES: list[int] = []


@torch.compiler.assume_constant_result
def _note_trace() -> int:
    _TRACES.append(1)
    return 0


class CountedMlp(Mlp):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and x.device.type != "meta":
            _note_trace()
        return super().forward(x)


class TupleMlp(CountedMlp):
    """Returns a tuple holding None: no keyed body (torch requires tensor outputs there)."""

    def forward(self, x: torch.Tensor):
        return super().forward(x), None


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module], n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            out = block(x)
            x = out[0] if isinstance(out, tuple) else out
        return x


def _body_traces(model: nn.Module, *inputs: torch.Tensor, dynamic: bool = False) -> int:
    """Compile ``model`` (eager backend), run it on each input, check it against eager, and
    return how many times Dynamo traced a block's forward."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", dynamic=dynamic)
    traces = 0
    for x in inputs:
        _TRACES.clear()
        out = compiled(x)
        traces += len(_TRACES)
        torch.testing.assert_close(out, model(x))
    return traces


def test_bodies_are_traced_once_per_distinct_input_where_torch_can_key_them():
    """Dynamo's traces of the block forward, on whichever torch runs. With torch's
    reuse_hash_fn (2.13+), identical blocks' body calls whose arguments have static sizes are
    traced once and stamped out (the key: shapes, strides, dtypes, devices, requires_grad, other
    arguments, grad mode, autocast), symbolic sizes by their expressions (s55); a block
    returning something other than tensors keeps the guard-based body, traced at every call.
    torch 2.11 and 2.12
    have no reuse_hash_fn and trace every call (their Dynamo has no reuse of a
    nested_compile_region's trace at all, only the deduplication of identical subgraphs)."""
    from shardc import _torch

    x = torch.randn(3, 6, requires_grad=True)  # as the later blocks' inputs: one key for all
    model = Stack(CountedMlp)
    bodies = wrap_repeated_blocks(model, {}, shared=set(), special=set())
    seal(bodies, model)
    keyed = _torch.keyed_compile_region(lambda key: key) is not None
    assert bool(bodies.groups[0].keyed) is keyed
    assert _body_traces(model, x) == (1 if keyed else 4)
    if keyed:
        (key,) = bodies.groups[0].prober.keys.values()  # numbered across the process
        assert key > 0
        # Another batch size is another key (in a recompiled frame); no_grad another one.
        assert _body_traces(model, x, torch.randn(5, 6, requires_grad=True)) == 2
        with torch.no_grad():
            assert _body_traces(model, x.detach()) == 1
        # A weight frozen after sealing: its block's body is another trace (the key has each
        # weight's requires_grad), the other three still share one.
        model.blocks[0].up.weight.requires_grad_(False)
        assert _body_traces(model, x) == 2
        assert len(bodies.groups[0].prober.keys) == 4
        model.blocks[0].up.weight.requires_grad_(True)
    tuples = Stack(TupleMlp)
    seal(wrap_repeated_blocks(tuples, {}, shared=set(), special=set()), tuples)
    assert _body_traces(tuples, x) == 4
    # Symbolic sizes (floats kept static: with symbolic floats blocks compile inline, as
    # tests/test_parity.py's blocks_dynamic shows). Keyed: a call is described by its sizes'
    # symbolic expressions, so the blocks share the trace of the first call with their sizes.
    # Under dynamic=True the first block's input width is a symbol until its matmul makes it 6:
    # that call has a description of its own, the other three share one.
    with torch._dynamo.config.patch(specialize_float=True):
        assert _body_traces(model, x, dynamic=True) == (2 if keyed else 4)
        marked = x.detach().clone().requires_grad_(True)
        torch._dynamo.mark_dynamic(marked, 0)  # only the batch: every block's input (s0, 6)
        assert _body_traces(model, marked) == (1 if keyed else 4)
    # The count is of the body's traces: inline blocks are traced once each too.
    inline = Stack(CountedMlp)
    assert _body_traces(inline, x) == 4


class TanhMlp(Mlp):
    """Same parameters and call as :class:`Mlp`, another forward."""

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class BiasBlock(nn.Module):
    """Returns the bias it is given beside its output, as T5's layers return their position
    biases; ``layer_idx`` differs per block (transformers numbers its layers)."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.up = nn.Linear(6, 6)
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor):
        return torch.tanh(self.up(x) * scale + bias), bias, scale.sin()


@pytest.mark.parametrize("numbered", [False, True], ids=["same", "numbered"])
def test_blocks_that_return_an_argument_get_it_back_itself(numbered):
    """A block that returns one of its arguments (T5's position bias): torch refuses a
    compiled region whose output is its input, so the compile failed. Now the body returns a
    marker there and the wrapped forward the argument itself: the same outputs, gradients and
    object as eager, one body for the blocks (guard-based: such a call gets no reuse key), for
    blocks alike and for blocks whose numbers differ (their member body)."""
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList(BiasBlock(i if numbered else 0) for i in range(3))

    def forward(x, bias, scale):
        passed = True
        for block in model.blocks:
            x, same, scale = block(x, bias, scale)
            passed = passed and same is bias
        return x * scale, passed

    inputs = [torch.randn(3, 6, requires_grad=True) for _ in range(2)]
    inputs.append(torch.rand(6, requires_grad=True))
    expected, _ = forward(*inputs)
    expected_grads = torch.autograd.grad(expected.sum(), [*inputs, *model.parameters()])
    bodies = wrap_repeated_blocks(model, {}, shared=set(), special=set())
    seal(bodies, model)
    assert [g.members for g in bodies.groups] == [("blocks.0", "blocks.1", "blocks.2")]
    torch._dynamo.reset()
    try:
        out, passed = torch.compile(forward, backend="aot_eager", fullgraph=True)(*inputs)
    finally:
        torch._dynamo.reset()
    assert passed is True
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.sum(), [*inputs, *model.parameters()])
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)
    assert not any(bodies.groups[0].prober.keys.values())  # no key: the guard-based body


class RotaryBlock(nn.Module):
    """Takes ``(sin, cos)`` as GPT-J's layers do: two halves of one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, position_embeddings: tuple, scale: torch.Tensor):
        sin, cos = position_embeddings
        return torch.tanh(self.up(x) * cos + sin) * scale


def test_blocks_given_arguments_that_share_a_storage_get_copies():
    """Arguments that are views of one tensor (GPT-J's rotary ``(sin, cos)``, split from one
    table, in a tuple; and a positional view of it): torch refuses a region whose inputs alias
    each other, so the compile failed. The wrapped forward passes a copy of each argument that
    shares a storage with an earlier one: same outputs and gradients as eager, one body."""
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList(RotaryBlock() for _ in range(3))

    def forward(x, table):
        sincos = table * 2
        sin, cos = torch.split(sincos, 6, dim=-1)
        for block in model.blocks:
            x = block(x, position_embeddings=(sin, cos), scale=sincos[:, :6])
        return x

    x, table = torch.randn(3, 6, requires_grad=True), torch.randn(3, 12, requires_grad=True)
    expected = forward(x, table)
    expected_grads = torch.autograd.grad(expected.sum(), [x, table, *model.parameters()])
    bodies = wrap_repeated_blocks(model, {}, shared=set(), special=set())
    seal(bodies, model)
    assert [g.members for g in bodies.groups] == [("blocks.0", "blocks.1", "blocks.2")]
    torch._dynamo.reset()
    try:
        out = torch.compile(forward, backend="aot_eager", fullgraph=True)(x, table)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.sum(), [x, table, *model.parameters()])
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("keyword", [False, True], ids=["positional", "keyword"])
def test_a_block_given_one_tensor_twice_never_shares_a_trace_with_two_tensors(keyword):
    """``block(h, h)`` then ``block(h, r)`` (a residual stream that starts as the hidden state):
    Dynamo lifts a tensor passed twice into a subgraph once, so the first call's trace, stamped
    out for the later calls under the same reuse key, dropped their second tensor: a silently
    wrong output where the calls' descriptions are equal (under ``no_grad``, or where the input
    requires grad as an embedding's output does). The key carries the pattern of identical
    tensors now: outputs and gradients as eager, with grad and under ``no_grad``, for a call
    described at trace time (positional tensors) and an interpreted one (a keyword)."""
    torch.manual_seed(0)
    model = nn.Module()
    model.inp = nn.Linear(6, 6)
    model.blocks = nn.ModuleList(PairBlock() for _ in range(3))

    def forward(x):
        h = r = model.inp(x)
        for block in model.blocks:
            h, r = block(h, r, scale=0.5) if keyword else block(h, r)
        return h.square().mean() + r.mean()

    x = torch.randn(3, 6)
    params = list(model.parameters())
    expected = forward(x)
    expected_grads = torch.autograd.grad(expected, params)
    with torch.no_grad():
        expected_eval = forward(x + 1)
    bodies = wrap_repeated_blocks(model, {}, shared=set(), special=set())
    seal(bodies, model)
    assert [g.members for g in bodies.groups] == [("blocks.0", "blocks.1", "blocks.2")]
    torch._dynamo.reset()
    try:
        compiled = torch.compile(forward, backend="aot_eager", fullgraph=True)
        out = compiled(x)
        grads = torch.autograd.grad(out, params)
        with torch.no_grad():
            evaluated = compiled(x + 1)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(evaluated, expected_eval)


def test_two_groups_of_blocks_never_share_a_keyed_trace():
    """Two groups of identical blocks in one compiled frame whose calls are described alike
    (same weights' shapes, same input) but whose forwards differ: each group runs its own body.
    Dynamo finds a keyed body's trace by the body function's code (one nested function for
    every group) and the key alone, so keys numbered per group made both groups' first
    description key 1, and the second group silently ran the first group's trace (found in the
    sixty-second session with an encoder and a decoder ModuleList)."""
    torch.manual_seed(0)
    model = nn.Module()
    model.first = nn.ModuleList(Mlp() for _ in range(2))
    model.second = nn.ModuleList(TanhMlp() for _ in range(2))

    def forward(x: torch.Tensor) -> torch.Tensor:
        for block in (*model.first, *model.second):
            x = block(x)
        return x

    x = torch.randn(3, 6, requires_grad=True)
    expected = forward(x)
    expected_grads = torch.autograd.grad(expected.sum(), [x, *model.parameters()])
    bodies = wrap_repeated_blocks(model, {}, shared=set(), special=set())
    seal(bodies, model)
    assert [g.members for g in bodies.groups] == [("first.0", "first.1"),
                                                  ("second.0", "second.1")]
    torch._dynamo.reset()
    try:
        out = torch.compile(forward, backend="aot_eager")(x)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.sum(), [x, *model.parameters()])
    torch.testing.assert_close(grads, expected_grads)
    keys = [k for g in bodies.groups for k in g.prober.keys.values()]
    assert len(set(keys)) == len(keys), keys


class TwoStreams(nn.Module):
    """Blocks alternating between two inputs whose batch sizes are two symbols."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CountedMlp() for _ in range(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i % 2:
                y = block(y)
            else:
                x = block(x)
        return torch.cat([x, y])


def test_calls_with_other_symbols_do_not_share_a_keyed_trace():
    """A symbolic description names its symbols: inputs of batch sizes ``s0`` and ``s1`` are
    two keys (a shared trace would give the second stream the first one's sizes), and inputs
    with the same symbols share one, checked against eager at sizes the first compile did not
    see."""
    from shardc import _torch

    model = TwoStreams()
    seal(wrap_repeated_blocks(model, {}, shared=set(), special=set()), model)
    keyed = _torch.keyed_compile_region(lambda key: key) is not None
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")  # (eager's backward: no fake mode)
    traces = []
    for rows in ((3, 5), (4, 7), (6, 2)):
        x, y = (torch.randn(n, 6, requires_grad=True) for n in rows)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(y, 0)
        _TRACES.clear()
        out = compiled(x, y)
        traces.append(len(_TRACES))
        torch.testing.assert_close(out, model(x, y))
        grads = torch.autograd.grad(out.sum(), (x, y))
        torch.testing.assert_close(grads, torch.autograd.grad(model(x, y).sum(), (x, y)))
    assert traces == ([2, 0, 0] if keyed else [4, 0, 0])


@pytest.mark.parametrize("guarded", [False, True], ids=["torch_default", "hooks_guarded"])
def test_a_hook_registered_later_is_seen_when_torch_sees_one_on_a_compiled_module(guarded):
    """A block's layout (its modules' classes and hooks) is checked when a region is traced: a
    hook registered after sealing and before compiling makes that block run its own forward. A
    hook registered after compiling is seen exactly when torch.compile sees one on a module it
    inlines: at once where Dynamo guards module hooks (``skip_nnmodule_hook_guards`` off; the
    walk is traced and guarded), at the next recompile with torch's default (the check runs once
    per trace, outside it: half of Dynamo's instructions per block, issue 18)."""
    models = []
    for _ in range(2):  # the same weights: one for shardc's blocks, one plain
        torch.manual_seed(0)
        models.append(Stack(Mlp))
    model, plain = models
    seal(wrap_repeated_blocks(model, {}, shared=set(), special=set()), model)
    x = torch.randn(3, 6)
    # Hooks that change the output (a hook that appended to a list would make Dynamo guard the
    # list, and recompile for that).
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=not guarded):
        torch._dynamo.reset()
        # Two functions (two code objects: Stack.forward's cache would mix the two models).
        compiled = torch.compile(lambda x: model(x), backend="eager")
        compiled_plain = torch.compile(lambda x: plain(x), backend="eager")
        for m in models:
            m.blocks[1].up.register_forward_hook(lambda _m, _i, out: out + 1)
        out, out_plain = compiled(x), compiled_plain(x)
        torch.testing.assert_close(out, plain(x))
        torch.testing.assert_close(out_plain, plain(x))
        for m in models:
            m.blocks[2].up.register_forward_hook(lambda _m, _i, out: out * 2)
        out, out_plain = compiled(x), compiled_plain(x)
    torch.testing.assert_close(out, out_plain)
    seen = torch.allclose(out, plain(x))
    assert seen == torch.allclose(out_plain, plain(x)) == guarded


class IndexedMlp(CountedMlp):
    """Numbered as transformers numbers its attention modules (``layer_idx``): a scalar whose
    value differs per block, read by the forward only if ``reads`` (the same in every block)."""

    def __init__(self, index: int | None = 0, reads: bool = False) -> None:
        super().__init__()
        self.index, self.reads = index, reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * (self.index + 1) if self.reads else out


def test_blocks_differing_in_a_scalar_share_a_body_only_where_it_is_not_read(caplog):
    """Blocks whose scalar attributes differ only in value form one group; a call shares the
    body traced from the first block only where the prober, running the call on a skeleton that
    records reads of those attributes, saw none read. A forward that reads its index runs each
    block's own forward, said once with the attribute named: compiled, every output equals the
    eager model's (a shared body would scale every block by the first one's index). A scalar of
    another type (None) is another signature."""
    from shardc import _torch

    keyed = _torch.keyed_compile_region(lambda key: key) is not None
    x = torch.randn(3, 6, requires_grad=True)
    for reads in (False, True):
        model = Stack(IndexedMlp)
        for i, block in enumerate(model.blocks):
            block.index, block.reads = i, reads
        bodies = wrap_repeated_blocks(model, {}, shared=set(), special=set())
        seal(bodies, model)
        (group,) = bodies.groups
        assert group.varying == {("", "index")}
        with caplog.at_level(logging.INFO, logger="shardc"):
            traces = _body_traces(model, x)  # each output checked against the eager model's
        assert group.varying_read == ({"index"} if reads else set())
        if keyed:
            assert traces == (4 if reads else 1), (reads, traces)
        said = [r.getMessage() for r in caplog.records if "run their own forwards" in
                r.getMessage()]
        assert len(said) == int(reads) and (not reads or "index" in said[0]), said
        assert not reads or "reads index" in bodies.inline_reason("blocks.1")
        caplog.clear()
    model = Stack(IndexedMlp)
    model.blocks[3].index = None
    bodies = wrap_repeated_blocks(model, {}, shared=set(), special=set())
    assert [g.members for g in bodies.groups] == [("blocks.0", "blocks.1", "blocks.2")]
    assert [f.module for f in bodies.fallbacks] == ["blocks.3"]
    # Identical blocks keep their group with their values, as before; only blocks left without
    # an identical sibling are grouped across scalar values.
    model = Stack(IndexedMlp, n=5)
    model.blocks[4].index = 4
    bodies = wrap_repeated_blocks(model, {}, shared=set(), special=set())
    assert [(g.members, g.varying) for g in bodies.groups] == [
        (tuple(f"blocks.{i}" for i in range(4)), frozenset())]
    assert [f.module for f in bodies.fallbacks] == ["blocks.4"]


def _subgraph_calls(model: nn.Module, *inputs: torch.Tensor) -> list[list[str]]:
    """Compile ``model`` with dynamic shapes (eager backend), run it on each input, check it
    against eager, and return each compiled graph's ``invoke_subgraph`` calls (the name of the
    subgraph each call runs, in order) after ``share_equal_bodies``, as shardc's backend sees
    them (torch 2.11's Dynamo keeps equal traces of distinct functions apart; 2.13's installs
    one subgraph for the equal traces of one function's code)."""
    from shardc.passes.body_share import INVOKE_SUBGRAPH, share_equal_bodies

    graphs = []

    def backend(gm, example_inputs):
        share_equal_bodies(list(gm.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH)))
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch._dynamo.config.patch(specialize_float=True):  # floats symbolic: blocks inline
        for x in inputs:
            torch.testing.assert_close(compiled(x), model(x))
    return [[n.args[1] for n in gm.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH)]
            for gm in graphs]


@pytest.mark.parametrize("reads", [False, True])
def test_blocks_differing_in_a_scalar_share_a_body_under_dynamic_shapes(reads):
    """Under dynamic shapes: with keyed bodies (torch 2.13+) a call is described by its sizes'
    symbols and probed at their current values, as a static call is; without them (2.11, 2.12)
    it has no description, and each block calls a body traced from its own skeleton (its own
    scalars). Either way, where the forward does not read the scalar that differs the blocks
    share one subgraph, as identical blocks share theirs; where it reads it, every block
    computes with its own value (a shared body would scale every block by the first one's
    index), checked against the eager model."""
    model = Stack(IndexedMlp)
    for i, block in enumerate(model.blocks):
        block.index, block.reads = i, reads
    identical = Stack(IndexedMlp)  # the same index everywhere: one group without varying
    identical.load_state_dict(model.state_dict())
    for m in (model, identical):
        seal(wrap_repeated_blocks(m, {}, shared=set(), special=set()), m)
    xs = [torch.randn(n, 6, requires_grad=True) for n in (3, 5)]
    calls = _subgraph_calls(model, *xs)  # outputs checked against the eager model
    assert len(calls) == 1, calls  # one dynamic graph for both batch sizes
    if reads:
        # Each block's trace differs: no subgraph runs two blocks.
        assert len(set(calls[0])) == len(calls[0]), calls
        return
    # The same calls of the same subgraphs as identical blocks make (torch may trace the first
    # block's call apart: its input is the region's own), one of them shared by several blocks.
    assert calls == _subgraph_calls(identical, *xs), calls
    assert max(calls[0].count(name) for name in calls[0]) >= 2, calls


# shardc's own trace once (torch < 2.13, no reuse_hash_fn; forced on newer torch by dropping the
# keyed bodies): later calls of a body whose arguments have the same description are one
# shardc::body_call node that the backend turns into a call of the first call's subgraph.


class PairBlock(nn.Module):
    """Two inputs of one shape, used in another order than passed (the first call's subgraph
    lifts ``y`` before ``x``), a keyword argument, two outputs."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, scale: float = 1.0):
        if torch.compiler.is_compiling() and x.device.type != "meta":
            _note_trace()
        h = torch.tanh(self.a(y))
        return x + scale * h, self.b(x) * y


class PairStack(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PairBlock() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x  # the first block gets one tensor twice: its own slot
        for block in self.blocks:
            x, y = block(x, y, scale=0.5)
        return x.square().mean() + y.mean()


def _train_pair_stack(rank: int, world: int, trace_once: bool, packed: bool) -> dict:
    import os

    import shardc

    os.environ["SHARDC_TRACE_ONCE"] = "1" if trace_once else "0"
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PairStack()
    shardc.shard(model, pack_blocks=packed)
    for g in model._shardc_state.blocks.groups:
        for bodies in (g, g.packed) if g.packed is not None else (g,):
            bodies.keyed.clear()  # torch 2.13+: the path torch 2.11/2.12 take
    options = {"inductor": False, "compile_blocks_once": trace_once}
    compiled = torch.compile(model, backend=shardc.backend(**options))
    if hasattr(torch._dynamo.config, "inline_single_use_invoke_subgraph"):  # torch 2.13+
        torch._dynamo.config.inline_single_use_invoke_subgraph = False  # a fresh process
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(4, 3, 6)
    _TRACES.clear()
    losses = []
    for x in data[:3]:
        loss = compiled(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    traces = len(_TRACES)
    with torch.no_grad():
        _TRACES.clear()
        # The inline run's reference: its model eagerly (a second compile costs suite time).
        evaluated = (compiled if trace_once else model)(data[3])
        eval_traces = len(_TRACES)
    plans = shardc.explain_all(model)
    return {"losses": torch.stack(losses), "eval": evaluated, "traces": traces,
            "eval_traces": eval_traces,
            "params": {n: p.full_tensor() for n, p in model.named_parameters()},
            "bodies": [(b.blocks, b.partitions) for p in plans for b in p.bodies]}


def _train_pair_stack_both(rank: int, world: int, packed: bool) -> tuple[dict, dict]:
    return (_train_pair_stack(rank, world, True, packed),
            _train_pair_stack(rank, world, False, packed))


@pytest.mark.parametrize("packed", [False, True], ids=["per_parameter", "packed"])
def test_trace_once_without_reuse_hash_fn_trains_like_inline_blocks(packed):
    """shardc's own trace once, world 1, FX, per-parameter reads and packed blocks: Dynamo
    traces the body once per slot (the first
    block, called with one tensor twice, has its own), every block still calls the shared body,
    and training (3 SGD steps) equals the inline path's (``compile_blocks_once=False``, trace
    once off), a compiled no_grad forward the inline model's eager one. A call rewritten with
    its operands in argument order instead of the subgraph's (``y`` is lifted first) would
    fail or compute another function."""
    from dist_utils import run_ranks

    once, inline = run_ranks(_train_pair_stack_both, 1, packed)[0]
    assert inline["traces"] == 4 and inline["bodies"] == []
    assert once["traces"] == 2, once["traces"]  # slots: (x, x) for block 0, (x, y) for 1-3
    assert once["eval_traces"] == 2, once["eval_traces"]
    # Two bodies (Dynamo lifts block 0's one tensor once: another subgraph), each partitioned
    # once in the training region; the no_grad region calls them without a partition.
    blocks = [f"blocks.{i}" for i in range(1, 4)]
    assert once["bodies"] == [(["blocks.0"], 1), (blocks, 1), (["blocks.0"], 0), (blocks, 0)]
    torch.testing.assert_close(once["losses"], inline["losses"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(once["eval"], inline["eval"], rtol=1e-6, atol=1e-6)
    for name, value in inline["params"].items():
        torch.testing.assert_close(once["params"][name], value, rtol=1e-6, atol=1e-6)


_ACTIVE_LAYER = __import__("contextvars").ContextVar("active_layer", default=None)


class _ContextAttention(nn.Module):
    """Sets a plain context variable around its forward: Dynamo cannot trace ``ContextVar.set``
    (a graph break)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        token = _ACTIVE_LAYER.set(id(self))
        try:
            return self.lin(x)
        finally:
            _ACTIVE_LAYER.reset(token)


class _CompileAwareContext:
    """A context variable that is a plain attribute under compilation, as the ``kernels``
    package's ``CompileableContextVar`` (transformers 5.25 wraps its attention modules' forwards
    with one): traceable, but a mutation of a global object, which Dynamo refuses inside an
    activation-checkpoint region."""

    def __init__(self) -> None:
        self.var = __import__("contextvars").ContextVar("active_kernels", default=None)
        self.value = None

    def get(self):
        return self.value if torch.compiler.is_compiling() else self.var.get()

    def set(self, value):
        if torch.compiler.is_compiling():
            previous, self.value = self.value, value
            return previous
        return self.var.set(value)

    def reset(self, token) -> None:
        if torch.compiler.is_compiling():
            self.value = token
        else:
            self.var.reset(token)


_ACTIVE_KERNELS = _CompileAwareContext()


class _KernelsAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As kernels does: a new dict of this module's kernels (Dynamo cannot undo the store).
        active = dict(_ACTIVE_KERNELS.get() or {})
        active[id(self)] = self
        token = _ACTIVE_KERNELS.set(active)
        try:
            return self.lin(x)
        finally:
            _ACTIVE_KERNELS.reset(token)


class _SelfCheckpointingLayer(nn.Module):
    """Checkpoints its own forward as transformers 5.25's ``GradientCheckpointingLayer`` does:
    ``__init_subclass__`` wraps each subclass's forward (shardc's swapped class included), and
    only the outermost wrapper checkpoints."""

    gradient_checkpointing = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        forward = cls.forward

        def checkpointing_forward(self, *args):
            if (self.gradient_checkpointing and self.training
                    and type(self).forward is checkpointing_forward):
                return checkpoint(forward, self, *args, use_reentrant=False)
            return forward(self, *args)

        cls.forward = checkpointing_forward


class _ContextLayer(_SelfCheckpointingLayer):
    def __init__(self, attention: type[nn.Module]) -> None:
        super().__init__()
        self.attn = attention()
        self.mlp = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(torch.relu(self.attn(x)))


class _ContextStack(nn.Module):
    def __init__(self, attention: type[nn.Module], checkpointed: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_ContextLayer(attention) for _ in range(3))  # identical
        for layer in self.layers:  # as transformers' gradient_checkpointing_enable()
            layer.gradient_checkpointing = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _compile_context_stack(attention: type[nn.Module], checkpointed: bool,
                           **shard_kwargs) -> list:
    """Train one step of :class:`_ContextStack` under shardc (FX, one rank) beside its eager
    copy, sharded with ``shard_kwargs``; returns the compiled model's plans (each region's)."""
    return _one_step_beside_eager(lambda: _ContextStack(attention, checkpointed),
                                  **shard_kwargs)


def _one_step_beside_eager(build, input_requires_grad: bool = False, **shard_kwargs) -> list:
    """One step of the model ``build()`` makes, sharded with ``shard_kwargs`` and compiled
    through shardc (FX, one rank), beside its eager copy: outputs and gradients equal; returns
    the compiled model's plans (each region's)."""
    from dist_utils import one_rank_mesh

    import shardc

    torch._dynamo.reset()
    try:
        with one_rank_mesh() as mesh:
            torch.manual_seed(0)
            model = build()
            reference = __import__("copy").deepcopy(model)
            x = torch.randn(2, 8, requires_grad=input_requires_grad)
            expected = reference(x)
            expected.sum().backward()
            shardc.shard(model, mesh, **shard_kwargs)
            compiled = torch.compile(model, backend=shardc.backend(inductor=False))
            got = compiled(x)
            got.sum().backward()
            torch.testing.assert_close(got, expected)
            for name, p in reference.named_parameters():
                torch.testing.assert_close(model.get_parameter(name).grad.full_tensor(),
                                           p.grad, msg=name)
            return shardc.explain_all(compiled)
    finally:
        torch._dynamo.reset()


def test_a_block_that_sets_a_plain_context_variable_keeps_the_usual_path():
    """Dynamo graph-breaks on ``ContextVar.set``, which a shared body cannot hold (it failed in
    Dynamo before, s47): the blocks are refused at shard, named with the variable, and compile
    as plain torch.compile compiles them (around the graph breaks)."""
    plans = _compile_context_stack(_ContextAttention, checkpointed=False)
    assert all(not plan.bodies for plan in plans)
    reasons = {b.module: b.reason for plan in plans for b in plan.inline_blocks}
    assert sorted(reasons) == [f"layers.{i}" for i in range(3)], reasons
    assert all("_ACTIVE_LAYER (submodule 'attn')" in r and "ContextVar.set" in r
               for r in reasons.values()), reasons


@pytest.mark.parametrize("checkpointed,pack", [(False, False), (True, False), (False, True)],
                         ids=["plain", "checkpointed", "packed"])
def test_a_self_checkpointing_block_with_a_compile_aware_context_variable_shares_a_body(
        checkpointed, pack):
    """transformers 5.25's decoder layer with the kernels package installed: each layer
    checkpoints its own call, and its attention sets a compile-aware context variable. The body
    runs the layer's computation without a checkpoint of its own (the live layer checkpoints
    around the gathers and the body call): before (s47), the body's copy checkpointed again
    inside the body, where Dynamo refused the variable's side effect and failed the compile.
    Layer 0's input does not require grad: its call is its own; torch 2.13+ inlines a body
    called once, which the plan says (it said "sizes known only at run time" before; with
    packed blocks it still did before s54: the reason read the per-parameter bodies' prober)."""
    plans = _compile_context_stack(_KernelsAttention, checkpointed, pack_blocks=pack)
    bodies = [tuple(b.blocks) for plan in plans for b in plan.bodies]
    reasons = {b.module: b.reason for plan in plans for b in plan.inline_blocks}
    assert ("layers.1", "layers.2") in bodies, bodies
    if ("layers.0",) in bodies:  # torch 2.11, 2.12: a body of its own
        assert reasons == {}, reasons
    else:  # torch 2.13+ inlines a body called once
        assert list(reasons) == ["layers.0"], reasons
        assert "inline_single_use_invoke_subgraph" in reasons["layers.0"], reasons


class _WrappedContextStack(nn.Module):
    """:class:`_ContextLayer`s each in torch's ``checkpoint_wrapper`` (the checkpoint inside the
    block, as torchtitan's activation checkpointing puts it) around the kernels-like attention."""

    def __init__(self) -> None:
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        self.layers = nn.ModuleList(checkpoint_wrapper(_ContextLayer(_KernelsAttention))
                                    for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("skip_side_effects,input_requires_grad",
                         [(False, True), (True, True), (False, False),
                          pytest.param(True, False, marks=pytest.mark.slow)],
                         ids=["break", "skip", "break-input-without-grad",
                              "skip-input-without-grad"])
def test_a_body_dynamo_runs_eagerly_keeps_its_weights_for_the_checkpoints_recompute(
        skip_side_effects, input_requires_grad, caplog):
    """transformers' layers (the kernels package installed) in torch's ``checkpoint_wrapper``:
    Dynamo refuses the attention's side effect inside the checkpoint region and runs the body
    eagerly, and the checkpoint's recompute in the backward ran the skeleton after its weights
    were taken out again: "Tensor on device meta is not on the expected device cpu" (s76). The
    eager body now runs a copy holding the call's weights: gradients equal eager's (FX, one
    rank), the log says the body ran eagerly and names torch's flag, with which the blocks
    share one body. On torch 2.11 (guard-based bodies traced once per slot) the graph resuming
    after the eager body held its anchor without a traced call, which failed the compile
    (``TraceOnceMismatch``) before and after the first fix; such an anchor is now dropped.

    Where the first block's input needs no gradient, its call has another reuse key than the
    later blocks'; run eagerly, the region's own frame, which Dynamo compiles on its own, took
    the second key as a symbolic int and failed on torch 2.13+ ("reuse_hash_fn must return a
    constant integer", s76): the key is passed as a string now (``_torch.region_key``)."""
    with torch._dynamo.config.patch(
            skip_fwd_side_effects_in_bwd_under_checkpoint=skip_side_effects), \
            caplog.at_level(logging.WARNING, logger="shardc"):
        plans = _one_step_beside_eager(_WrappedContextStack,
                                       input_requires_grad=input_requires_grad)
    bodies = [tuple(b.blocks) for plan in plans for b in plan.bodies]
    eager = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    if skip_side_effects and input_requires_grad:
        assert bodies == [("layers.0", "layers.1", "layers.2")] and not eager, (bodies, eager)
    elif skip_side_effects:
        # The first block's input without grad: its call is another key, its own trace (a
        # body of its own on torch 2.11 and 2.12, where bodies are traced once per slot).
        assert ("layers.1", "layers.2") in bodies and not eager, (bodies, eager)
        assert set(bodies) <= {("layers.0",), ("layers.1", "layers.2")}, bodies
    else:
        assert bodies == [] and len(eager) <= 1, (bodies, eager)
        assert eager and "skip_fwd_side_effects_in_bwd_under_checkpoint" in eager[0], eager


def _both_descriptions(*args):
    """The description of a tensor call made at trace time (``_record_tensor_call``, what the
    wrapped forward uses) and the one interpreted by Dynamo (``_describe_tensor_call``)."""
    from shardc import _torch
    from shardc.sharding import blocks

    args = tuple(args)
    _torch.comptime(blocks._record_tensor_call)
    return blocks._recorded_tensor_call(), blocks._describe_tensor_call(args)


def _recorded(number: int):
    from shardc.sharding import blocks

    return None if number == 0 else blocks.call_description(number)


def test_a_tensor_call_described_at_trace_time_equals_the_interpreted_description():
    """The wrapped forward describes a call of plain tensors from their fake values at trace
    time (s68: about a third of the instructions Dynamo interpreted per block). The result is
    the description Dynamo computes by interpreting ``_describe_tensor_call``: sizes, strides
    (a transposed view), dtypes and ``requires_grad``, a parameter among them; None where an
    item is no plain tensor or a size is symbolic (the forward then interprets it as before)."""
    torch._dynamo.reset()
    compiled = torch.compile(_both_descriptions, backend="eager", fullgraph=True)
    weight = nn.Parameter(torch.randn(3, 5))
    x = torch.randn(4, 6, dtype=torch.bfloat16).t()
    number, interpreted = compiled(torch.randn(2, 3, requires_grad=True), x, weight)
    recorded = _recorded(number)
    assert recorded is not None and recorded == interpreted, (recorded, interpreted)
    assert recorded[1][0][1][1][2] == x.stride()
    # The same description again: the same number (the traced code holds numbers only).
    assert compiled(torch.randn(2, 3, requires_grad=True), x, weight)[0] == number
    # Not every item a plain tensor: nothing recorded.
    number, _ = compiled(torch.randn(2, 3), 7)
    assert _recorded(number) is None
    torch._dynamo.reset()
    dynamic = torch.compile(_both_descriptions, backend="eager", fullgraph=True, dynamic=True)
    number, interpreted = dynamic(torch.randn(2, 3), torch.randn(5))
    assert _recorded(number) is None
    torch._dynamo.reset()


class CountingBlock(nn.Module):
    """A block whose training forward changes its buffers in place: a call counter and a
    running mean of its hidden state, which it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 11)
        self.down = nn.Linear(11, 6)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(11))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x))
        if self.training:
            self.calls += 1
            with torch.no_grad():
                self.mean.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return x + self.down(h) + self.mean.sum() * 0.01


def test_blocks_that_change_their_buffers_run_their_own_forwards(caplog):
    """torch's invoke_subgraph refuses a body that changes an input in place in training
    ("does not support training with in-place input or buffer mutations"), which a shared body
    of these blocks did, packed or not. The prober sees the change, says so once, and such a
    call runs its block's own forward in the region: training equals the unsharded eager
    reference's (losses, parameters and both buffers) on one rank, under Inductor and FX."""
    from dist_utils import one_rank_mesh

    import shardc

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(CountingBlock() for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    def build() -> nn.Module:
        torch.manual_seed(0)
        return Net()

    def train(model, forward) -> list[float]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            loss = forward(torch.randn(5, 6, generator=g)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    reference = build()
    ref_losses = train(reference, reference)
    for inductor in (False, True):
        torch._dynamo.reset()
        with one_rank_mesh() as mesh, caplog.at_level(logging.INFO, logger="shardc"):
            caplog.clear()
            model = shardc.shard(build(), mesh)
            forward = torch.compile(model, backend=shardc.backend(inductor=inductor))
            losses = train(model, forward)
            state = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t)
                     for n, t in model.state_dict().items()}
            inline = [b for plan in shardc.explain_all(forward) for b in plan.inline_blocks]
        assert "changes a buffer or an argument in place" in caplog.text
        # The plan says why, too (before s72 it named unbacked symbolic sizes).
        assert {b.module for b in inline} == {f"blocks.{i}" for i in range(3)}
        assert all("in place" in b.reason for b in inline), inline
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), inductor
        for name, want in reference.state_dict().items():
            torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6, msg=name)
        assert [int(state[f"blocks.{i}.calls"]) for i in range(3)] == [3, 3, 3]


class ComplexRotaryBlock(nn.Module):
    """A block with a complex rotary embedding, as Llama 4's: the query viewed as complex
    numbers, multiplied by the complex frequencies the model passes every block."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.o = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        q = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        return x + self.o(torch.view_as_real(q * freqs).flatten(-2))


class ComplexRotaryNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ComplexRotaryBlock() for _ in range(3))
        inv = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
        self.register_buffer("inv", inv, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.outer(torch.arange(x.shape[1]).float(), self.inv)
        freqs = torch.polar(torch.ones_like(angles), angles)
        for block in self.blocks:
            x = block(x, freqs)
        return x


class NonzeroExpertsBlock(nn.Module):
    """A mixture of experts that loops over the experts some token was routed to, found with
    ``nonzero`` (DBRX's experts, as transformers writes them): Dynamo breaks the graph there."""

    def __init__(self, dim: int = 8, experts: int = 4, hidden: int = 6) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) * 0.3)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) * 0.3)
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weights, index = torch.topk(self.router(h).softmax(-1), 2, dim=-1)
        out = torch.zeros_like(h)
        with torch.no_grad():
            mask = F.one_hot(index, self.experts).permute(2, 1, 0)
            hit = (mask.sum(dim=(-1, -2)) > 0).nonzero()
        for expert in hit:
            expert = expert[0]
            with torch.no_grad():
                slot, token = torch.where(mask[expert])
            y = torch.tanh(h[token] @ self.w1[expert].T) @ self.w2[expert]
            out.index_add_(0, token, y * weights[token, slot, None])
        return x + out.view(x.shape)


def _train_sharded_and_eager(build, caplog, lengths: tuple[int, ...] = (5, 5),
                             **backend) -> tuple:
    """SGD steps of ``build()`` (one per sequence length of ``lengths``) sharded on one rank and
    compiled by shardc (FX unless ``backend`` says), and of ``build()`` eagerly: (losses,
    reference losses, parameters, reference parameters, each region's ``Plan.inline_blocks``,
    the shardc log)."""
    from dist_utils import one_rank_mesh

    import shardc

    def train(model, forward) -> list[float]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        losses = []
        for length in lengths:
            loss = forward(torch.randn(2, length, 8, generator=g)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    torch.manual_seed(0)
    reference = build()
    ref_losses = train(reference, reference)
    torch._dynamo.reset()
    with one_rank_mesh() as mesh, caplog.at_level(logging.INFO, logger="shardc"):
        caplog.clear()
        torch.manual_seed(0)
        model = shardc.shard(build(), mesh)
        forward = torch.compile(model, backend=shardc.backend(**{"inductor": False, **backend}))
        losses = train(model, forward)
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
        inline = [b for plan in shardc.explain_all(forward) for b in plan.inline_blocks]
    torch._dynamo.reset()
    return losses, ref_losses, params, dict(reference.named_parameters()), inline, caplog.text


def test_blocks_computing_with_complex_tensors_run_their_own_forwards(caplog):
    """A shared body of blocks with a complex rotary embedding (Llama 4's) failed in its
    backward: the forward saves a conjugated tensor, and torch's invoke_subgraph has no kernel
    for the Conjugate dispatch key (plain nested_compile_region fails the same). The prober
    sees the complex tensors on meta, says so once, and the blocks compile inline with the
    reason in the plan: training equals the eager reference's."""
    losses, ref_losses, params, ref_params, inline, log_text = _train_sharded_and_eager(
        ComplexRotaryNet, caplog)
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, rtol=1e-6, atol=1e-7, msg=name)
    assert {b.module for b in inline} == {f"blocks.{i}" for i in range(3)}
    assert all("complex tensors" in b.reason and "Conjugate" in b.reason for b in inline)
    assert log_text.count("computes with complex tensors") == 1 + 3  # the group, each block


@pytest.mark.parametrize("once", [True, False])
def test_blocks_whose_forward_breaks_the_graph_run_their_own_forwards(caplog, once):
    """``nonzero`` in an MoE's expert loop (DBRX's) made Dynamo break the graph inside a
    block's body: UncapturedHigherOrderOpError, with compile_blocks_once=False too (its bodies
    are traced first, inlined after). The prober stops at the op on meta, says so once, and the
    blocks run their own forwards, where Dynamo breaks the graph as without shardc: training
    equals the eager reference's, each block said inline with the op named."""

    def build() -> nn.Module:
        return Stack(NonzeroExpertsBlock, n=3)

    losses, ref_losses, params, ref_params, inline, log_text = _train_sharded_and_eager(
        build, caplog, compile_blocks_once=once)
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, rtol=1e-6, atol=1e-7, msg=name)
    assert "runs nonzero, at which Dynamo breaks the graph" in log_text
    if once:
        assert {b.module for b in inline} == {f"blocks.{i}" for i in range(3)}
        assert all("runs nonzero" in b.reason for b in inline)


def test_graph_breaking_blocks_run_their_own_forwards_after_a_shape_change(caplog):
    """The second length recompiles with symbolic sizes; torch 2.11 cannot describe such a
    call, so the prober does not run it, and the blocks went to a body, where Dynamo failed at
    ``nonzero`` (UncapturedHigherOrderOpError; transformers' DBRX on one H100, s74). A call
    that is not probed runs its own forward where probed calls broke the graph. (torch 2.13
    describes and probes the call: it passes there either way.)"""

    def build() -> nn.Module:
        return Stack(NonzeroExpertsBlock, n=3)

    losses, ref_losses, params, ref_params, _, _ = _train_sharded_and_eager(
        build, caplog, lengths=(5, 7))
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, rtol=1e-6, atol=1e-7, msg=name)


def test_more_graph_breaking_blocks_than_dynamos_recompile_limit_are_warned_of(caplog):
    """Dynamo compiles the pieces of a graph-breaking block forward once per block (each
    block's modules have classes of their own), and past its recompile limit it runs the rest
    eagerly (s73: transformers' DBRX at 12 layers compiled 4 of its blocks): shardc warns with
    the limit to set. Training stays equal to the eager reference's."""

    def build() -> nn.Module:
        return Stack(NonzeroExpertsBlock, n=3)

    with torch._dynamo.config.patch(recompile_limit=2), \
            pytest.warns(UserWarning, match=r"\(3\) break Dynamo's graph.*recompile limit \(2\)"):
        losses, ref_losses, params, ref_params, _, _ = _train_sharded_and_eager(build, caplog)
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, rtol=1e-6, atol=1e-7, msg=name)
    # Within the limit (the default 8 for three blocks): no warning.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*recompile limit.*")
        _train_sharded_and_eager(build, caplog)


def test_graph_breaking_blocks_over_several_ranks_are_warned_of_with_the_flags_to_set():
    """Over more than one rank, blocks that break Dynamo's graph at a data-dependent op compile
    regions shaped by each rank's data (s78: DBRX with AdamW at two ranks crashed on a collective
    mismatch): shardc warns, naming the blocks, the op and the two Dynamo flags that make them
    run as an eager body; over one rank it says nothing."""
    from shardc.sharding.blocks import _warn_rank_dependent_regions

    with pytest.warns(UserWarning, match=r"blocks\.0 \.\.\. blocks\.2 break Dynamo's graph at "
                      r"nonzero.*over 2 ranks.*capture_dynamic_output_shape_ops = True.*"
                      r"capture_scalar_outputs = True"):
        _warn_rank_dependent_regions(["blocks.0", "blocks.1", "blocks.2"], "nonzero", 2, True)
    with pytest.warns(UserWarning, match=r"over 4 ranks.*no way around it.*torch 2\.12 or later"):
        _warn_rank_dependent_regions(["blocks.0", "blocks.1", "blocks.2"], "nonzero", 4, False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error")
        _warn_rank_dependent_regions(["blocks.0", "blocks.1", "blocks.2"], "nonzero", 1, True)


def _nonzero_stack_over_ranks(rank: int, world: int) -> dict:
    """Three graph-breaking MoE blocks sharded over ``world`` ranks, each rank on its own rows
    of the batch (so their experts get different tokens), trained with SGD beside the unsharded
    model on the whole batch: first with Dynamo's defaults and the same rows on every rank
    (the warning), then with the two capture flags and each rank's own rows (the workaround)."""
    import shardc

    def run(capture: bool) -> dict:
        g = torch.Generator().manual_seed(1)
        batches = [torch.randn(2 * world, 5, 8, generator=g) for _ in range(3)]
        torch.manual_seed(0)
        reference = Stack(NonzeroExpertsBlock, n=3)
        torch.manual_seed(0)
        model = shardc.shard(Stack(NonzeroExpertsBlock, n=3))
        torch._dynamo.reset()
        forward = torch.compile(model, backend=shardc.backend(inductor=False))
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=capture,
                                        capture_scalar_outputs=capture), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x in batches:
                mine = x[2 * rank:2 * rank + 2] if capture else x
                loss = forward(mine).square().mean()
                loss.backward()
                reference(x).square().mean().backward()
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
        err = max(((p.full_tensor() - q).abs().max() / q.abs().max()).item()
                  for p, q in zip(model.parameters(), reference.parameters()))
        return {"err": err, "warned": [str(w.message) for w in caught
                                       if "break Dynamo's graph at nonzero" in str(w.message)]}

    return {"defaults": run(False), "captured": run(True)}


@pytest.mark.slow
@pytest.mark.skipif(not _torch.captured_data_dependent_ops_run_in_bodies(),
                    reason="torch 2.11 fails inside the body with the op captured")
def test_graph_breaking_blocks_over_two_ranks_train_with_dynamo_capturing_the_op():
    """The warned case end to end over two ranks: with Dynamo's defaults (every rank on the same
    rows, so their regions agree) shardc warns once per rank and trains; with the two capture
    flags each rank trains on its own rows (its experts get other tokens) at parity with the
    unsharded model on the whole batch, without the warning."""
    from dist_utils import run_ranks

    for out in run_ranks(_nonzero_stack_over_ranks, 2):
        assert len(out["defaults"]["warned"]) == 1, out["defaults"]["warned"]
        assert out["defaults"]["err"] < 1e-5, out["defaults"]
        assert out["captured"]["warned"] == [], out["captured"]["warned"]
        assert out["captured"]["err"] < 1e-5, out["captured"]


class IndexedBlock(nn.Module):
    """Reads rows of a parameter by integer ids (``aten.index.Tensor``, tagged as an op with a
    data-dependent output shape for its boolean-mask form), as MoE experts read biases."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.table = nn.Parameter(torch.randn(8, 8) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.lin(x).argmax(-1)
        return x + torch.tanh(self.lin(x)) * self.table[ids]


def test_blocks_indexing_by_integer_ids_keep_their_shared_body(caplog):
    """The prober's check for ops Dynamo breaks the graph at names an op only where it fails on
    meta tensors: ``index`` with integer ids (GPT-OSS's expert biases) keeps the shared body
    (a check by the op's tag alone sent such blocks inline)."""

    def build() -> nn.Module:
        return Stack(IndexedBlock, n=3)

    losses, ref_losses, params, ref_params, inline, log_text = _train_sharded_and_eager(
        build, caplog)
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, rtol=1e-6, atol=1e-7, msg=name)
    assert "breaks the graph" not in log_text
    assert not [b for b in inline if "breaks the graph" in b.reason], inline
    # The blocks after the first share one body on torch 2.13+ (the first, whose input needs no
    # gradient, runs inline); torch 2.11 gives that first call a body of its own (two bodies,
    # three calls), as before s72's check.
    assert re.search(r"region 0 calls [12] compiled block bod(y|ies)", log_text)


class InPlaceBiasBlock(nn.Module):
    """Two in-place methods whose results nobody reads, as transformers' MoE experts write them
    (``out.add_(bias)`` in ``_grouped_linear``, ``next_states.index_add_(...)``): in Dynamo's
    graph a ``call_method`` node without users."""

    def __init__(self, dim: int = 6, dropout: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) * 0.3)
        self.bias = nn.Parameter(torch.randn(dim))
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight
        out.add_(self.bias)
        mixed = torch.zeros_like(x)
        mixed.index_add_(0, torch.arange(x.shape[0] - 1, -1, -1), out)
        mixed = F.dropout(mixed, self.dropout, self.training)
        return x + torch.tanh(mixed) + 0.1 * out


@pytest.mark.parametrize("packed,once,dropout", [(False, False, 0.0), (True, False, 0.0),
                                                 (True, True, 0.25)],
                         ids=["inline", "inline_packed", "default_random_body_inlined"])
def test_inlined_blocks_keep_in_place_ops_whose_result_is_unread(packed, once, dropout):
    """Blocks compiled inline (``compile_blocks_once=False``; by default a block that draws
    random numbers under activation checkpointing: here around each call, since s75 where
    dropout alone keeps the body) train as the unsharded eager model (3 blocks, 2 SGD steps, FX,
    one rank):
    losses, every ``.grad`` (presence and value) and the parameters. Inlining the bodies ran
    FX's dead-code elimination on Dynamo's graph, which dropped ``out.add_(self.bias)`` and
    ``mixed.index_add_(...)`` (in-place methods whose results are unread), and then the bias's
    gather: a wrong loss and no bias gradient (packed: a zero one) without any error (s72,
    transformers' GPT-OSS with ``compile_blocks_once=False``)."""
    from dist_utils import one_rank_mesh

    import shardc

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Module()
        model.blocks = nn.ModuleList(InPlaceBiasBlock(dropout=dropout) for _ in range(3))
        return model

    def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        for block in model.blocks:
            x = checkpoint(block, x, use_reentrant=False) if dropout else block(x)
        return x.square().mean()

    def train(model: nn.Module, run) -> list[tuple[float, dict]]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(1))
        steps = []
        for step, x in enumerate(data):
            torch.manual_seed(10 + step)  # the same dropout masks in both runs
            loss = run(x)
            loss.backward()
            grads = {n: None if p.grad is None else
                     (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            steps.append((loss.item(), grads))
        return steps

    reference = build()
    want = train(reference, functools.partial(forward, reference))
    torch._dynamo.reset()
    with one_rank_mesh() as mesh:
        model = shardc.shard(build(), mesh, pack_blocks=packed)
        compiled = torch.compile(functools.partial(forward, model), backend=shardc.backend(
            inductor=False, compile_blocks_once=once))
        got = train(model, compiled)
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
        inline = {b.module for plan in shardc.explain_all(model) for b in plan.inline_blocks}
    # The path under test: body calls inlined by shardc (torch 2.13 inlines block 0's own
    # single-use subgraph itself).
    assert {"blocks.1", "blocks.2"} <= inline, inline
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(got, want)):
        assert loss == pytest.approx(ref_loss, rel=1e-6), step
        for name, ref_grad in ref_grads.items():
            assert grads[name] is not None, (step, name)
            torch.testing.assert_close(grads[name], ref_grad, rtol=1e-6, atol=1e-7,
                                       msg=f"step {step}: {name}")
    for name, value in reference.named_parameters():
        torch.testing.assert_close(params[name], value.detach(), rtol=1e-6, atol=1e-7, msg=name)


class TokenCountBlock(nn.Module):
    """Flattens its tokens and views its output by the token count (``2*s`` under dynamic
    shapes, an expression of the sequence length), as transformers' grouped-MM experts do
    (``weighted_out.view(num_tokens, num_top_k, hidden_dim)``)."""

    def __init__(self, dim: int = 8, k: int = 2) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, k * dim) * 0.3)
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        tokens = h.shape[0]
        return x + torch.tanh(h @ self.w).view(tokens, self.k, -1).sum(1).view(x.shape)


class HalvedTokenCountBlock(TokenCountBlock):
    """Another class: no identical sibling, so it runs inline between the others' body calls."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * super().forward(x)


def test_a_size_a_body_computes_is_computed_again_by_the_inline_block_that_reads_it(caplog):
    """Blocks 0 and 2 share a body, block 1 (another class) runs inline between them, and all
    view by the token count. At the dynamic-shape recompile Dynamo hash-conses sizes by their
    expression: block 1's token count became an output of block 0's body call, and Inductor
    holds a size an ``invoke_subgraph`` returns as a ``ShapeAsConstantBuffer``, which its view
    lowering cannot take (``SympifyError``; transformers' GPT-OSS, s72). The region computes
    such sizes itself now: Inductor, one rank, two sequence lengths, losses and every gradient
    as the unsharded eager model's."""
    from dist_utils import one_rank_mesh

    import shardc

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Module()
        model.scale = nn.Parameter(torch.ones(8))  # block 0's input needs a gradient: a body
        model.blocks = nn.ModuleList([TokenCountBlock(), HalvedTokenCountBlock(),
                                      TokenCountBlock()])
        return model

    def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = x * model.scale
        for block in model.blocks:
            x = block(x)
        return x.square().mean()

    def train(model: nn.Module, run) -> list[tuple[float, dict]]:
        g = torch.Generator().manual_seed(1)
        steps = []
        for seq in (5, 7):  # the second compiles the region again with a symbolic length
            loss = run(torch.randn(2, seq, 8, generator=g))
            loss.backward()
            steps.append((loss.item(), {
                n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                for n, p in model.named_parameters()}))
            model.zero_grad()
        return steps

    reference = build()
    want = train(reference, functools.partial(forward, reference))
    torch._dynamo.reset()
    with one_rank_mesh() as mesh, caplog.at_level(logging.DEBUG, logger="shardc"):
        model = shardc.shard(build(), mesh)
        compiled = torch.compile(functools.partial(forward, model), backend="shardc")
        got = train(model, compiled)
        plans = shardc.explain_all(model)
    torch._dynamo.reset()
    assert len(plans) == 2, plans  # the static region and the dynamic one
    for plan in plans:
        assert [b.module for b in plan.inline_blocks] == ["blocks.1"], plan.inline_blocks
    # The path under test: the dynamic region read a size from a body's outputs.
    assert "sizes read from block bodies' outputs computed by the region" in caplog.text
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(got, want)):
        assert loss == pytest.approx(ref_loss, rel=1e-6), step
        for name, ref_grad in ref_grads.items():
            torch.testing.assert_close(grads[name], ref_grad, rtol=1e-6, atol=1e-7,
                                       msg=f"step {step}: {name}")


class _DropoutBlock(nn.Module):
    def __init__(self, d: int = 12, p: float = 0.5) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d, bias=False)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.lin(x))


class _DropoutStack(nn.Module):
    """Identical blocks ``x + dropout(lin(x))``: each block's mask can be read off its output
    (``out - x != 0``), so its weight's gradient can be recomputed from the masks drawn."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_DropoutBlock() for _ in range(n))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        return outs


def replay_with_drawn_masks(model: _DropoutStack, x0: torch.Tensor, outs: list
                            ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The masks a step of ``model`` (sharded) drew, read off its outputs ``outs`` for the input
    ``x0``, and each block's weight gradient from the step run again eagerly with those masks
    (the loss: the sum of the outputs' squares): what the backward must give if it read the
    masks its forward drew."""
    drawn = [(o - x).detach() != 0 for o, x in zip(outs, [x0, *outs[:-1]])]
    weights = [b.lin.weight.full_tensor().detach().clone().requires_grad_(True)
               for b in model.blocks]
    x, replayed = x0, []
    for w, mask in zip(weights, drawn):
        x = x + (x @ w.t()) * mask * (1 / (1 - model.blocks[0].drop.p))
        replayed.append(x)
    sum(o.square().sum() for o in replayed).backward()
    return drawn, [w.grad for w in weights]


def _dropout_bodies(inductor: bool) -> None:
    from dist_utils import one_rank_mesh

    import shardc

    torch._dynamo.reset()
    torch.manual_seed(0)
    with one_rank_mesh() as mesh:
        model = shardc.shard(_DropoutStack(), mesh)
        forward = torch.compile(model, backend=shardc.backend(inductor=inductor))
        x0 = torch.randn(8, 12, requires_grad=True)
        masks = []
        for step in range(2):
            outs = forward(x0)
            sum(o.square().sum() for o in outs).backward()
            drawn, replayed = replay_with_drawn_masks(model, x0, outs)
            masks.append(drawn)
            for i, (block, want) in enumerate(zip(model.blocks, replayed)):
                torch.testing.assert_close(block.lin.weight.grad.full_tensor(), want,
                                           rtol=1e-5, atol=1e-5, msg=f"step {step}, block {i}")
                block.lin.weight.grad = None
        # Each block and each step draws its own numbers.
        assert not torch.equal(masks[0][1], masks[0][2]) and not torch.equal(masks[0][1],
                                                                            masks[1][1])
        plans = [r.plan for r in shardc.shard_state(model).regions]
        assert not [b for p in plans for b in p.inline_blocks if "random" in b.reason]
        shared = [b.blocks for p in plans for b in p.bodies]
        assert any(len(blocks) >= 2 for blocks in shared), shared
    torch._dynamo.reset()


def test_blocks_drawing_random_numbers_share_a_body_where_nothing_recomputes_them():
    """Blocks with dropout and no activation checkpointing keep their shared body (s75; before,
    every block drawing random numbers compiled inline, as checkpointed ones must: a recomputed
    body does not replay its masks). Each call draws its own mask, and the backward reads the
    one its forward drew: every block's weight gradient equals an eager replay of the step with
    the masks read off the outputs. FX backend, one rank (the Inductor run is slow; the
    checkpointed-vs-plain comparison at world 3 is
    ``tests/test_real_models.py::test_checkpointed_random_ops_replay_the_forward_random_numbers``)."""
    _dropout_bodies(inductor=False)


@pytest.mark.slow
def test_blocks_drawing_random_numbers_share_a_body_under_inductor():
    """The same under Inductor (its generated random numbers, drawn in the shared body)."""
    _dropout_bodies(inductor=True)


def _gpt2_with_dropout(rank: int, world: int) -> dict:
    """One rank: transformers' GPT-2 (dropout 0.1 on embeddings, attention and residuals; SDPA)
    trained three SGD steps on its rows, with shared bodies and with every block inline, from
    the same seeds; the losses and full parameters of each, and the first run's plans."""
    import transformers

    import shardc

    out = {}
    for once in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=37, n_embd=24, n_layer=3, n_head=4,
                                      n_positions=16, resid_pdrop=0.1, embd_pdrop=0.1,
                                      attn_pdrop=0.1, attn_implementation="sdpa")
        model = shardc.shard(transformers.GPT2LMHeadModel(cfg))
        forward = torch.compile(model, backend=shardc.backend(inductor=False,
                                                             compile_blocks_once=once))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.randint(0, 37, (3, 2 * world, 9), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(rank + 1)
        losses = []
        for batch in data:
            mine = batch[2 * rank:2 * rank + 2]
            logits = forward(input_ids=mine[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        plans = [r.plan for r in shardc.shard_state(model).regions]
        out[once] = {"losses": torch.stack(losses),
                     "params": {n: p.full_tensor() for n, p in model.named_parameters()},
                     "shared": [tuple(b.blocks) for p in plans for b in p.bodies],
                     "inline": [(b.module, b.reason) for p in plans for b in p.inline_blocks]}
    torch._dynamo.reset()
    return out


@pytest.mark.slow
def test_hf_gpt2_with_dropout_shares_one_body_and_trains_as_inline_blocks():
    """transformers' GPT-2 with its default dropout (0.1) on two gloo ranks: its
    layers share one body (s75; before, dropout made them compile inline), and from the same
    seeds it trains exactly as with every block inline (FX execution draws the same numbers in
    the same order), so each call's masks are its own and its backward reads them."""
    pytest.importorskip("transformers")
    from dist_utils import run_ranks

    for rank, out in enumerate(run_ranks(_gpt2_with_dropout, 2)):
        shared, inline = out[True], out[False]
        assert any(len(blocks) == 3 for blocks in shared["shared"]), shared["shared"]
        assert not [r for _, r in shared["inline"] if "random" in r], shared["inline"]
        assert not inline["shared"]
        torch.testing.assert_close(shared["losses"], inline["losses"], rtol=1e-6, atol=1e-7,
                                   msg=f"rank {rank}: losses")
        for name, value in inline["params"].items():
            torch.testing.assert_close(shared["params"][name], value, rtol=1e-6, atol=1e-7,
                                       msg=f"rank {rank}: {name}")


class _CheckpointedDropoutBlock(_DropoutBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=False)


@pytest.mark.parametrize("where", ["inside", "around"])
def test_blocks_drawing_random_numbers_under_checkpointing_compile_inline(where):
    """The other side of the rule above: where activation checkpointing recomputes a block that
    draws random numbers, checkpointed inside its forward or around its call, the block
    compiles inline with the reason in the plan (a shared body would draw other masks when
    recomputed)."""
    from dist_utils import one_rank_mesh

    import shardc

    class Around(_DropoutStack):
        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return [x]

    torch._dynamo.reset()
    torch.manual_seed(0)
    with one_rank_mesh() as mesh:
        if where == "inside":
            model = _DropoutStack()
            model.blocks = nn.ModuleList(_CheckpointedDropoutBlock() for _ in range(3))
        else:
            model = Around()
        shardc.shard(model, mesh)
        forward = torch.compile(model, backend=shardc.backend(inductor=False))
        sum(o.sum() for o in forward(torch.randn(8, 12, requires_grad=True))).backward()
        plans = [r.plan for r in shardc.shard_state(model).regions]
        inline = {b.module: b.reason for p in plans for b in p.inline_blocks}
        assert {f"blocks.{i}" for i in range(1, 3)} <= set(inline), inline
        assert all("random numbers" in inline[f"blocks.{i}"] for i in range(1, 3)), inline
    torch._dynamo.reset()


def _sgd_beside_eager(reference: nn.Module, model: nn.Module, compiled, batches: torch.Tensor,
                      loss_fn, inputs=lambda batch: batch) -> None:
    """Train the unsharded ``reference`` and the sharded ``model`` (called through
    ``compiled``) with SGD on each of ``batches`` (``loss_fn(output, batch)``, the model fed
    ``inputs(batch)``); every parameter equal to the reference's after each step."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for step, batch in enumerate(batches):
        for run, opt in zip((reference, compiled), optimizers):
            loss_fn(run(inputs(batch)), batch).backward()
            opt.step()
            opt.zero_grad()
        for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.full_tensor(), ref, rtol=1e-5, atol=1e-6,
                                       msg=f"step {step}: {name}")


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_blocks_wrapped_by_checkpoint_wrapper_share_a_body(policy):
    """torchtitan's activation checkpointing: each block of the ``nn.ModuleList`` wrapped in
    torch's ``checkpoint_wrapper`` (``selective``: with a ``context_fn`` policy saving attention
    and matmul outputs, each wrapper holding its own
    ``partial(checkpoint, context_fn=partial(create_selective_checkpoint_contexts, policy))``).
    ``shardc.shard`` failed with a ``KeyError`` on such a model: the wrapper's
    ``named_parameters`` drops its ``_checkpoint_wrapped_module.`` prefix, so the group's names
    did not match the model's (s75). Now the wrapped blocks share one body (the selective
    wrappers too: their partials compare by what they call), train as the unsharded eager
    model (FX, one rank, two SGD steps), and the backward recomputes attention under the full
    policy but not under the selective one (the body's checkpoint follows it)."""
    from real_models import (
        AttentionBlock,
        _save_attention_and_matmuls,
        backward_targets,
        selective_checkpointing,
    )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    import shardc

    def wrapped() -> nn.Module:
        if policy == "full":
            return checkpoint_wrapper(AttentionBlock())
        return checkpoint_wrapper(AttentionBlock(), context_fn=selective_checkpointing(
            _save_attention_and_matmuls))

    model = _train_beside_eager(lambda: _BlockLM(wrapped), inductor=False, steps=2)
    plans = [r.plan for r in shardc.shard_state(model).regions]
    assert [len(b.blocks) for p in plans for b in p.bodies] == [3], plans[0].bodies
    attention = [t for t in backward_targets(model)
                 if "scaled_dot_product" in t and "backward" not in t]
    assert bool(attention) == (policy == "full"), attention
    torch._dynamo.reset()


class _SelfCheckpointing(nn.Module):
    """A block that checkpoints its own attention block (torch.utils.checkpoint, non-reentrant),
    as ``checkpoint_wrapper`` does with the whole block."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        from real_models import AttentionBlock

        self.inner = AttentionBlock(dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


class _BlockLM(nn.Module):
    """An embedding, three blocks made by ``make_block`` and a head."""

    def __init__(self, make_block) -> None:
        from real_models import DIM, VOCAB

        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(make_block() for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _checkpointed_attention_lm(wrapper: str, dropout: float = 0.0) -> nn.Module:
    from real_models import AttentionBlock
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return _BlockLM(lambda: checkpoint_wrapper(AttentionBlock(dropout=dropout))
                    if wrapper == "wrapper" else _SelfCheckpointing(dropout))


def _rng_wrappers_run(model: nn.Module) -> list[str]:
    """The generator-state wrappers (torch's ``run_and_save_rng_state`` and the others) that
    the compiled regions' forward and backward graphs of ``model`` run, subgraphs included."""
    import shardc

    return sorted({str(node.target) for region in shardc.shard_state(model).regions
                   for graph in (region.forward, region.backward) if graph is not None
                   for gm in graph.modules() if isinstance(gm, fx.GraphModule)
                   for node in gm.graph.nodes
                   if node.op == "call_function" and "rng_state" in str(node.target)})


def _train_checkpointed_attention(wrapper: str, inductor: bool, steps: int) -> nn.Module:
    """``_checkpointed_attention_lm`` (attention without dropout) sharded at world 1, compiled
    (``inductor`` or FX) and trained ``steps`` SGD steps beside its unsharded eager copy, every
    parameter equal after each step; the sharded model, for its regions and plans."""
    return _train_beside_eager(lambda: _checkpointed_attention_lm(wrapper), inductor, steps)


def _train_beside_eager(build, inductor: bool, steps: int) -> nn.Module:
    """The model ``build()`` makes (a :class:`_BlockLM`) sharded at world 1, compiled
    (``inductor`` or FX) and trained ``steps`` SGD steps beside its unsharded eager copy, every
    parameter equal after each step; the sharded model, for its regions and plans."""
    import copy

    from dist_utils import one_rank_mesh
    from real_models import VOCAB

    import shardc

    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = build()
    model = copy.deepcopy(reference)
    with one_rank_mesh() as mesh:
        shardc.shard(model, mesh)
        compiled = torch.compile(model, backend=shardc.backend(inductor=inductor))
        _sgd_beside_eager(reference, model, compiled, torch.randint(
            0, VOCAB, (steps, 2, 9), generator=torch.Generator().manual_seed(1)),
            lambda out, ids: F.cross_entropy(out.flatten(0, 1), ids[:, 1:].flatten()),
            lambda ids: ids[:, :-1])
    return model


@pytest.mark.parametrize("wrapper", ["wrapper", "checkpoint"])
def test_checkpointed_attention_without_dropout_saves_no_generator_state(wrapper):
    """torch's partitioner wraps every op that a checkpoint recomputes and that is tagged
    random, attention without dropout included, so that its recompute replays the generator's
    state (``run_and_save_rng_state`` / ``run_with_rng_state``): a real tensor among a shared
    body's backward inputs, for which such bodies compiled inline under Inductor before s76.
    A body's partition now undoes the wrappers of ops that draw nothing
    (``shardc.passes.body_rng``): blocks checkpointed around attention without dropout
    (``checkpoint_wrapper``, or ``torch.utils.checkpoint`` inside the block) share one body
    whose graphs run no wrapper, recompute attention in the backward, and train as the
    unsharded eager model (FX, one rank, two SGD steps; Inductor: the slow test below)."""
    import shardc

    model = _train_checkpointed_attention(wrapper, inductor=False, steps=2)
    plans = [r.plan for r in shardc.shard_state(model).regions]
    assert [len(b.blocks) for p in plans for b in p.bodies] == [3], plans[0].bodies
    assert not [b for p in plans for b in p.inline_blocks], plans[0].inline_blocks
    assert _rng_wrappers_run(model) == []
    from real_models import backward_targets

    assert [t for t in backward_targets(model)
            if "scaled_dot_product" in t and "backward" not in t]  # recomputed
    torch._dynamo.reset()


def test_checkpointed_attention_with_dropout_still_compiles_inline():
    """The other side: blocks whose checkpoint recomputes attention (and an MLP) with dropout
    compile inline, the reason in the plan, and keep torch's wrappers, which replay the forward's
    masks (a shared body would draw other ones)."""
    from dist_utils import one_rank_mesh
    from real_models import VOCAB

    import shardc

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _checkpointed_attention_lm("wrapper", dropout=0.25)
    with one_rank_mesh() as mesh:
        shardc.shard(model, mesh)
        compiled = torch.compile(model, backend=shardc.backend(inductor=False))
        compiled(torch.randint(0, VOCAB, (2, 8))).sum().backward()
        plans = [r.plan for r in shardc.shard_state(model).regions]
        inline = {b.module: b.reason for p in plans for b in p.inline_blocks}
        assert not [b for p in plans for b in p.bodies], plans[0].bodies
        assert {f"blocks.{i}" for i in range(1, 3)} <= set(inline), inline
        assert all("random numbers" in reason for reason in inline.values()), inline
        assert "run_with_rng_state" in _rng_wrappers_run(model)
    torch._dynamo.reset()


@pytest.mark.slow
def test_checkpointed_attention_without_dropout_shares_a_body_under_inductor():
    """The first test above under Inductor, where it mattered: the blocks share one body
    (before s76 each compiled inline, "its activation checkpoint saves the random generator's
    state"), run no generator-state wrapper, and train as the unsharded eager model over three
    SGD steps."""
    import shardc

    model = _train_checkpointed_attention("wrapper", inductor=True, steps=3)
    plans = [r.plan for r in shardc.shard_state(model).regions]
    assert [len(b.blocks) for p in plans for b in p.bodies] == [3], plans[0].bodies
    assert not [b for p in plans for b in p.inline_blocks], plans[0].inline_blocks
    assert _rng_wrappers_run(model) == []
    torch._dynamo.reset()


class _TimmStyle(nn.Module):
    """timm's layout: identical blocks in an ``nn.Sequential`` called as one, and a head whose
    ``nn.Sequential`` is a sequence of layers (two identical ``Linear``s around a ``GELU``)."""

    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(_DropoutBlock(d, p=0.0) for _ in range(3)))
        self.head = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def test_identical_blocks_in_a_sequential_share_a_body():
    """Identical blocks held in an ``nn.Sequential`` and called as one (timm) share one body
    as a ``nn.ModuleList``'s do (s75's probe: they compiled inline and read their parameters
    one by one); a ``Sequential`` of layers is not grouped. Parity with the unsharded eager
    model (FX, one rank, two SGD steps)."""
    import copy

    from dist_utils import one_rank_mesh

    import shardc

    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = _TimmStyle()
    model = copy.deepcopy(reference)
    with one_rank_mesh() as mesh:
        shardc.shard(model, mesh)
        compiled = torch.compile(model, backend=shardc.backend(inductor=False))
        _sgd_beside_eager(reference, model, compiled,
                          torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(1)),
                          lambda out, x: out.square().mean())
        plans = [r.plan for r in shardc.shard_state(model).regions]
        shared = [tuple(b.blocks) for p in plans for b in p.bodies]
        assert any(set(blocks) >= {"blocks.1", "blocks.2"} for blocks in shared), shared
        assert not any(m.startswith("head") for blocks in shared for m in blocks), shared
        groups = [g.members for g in shardc.shard_state(model).blocks.groups]
        assert groups == [("blocks.0", "blocks.1", "blocks.2")], groups
    torch._dynamo.reset()


def _sequential_stack_rank(rank: int, world: int) -> dict:
    import shardc

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = shardc.shard(_TimmStyle(d=13))
    compiled = torch.compile(model, backend="shardc")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    after = []
    for x in torch.randn(2, 4 * world, 13, generator=torch.Generator().manual_seed(1)):
        compiled(x[4 * rank:4 * rank + 4]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        after.append({n: p.full_tensor().detach().clone() for n, p in model.named_parameters()})
    groups = [g.members for g in shardc.shard_state(model).blocks.groups]
    torch._dynamo.reset()
    return {"after": after, "groups": groups}


@pytest.mark.slow
def test_identical_blocks_in_a_sequential_match_the_reference_on_uneven_ranks():
    """The stack above under Inductor on 2 gloo ranks, 13 features (uneven shards), each rank
    its rows: every parameter after each step as the unsharded eager model's on the whole
    batch."""
    from dist_utils import run_ranks

    runs = run_ranks(_sequential_stack_rank, 2)
    torch.manual_seed(0)
    reference = _TimmStyle(d=13)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step, x in enumerate(torch.randn(2, 8, 13, generator=torch.Generator().manual_seed(1))):
        reference(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        for rank, run in enumerate(runs):
            assert run["groups"] == [("blocks.0", "blocks.1", "blocks.2")], run["groups"]
            for name, ref in reference.named_parameters():
                torch.testing.assert_close(run["after"][step][name], ref.detach(), rtol=1e-5,
                                           atol=1e-6, msg=f"rank {rank}, step {step}: {name}")
