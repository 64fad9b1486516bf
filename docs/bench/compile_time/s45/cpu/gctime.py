import gc, os, sys, time, resource, tempfile
ROOT = sys.argv[1]; BLOCKS = int(sys.argv[2]); BUDGET = int(float(sys.argv[3])) if len(sys.argv) > 3 else 0
sys.path[:0] = [ROOT, ROOT + "/benchmarks"]
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(); os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 2000), SHARDC_LOG="info")
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1); torch.set_num_threads(1)
import bench_mesh
from train.runner import train_step
from train.shardc_mode import setup_shardc
from train.workload import build_model, model_config, synthetic_batches
import torch._inductor.compile_fx  # noqa
VARIANT = os.environ.get("GCV", "")
if VARIANT:
    import functools
    from shardc.memory.gc_pause import collector_paused
    import shardc.compile.backend as B
    if VARIANT == "A":
        orig = B.ShardcPartitioner.__call__
        B.ShardcPartitioner.__call__ = collector_paused()(orig)
    elif VARIANT == "B":
        B._compile_region = collector_paused()(B._compile_region)
    elif VARIANT == "D":
        B._compile_region = collector_paused()(B._compile_region)
        B._inductor_with_pool = collector_paused()(B._inductor_with_pool)
stats = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}; t0 = [0.0]
def cb(phase, info):
    if phase == "start": t0[0] = time.perf_counter()
    else: s = stats[info["generation"]]; s[0] += 1; s[1] += time.perf_counter() - t0[0]
gc.callbacks.append(cb)
cfg = model_config("1b", 32, True, BLOCKS)
data = synthetic_batches(1, 2, 32, cfg.vocab_size, 0, torch.device("cpu"))
kw = {"peak_memory_budget_bytes": BUDGET} if BUDGET else {}
IND = os.environ.get("IND", "1") == "1"
setup = setup_shardc(build_model(cfg, torch.device("cpu")), bench_mesh.build_mesh("cpu", 1, None, 1), True, pack_blocks=True, inductor=IND, **kw)
opt = torch.optim.AdamW(setup.params, lr=1e-4)
for s in stats.values(): s[:] = [0, 0.0]
t = time.perf_counter(); train_step(setup, opt, *data[0]); t = time.perf_counter() - t
print(f"RESULT first step {t:.2f} s; gc " + " ".join(f"gen{g}: {n} / {s:.2f}s" for g, (n, s) in stats.items()) + f"; maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024:.0f} MiB", flush=True)
import shardc
for p in shardc.explain_all(setup.model if hasattr(setup, "model") else None) if False else []: pass
su = setup.after_first_step(); print("SUMMARY peak", su.get("predicted_peak_bytes"), [r.get("budget", {}).get("trials") for r in su["regions"]], flush=True)
dist.destroy_process_group()
