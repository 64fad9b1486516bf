"""Probe (not a test): what reaches the last block's backward as its output's gradient depends on
the loss the user writes; each such layout must train a shardc-compiled stack of identical blocks
like the unsharded model. For each loss below and each backend, one rank (gloo, in process), two
SGD steps; prints the stand-in count, whether stand-ins were refused, the largest loss and
gradient differences, or the failure.
``PYTHONPATH=$PWD python docs/bench/standin_s65/loss_layouts.py [inductor|fx] [cpu|cuda]``;
``SHARD_OPTS`` / ``BACKEND_OPTS``: Python dicts of ``shardc.shard`` / ``shardc.backend`` options
(e.g. ``SHARD_OPTS="dict(pack_blocks=True)"``); ``CHECKPOINT=1`` checkpoints each block.``"""
import copy
import logging
import os
import sys

import torch
import torch.distributed as dist


class Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 12), torch.nn.Linear(12, 8)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Stack(torch.nn.Module):
    def __init__(self, loss) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Residual() for _ in range(4))
        self.loss = loss

    def forward(self, x):
        for block in self.blocks:
            if os.environ.get("CHECKPOINT") == "1":
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.loss(x)


LOSSES = {
    "sum": lambda y: y.sum(),
    "mean": lambda y: y.mean(),
    "last_token": lambda y: y[:, -1].pow(2).sum(),
    "slice_features": lambda y: y[..., :4].sum(),
    "transposed_sum": lambda y: (y.transpose(0, 1)
                                 * torch.arange(5.0, device=y.device)[:, None, None]).sum(),
    "expand_mul": lambda y: (y * torch.ones(1, 1, 8, device=y.device)).sum(),
    "norm": lambda y: torch.nn.functional.layer_norm(y, (8,)).pow(2).mean(),
    "tuple_out": lambda y: (y[0].sum() + y[1:].mean()),
    "detached_half": lambda y: (y * y.detach()).sum(),
}


def run(name, loss, inductor, device):
    from torch.distributed.device_mesh import init_device_mesh

    import shardc
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("shardc").addHandler(handler)
    torch.manual_seed(0)
    model = Stack(loss).to(device)
    reference = copy.deepcopy(model)
    shardc.shard(model, init_device_mesh(device, (1,)), **eval(os.environ.get("SHARD_OPTS", "{}")))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=shardc.backend(
        inductor=inductor, **eval(os.environ.get("BACKEND_OPTS", "{}"))))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-2)
    loss_diff = grad_diff = 0.0
    for step in range(2):
        x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(step)).to(device)
        out = compiled(x)
        out.backward()
        expected = reference(x)
        expected.backward()
        loss_diff = max(loss_diff, abs(out.item() - expected.item()))
        ref = dict(reference.named_parameters())
        grad_diff = max(grad_diff, max((p.grad.full_tensor() - ref[n].grad).abs().max().item()
                                       for n, p in model.named_parameters()))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    logging.getLogger("shardc").removeHandler(handler)
    stand_ins = [len(r.stand_ins or ()) for r in shardc.shard_state(model).regions]
    refused = any("stand-ins do not fit" in m for m in messages)
    return f"stand-ins {stand_ins} refused {refused} loss {loss_diff:.2e} grad {grad_diff:.2e}"


def main():
    inductor = (sys.argv[1] if len(sys.argv) > 1 else "inductor") == "inductor"
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_num_threads(1)
    for name, loss in LOSSES.items():
        try:
            print(f"{name:15s}", run(name, loss, inductor, device), flush=True)
        except Exception as exc:
            print(f"{name:15s} FAILED {type(exc).__name__}: {str(exc)[-300:]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
