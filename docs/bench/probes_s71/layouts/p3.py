import torch
from harness import Stack, step
from dist_utils import one_rank_mesh
import harness
if __name__ == "__main__":
    torch.manual_seed(0)
    m, r = Stack(4, "sum01"), Stack(4, "sum01")
    r.load_state_dict(m.state_dict())
    x = torch.randn(3, 5, 8)
    torch._dynamo.reset()
    torch.compile(m)(x).backward()
    r(x).backward()
    for (k, p), q in zip(m.named_parameters(), r.parameters()):
        if p.grad is not None:
            print(k, f"{(p.grad - q.grad).abs().max().item():.3g}", f"{q.grad.abs().max().item():.3g}")
    with one_rank_mesh() as mesh:
        print(step(mesh, 4, "sum01", inductor=True))
        print(step(mesh, 4, "sum01", inductor=True, sink=False))
