"""shardc's own per-step Python, timed alone: local_shard_step's pre/post hooks and the
plain-input hand-off, on the 16-layer tiny llama (147 parameters), world 1 (gloo)."""
import os, sys, time, statistics
sys.path[:0] = [os.getcwd(), os.getcwd() + "/benchmarks"]
import torch, torch.distributed as dist
from train.workload import build_model, model_config
import shardc
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29655")
dist.init_process_group("gloo")
torch.set_num_threads(1)
cfg = model_config("1b", 16, True, 16, 32)
model = build_model(cfg, torch.device("cpu"))
shardc.shard(model, plain_inputs=True)
params = list(model.parameters())
opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
shardc.optim.local_shard_step(opt)
lss = opt._shardc_local_step
for p in params:
    p.grad = torch.zeros_like(p)
opt.step()  # creates the state
def cpu_us(fn, n=200, reps=7):
    out = []
    for _ in range(reps):
        t = time.thread_time()
        for _ in range(n):
            fn()
        out.append((time.thread_time() - t) / n * 1e6)
    return statistics.median(out)
def local_hooks():
    lss._pre(opt, (), {})
    lss._restore(opt)
# plain hand-off: every leaf's hook with a gradient, then param.grad cleared (zero_grad)
leaves = []
for m in model.modules():
    for name, leaf in m.__dict__.get("_shardc_leaves", {}).items():
        leaves.append((leaf, list(leaf._post_accumulate_grad_hooks.values())[0]))
grads = [torch.zeros_like(l) for l, _ in leaves]
def hand_offs():
    for (leaf, hook), g in zip(leaves, grads):
        leaf.grad = g
        hook(leaf)
    for p in params:
        p.grad = None
def clear_only():
    for (leaf, hook), g in zip(leaves, grads):
        leaf.grad = g
        leaf.grad = None
    for p in params:
        p.grad = None
print(f"{len(params)} params, {len(leaves)} leaves; torch {torch.__version__}")
print(f"local_shard_step pre+post hooks: {cpu_us(local_hooks):.1f} us per step")
base = cpu_us(clear_only)
print(f"plain hand-offs: {cpu_us(hand_offs) - base:.1f} us per backward (loop/clear baseline {base:.1f} us subtracted)")
dist.destroy_process_group()
