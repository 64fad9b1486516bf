"""The CUDA caching allocator's reserved memory, estimated from a plan made on the CPU (s55 probe).

    PYTHONPATH=$PWD python docs/bench/compile_time/s55/plan_reserved.py LAYERS MODE BATCH [WORLD]

(MODE: ``perparam`` or ``packed``.)

Plans the benchmarks' 1b config (world 1, bf16, Inductor, blocks compiled once, as
``train_bench.py``'s ``shardc`` / ``shardc-packed`` run it on one H200) with the capacity
planner's code on this CPU, without a template, and catches the peak prediction's graphs (it
wraps ``shardc.compile.pipeline.predict_peak``: a probe, not shipped code). Then it replays the
predicted lifetimes through ``shardc.memory.caching_allocator`` for five steps: the parameters
first, each graph's values at the positions the prediction gives them (frees before requests at
a position), the forward's saved values freed at their last use in the backward, AdamW's state
(two tensors per parameter, made after the first backward) and one parameter-sized temporary
per parameter in each optimizer step, the gradients freed after it. Prints the model's reserved
and allocated peaks per step and which requests made segments after the first step.
An estimate: the request stream is the plan's, not Inductor's (its order within a position, its
reuse of dead buffers as the prediction models it), and torch's optimizer temporaries are
modelled as one per parameter."""

import collections
import dataclasses
import sys
import time

import torch
from torch import fx

import shardc.compile.pipeline as pipeline
from shardc.memory import peak as peak_mod
from shardc.memory.caching_allocator import CachingAllocatorModel
from shardc.models.llama import LlamaConfig, Transformer
from shardc.passes.body import flattened
from shardc.tools import planner

GiB = 2**30
captured: dict = {}
_predict_peak = pipeline.predict_peak


def _spy(fw, bw, plan, params, bw_params, **kw):
    captured.update(fw=fw, bw=bw, params=params, bw_params=bw_params)
    return _predict_peak(fw, bw, plan, params, bw_params, **kw)


@dataclasses.dataclass(frozen=True)
class Setup(planner.PlanSetup):
    pack: bool = False

    def shard_kwargs(self):
        kw = super().shard_kwargs()
        if self.pack:
            kw["pack_blocks"] = True
        return kw


def lives_of(gm, skip):
    flat, mapping = flattened(gm, module_stacks=False, check=False)
    lives, storage = peak_mod.lifetimes_and_storage(flat, {mapping[p] for p in skip}, fusion=True)
    return flat, mapping, lives, storage


def events(lives, end):
    """(kind, lifetime) in order: at each position the frees, then the requests."""
    born, dies = {}, {}
    for life in lives:
        born.setdefault(life.born, []).append(life)
        dies.setdefault(life.last + 1, []).append(life)
    for pos in range(end + 2):
        for life in dies.get(pos, ()):
            yield "free", life
        for life in born.get(pos, ()):
            yield "alloc", life


def replay(model, kind, life, addr, graph, made) -> None:
    """One event of a graph's lifetimes; ``graph``: (phase, its outputs, its end, where an output
    that lives past the graph goes: ``keep(node, address)``); ``made``: where to note requests
    that make a segment (None: not noted)."""
    phase, outputs, end, keep = graph
    if kind == "alloc":
        if made is not None and model.would_make_segment(life.nbytes):
            made.append((phase, life.node.name, life.nbytes))
        addr[life.node] = model.malloc(life.nbytes)
    elif life.node in outputs and life.last >= end:
        keep(life.node, addr.pop(life.node))
    else:
        model.free(addr.pop(life.node))


def main() -> None:
    layers, pack, batch = int(sys.argv[1]), sys.argv[2] == "packed", int(sys.argv[3])
    world = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    pipeline.predict_peak = _spy
    cfg = LlamaConfig(vocab_size=32000, dim=2048, n_layers=layers, n_heads=16, max_seq_len=2048)
    start = time.time()
    planned = planner.plan_model_step(
        cfg, world, batch, 2048, {"compile_blocks_once": True}, template=False,
        setup=Setup(precision="bf16", inductor=True, pack=pack))
    print(f"planned in {time.time() - start:.1f} s; predicted peak "
          f"{planned.plan.predicted.peak_bytes / GiB:.2f} GiB")
    fw, bw = captured["fw"], captured["bw"]
    ffw, _, flives, fstore = lives_of(fw, captured["params"])
    fbw, bmap, blives, bstore = lives_of(bw, captured["bw_params"])
    fout = list(ffw.graph.output_node().args[0])
    # The saved values: forward outputs named as backward placeholders (unflattened names).
    names = [a.name if isinstance(a, fx.Node) else None for a in fw.graph.output_node().args[0]]
    placeholders = {n.name: bmap[n] for n in bw.graph.find_nodes(op="placeholder")}
    saved = {placeholders[name]: fstore[fout[k]] for k, name in enumerate(names)
             if name in placeholders and isinstance(fout[k], fx.Node)}
    shard_bytes = [peak_mod._nbytes(p.meta["val"]) for p in captured["params"]]
    with torch.device("meta"):
        # this rank's shard of each parameter (dim 0 split as torch.chunk splits it)
        each_param = [-(-p.shape[0] // world) * (p.numel() // p.shape[0]) * 4
                      for p in Transformer(cfg).parameters()]
    model = CachingAllocatorModel()
    for nbytes in shard_bytes:
        model.malloc(nbytes)
    fend, bend = len(ffw.graph.nodes), len(fbw.graph.nodes)
    fw_outputs = {fstore[a] for a in fout if isinstance(a, fx.Node)}
    bw_outputs = {bstore[a] for a in fbw.graph.output_node().args[0] if isinstance(a, fx.Node)}
    state, made = [], []
    for step in range(5):
        addr, kept = {}, {}
        for kind, life in events(flives, fend):
            if life.nbytes:
                replay(model, kind, life, addr, ("fw", fw_outputs, fend, kept.__setitem__),
                       made if step else None)
        fwd_reserved = model.reserved
        refs = collections.Counter(root for root in saved.values() if root in kept)
        grads: dict = {}
        for kind, life in events(blives, bend):
            if life.node in saved:
                root = saved[life.node]
                if kind == "free" and root in kept:
                    refs[root] -= 1
                    if refs[root] == 0:
                        model.free(kept.pop(root))
                continue
            if life.nbytes:
                replay(model, kind, life, addr,
                       ("bw", bw_outputs, bend, grads.__setitem__),
                       made if step else None)
        for root in [r for r in kept if refs.get(r, 0) == 0]:
            model.free(kept.pop(root))  # outputs not saved (the loss): freed at the step's end
        bwd_reserved = model.reserved
        if not state:
            for nbytes in each_param:
                state += [model.malloc(nbytes), model.malloc(nbytes)]
        for address in [model.malloc(nbytes) for nbytes in each_param]:
            model.free(address)
        for address in grads.values():
            model.free(address)
        print(f"step {step}: reserved after fw {fwd_reserved / GiB:.2f} bw "
              f"{bwd_reserved / GiB:.2f} peak reserved {model.peak_reserved / GiB:.2f} peak "
              f"alloc {model.peak_allocated / GiB:.2f} segments {model.segments}")
    by_size = collections.Counter((phase, nbytes) for phase, _, nbytes in made)
    print("segments made after step 0:", len(made), f"{sum(n for *_, n in made) / GiB:.2f} GiB")
    for (phase, nbytes), count in by_size.most_common(12):
        print(f"  {phase} {nbytes} B x {count}")


if __name__ == "__main__":
    main()
