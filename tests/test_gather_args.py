"""The gather and reduce ops' argument codec (``shardc.ops.gather_args``): named fields in the
ops' schema order, defaults for trailing arguments, keyword arguments of graph nodes."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from shardc.ops.gather import GATHER_OP, REDUCE_SCATTER_OP, args_with_fqn, shardc_args
from shardc.ops.gather_args import GatherArgs, ReduceArgs, check_schema


def test_gather_args_round_trip_and_defaults():
    shard = torch.zeros(2, 3)
    a = GatherArgs.of((shard, "w", 4, 2, "g", torch.bfloat16, None, True))
    assert (a.fqn, a.dim0, a.world, a.group_name) == ("w", 4, 2, "g")
    assert (a.grad_sync, a.sync_key, a.replicate, a.replicate_group) == (0, "", 1, "")
    assert GatherArgs.of(a.args()) == a
    assert len(a.args()) == len(GATHER_OP._schema.arguments)


def test_reduce_args_keep_hsdp_pair_only_with_replicas():
    r = GatherArgs.of((None, "w", 4, 2, "g", None, torch.float32, True)).reduce_args(
        None, torch.float32)
    assert r.args() == (None, "w", 4, 2, "g", torch.float32, torch.float32)
    hsdp = ReduceArgs(None, "w", 4, 2, "g", None, torch.float32, 3, "r")
    assert hsdp.args()[-2:] == (3, "r") and ReduceArgs.of(hsdp.args()) == hsdp


def test_constants_follow_the_shard_for_every_sync_mode():
    """What a traced parameter read passes after the shard (built once per property,
    ``ShardedParamInfo.gather_constants``) is the codec's encoding without the shard."""
    from shardc.runtime.grad_sync import REDUCE, REDUCE_STASHED, STASH
    from shardc.sharding.shard import ShardedParamInfo

    info = ShardedParamInfo("layers.0.w", 4, 2, "g", torch.bfloat16, torch.float32, True,
                            replicate=3, replicate_group_name="r")
    shard = torch.zeros(2, 3)
    by_mode = info.gather_constants("grads7")
    assert set(by_mode) == {REDUCE, STASH, REDUCE_STASHED}
    for mode, constants in by_mode.items():
        assert (shard, *constants) == info.gather_args(shard, mode, "grads7").args()
        assert GatherArgs.of((shard, *constants)).grad_sync == mode


def test_missing_argument_is_named():
    with pytest.raises(TypeError, match="reshard_after_forward"):
        GatherArgs.of((None, "w", 4, 2, "g", None, None))


def test_node_keyword_arguments_are_decoded():
    graph = fx.Graph()
    x = graph.placeholder("x")
    gather = graph.call_function(GATHER_OP, (x, "layers.0.w", 4, 2, "g", None, None, True),
                                 {"replicate": 2, "replicate_group": "r"})
    reduce = graph.call_function(REDUCE_SCATTER_OP, (x, "layers.0.w", 4, 2, "g", None,
                                                     torch.float32))
    a = shardc_args(gather)
    assert isinstance(a, GatherArgs) and a.shard is x and (a.replicate, a.replicate_group) == (
        2, "r")
    assert shardc_args(reduce).out_dtype == torch.float32
    assert shardc_args(x) is None
    assert args_with_fqn(reduce, "layers.1.w")[1] == "layers.1.w"


def test_schema_check_fails_on_a_mismatch():
    check_schema(GATHER_OP, GatherArgs)
    with pytest.raises(RuntimeError, match="ReduceArgs"):
        check_schema(GATHER_OP, ReduceArgs)
