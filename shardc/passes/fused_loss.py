"""Fuse the output projection and cross-entropy of a joint graph into the chunked op (issue 22).

The pattern, forward: ``mm(h, t(W))`` (``h``: ``[tokens, D]``, ``W``: the gathered output
weight ``[V, D]``, through ``t``/``permute``), then views, an optional cast to fp32 (the
model's ``.float()``), more views, ``_log_softmax(x, 1)``, ``nll_loss_forward(logp, target,
None, mean|sum, ignore_index)``; backward: ``nll_loss_backward(grad, logp, ...)``,
``_log_softmax_backward_data`` (reading ``logp`` through ``detach``), the cast back, views,
and the two matmuls that read the logits' gradient: ``mm(g, t(t(W)))`` (the gradient of ``h``)
and ``mm(t(g), h)`` or ``mm(t(h), g)`` (the gradient of ``W``, or its transpose). It is
replaced by one ``shardc::fused_linear_cross_entropy`` in the forward (its loss replaces the
nll's) and, in the backward, its unscaled gradients times the loss's incoming gradient in
place of the two matmuls. The rest of the pattern is erased.

A candidate is left alone, with the reason recorded, when any value of the pattern (logits,
their fp32 copy, the log-probabilities, their gradients) has a reader outside it (the logits
returned to the user, a label-smoothing term reading the log-probabilities), when the
projection has a bias (``addmm``), or with class weights or ``reduction='none'``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from shardc.ops.fused_ce import FUSED_CE_OP, MEAN, SUM, tokens_per_chunk, workspace_bytes
from shardc.passes.fx_utils import call, is_view, op_overload, size_hint, tensor_nbytes

_aten = torch.ops.aten
_NLL = _aten.nll_loss_forward.default
_NLL_BW = _aten.nll_loss_backward.default
_LOG_SOFTMAX = _aten._log_softmax.default
_LOG_SOFTMAX_BW = _aten._log_softmax_backward_data.default
_MM = _aten.mm.default
_CASTS = frozenset({_aten._to_copy.default, torch.ops.prims.convert_element_type.default})
_TRANSPOSES = frozenset({_aten.t.default, _aten.permute.default, _aten.transpose.int})
_DETACH = frozenset({_aten.detach.default, _aten.alias.default})
# The ops of the pattern that Inductor's decompositions would otherwise split before the joint
# graph (shardc's backend keeps them whole where the fused loss may be used).
LOSS_OPS = (_NLL, _NLL_BW, _LOG_SOFTMAX, _LOG_SOFTMAX_BW)
# Not aten view ops by their schema, yet only a relabelling of the matmul's output here.
_UNSAFE_VIEWS = frozenset({_aten._unsafe_view.default, _aten.reshape.default})


def _viewish(node: fx.Node) -> bool:
    return node.op == "call_function" and (is_view(node) or node.target in _UNSAFE_VIEWS)


@dataclass
class LossMatch:
    """One output projection + cross-entropy found in a joint graph."""

    h: fx.Node  # [tokens, D], the matmul's input
    weight: fx.Node  # [V, D], the (gathered) output weight
    target: fx.Node  # [tokens]
    nll: fx.Node
    loss: fx.Node | None  # getitem 0 of the nll (None: the loss is not read)
    grad_out: fx.Node | None  # the loss's incoming gradient (nll_loss_backward's first arg)
    grad_h_mm: fx.Node | None
    grad_w_mm: fx.Node | None
    grad_w_transposed: bool  # grad_w_mm computes grad_W.T
    upcast: bool
    reduction: int
    ignore_index: int
    nodes: set[fx.Node] = field(default_factory=set)  # erased once replaced

    @property
    def tokens(self) -> int:
        return size_hint(self.h.meta["val"].shape[0])

    @property
    def hidden(self) -> int:
        return size_hint(self.h.meta["val"].shape[1])

    @property
    def vocab(self) -> int:
        return size_hint(self.weight.meta["val"].shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.h.meta["val"].dtype

    def logits_bytes(self) -> int:
        """Bytes of the unfused graph's [tokens, V] values (logits, their fp32 copy, the
        log-probabilities, their gradients), what the fused op never holds at once."""
        return sum(tensor_nbytes(n.meta.get("val")) for n in self.nodes
                   if not _is_alias(n) and _is_logits_sized(n, self.tokens, self.vocab))

    def workspace(self, chunk: int) -> int:
        return workspace_bytes(self.tokens, self.hidden, self.vocab, chunk, self.dtype,
                               self.weight.meta["val"].dtype, self.upcast)


@dataclass
class Refused:
    """A cross-entropy left unfused, and why."""

    where: str  # the nll_loss_forward node's name
    reason: str


def _is_alias(node: fx.Node) -> bool:
    return node.op == "call_function" and (_viewish(node) or node.target in _DETACH
                                          or node.target is operator.getitem)


def _is_logits_sized(node: fx.Node, tokens: int, vocab: int) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.numel() == tokens * vocab


def _upstream(node: fx.Node, chain: list[fx.Node]) -> tuple[fx.Node, bool]:
    """Walk up from ``node`` through views and casts (appending them to ``chain``): the first
    other node, and whether a cast was crossed."""
    cast = False
    while node.op == "call_function" and (_viewish(node) or node.target in _CASTS):
        chain.append(node)
        cast = cast or node.target in _CASTS
        node = node.all_input_nodes[0]
    return node, cast


def _root_through(node: fx.Node) -> tuple[fx.Node, int]:
    """The node ``node`` is a view of (through transposes and views), and how many transposes
    were crossed."""
    flips = 0
    while node.op == "call_function" and (_viewish(node) or node.target in _DETACH):
        flips += node.target in _TRANSPOSES
        node = node.all_input_nodes[0]
    return node, flips


def _downstream(node: fx.Node, chain: set[fx.Node]) -> list[fx.Node]:
    """The non-view, non-cast readers reached from ``node`` through views, casts and
    transposes (all added to ``chain``)."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        for user in n.users:
            if user.op == "call_function" and (_viewish(user) or user.target in _CASTS):
                chain.add(user)
                stack.append(user)
            else:
                out.append(user)
    return out


