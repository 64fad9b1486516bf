"""The allocation profile of an Inductor graph's generated code, replayed without a GPU.

    python benchmarks/output_code_peak.py LOG [--graph 0_backward] [--top 40] [--dim 2048]

LOG: a ``TORCH_LOGS=output_code`` log (``.gz`` read as is), e.g.
``docs/bench/budget/lb320_h200_s12/lb320_output_code.log.gz``. The graph's module (``# AOT ID:
['0_backward']``) is executed with stand-ins: ``empty_strided_cuda`` allocates a counted storage
of its shape/stride/dtype's bytes, freed when Python frees its last reference (the generated
code's ``del``, ``# reuse`` and the block bodies' functions, whose locals die when they return),
``reinterpret_tensor`` is a view of its storage, kernels and matmuls do nothing, and the cuDNN
attention's forward and backward allocate their outputs. The graph's inputs (``get_args``) are
alive from the start and freed where the code drops them; fp32 2-D/1-D ``primals_*`` (the
parameter shards, held by the module) are kept. Prints the peak, the line where it is reached
and the storages alive there. Written for issue 22/19 (docs/memory_budget.md, peak13).
"""
import argparse
import contextlib
import gzip
import math
import re
import sys
import types

import torch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("log")
parser.add_argument("--graph", default="0_backward")
parser.add_argument("--top", type=int, default=40)
parser.add_argument("--dim", type=int, default=2048,
                    help="the model dimension: the length of a workspace's reduced vector "
                         "(2048: the 1b config's)")
cli = parser.parse_args()
opener = gzip.open if cli.log.endswith(".gz") else open
with opener(cli.log, "rt") as fh:
    text = [re.sub(r"^.*\[__output_code\] ?", "", line.rstrip("\n")) for line in fh]
first = text.index(f"# AOT ID: ['{cli.graph}']")
stop = next(i for i in range(first, len(text)) if text[i].startswith("Output code written to"))
src = "\n".join(text[first:stop])
src = re.sub(r"^(\w+) = async_compile\.triton\('\w+', '''.*?''', device_str='cuda'\)",
             lambda m: f"{m.group(1)} = _K()" + "\n" * m.group(0).count("\n"), src,
             flags=re.S | re.M)  # a kernel's definition: a stand-in, on as many lines
keep = []
for line in src.splitlines():
    if re.match(r"^(import |from |aten = |inductor_ops|_quantized|assert_size_stride =|"
                r"assert_alignment =|empty_strided_\w+ =|reinterpret_tensor =|alloc_from_pool|"
                r"async_compile|del async_compile|empty_strided_p2p|if __name__)", line):
        line = ""  # the names come from the stand-ins below; the line numbers stay the log's
    keep.append(line)
src = "\n".join(keep)
src = src.split("def benchmark_compiled_module")[0]

ITEM = {torch.bfloat16: 2, torch.float32: 4, torch.int64: 8, torch.bool: 1, torch.int32: 4}
state = dict(live=0, peak=0, where=None, snap=None, live_set={})


class Storage:
    """A counted allocation, freed when Python frees it."""

    n = 0

    def __init__(self, nbytes, label):
        Storage.n += 1
        self.id, self.nbytes, self.label = Storage.n, nbytes, label
        state["live"] += nbytes
        state["live_set"][self.id] = (nbytes, label)
        if state["live"] > state["peak"]:
            state["peak"], state["where"] = state["live"], label
            state["snap"] = sorted(state["live_set"].values(), reverse=True)

    def __del__(self):
        state["live"] -= self.nbytes
        state["live_set"].pop(self.id, None)


def _label():
    f = sys._getframe(2)
    return f"{f.f_code.co_name} (log line {f.f_lineno + first})"


