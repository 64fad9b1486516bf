import contextvars, functools, sys, torch
from torch import nn
from torch.utils.checkpoint import checkpoint
sys.path.insert(0, "/work/main/tests"); sys.path.insert(0, "/work/main")
import conftest
from dist_utils import one_rank_mesh
import shardc

_ACTIVE = contextvars.ContextVar("active", default=None)

def sets_context(forward):
    @functools.wraps(forward)
    def wrapped(self, *args, **kwargs):
        token = _ACTIVE.set({"layer": id(self)})
        try:
            return forward(self, *args, **kwargs)
        finally:
            _ACTIVE.reset(token)
    return wrapped

class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
    @sets_context
    def forward(self, x):
        return self.lin(x)

class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attn()
        self.mlp = nn.Linear(8, 8)
    def forward(self, x):
        return x + self.mlp(torch.relu(self.attn(x)))

class Net(nn.Module):
    def __init__(self, ckpt):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.ckpt = ckpt
    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.ckpt else layer(x)
        return x

for ckpt in (False, True):
    torch._dynamo.reset()
    with one_rank_mesh() as mesh:
        torch.manual_seed(0)
        m = Net(ckpt)
        shardc.shard(m, mesh)
        f = torch.compile(m, backend=shardc.backend(inductor=False))
        try:
            f(torch.randn(2, 8)).sum().backward()
            print("RESULT ckpt", ckpt, "ok")
        except Exception as e:
            print("RESULT ckpt", ckpt, "FAIL", type(e).__name__)
    torch._dynamo.reset()
    m2 = Net(ckpt)
    try:
        torch.compile(m2, backend="aot_eager")(torch.randn(2, 8)).sum().backward()
        print("RESULT plain ckpt", ckpt, "ok")
    except Exception as e:
        print("RESULT plain ckpt", ckpt, "FAIL", type(e).__name__)
