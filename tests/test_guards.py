"""The guards Dynamo installs for a shardc-compiled step (issue 20: Dynamo evaluates all of them
at every call; docs/overhead.md, "Guards per step"). Two families used to grow with the model:
the compile-once blocks' layout check (every element of the layout recorded at ``shard``) and
each sharded parameter's read property (its ``ShardedParamInfo`` and flags). Here the first
costs one guard per block whatever the block's depth, and the second never guards the info."""

from __future__ import annotations

import re

import pytest
import torch
from dist_utils import run_ranks
from torch import nn

import shardc
from shardc import _torch


class Deep(nn.Module):
    """A block of ``depth`` linear layers (attributes, not a list, which would be grouped too):
    its recorded layout has ``depth + 1`` entries."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        for i in range(depth):
            setattr(self, f"linear{i}", nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = torch.relu(layer(x))
        return x


class Stack(nn.Module):
    def __init__(self, blocks: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Deep(depth) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


BLOCKS = 3

# Guards reading what the general parameter read consults and the plain one does not: the
# ShardedParamInfo in the property's closure (its type, fields, the sent_shard method).
_INFO = re.compile(r"ShardedParamInfo|cell_contents\.(tp|fp8|quantized|offload_device)\b"
                   r"|'sent_shard'")


def _census(rank: int, world: int, depth: int) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack(BLOCKS, depth)
    shardc.shard(model)
    groups = [g.members for g in shardc.shard_state(model).blocks.groups]

    def step(x):
        return model(x).sum()

    compiled = torch.compile(step, backend=shardc.backend(inductor=False))
    compiled(torch.randn(2, 4)).backward()
    # Each guard's code, without the comment naming the traced line that installed it.
    guards = [text.split("  #", 1)[0] for _, text in _torch.cached_guards(step.__code__)]
    closure = [t for t in guards if ".fget.__closure__" in t]
    return {
        "groups": groups,
        "params": len(list(model.parameters())),
        # Guards on the record itself: its key (one integer per block) and nothing inside it.
        "key": [t for t in guards if "._shardc_layout_key" in t],
        "record": [t for t in guards if re.search(r"\._shardc_layout\b", t)],
        "closure": len(closure),
        "info": [t for t in closure if _INFO.search(t)],
    }


def _censuses(rank: int, world: int) -> dict:
    """The tests' censuses in one spawned process (each traced after a Dynamo reset)."""
    return {"shallow": _census(rank, world, 1), "deep": _census(rank, world, 3),
            "llama": _llama_aliasing(rank, world),
            "late_hook": _late_hook(),
            "guards": {(layers, packed): _llama_guards(layers, packed)
                       for layers in (2, 3) for packed in (False, True)}}


