"""A region's donated buffers kept where its backward calls block bodies.

AOTAutograd donates to a backward the saved tensors nothing else holds (``donated_buffer``):
their positions among the backward's inputs, ``bw_donated_idxs``, are the number of saved
symbolic sizes (the backward's first inputs) plus each donated tensor's position among the
saved tensors (``collect_bw_donated_buffer_idxs`` in torch/_functorch/_aot_autograd/
graph_compile.py, torch 2.11-2.14). Inductor lowers the backward's input at such a position as
a buffer it may overwrite, and, by a bug of torch's, also the input at that position of every
subgraph it compiles inside that backward (each ``SubgraphLowering`` reads the same positions
and numbers its own placeholders from 0: ``GraphLowering.placeholder``), so a body overwrote
buffers its caller still used (docs/design.md, *Bodies own none of their inputs*).

:func:`order_for_body_donations` puts the saved tensors AOTAutograd does not donate (parameter
shards, values the forward also returns) before those it does, so that the first donated
position is at least the number of inputs of the largest subgraph the backward calls: no
subgraph placeholder can then be at a donated position, and the region keeps its donations.
Where there are too few such values (a model of few blocks, each packed into one input:
``pack_blocks``), it pads them: the first saved value not donated is saved again, as often as
the first donated position falls short, as extra outputs of the forward and inputs of the
backward that nothing reads. A duplicate shares its storage with a value the backward already
holds, so it costs no memory and is never donated itself. Without any value to repeat, the
donations stay off for that region (the backend's default for regions with bodies). It stamps
each saved input of the backward with whether it is donated (:data:`DONATED`), which the peak
model reads (``shardc.memory.inplace``).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import fx

from shardc import _torch
from shardc.passes.lower import POOL_PLACEHOLDER
from shardc.passes.saved_order import saved_inputs

log = logging.getLogger("shardc")

# ``node.meta`` key of a backward's saved inputs: whether AOTAutograd donates it to the
# backward as this pass left the graphs (with the region's switch as the backend sets it).
DONATED = "shardc_donated"


@dataclasses.dataclass(frozen=True)
class BodyDonations:
    """What :func:`order_for_body_donations` decided for one backward."""

    kept: bool  # whether AOTAutograd's donated buffers stay on for the region
    body_inputs: int  # the most placeholders of any subgraph the backward calls (0: none)
    donated: int  # saved tensors AOTAutograd donates (with ``kept``)
    first: int | None  # the first donated position among the backward's inputs (None: none)
    reason: str = ""  # why they are off (``kept`` False)
    padded: int = 0  # saved values repeated before the donated ones (``kept``)

    def note(self) -> str:
        """The plan's note (only for backwards that call subgraphs)."""
        if self.kept:
            where = f"from input {self.first} on" if self.first is not None else "none"
            pads = (f"; {self.padded} saved value(s) repeated before them to get there"
                    if self.padded else "")
            return (f"donated buffers kept with block bodies: {self.donated} saved value(s) "
                    f"donated ({where}), after every body's {self.body_inputs} input(s)"
                    f"{pads}")
        return f"donated buffers off (block bodies): {self.reason}"


def subgraph_inputs(bw: fx.GraphModule) -> int:
    """The most placeholders of any graph module ``bw`` holds (the bodies Inductor compiles
    inside it, nested ones and a recomputed body's forward included; one it no longer calls
    counts too, which only asks for more); 0 without any."""
    return max((len(m.graph.find_nodes(op="placeholder")) for name, m in bw.named_modules()
                if name and isinstance(m, fx.GraphModule)), default=0)


def _saved_inputs(bw: fx.GraphModule) -> list[fx.Node]:
    """The backward's inputs that are saved values (``saved_order.saved_inputs``), less
    shardc's pool, which lowering puts among them."""
    return [ph for ph in saved_inputs(bw) if ph.name != POOL_PLACEHOLDER]


