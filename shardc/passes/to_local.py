"""A pass on Dynamo's graph: ``DTensor.to_local()`` as a plain method call.

torch 2.11's Dynamo records ``param.to_local()`` (shardc's gather property reads each parameter's
shard this way) as a call of a function it makes on the fly, which AOTAutograd's cache refuses
("Unsupported call_function target ... prim_to_local"), so no region of shardc's was ever cached
there. Without arguments that function is exactly the method ``to_local`` of its operand, a
``call_method`` node that AOTAutograd traces alike and its cache accepts (the graph's code, which
the cache key covers, then says ``to_local()``). torch 2.13's Dynamo leaves no such node.
"""

from __future__ import annotations

from torch import fx

from shardc import _torch

__all__ = ["plain_to_local_calls"]


def plain_to_local_calls(gm: fx.GraphModule) -> int:
    """Replace each Dynamo ``prim_to_local`` call without arguments in ``gm`` (and its
    subgraphs) by ``call_method("to_local")`` on the same operand; returns how many were
    replaced. Calls with arguments (``grad_placements``) are left as they are."""
    replaced = 0
    for owner in gm.modules():
        if not isinstance(owner, fx.GraphModule):
            continue
        changed = False
        for node in list(owner.graph.nodes):
            if node.op != "call_function":
                continue
            closure = _torch.dynamo_to_local_closure(node.target)
            if closure is None or closure != ((), {}) or len(node.args) != 1 or node.kwargs:
                continue
            with owner.graph.inserting_before(node):
                plain = owner.graph.call_method("to_local", node.args)
            plain.meta = dict(node.meta)
            node.replace_all_uses_with(plain)
            owner.graph.erase_node(node)
            replaced += 1
            changed = True
        if changed:
            owner.recompile()
    return replaced