def _late_hook() -> dict:
    """A sharded Stack compiled and run, then a hook registered on a block's submodule that
    doubles its output (Dynamo's defaults): the compiled step's outputs before and after, and
    the eager one after."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack(BLOCKS, 2)
    shardc.shard(model)

    def step(x):
        return model(x)

    compiled = torch.compile(step, backend=shardc.backend(inductor=False))
    x = torch.randn(2, 4)
    with torch.no_grad():
        before = compiled(x)
        model.blocks[1].linear0.register_forward_hook(lambda _m, _i, out: out * 2)
        return {"before": before, "after": compiled(x), "eager": model(x)}


def _llama_guards(layers: int, packed: bool) -> int:
    """Guards of a compiled llama step with ``layers`` blocks (``pack_blocks=packed``)."""
    from shardc.models.llama import LlamaConfig, Transformer, llama_loss

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Transformer(LlamaConfig(dim=32, n_layers=layers, n_heads=4, vocab_size=64,
                                    max_seq_len=16))
    shardc.shard(model, pack_blocks=packed)

    def step(t, y):
        return llama_loss(model(t), y)

    compiled = torch.compile(step, backend=shardc.backend(inductor=False))
    tokens = torch.randint(0, 64, (2, 8))
    compiled(tokens, tokens).backward()
    return len(_torch.cached_guards(step.__code__))


def test_packed_blocks_cost_fewer_guards_per_block(censuses):
    """pack_blocks=True: a block is one graph input and one gather, not nine parameter reads
    (issue 18): each block adds less than half the guards it adds with per-parameter reads
    (torch 2.13: 31 against 95)."""
    guards = censuses["guards"]
    per_block = {packed: guards[3, packed] - guards[2, packed] for packed in (False, True)}
    assert 0 < per_block[True] < per_block[False] / 2, per_block


@pytest.fixture(scope="module")
def censuses() -> dict:
    return run_ranks(_censuses, 1)[0]


def test_layout_check_and_parameter_reads_cost_guards_independent_of_block_depth(censuses):
    shallow, deep = censuses["shallow"], censuses["deep"]
    for census in (shallow, deep):
        assert census["groups"] == [tuple(f"blocks.{i}" for i in range(BLOCKS))], census
        # The layout check: no guard on the record, one per block on its key.
        assert census["record"] == [], census["record"][:5]
        assert len(census["key"]) == BLOCKS, census["key"]
        # The reads: nothing about the info, which cannot change once sharded.
        assert census["info"] == [], census["info"][:5]
    # A read's name, gradient store key and gather constants are constants of its code, which
    # Dynamo guards anyway (one ID_MATCH per read): nothing in a closure. Before issue 18 they
    # were closure cells, 6 guards per parameter (the name, the key, the constants' dict type
    # and its entry's value, type and length); before issue 20 also the info's type, fields and
    # method and the plain flag: 12.
    assert shallow["params"] < deep["params"]
    assert shallow["closure"] == deep["closure"] == 0, (shallow, deep)


def test_a_hook_registered_after_compiling_waits_for_a_recompile_as_in_torch(censuses):
    """With Dynamo's default (``skip_nnmodule_hook_guards``), a block's layout is checked when a
    region is traced, not guarded (issue 18: the traced check was half of Dynamo's work per
    block): a hook registered after compiling is not run until something recompiles, as
    torch.compile treats any module it inlines; eager runs it. (Where hooks are guarded, the
    step recompiles with that block inline: tests/test_parity.py, ``hook_after_eval``.)"""
    run = censuses["late_hook"]
    assert torch.equal(run["after"], run["before"])
    assert not torch.allclose(run["eager"], run["after"])


def _llama_aliasing(rank: int, world: int) -> dict:
    from shardc.models.llama import LlamaConfig, Transformer, llama_loss

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Transformer(LlamaConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64,
                                    max_seq_len=16))
    shardc.shard(model)

    def step(t, y):
        return llama_loss(model(t), y)

    compiled = torch.compile(step, backend=shardc.backend(inductor=False))
    tokens = torch.randint(0, 64, (2, 8))
    compiled(tokens, tokens).backward()
    guards = [text.split("  #", 1)[0]
              for _, text in _torch.cached_guards(step.__code__, every_part=True)]
    return {"params": len(list(model.parameters())),
            # Object-aliasing checks ("a is b", evaluated in Python at every call) between
            # what two parameter reads' closures hold.
            "closure_aliasing": [t for t in guards
                                 if re.search(r"__closure__\[\d+\]\.cell_contents is ", t)],
            # The mode's value under the model's key: "...['SYNC_MODES']['grads0'] == 0".
            "sync_mode": [t for t in guards if "SYNC_MODES" in t and " == " in t]}


def test_parameter_reads_share_the_sync_mode_without_aliasing_checks(censuses):
    """Every parameter read consults the model's gradient-sync mode. Read from the state each
    read's closure held, Dynamo checked at every call that all those closures hold the same
    object (one Python ``is`` per parameter: 146 at 16 layers); read through the store's key
    (``shardc.runtime.grad_sync.sync_mode``) it guards the mode once."""
    census = censuses["llama"]
    assert census["params"] > 10, census
    assert census["closure_aliasing"] == [], census["closure_aliasing"][:3]
    # Once for the model: every read looks it up in the same globals under the same key.
    assert len(census["sync_mode"]) == 1, census


def test_parameter_read_holds_its_constants_in_its_code():
    """The read of a parameter gathered as it is (``shard._read_gathered_as_is``) is compiled
    with its name, gather constants and store key among its code's constants, so Dynamo guards
    none of them apart; also when the constants hold dtypes (a mixed-precision gather, which a
    first version compiled from literals only and left in a closure). It returns the parameter
    itself outside a forward."""
    from shardc.sharding.shard import _read_gathered_as_is

    for dtype in (None, torch.bfloat16):
        constants = {mode: ("l.weight", 4, 1, "0", dtype, dtype, mode != 1)
                     for mode in range(3)}
        read = _read_gathered_as_is("weight", "l.weight", constants, "grads7")
        assert read.__closure__ is None
        assert "grads7" in read.__code__.co_consts and "'l.weight'" in read.__code__.co_filename
        assert tuple(constants.values()) in read.__code__.co_consts
        module = nn.Linear(4, 4)
        assert read(module) is module.weight
