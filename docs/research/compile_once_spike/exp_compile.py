"""Spike 18: time the stages of shardc's first compiled step, with and without
torch.compiler.nested_compile_region around the blocks.

python scratch/exp_compile.py --layers 16 --mode {plain,region_in,region_out} [--inductor]
  plain      : today's path (every block traced inline)
  region_in  : each block's forward wrapped in nested_compile_region; gathers happen inside
  region_out : Design A prototype: the parent gathers a block's parameters (shardc properties),
               then calls a nested_compile_region'd pure function (functional_call on an
               unsharded meta skeleton of the block) with them as arguments
Single process, 1-rank gloo group (file store), tiny Llama from shardc.models.llama.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

T = collections.defaultdict(float)   # stage -> seconds
N = collections.Counter()


def timed(name, fn):
    @functools.wraps(fn)
    def run(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T[name] += time.perf_counter() - t
            N[name] += 1
    return run


def install_timers(inductor: bool):
    import sys; import shardc; B = sys.modules["shardc.backend"]
    import torch._functorch.partitioners as P
    import torch._inductor.compile_fx as CF
    B.ShardcPartitioner.__call__ = timed("partitioner_total", B.ShardcPartitioner.__call__)
    B.ShardcPartitioner.plan_inference = timed("plan_inference", B.ShardcPartitioner.plan_inference)
    P.min_cut_rematerialization_partition = timed("min_cut", P.min_cut_rematerialization_partition)
    B.plan_region = timed("plan_region", B.plan_region)
    B.apply_plan = timed("lower(apply_plan)", B.apply_plan)
    B.predict_peak = timed("predict_peak", B.predict_peak)
    B.order_saved_values = timed("saved_order", B.order_saved_values)
    B.dedupe_gathers = timed("dedupe", B.dedupe_gathers)
    CF.compile_fx_inner = timed("inductor(compile_fx_inner)", CF.compile_fx_inner)


def rewire_input_aliases(gm) -> int:
    """In the outer joint graph: where a forward invoke_subgraph returns one of its inputs
    unchanged (a weight the body saves for its backward), make the readers use the input itself
    (the gather's output), so the outer partitioner can recompute the gather in the backward
    instead of saving the gathered weight."""
    import operator
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.higher_order.invoke_subgraph:
            continue
        body = getattr(gm, node.args[0].target)
        places = body.graph.find_nodes(op="placeholder")
        (out,) = body.graph.find_nodes(op="output")
        results = out.args[0]
        for user in list(node.users):
            if user.target is operator.getitem:
                res = results[user.args[1]]
                if isinstance(res, torch.fx.Node) and res.op == "placeholder":
                    operand = node.args[2 + places.index(res)]
                    user.replace_all_uses_with(operand)
                    count += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return count


def body_recompute_partitioner(B, weight_shapes):
    """Prototype for Design A's memory problem: when AOTAutograd partitions the body of a
    nested_compile_region (a joint graph without shardc's ops), tag every forward node computed
    from weight inputs alone MUST_RECOMPUTE, so the body saves the weight inputs themselves (not
    transposes of them) and the outer graph can re-gather them for the backward."""
    from torch.utils.checkpoint import CheckpointPolicy
    from shardc.runtime.ops import GATHER_OP, REDUCE_SCATTER_OP
    original = B.ShardcPartitioner.__call__

    def call(self, gm, joint_inputs, **kwargs):
        ops = {n.target for n in gm.graph.nodes if n.op == "call_function"}
        if GATHER_OP in ops or REDUCE_SCATTER_OP in ops:
            T["outer_aliases_rewired"] = rewire_input_aliases(gm)
            return original(self, gm, joint_inputs, **kwargs)
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        weights = set()
        for n in gm.graph.find_nodes(op="placeholder"):
            val = n.meta.get("val")
            if n.name.startswith("primals") and val is not None and tuple(val.shape) in weight_shapes:
                weights.add(n)
        pure = set(weights)
        for n in gm.graph.nodes:
            if n.op != "call_function" or n.meta.get("partitioner_tag") == "is_backward":
                continue
            ins = n.all_input_nodes
            if ins and all(i in pure for i in ins):
                pure.add(n)
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                n.meta["ac_graph_id"] = 100000
        N["body_partitions"] += 1
        T["body_weights_tagged"] = len(weights)
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    B.ShardcPartitioner.__call__ = call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mode", default="plain", choices=["plain", "region_in", "region_out", "region_out_hash"])
    ap.add_argument("--inductor", action="store_true")
    ap.add_argument("--dump", default="")
    ap.add_argument("--steps", type=int, default=1)
    args = ap.parse_args()

    torch.set_num_threads(1)
    f = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
    import shardc
    import sys; import shardc; B = sys.modules["shardc.backend"]
    from shardc.models.llama import LlamaConfig, Transformer, TransformerBlock, llama_loss

    install_timers(args.inductor)
    if os.environ.get("BODY_RECOMPUTE"):
        from shardc.models.llama import TransformerBlock as _TB
        shapes = {tuple(p.shape) for p in _TB(LlamaConfig(dim=64, n_heads=4)).parameters()}
        body_recompute_partitioner(B, shapes)
    cfg = LlamaConfig(n_layers=args.layers, dim=64, n_heads=4, vocab_size=256, max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(cfg)
    ref_state = {k: v.clone() for k, v in model.state_dict().items()}
    shardc.shard(model)

    if args.mode == "region_in":
        body = torch.compiler.nested_compile_region(TransformerBlock.forward)
        for layer in model.layers:
            cls = type(layer)
            sub = type(f"Region{cls.__name__}", (cls,), {"forward": body})
            layer.__class__ = sub
            break
        for layer in model.layers:
            layer.__class__ = sub
    elif args.mode.startswith("region_out"):
        skeleton = TransformerBlock(cfg).to("meta")  # unsharded class, no real storage
        # region_out_hash (torch >= 2.13 only): a constant reuse key, so Dynamo skips tracing the
        # body again (the caller vouches that every call is the same computation).
        kw = {"reuse_hash_fn": lambda *a, **k: 0} if args.mode == "region_out_hash" else {}

        @torch.compiler.nested_compile_region(**kw)
        def block_body(params: dict, x, cos, sin):
            return torch.func.functional_call(skeleton, params, (x, cos, sin))

        names = [n for n, _ in skeleton.named_parameters()]

        def outer_forward(self, x, cos, sin):
            # Parent graph: one shardc gather per parameter (the sharded property).
            params = {}
            for n in names:
                owner, _, leaf = n.rpartition(".")
                params[n] = getattr(self.get_submodule(owner), leaf)
            return block_body(params, x, cos, sin)

        for layer in model.layers:
            cls = type(layer)
            sub = type(f"Outer{cls.__name__}", (cls,), {"forward": outer_forward})
            layer.__class__ = sub

    graphs = {}

    def backend(gm, example_inputs):
        graphs["dynamo"] = gm
        t = time.perf_counter()
        out = B.shardc_backend(gm, example_inputs, {"inductor": args.inductor})
        T["backend_total(aot+partition+plan+compile)"] += time.perf_counter() - t
        return out

    compiled = torch.compile(model, backend=backend)
    tokens = torch.randint(0, 256, (2, 16))
    targets = torch.randint(0, 256, (2, 16))
    losses = []
    t0 = time.perf_counter()
    loss = llama_loss(compiled(tokens), targets)
    t_fw = time.perf_counter() - t0
    loss.backward()
    t_step = time.perf_counter() - t0
    losses.append(loss.item())

    # reference: unsharded eager, same weights
    torch.manual_seed(0)
    ref = Transformer(cfg)
    ref.load_state_dict(ref_state)
    ref_loss = llama_loss(ref(tokens), targets)
    ref_loss.backward()
    g_ok = True
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if not torch.allclose(g, q.grad, atol=1e-5, rtol=1e-4):
            g_ok = False
            print("grad mismatch", n, (g - q.grad).abs().max().item())

    region = B.RegionRecord  # noqa
    from torch._dynamo.utils import compile_times
    plan = shardc.explain_all(compiled) if hasattr(shardc, "explain_all") else None
    res = {
        "layers": args.layers, "mode": args.mode, "inductor": args.inductor,
        "torch": torch.__version__,
        "first_forward_s": round(t_fw, 3), "first_step_s": round(t_step, 3),
        "loss_match": abs(losses[0] - ref_loss.item()) < 1e-5, "grads_match": g_ok,
        "stages_s": {k: round(v, 3) for k, v in T.items()},
        "calls": dict(N),
        "dynamo_graph_nodes": len(graphs["dynamo"].graph.nodes),
        "dynamo_subgraphs": [n for n, m in graphs["dynamo"].named_children()],
    }
    try:
        names, secs = compile_times(repr="csv", aggregate=True)
        res["dynamo_compile_times"] = {k: float(v) for k, v in zip(names, secs)}
    except Exception as e:  # noqa
        res["dynamo_compile_times"] = repr(e)
    if plan is not None:
        res["n_plans"] = len(plan)
    from torch._dynamo.utils import counters
    res["cache_counters"] = {f"{g}.{k}": v for g in ("inductor", "aot_autograd")
                             for k, v in counters[g].items() if "cache" in k or "bypass" in k}
    print(json.dumps(res, indent=1, default=str))
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        with open(os.path.join(args.dump, "dynamo.txt"), "w") as fh:
            fh.write(graphs["dynamo"].print_readable(print_output=False))
        st = shardc.backend  # region records through shard state
        from shardc.runtime.sharding import shard_state
        for i, r in enumerate(shard_state(model).regions):
            for nm, g in (("fw", r.forward), ("bw", r.backward)):
                if g is not None:
                    with open(os.path.join(args.dump, f"region{i}_{nm}.txt"), "w") as fh:
                        fh.write(g.print_readable(print_output=False))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
