"""Throwaway: capture predict_peak's arguments at N packed blocks (FX backend, world 1) and
time predict_peak / flattened on them, wall clock, medians of repeats."""
import os, sys, time, statistics, argparse
import torch, torch.distributed as dist
ROOT = os.getcwd()
sys.path[:0] = [ROOT, ROOT + "/benchmarks"]
p = argparse.ArgumentParser(); p.add_argument("--blocks", type=int, default=64)
p.add_argument("--repeat", type=int, default=5); a = p.parse_args()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
import bench_mesh
from train.runner import train_step
from train.shardc_mode import setup_shardc
from train.workload import build_model, model_config, synthetic_batches
import shardc.compile.pipeline as pl
from shardc.memory import peak
from shardc.passes import body
captured = []
orig = pl.predict_peak
def spy(*args, **kw):
    captured.append((args, kw)); return orig(*args, **kw)
pl.predict_peak = spy
cfg = model_config("1b", 32, True, a.blocks)
data = synthetic_batches(1, 2, 32, cfg.vocab_size, 0, torch.device("cpu"))
setup = setup_shardc(build_model(cfg, torch.device("cpu")), bench_mesh.build_mesh("cpu", 1, None, 1), True, pack_blocks=True, inductor=False)
opt = torch.optim.AdamW(setup.params, lr=1e-4)
train_step(setup, opt, *data[0])
args, kw = captured[0]
fw, bw = args[0], args[1]
def t(f):
    xs = []
    for _ in range(a.repeat):
        s = time.perf_counter(); f(); xs.append(time.perf_counter() - s)
    return statistics.median(xs)
import copy
res = orig(*args, **kw)
print("torch", torch.__version__, "blocks", a.blocks, "nodes fw/bw", len(fw.graph.nodes), len(bw.graph.nodes))
print("flat fw nodes", len(body.flattened(fw)[0].graph.nodes), "bw", len(body.flattened(bw)[0].graph.nodes))
print("predict_peak  %.3f s" % t(lambda: orig(*args, **kw)))
import gc
gc.disable()
print("flattened fw+bw (gc off) %.3f s" % t(lambda: (body.flattened(fw), body.flattened(bw))))
fl=body.flattened(bw)[0]
def copies():
    g = torch.fx.Graph(); m={}
    g.graph_copy(fl.graph, m)
print("graph_copy of flat bw %.3f s" % t(copies))
from shardc.passes import fx_utils
def plain(graph, node, tr):
    c = graph.create_node(node.op, node.target, (), {}, fx_utils._NUMBERED.sub("", node.name) or node.name, node.type)
    c.args = torch.fx.map_arg(node.args, tr); c.kwargs = torch.fx.map_arg(node.kwargs, tr)
    c.meta.update(node.meta)
    return c
old = body.copy_node
body.copy_node = plain
print("flattened fw+bw, args set after (gc off) %.3f s" % t(lambda: (body.flattened(fw), body.flattened(bw))))
print("predict_peak with it %.3f s" % t(lambda: orig(*args, **kw)))
res2 = orig(*args, **kw)
print("same", res2 == res)
body.copy_node = old
gc.enable()
print("result", res["peak_bytes"], res["forward_peak_bytes"], res["backward_peak_bytes"])
import hashlib, json
print("breakdown hash", hashlib.sha1(json.dumps(args[2].memory_by_category, sort_keys=True, default=str).encode()).hexdigest()[:12])
dist.destroy_process_group()