class Fake:
    """A tensor: a storage, a size and a dtype."""

    def __init__(self, storage, size=(), dtype=torch.bfloat16):
        self.s, self.size, self.dtype = storage, size, dtype

    def __getitem__(self, k):  # a workspace's slice
        return Fake(Storage(0, "slice"), (), self.dtype)

    def view(self, *a):
        return self

    def sum(self, *a, **k):  # a workspace's partial sums reduced: a vector of the model's dim
        return Fake(Storage(cli.dim * 4, _label() + " sum"), (cli.dim,), torch.float32)

    def to(self, *a, **k):
        return Fake(Storage(cli.dim * 2, _label() + " to"), (cli.dim,), torch.bfloat16)


def nbytes(size, stride, dtype):
    if any(s == 0 for s in size):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(size, stride))) * ITEM[dtype]


def empty_strided_cuda(size, stride, dtype):
    return Fake(Storage(nbytes(size, stride, dtype), _label()), size, dtype)


def reinterpret_tensor(t, size, stride, offset=0):
    return Fake(t.s, size, t.dtype)


def rand_strided(size, stride, device=None, dtype=None):
    return Fake(Storage(nbytes(size, stride, dtype), "input"), size, dtype)


class Kernel:
    def run(self, *a, **k):
        pass


class Extern:
    def mm(self, a, b, out=None):
        pass

    addmm = bmm = mm


def sdpa(q, k, v, *a):  # cuDNN attention: output, log-sum-exp, seed and offset
    b, h, n, d = q.size
    lab = _label()
    return (Fake(Storage(b * h * n * d * 2, lab + " sdpa.out"), q.size),
            Fake(Storage(b * h * n * 4, lab + " sdpa.lse"), (b, h, n, 1), torch.float32),
            None, None, 0, 0, Fake(Storage(8, lab + " seed")), Fake(Storage(8, lab + " off")))


def sdpa_bw(g, q, k, v, *a):  # dq, dk, dv: each its input's bytes
    lab = _label()
    return tuple(Fake(Storage(math.prod(t.size) * 2, f"{lab} sdpa_bw.d{n}"), t.size)
                 for n, t in zip("qkv", (q, k, v)))


ns = types.SimpleNamespace
aten = ns(_scaled_dot_product_cudnn_attention=ns(default=sdpa),
          _scaled_dot_product_cudnn_attention_backward=ns(default=sdpa_bw))
fake_torch = ns(bfloat16=torch.bfloat16, float32=torch.float32, int64=torch.int64,
                bool=torch.bool, int32=torch.int32, ops=ns(aten=aten),
                cuda=ns(_DeviceGuard=lambda i: contextlib.nullcontext(), set_device=lambda i: None))
env = dict(torch=fake_torch, empty_strided_cuda=empty_strided_cuda,
           reinterpret_tensor=reinterpret_tensor, rand_strided=rand_strided,
           assert_size_stride=lambda *a: None, assert_alignment=lambda *a: None,
           get_raw_stream=lambda i: 0, extern_kernels=Extern(), _K=Kernel,
           triton_helpers=ns(set_driver_to_gpu=lambda: None), start_graph=None, end_graph=None)
src = src.replace("from torch._dynamo.testing import rand_strided", "pass")
exec(compile(src, "generated", "exec"), env)
args = env["get_args"]()
names = re.search(r"def get_args\(\):.*?return \[(.*?)\]", src, re.S).group(1).split(", ")
held, param_bytes = [], 0
for name, arg in zip(names, args):
    arg.s.label = "input " + name
    state["live_set"][arg.s.id] = (arg.s.nbytes, arg.s.label)
    # parameter shards (fp32 primals, not the RoPE tables) are the module's: kept alive
    if re.fullmatch(r"primals_\d+", name) and arg.dtype == torch.float32 \
            and len(arg.size) in (1, 2) and arg.size[-1] != 64:
        held.append(arg)
        param_bytes += arg.s.nbytes
del arg
inputs = state["live"]
state["peak"] = 0
env["call"](args)
print("inputs at the start", inputs, "of which parameter shards (kept)", param_bytes)
print("peak", state["peak"], "at", state["where"])
for size, what in state["snap"][:cli.top]:
    print(f"{size:>16,} {what}")
print("alive at the peak:", len(state["snap"]), "storages")
