# Times invoke_subgraph.gen_schema (torch re-tracing a body to build its schema) in the first step of the benchmarks' packed Llama (FX, world 1, CPU): python3 gen_schema_probe.py BLOCKS (s69). A probe: it wraps a torch method, never shardc code.
import os, sys, tempfile, time
R = "/work/main"; sys.path[:0] = [R, R + "/benchmarks"]
import torch, torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
import shardc
from train.workload import build_model, model_config
import importlib; isg = importlib.import_module("torch._higher_order_ops.invoke_subgraph")
spent = [0.0, 0]
orig = isg.InvokeSubgraphHOP.gen_schema
def timed(self, *a, **k):
    t = time.perf_counter(); r = orig(self, *a, **k); spent[0] += time.perf_counter() - t; spent[1] += 1; return r
isg.InvokeSubgraphHOP.gen_schema = timed
n = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
torch.set_num_threads(1)
cfg = model_config("1b", 32, True, n)
model = build_model(cfg, torch.device("cpu"))
mp = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
shardc.shard(model, DeviceMesh.from_group(dist.group.WORLD, "cpu"), mp_policy=mp, pack_blocks=True)
fn = torch.compile(model, backend=shardc.backend(inductor=False))
tok = torch.randint(0, cfg.vocab_size, (2, 32))
t = time.perf_counter()
fn(tok).float().sum().backward()
step = time.perf_counter() - t
m = torch._dynamo.utils.compilation_time_metrics
print(torch.__version__, n, "first step %.2f s" % step, "gen_schema %d calls %.2f s" % (spent[1], spent[0]), {k: round(sum(v), 2) for k, v in m.items() if k in ("aot_trace_joint_graph", "create_aot_dispatcher_function")})