def find(graph: fx.Graph) -> tuple[list[LossMatch], list[Refused]]:
    """Every fusable output projection + cross-entropy of the joint graph, and those left
    alone with their reason."""
    found, refused = [], []
    for nll in graph.find_nodes(op="call_function", target=_NLL):
        result = _match(nll)
        (found if isinstance(result, LossMatch) else refused).append(result)
    return found, refused


def _match_backward(nll: fx.Node, logp: fx.Node, total: fx.Node | None,
                    roots: tuple[fx.Node, fx.Node], nodes: set[fx.Node]
                    ) -> tuple[fx.Node | None, fx.Node | None, fx.Node | None, bool] | str:
    """The backward of the pattern (see the module): ``(the loss's incoming gradient, the
    matmul giving ``h``'s gradient, the one giving ``W``'s, whether the latter gives its
    transpose)``, all None where the graph has no backward, or why it does not match. Adds
    the nodes it crosses to ``nodes``. ``roots``: the weight's and ``h``'s view roots."""
    nll_bw = [u for u in logp.users if u.target is _NLL_BW]
    if not nll_bw:
        return None, None, None, False
    _, target, _, reduction, ignore_index = nll.args[:5]
    if len(nll_bw) != 1 or nll_bw[0].args[6] is not total or nll_bw[0].args[2] is not \
            target or list(nll_bw[0].args[3:6]) != [None, reduction, ignore_index]:
        return "the nll_loss_backward does not match its forward"
    nodes.add(nll_bw[0])
    bw_users = list(nll_bw[0].users)
    if len(bw_users) != 1 or bw_users[0].target is not _LOG_SOFTMAX_BW:
        return (f"the nll_loss's gradient is also read by {[u.name for u in bw_users]} "
                "outside the log-softmax's backward (another term of the loss, such as label "
                "smoothing, reads the log-probabilities)")
    ls_bw = bw_users[0]
    nodes.add(ls_bw)
    if _root_through(ls_bw.args[1])[0] is not logp:
        return "the log-softmax's backward does not read its output"
    walk = ls_bw.args[1]
    while walk is not logp:
        nodes.add(walk)
        walk = walk.all_input_nodes[0]
    grad_chain: set[fx.Node] = set()
    readers = _downstream(ls_bw, grad_chain)
    nodes.update(grad_chain)
    if len(readers) != 2 or any(r.target is not _MM for r in readers):
        return ("the logits' gradient is not read by exactly the two matmuls of the "
                "projection's backward")
    grad_h_mm = grad_w_mm = None
    transposed = False
    for r in readers:
        a, b = r.args
        grad_first = a in grad_chain or a is ls_bw
        other = _root_through(b if grad_first else a)[0]
        if other is roots[0]:
            grad_h_mm = r
        elif other is roots[1]:
            grad_w_mm, transposed = r, not grad_first
        else:
            return (f"the logits' gradient is multiplied by {other.name}, neither the weight "
                    "nor the hidden states")
        nodes.add(r)
    if grad_h_mm is None or grad_w_mm is None:
        return "the projection's backward matmuls were not both found"
    return nll_bw[0].args[0], grad_h_mm, grad_w_mm, transposed


