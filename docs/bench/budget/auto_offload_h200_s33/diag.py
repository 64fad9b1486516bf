# s33 call 3 diagnostic: OffloadPolicy(params="auto") on one GPU, FX, small llama; where the backward's stream assert comes from
import os, tempfile, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import shardc
from shardc.models.llama import LlamaConfig, Transformer, llama_loss
from shardc.sharding import auto_offload
from shardc.compile import backend as B
torch.cuda.set_device(0)
dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)
mesh = init_device_mesh("cuda", (1,))
CFG = LlamaConfig(vocab_size=8000, dim=512, n_layers=2, n_heads=8, ffn_dim=1408, max_seq_len=128)
orig_move, orig_inputs = auto_offload.move_to_host, B._host_example_inputs
def move(state, chosen):
    p = next(iter(state.root().parameters()))
    print("before move: wrapper", p.device, "local", p.to_local().device, flush=True)
    n = orig_move(state, chosen)
    print("after move: wrapper", p.device, "local", p.to_local().device, "pinned", p.to_local().is_pinned(), flush=True)
    return n
def inputs(gm, ex, state):
    import torch.fx as fx
    print("dynamo offload targets", {repr(n.target)[:80] + " | " + type(n.target).__name__ for m in gm.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes if n.op == "call_function" and "offload" in repr(n.target)}, flush=True)
    out = orig_inputs(gm, ex, state)
    changed = [i for i, (a, b) in enumerate(zip(ex, out)) if a is not b or True][:0]
    print("example inputs swapped", len(changed), "of", len(ex), "fake?", [type(getattr(e, "_local_tensor", e)).__name__ for e in ex[:3]], [(type(out[i]).__name__, str(out[i].device), str(getattr(out[i], '_local_tensor', out[i]).device)) for i in changed[:3]], flush=True)
    return out
auto_offload.move_to_host, B._host_example_inputs = move, inputs
inductor = os.environ.get("DIAG_INDUCTOR") == "1"
torch.manual_seed(0)
model = Transformer(CFG).cuda()
shardc.shard(model, mesh, offload=shardc.OffloadPolicy(params="auto"))
shard_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
fwd = torch.compile(model, backend=shardc.backend(inductor=inductor, peak_memory_budget_bytes=int(3.0 * shard_bytes), peak_memory_margin=0.0))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
g = torch.Generator().manual_seed(5)
toks = torch.randint(0, CFG.vocab_size, (2, 129), generator=g).cuda()
loss = llama_loss(fwd(toks[:, :-1]), toks[:, 1:])
print("loss", loss.item(), "grad_fn", loss.grad_fn.name(), flush=True)
st = shardc.shard_state(model)
print("regions", len(st.regions), "offload_key", [r.offload_key for r in st.regions], flush=True)
r = st.regions[-1]
if r.forward is not None:
    ph = [n for n in r.forward.graph.nodes if n.op == "placeholder"]
    print("fw placeholders devices", sorted({str(getattr(n.meta.get("val"), "device", None)) for n in ph}), flush=True)
    print("fw to_device ops", sum(1 for n in r.forward.graph.nodes if "offload" in str(n.target)), flush=True)
if r.backward is not None:
    outs = [a for a in r.backward.graph.output_node().args[0] if a is not None]
    print("bw output devices", [str(getattr(a.meta.get("val"), "device", None)) for a in outs][:8], flush=True)
    print("bw offload ops", sorted({str(n.target) for n in r.backward.graph.nodes if "offload" in str(n.target)}), flush=True)
seen, stack = set(), [loss.grad_fn]
while stack:
    n = stack.pop()
    if n is None or n in seen: continue
    seen.add(n)
    md = getattr(n, "_input_metadata", None)
    devs = None
    try: devs = [str(m.device) for m in md] if md is not None else None
    except Exception as e: devs = repr(md)[:120]
    var = getattr(n, "variable", None)
    if var is not None:
        if len([s for s in seen if getattr(s, 'variable', None) is not None]) <= 3:
            print("  leaf", n.name(), "var wrapper", var.device, "local", getattr(var, '_local_tensor', var).device, "meta", devs, flush=True)
    else:
        print("  node", n.name(), "meta", devs, "next", len(n.next_functions), flush=True)
    stack.extend(f for f, _ in n.next_functions)
try:
    loss.backward()
    print("backward ok; grad", next(model.parameters()).grad.device, flush=True)
    opt.step(); opt.zero_grad()
    loss2 = llama_loss(fwd(toks[:, :-1]), toks[:, 1:]); loss2.backward(); opt.step()
    print("step 2 ok", loss2.item(), "regions", len(shardc.shard_state(model).regions), flush=True)
except Exception as e:
    print("backward failed:", type(e).__name__, str(e)[:200], flush=True)
print("peak", torch.cuda.max_memory_allocated(), "budget", int(3.0 * shard_bytes))
