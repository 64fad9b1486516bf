import sys, traceback, time
import torch
from dist_utils import one_rank_mesh

D = 8

class Residual(torch.nn.Module):
    def __init__(self, kind="res"):
        super().__init__()
        self.up, self.down = torch.nn.Linear(D, 12), torch.nn.Linear(12, D)
        self.kind = kind
    def forward(self, x):
        if self.kind == "expand_out":
            m = x.mean(1, keepdim=True)
            return (m + self.down(torch.tanh(self.up(m)))).expand_as(x)
        y = x + self.down(torch.tanh(self.up(x)))
        if self.kind == "view_out":
            return y.view(y.shape)
        if self.kind == "view_out2":
            return y.unsqueeze(0)[0]
        if self.kind == "transpose_out":  # T == D
            return y.transpose(1, 2)
        if self.kind == "noncontig_out":
            return y.transpose(0, 1).contiguous().transpose(0, 1)
        if self.kind == "slice_out":
            return torch.cat([y, 2 * y], -1)[..., :D]
        if self.kind == "tuple_out":
            return y, y.sum(1)
        if self.kind == "tuple_out2":
            return y, x
        if self.kind == "inplace":
            z = self.down(torch.tanh(self.up(x)))
            z += x
            return z
        return y

CONSUMERS = {
    "idx0": lambda x: x[:, 0].square().sum(),
    "idx-1": lambda x: x[:, -1].square().sum(),
    "max1": lambda x: x.max(1).values.square().sum(),
    "amax1": lambda x: x.amax(1).square().sum(),
    "tsum": lambda x: x.transpose(1, 2).sum(-1).square().sum(),
    "flip": lambda x: (x.flip(1) * torch.arange(x.shape[1] * x.shape[2], dtype=x.dtype).view(x.shape[1], x.shape[2])).sum(),
    "sumkd": lambda x: x.sum(1, keepdim=True).square().sum(),
    "sum01": lambda x: x.sum((0, 1)).square().sum(),
    "expand": lambda x: (x.expand(2, *x.shape) * torch.arange(2.).view(2, 1, 1, 1)).sum(),
    "einsum": lambda x: torch.einsum("btd,d->bt", x, torch.linspace(-1, 1, x.shape[-1])).square().sum(),
    "unsq_expand": lambda x: (x.unsqueeze(2).expand(x.shape[0], x.shape[1], 3, x.shape[2]) * torch.arange(3.).view(1, 1, 3, 1)).sum(),
    "narrow": lambda x: x.narrow(1, 1, 2).square().sum(),
    "bcast_w": lambda x: (x * torch.linspace(0, 1, x.shape[-1])).sum(),
    "bcast_w_t": lambda x: (x * torch.linspace(0, 1, x.shape[1]).view(1, -1, 1)).sum(),
    "sum": lambda x: x.sum(),
    "sum0": lambda x: x.sum(0).square().sum(),
    "perm_w": lambda x: (x.permute(2, 0, 1).contiguous() * torch.linspace(0, 1, x.numel()).view(x.shape[2], x.shape[0], x.shape[1])).sum(),
    "stride_t": lambda x: (x.transpose(0, 1).contiguous() * torch.linspace(0, 1, x.numel()).view(x.shape[1], x.shape[0], x.shape[2])).sum(),
    "sum2": lambda x: x.sum(2).square().sum(),
    "idx_b": lambda x: x[0].square().sum(),
    "sum1": lambda x: x.sum(1).square().sum(),
    "mean": lambda x: x.mean(),
    "tuple": "tuple",
    "mean1_head": "head",
    "side_sum": "side",
}

INPUTS = {
    "plain": lambda x: x,
    "transposed": lambda x: x.transpose(0, 1).contiguous().transpose(0, 1),  # (B,T,D) noncontig
    "expanded": "expanded",
    "slice": "slice",
    "permuted": lambda x: x.permute(0, 2, 1).contiguous().permute(0, 2, 1),
}