def _is_tensor(node: object) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def _is_symbolic(node: object) -> bool:
    """A symbolic size as AOTAutograd counts them (``is_sym_node``: a ``Sym*`` value)."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _no_vc_check(node: fx.Node) -> bool:
    return bool(node.meta.get("saved_tensor_with_no_vc_check"))


def _same_value(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return va.shape == vb.shape and va.dtype == vb.dtype


def _donated_last(tensors: list[fx.Node], donated: set[int]) -> list[int]:
    """Positions among the saved ``tensors`` in the new order: within each of AOTAutograd's
    two tensor groups (checked against in-place changes, then not: their order is fixed), the
    ones not donated first, each part in its old order."""
    groups = ([j for j, n in enumerate(tensors) if not _no_vc_check(n)],
              [j for j, n in enumerate(tensors) if _no_vc_check(n)])
    return [j for group in groups for j in sorted(group, key=lambda j: j in donated)]


def _stamp(saved_in: list[fx.Node], donated: set[fx.Node]) -> None:
    for node in saved_in:
        node.meta[DONATED] = node in donated


def _permute(fw: fx.GraphModule, bw: fx.GraphModule, saved_in: list[fx.Node], start: int,
             num_symbolic: int, order: list[int]) -> None:
    """Reorder the saved tensors in both graphs: the forward's outputs from ``start`` and the
    backward's inputs after its ``num_symbolic`` symbolic sizes take ``order``'s positions."""
    output = fw.graph.output_node()
    outs = tuple(output.args[0])
    n = len(order)
    new_outs = outs[:start] + tuple(outs[start + j] for j in order) + outs[start + n:]
    output.args = (new_outs,) + tuple(output.args[1:])
    descs = output.meta.get("desc")
    if isinstance(descs, (list, tuple)) and len(descs) == len(outs):
        output.meta["desc"] = (list(descs[:start]) + [descs[start + j] for j in order]
                               + list(descs[start + n:]))
    tensors = saved_in[num_symbolic:num_symbolic + n]
    anchor = tensors[-1].next
    for j in order:
        anchor.prepend(tensors[j])
    fw.recompile()
    bw.recompile()


def order_for_body_donations(fw: fx.GraphModule, bw: fx.GraphModule, *, enabled: bool = True
                             ) -> BodyDonations | None:
    """Order the saved tensors of a partitioned, lowered forward and backward so that AOTAutograd
    may keep donating them to the backward although it calls subgraphs (see the module
    docstring), and stamp the backward's saved inputs with :data:`DONATED`. Returns the decision,
    or None for graphs it cannot read (not partitioned by AOTAutograd's conventions, or a torch
    without its rule); then nothing is stamped and a backward with subgraphs is compiled with
    donations off. Where too few saved values are not donated, one is saved again until the
    donated ones come after every body's inputs (:func:`_pad`). Deterministic: it reads only
    the graphs' structure (the same on every rank).

    The saved values are the forward's last outputs and the backward's inputs before its
    tangents, in AOTAutograd's orders (``shardc.passes.saved_order``): the forward's
    ``[tensors, opaque objects, symbolic sizes]``, the backward's ``[symbolic sizes, tensors,
    opaque objects]``; the tensors pair up by position. ``enabled`` False (AOTAutograd's
    ``donated_buffer`` switch off): nothing is donated, every saved input is stamped so, and
    nothing is reordered."""
    saved_in = _saved_inputs(bw)
    outs = list(fw.graph.output_node().args[0])
    if len(saved_in) > len(outs):
        return None
    start = len(outs) - len(saved_in)
    saved_out = outs[start:]
    num_symbolic = sum(map(_is_symbolic, saved_out))
    num_tensors = sum(map(_is_tensor, saved_out))
    tensors_out = saved_out[:num_tensors]
    tensors_in = saved_in[num_symbolic:num_symbolic + num_tensors]
    if not (all(map(_is_tensor, tensors_out)) and all(map(_is_tensor, tensors_in))
            and all(map(_is_symbolic, saved_in[:num_symbolic]))
            and all(map(_same_value, tensors_out, tensors_in))):
        log.debug("shardc: saved values out of AOTAutograd's order; donations not ordered")
        return None
    positions = _torch.donated_saved_tensors(fw, bw, start, num_tensors)
    if positions is None:
        return None
    body_inputs = subgraph_inputs(bw)
    if not enabled:
        _stamp(saved_in, set())
        return BodyDonations(False, body_inputs, 0, None,
                             reason="AOTAutograd's donated_buffer is off")
    donated = set(positions)
    order = _donated_last(tensors_in, donated) if body_inputs else list(range(num_tensors))
    moved = [j for j in order if j in donated]
    first = num_symbolic + order.index(moved[0]) if moved else None
    pad_from = None
    if first is not None and first < body_inputs:
        pad_from = _pad_source(tensors_in, order, donated)
        if pad_from is None:
            _stamp(saved_in, set())
            return BodyDonations(False, body_inputs, 0, None, reason=(
                f"{first} saved value(s) not donated can precede the {len(moved)} donated, a "
                f"body takes {body_inputs} input(s), and none can be repeated"))
    if order != sorted(order):
        _permute(fw, bw, saved_in, start, num_symbolic, order)
    donated_in = {tensors_in[j] for j in moved}
    padded = 0
    if pad_from is not None:
        padded = body_inputs - first
        _pad(fw, bw, start + order.index(moved[0]), tensors_in[moved[0]],
             order.index(pad_from), start, padded)
        _check_padded(fw, bw, start, num_symbolic, num_tensors + padded, donated_in)
        first += padded
        saved_in = _saved_inputs(bw)
    _stamp(saved_in, donated_in)
    return BodyDonations(True, body_inputs, len(moved), first, padded=padded)


def _pad_source(tensors_in: list[fx.Node], order: list[int], donated: set[int]) -> int | None:
    """The saved tensor to repeat before the donated ones (its old position): the first one
    not donated that AOTAutograd checks against in-place changes (the group the repeats join,
    which comes before the unchecked one); None if there is none."""
    for j in order:
        if j not in donated and not _no_vc_check(tensors_in[j]):
            return j
    return None


def _pad(fw: fx.GraphModule, bw: fx.GraphModule, out_at: int, in_before: fx.Node,
         source_at: int, start: int, count: int) -> None:
    """Save the forward's output at ``start + source_at`` (saved tensors already in their new
    order) ``count`` more times: outputs inserted at ``out_at`` (the first donated one's),
    placeholders of the backward inserted before ``in_before`` (its first donated input), none
    read."""
    output = fw.graph.output_node()
    outs = tuple(output.args[0])
    source = outs[start + source_at]
    output.args = (outs[:out_at] + (source,) * count + outs[out_at:],) + tuple(output.args[1:])
    descs = output.meta.get("desc")
    if isinstance(descs, (list, tuple)) and len(descs) == len(outs):
        output.meta["desc"] = (list(descs[:out_at]) + [descs[start + source_at]] * count
                               + list(descs[out_at:]))
    with bw.graph.inserting_before(in_before):
        for i in range(count):
            pad = bw.graph.placeholder(f"shardc_donation_pad_{i}")
            pad.target = pad.name  # (the generated code's argument: unique as the node's name)
            pad.meta["val"] = source.meta["val"]
    fw.recompile()
    bw.recompile()


def _check_padded(fw: fx.GraphModule, bw: fx.GraphModule, start: int, num_symbolic: int,
                  num_tensors: int, donated_in: set[fx.Node]) -> None:
    """AOTAutograd's rule, asked again of the padded graphs, donates exactly the inputs
    ordered as donated (the repeats none): else the padding is wrong, which must not compile."""
    positions = _torch.donated_saved_tensors(fw, bw, start, num_tensors)
    tensors_in = _saved_inputs(bw)[num_symbolic:num_symbolic + num_tensors]
    if positions is None or {tensors_in[j] for j in positions} != donated_in:
        raise AssertionError("shardc: the saved values padded for block bodies' donations are "
                             "not donated as ordered; please report this graph")
