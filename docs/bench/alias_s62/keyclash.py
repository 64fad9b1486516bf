import torch, torch.nn as nn
import shardc
from shardc.tools.fake_world import fake_world
from torch.distributed import group
from torch.distributed.device_mesh import DeviceMesh

class Relu(nn.Module):
    def __init__(self):
        super().__init__(); self.lin = nn.Linear(6, 6)
    def forward(self, x):
        return x + self.lin(x).relu()

class Tanh(nn.Module):
    def __init__(self):
        super().__init__(); self.lin = nn.Linear(6, 6)
    def forward(self, x):
        return x + self.lin(x).tanh()

class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.ModuleList(Relu() for _ in range(2))
        self.second = nn.ModuleList(Tanh() for _ in range(2))
    def forward(self, x):
        for b in self.first: x = b(x)
        for b in self.second: x = b(x)
        return x

torch.manual_seed(0)
ref = Two(); x = torch.randn(4, 6)
import copy
expected = ref(x)
torch._dynamo.reset()
with fake_world(1):
    m = shardc.shard(copy.deepcopy(ref), DeviceMesh.from_group(group.WORLD, "cpu"))
    f = torch.compile(m, backend=shardc.backend(inductor=False, check_plan_consistency=False))
    got = f(x)
print((got - expected).abs().max().item())