class Stack(torch.nn.Module):
    def __init__(self, n, consumer, inp="plain", kind="res", mid=None):
        super().__init__()
        self.mid = mid or {}
        self.blocks = torch.nn.ModuleList(Residual(kind) for _ in range(n))
        self.head = torch.nn.Linear(D, 3)
        self.e = torch.nn.Parameter(torch.randn(1, 1, D))
        self.consumer, self.inp, self.kind = consumer, inp, kind
    def forward(self, x):
        if self.inp == "expanded":
            x = self.e.expand(x.shape[0], x.shape[1], D) * 1.0 if False else self.e.expand(x.shape[0], x.shape[1], D)
        elif self.inp == "expanded_plus":
            x = x + self.e
        elif self.inp == "slice":
            x = x[:, ::2]
        else:
            x = INPUTS[self.inp](x)
        sides = []
        for i, b in enumerate(self.blocks):
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if self.kind == "ckpt" else b(x)
            op = self.mid.get(i)
            if op == "nc":
                x = x.transpose(0, 1).contiguous().transpose(0, 1)
            elif op == "perm":
                x = x.permute(0, 2, 1).contiguous().permute(0, 2, 1)
            elif op == "expand":
                x = x.mean(1, keepdim=True).expand_as(x)
            elif op == "expand_res":
                x = x + x.mean(1, keepdim=True)
            elif op == "catview":
                x = torch.cat([x, 2 * x], -1)[..., :D]
            elif op == "tview":
                x = x.transpose(1, 2).contiguous().transpose(1, 2)
            elif op == "detach":
                x = x.detach()
            elif op == "sum1side":
                sides.append(x.sum(1).square().sum())
            elif op == "idxside":
                sides.append(x[:, -1].square().sum())
            if isinstance(x, tuple):
                x, side = x
                sides.append(side.square().sum() * 0.1)
            if self.consumer == "side_sum":
                sides.append(x.sum(1).square().sum())
        c = CONSUMERS[self.consumer]
        if c == "tuple":
            return x, x.sum(1)
        if c == "head":
            return self.head(x.mean(1)).square().sum()
        if c == "side":
            return x.square().sum() + sum(sides)
        out = c(x)
        if sides and self.consumer != "side_sum":
            out = out + sum(sides) if not isinstance(out, tuple) else (out[0], out[1] + sum(sides))
        return out

def loss_of(out):
    if isinstance(out, tuple):
        a, b = out
        return (a * torch.linspace(0, 1, a.numel()).view(a.shape)).sum() + b.square().sum()
    return out

def step(mesh, n, consumer, inp="plain", kind="res", inductor=False, sink="auto", T=5, mid=None):
    import shardc
    torch.manual_seed(0)
    model, ref = Stack(n, consumer, inp, kind, mid), Stack(n, consumer, inp, kind, mid)
    ref.load_state_dict(model.state_dict())
    if kind == "transpose_out":
        T = D
    x = torch.randn(3, T if inp != "slice" else 2 * T, D)
    shardc.shard(model, mesh)
    torch._dynamo.reset()
    kw = dict(inductor=inductor)
    if sink != "auto":
        kw["sink_block_residual"] = sink
    try:
        out = torch.compile(model, backend=shardc.backend(**kw))(x)
        l = loss_of(out)
        l.backward()
        grads = {k: p.grad.full_tensor() if p.grad is not None else None for k, p in model.named_parameters()}
        bodies = [len(p.bodies) for p in shardc.explain_all(model)]
    finally:
        torch._dynamo.reset()
    el = loss_of(ref(x))
    el.backward()
    bad = []
    if not torch.allclose(l.full_tensor() if hasattr(l, "full_tensor") else l, el, atol=1e-5, rtol=1e-5):
        bad.append(f"loss {float(l)} vs {float(el)}")
    for k, p in ref.named_parameters():
        g = grads[k]
        if p.grad is None and g is None:
            continue
        if (p.grad is None) != (g is None):
            bad.append(f"{k}: none-ness {g is None} vs {p.grad is None}")
            continue
        if (g - p.grad).abs().max() > 1e-5 * (1 + p.grad.abs().max()):
            bad.append(f"{k}: maxdiff {(g - p.grad).abs().max().item():.3g}")
    return bad, bodies

def run_cases(cases):
    with one_rank_mesh() as mesh:
        for case in cases:
            t = time.time()
            try:
                bad, bodies = step(mesh, **case)
                res = "OK" if not bad else "BUG mismatch: " + "; ".join(bad[:4])
            except Exception as e:
                msg = str(e).strip().splitlines()
                res = f"BUG {type(e).__name__}: " + " | ".join(msg[:3])[:400]
                bodies = None
            print(f"{case} -> {res} bodies={bodies} ({time.time()-t:.1f}s)", flush=True)