def _match(nll: fx.Node) -> LossMatch | Refused:  # noqa: PLR0911
    """The pattern around ``nll`` (see the module), or why not."""

    def no(reason: str) -> Refused:
        return Refused(nll.name, reason)

    logp, target, weight_arg, reduction, ignore_index = (list(nll.args) + [None] * 5)[:5]
    if weight_arg is not None:
        return no("cross-entropy with class weights")
    if reduction not in (MEAN, SUM):
        return no(f"reduction {reduction!r} (only mean and sum are fused)")
    if not isinstance(logp, fx.Node) or logp.target is not _LOG_SOFTMAX:
        return no("the nll_loss does not read a _log_softmax")
    x = logp.args[0]
    if logp.args[1] not in (1, -1) or logp.args[2] or x.meta["val"].dim() != 2:
        return no("the log-softmax is not over the last dimension of [tokens, V] logits")
    nodes: set[fx.Node] = {nll, logp}
    chain: list[fx.Node] = []
    mm, upcast = _upstream(x, chain)
    nodes.update(chain)
    if mm.target is _aten.addmm.default:
        return no("the output projection has a bias (addmm)")
    if mm.target is not _MM:
        return no(f"the logits come from {mm.target}, not an mm of the output projection")
    nodes.add(mm)
    h, wt = mm.args
    if wt.target not in _TRANSPOSES or wt.meta["val"].dim() != 2:
        return no("the projection's second operand is not a transposed [V, D] weight")
    weight = wt.args[0]
    w_root, h_root = _root_through(weight)[0], _root_through(h)[0]
    if upcast and x.meta["val"].dtype != torch.float32:
        return no("the logits are cast to another dtype than fp32")
    tokens = size_hint(h.meta["val"].shape[0])
    if size_hint(target.meta["val"].numel()) != tokens or target.meta["val"].dim() != 1:
        return no("the targets are not one per token")
    # Forward readers: the nll's two getitems.
    loss = total = None
    for user in nll.users:
        if user.target is not operator.getitem:
            return no(f"the nll_loss is read by {user.name}")
        if user.args[1] == 0:
            loss = user
        else:
            total = user
            nodes.add(user)
    # Backward: nll_loss_backward and _log_softmax_backward_data.
    detaches = [u for u in logp.users if u.target in _DETACH]
    backward = _match_backward(nll, logp, total, (w_root, h_root), nodes)
    if isinstance(backward, str):
        return no(backward)
    grad_out, grad_h_mm, grad_w_mm, transposed = backward
    nodes.update(d for d in detaches)
    # Every intermediate read only inside the pattern.
    for n in list(nodes):
        if n in (grad_h_mm, grad_w_mm):
            continue
        outside = [u.name for u in n.users if u not in nodes and u is not loss]
        if outside:
            return no(f"{n.name} (part of the logits' computation) is also read by "
                      f"{outside}: the full logits are needed (returned to the user, or read "
                      "by another term such as label smoothing)")
    return LossMatch(h, weight, target, nll, loss, grad_out, grad_h_mm, grad_w_mm, transposed,
                     upcast, reduction, ignore_index, nodes)


