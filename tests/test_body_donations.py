"""A block body's backward never writes into the buffers the region's backward passes it.

Inductor applied the region backward's donated-buffer positions (AOTAutograd's
``donated_buffer``) to the placeholders of the block bodies it compiled inside that backward:
a body's backward wrote its input gradient into the buffer of the output gradient it was given
(its ``tangents_0``). The region's backward freed that buffer at the call and, when it next
needed a buffer of that size before block i-1's backward read the result, took it: here block
i-1's gathered feed-forward weights, unpacked from the all-gather while the result was still
to be read. The model makes that happen with the blocks compiled once and the default options:
world 2 (collectives run), a feed-forward width equal to a rank's tokens (a gathered
feed-forward weight and a hidden state are buffers of one size) and ``w1`` frozen (the
backward gathers three such weights per block but frees only two such gradients before, so
the third gather takes the body's gradient buffer). Before the fix the losses differed from
the reference by ~1e-4 and block 0's ``w2`` by 5% (rel.); with it they match to ~1e-7.
``backend._no_donated_buffers``; docs/design.md, "Compile once per repeated block".

The first test reads the generated code and the peak model at world 1 (fast, default suite);
the second trains the model above against the reference (slow).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch._dynamo
from dist_utils import run_ranks
from parity import assert_parity, batches, build, reference, sharded_run

import shardc
from shardc import _torch
from shardc.memory import peak
from shardc.models.llama import llama_loss
from shardc.passes.body import BODY_SCOPE, flattened
from shardc.tools.fake_world import fake_world

# A function of Inductor's generated code and its arguments: ``def name(args):`` then
# ``a, b, c = args`` (block bodies: ``partitioned_bw_subgraph_0_0`` and the like).
_FUNCTION = re.compile(r"^def (\w+)\(args\):\n    (.+) = args$", re.M)


def _overwritten_inputs(code: str) -> list[str]:
    """The inputs that a subgraph function of ``code`` writes a buffer into (``bufN = input;
    del input  # reuse``, or a ``reinterpret_tensor`` of it)."""
    found = []
    for match in _FUNCTION.finditer(code):
        end = re.compile(r"^(def|class) ", re.M).search(code, match.end())
        body = code[match.end():end.start() if end else len(code)]
        found += [name for name in match.group(2).replace(" ", "").rstrip(",").split(",")
                  if f"; del {name}  # reuse" in body]
    return found


def test_bodies_compiled_inside_the_backward_own_none_of_their_inputs(monkeypatch):
    """World 1, the parity Llama's two blocks through one body: the body's backward writes
    none of its results into its inputs' buffers (torch 2.11-2.14 wrote the input gradient into
    the output gradient's, ``tangents_0``), and the peak model predicts no body kernel writing
    into its caller's buffer (``shardc.memory.inplace._owned``)."""
    torch.manual_seed(0)
    model = build("llama")
    tokens, targets = batches(1)
    try:
        with fake_world(1):
            shardc.shard(model)
            step = torch.compile(lambda t, y: llama_loss(model(t), y),
                                 backend=shardc.backend(inductor=True))
            _, codes = _torch.run_and_get_inductor_code(
                lambda: step(tokens[0], targets[0]).backward())
            (region,) = shardc.shard_state(model).regions
    finally:
        torch._dynamo.reset()
    assert any("partitioned_bw_subgraph" in code for code in codes), "no body backward"
    assert [name for code in codes for name in _overwritten_inputs(code)] == []
    taken: dict = {}
    real = peak.inplace_reuses

    def spy(*args):
        taken.update(real(*args))
        return taken

    monkeypatch.setattr(peak, "inplace_reuses", spy)
    backward = flattened(region.backward)[0]
    peak.lifetimes_and_storage(backward, set(), fusion=True)
    assert taken, "the model predicts in-place updates in the backward"
    scope = lambda node: node.meta.get(BODY_SCOPE, ())  # noqa: E731
    crossing = [(out.name, buf.name) for out, buf in taken.items()
                if scope(buf)[:len(scope(out))] != scope(out)]
    assert crossing == []


def _train(rank: int, world: int) -> dict:
    return sharded_run(rank, world, "llama-frozen-w1", "inductor")


@pytest.mark.slow  # two ranks and the reference under Inductor: 30-90 s on 2 cores
def test_body_backward_keeps_the_gradient_buffer_it_is_given():
    runs = run_ranks(_train, 2)
    torch._dynamo.reset()
    ref = reference("llama-frozen-w1", compile_backend="inductor")
    (plan,) = [p for p in runs[0]["plans"] if p is not None]
    assert plan.bodies, "the blocks were not compiled once"
    assert_parity(runs[0], ref)
