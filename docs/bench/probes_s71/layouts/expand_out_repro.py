"""Blocks whose output is an expand (stride 0) fail to compile under Inductor (FX fine)."""
import sys, traceback
import torch
from harness import step, Residual, D
from dist_utils import one_rank_mesh

class Plain(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Residual("expand_out") for _ in range(n))
    def forward(self, x):
        for b in self.blocks:
            x = torch.compiler.nested_compile_region(b)(x)
        return x.sum()

if __name__ == "__main__":
    torch.manual_seed(0)
    try:
        m = Plain(3)
        torch.compile(m)(torch.randn(3, 5, D)).backward()
        print("plain torch.compile + nested_compile_region: OK")
    except Exception as e:
        print("plain torch.compile + nested_compile_region: FAIL", type(e).__name__, str(e).splitlines()[:3])
    torch._dynamo.reset()
    with one_rank_mesh() as mesh:
        for sink in ("auto", False):
            try:
                print("shardc sink", sink, step(mesh, 3, "sum", kind="expand_out", inductor=True, sink=sink))
            except Exception as e:
                print("shardc sink", sink, "FAIL")
                traceback.print_exc()