def rewrite(graph: fx.Graph, match: LossMatch, chunk: int) -> None:
    """Replace ``match`` by the fused op (``chunk`` tokens per chunk) in ``graph``."""
    with graph.inserting_before(match.nll):
        fused = call(graph, FUSED_CE_OP, (match.h, match.weight, match.target, chunk,
                                          match.ignore_index, match.reduction, match.upcast))
        loss, grad_h, grad_w = (call(graph, operator.getitem, (fused, i)) for i in range(3))
    if match.loss is not None:
        match.loss.replace_all_uses_with(loss)
        match.nodes.add(match.loss)
    if match.grad_h_mm is not None:
        with graph.inserting_before(match.grad_h_mm):
            scaled_h = call(graph, _aten.mul.Tensor, (grad_h, match.grad_out))
        match.grad_h_mm.replace_all_uses_with(scaled_h)
        with graph.inserting_before(match.grad_w_mm):
            scaled_w = call(graph, _aten.mul.Tensor, (grad_w, match.grad_out))
            if match.grad_w_transposed:
                scaled_w = call(graph, _aten.t.default, (scaled_w,))
        match.grad_w_mm.replace_all_uses_with(scaled_w)
    operands = {a for n in match.nodes for a in n.all_input_nodes} - match.nodes
    _erase(graph, match.nodes)
    _erase_dead_views(graph, operands)
    for node in (fused, loss, grad_h, grad_w):
        node.meta["shardc_fused_loss"] = True


def _erase(graph: fx.Graph, nodes: set[fx.Node]) -> None:
    """Erase ``nodes`` (dead once replaced), readers first."""
    order = [n for n in reversed(graph.nodes) if n in nodes]
    for node in order:
        if node.users:
            raise AssertionError(f"shardc: fused loss: {node.name} still read by "
                                 f"{list(node.users)}")
        graph.erase_node(node)


def _erase_dead_views(graph: fx.Graph, nodes: set[fx.Node]) -> None:
    """Erase the views and transposes among ``nodes`` (and their own view inputs) that nothing
    reads any more: the weight's transposes of the erased matmuls."""
    stack, erased = list(nodes), set()
    while stack:
        node = stack.pop()
        if node in erased or node.users or not _is_alias(node) \
                or node.target is operator.getitem:
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        stack.extend(inputs)


@dataclass
class Fused:
    """What :func:`fuse` did to one cross-entropy."""

    where: str
    tokens: int
    hidden: int
    vocab: int
    chunk: int
    logits_bytes: int
    workspace_bytes: int
    upcast: bool
    reduction: int
    ignore_index: int


def fuse(gm: fx.GraphModule, chunk: int | None = None) -> tuple[list[Fused], list[Refused]]:
    """Fuse every matching output projection + cross-entropy of the joint graph ``gm`` (changed
    in place), ``chunk`` tokens per chunk (None: :func:`tokens_per_chunk`); returns what was
    fused and what was left alone, with why."""
    found, refused = find(gm.graph)
    done = []
    for match in found:
        if match.grad_out is None:
            refused.append(Refused(match.nll.name, "no backward (forward-only graph)"))
            continue
        per = chunk or tokens_per_chunk(match.tokens, match.vocab)
        per = max(1, min(per, match.tokens))
        done.append(Fused(match.nll.name, match.tokens, match.hidden, match.vocab, per,
                          match.logits_bytes(), match.workspace(per), match.upcast,
                          match.reduction, match.ignore_index))
        rewrite(gm.graph, match, per)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done, refused


