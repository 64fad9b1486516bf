import os, sys, time
import torch
sys.path[:0] = [os.getcwd(), os.getcwd() + "/benchmarks"]
from train.workload import build_model, model_config
cfg = model_config("1b", 32, True, 64)
m = build_model(cfg, torch.device("cpu"))
layers = list(m.layers)
V = int(os.environ.get("V", "0"))
names = [n for n, _ in layers[0].named_modules()]
print(len(names), names)
def v0(block):
    layout = []; pending = [block]
    while pending:
        module = pending.pop()
        if module is None: continue
        layout.append((type(module), len(module._forward_hooks), len(module._forward_pre_hooks), len(module._backward_hooks), len(module._backward_pre_hooks)))
        pending.extend(module._modules.values())
    return tuple(layout)
def v1(block):
    layout = []; pending = [block]
    while pending:
        module = pending.pop()
        if module is None: continue
        layout.append(type(module))
        pending.extend(module._modules.values())
    return tuple(layout)
def v2(block):
    return (type(block), len(block._forward_hooks), len(block._forward_pre_hooks))
def v4(block):
    layout = []; pending = [block]
    while pending:
        module = pending.pop()
        if module is None: continue
        layout.append(len(module._forward_hooks))
        pending.extend(module._modules.values())
    return tuple(layout)
def v5(block):  # dict views only: no module variables? 
    return len(block._modules)
walk = [v0, v1, v2, None, v4, v5][V]
@torch.compile(backend="eager", fullgraph=True)
def f(x):
    for b in layers:
        if walk(b) is None:
            x = x + 1
    return x + 1
t = time.perf_counter(); f(torch.ones(2)); dt = time.perf_counter() - t
from torch._dynamo.utils import compile_times
d = dict(zip(*compile_times(repr="csv", aggregate=True)))
print(f"V{V} total {dt:.2f} trace {float(d.get('bytecode_tracing',0)):.2f} guards {float(d.get('build_guards',0)):.2f}")