def decompose_whole_loss_ops(gm: fx.GraphModule) -> int:
    """Decompose, in the joint graph ``gm`` (in place), the loss ops that shardc's backend kept
    out of Inductor's decompositions (:data:`LOSS_OPS`) and the fused loss did not replace, as
    Inductor's decompositions would have before the joint graph was made: each node is traced
    through Inductor's table (its fake values, ``make_fx``) and the trace inlined in its place,
    with its metadata (recompute tags, stack trace). Returns the nodes decomposed."""
    from shardc import _torch
    from shardc.passes.fx_utils import fake_mode_of

    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in LOSS_OPS]
    if not nodes:
        return 0
    table = {**_torch.inductor_decompositions(), _NLL_BW: _nll_loss_backward_pointwise}
    mode = fake_mode_of(gm.graph)
    for node in nodes:
        inputs = [a for a in node.args if isinstance(a, fx.Node)]

        def run(*tensors, node=node):
            it = iter(tensors)
            args = [next(it) if isinstance(a, fx.Node) else a for a in node.args]
            return node.target(*args, **node.kwargs)

        with mode:
            traced = _torch.trace_decomposed(run, table, [a.meta["val"] for a in inputs])
        _inline(gm, node, traced, inputs)
    gm.graph.lint()
    gm.recompile()
    return len(nodes)


def _nll_loss_backward_pointwise(grad_output, logp, target, weight, reduction, ignore_index,
                                 total_weight):
    """``nll_loss_backward`` of ``[tokens, V]`` log-probs as a comparison with the class index
    (pointwise: a fusing compiler inlines it), the form Inductor's joint-graph passes give the
    table's ``scatter`` (they ran before this pass could decompose it)."""
    if weight is not None or logp.dim() != 2 or reduction not in (MEAN, SUM):
        from shardc import _torch

        return _torch.inductor_decompositions()[_NLL_BW](
            grad_output, logp, target, weight, reduction, ignore_index, total_weight)
    classes = torch.arange(logp.shape[1], device=logp.device)
    hit = (classes.unsqueeze(0) == target.unsqueeze(1)) & (target != ignore_index).unsqueeze(1)
    scale = -grad_output / total_weight if reduction == MEAN else -grad_output
    return torch.where(hit, scale, 0.0).to(logp.dtype)


def _inline(gm: fx.GraphModule, node: fx.Node, traced: fx.GraphModule,
            inputs: list[fx.Node]) -> None:
    """Put ``traced`` (a trace of ``node`` on ``inputs``) in ``node``'s place."""
    placeholders = list(traced.graph.find_nodes(op="placeholder"))
    env = dict(zip(placeholders, inputs, strict=True))
    inherited = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
    with gm.graph.inserting_before(node):
        for sub in traced.graph.nodes:
            if sub.op in ("placeholder", "output"):
                continue
            if sub.op == "get_attr":
                raise NotImplementedError(f"shardc: decomposing {node.target} made a constant")
            new = gm.graph.node_copy(sub, lambda n: env[n])
            for key, value in inherited.items():
                new.meta.setdefault(key, value)
            env[sub] = new
    out = traced.graph.output_node().args[0]
    if isinstance(out, (list, tuple)):
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise NotImplementedError(f"shardc: {node.name} is read whole by {user.name}")
            user.replace_all_uses_with(env[out[user.args[1]]])
            gm.graph.erase_node(user)
    else:
        node.replace_all_uses_with(env[out])
    gm.graph.erase_node(node)


def is_fused_loss(node: fx.Node) -> bool:
    """Whether ``node`` calls the fused op."""
    return op_overload(node) is FUSED_CE_OP
