"""The sixty-fourth session's two stand-in layout fixes (and s65's) on one GPU, a probe, not a
test: tiny GPT-J (its attention key laid out otherwise by the partitioned forward) and a stack
of residual blocks whose last output a bare ``.sum()`` reads (an expanded gradient), each
sharded at world 1 (NCCL), compiled by shardc with Inductor, three SGD steps beside the
unsharded model on the same data (lr 1e-3: the stack's loss is a sum, larger steps diverge).
Prints per case the stand-in count per region, the regions compiled, whether shardc logged
that stand-ins did not fit, and the largest loss and parameter differences.
``PYTHONPATH=$PWD python docs/bench/standin_s65/cuda_standins.py``"""
import copy
import logging
import os

import torch
import torch.distributed as dist


class Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 96), torch.nn.Linear(96, 64)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class SummedStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Residual() for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


def gptj():
    import transformers
    config = transformers.GPTJConfig(vocab_size=101, n_embd=64, n_layer=4, n_head=4, rotary_dim=8,
                                     n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, attn_implementation="eager")
    ids = [torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(s)).cuda()
           for s in range(3)]
    model = transformers.GPTJForCausalLM(config)
    return model, lambda m, i: m(input_ids=ids[i], labels=ids[i]).loss


def summed():
    xs = [torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(s)).cuda()
          for s in range(3)]
    return SummedStack(), lambda m, i: m(xs[i])


def case(name, build, mesh):
    import shardc
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("shardc").addHandler(handler)
    torch.manual_seed(0)
    model, step = build()
    model = model.cuda().train()
    reference = copy.deepcopy(model)
    shardc.shard(model, mesh)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=shardc.backend())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-3)
    loss_diff = 0.0
    for i in range(3):
        loss = step(compiled, i)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected = step(reference, i)
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_diff = max(loss_diff, abs(loss.item() - expected.item()))
    params = dict(reference.named_parameters())
    param_diff = max((p.full_tensor() - params[n]).abs().max().item()
                     for n, p in model.named_parameters())
    regions = shardc.shard_state(model).regions
    logging.getLogger("shardc").removeHandler(handler)
    print(f"{name}: stand-ins per region {[len(r.stand_ins or ()) for r in regions]}, "
          f"regions {len(regions)}, 'do not fit' logged: "
          f"{any('stand-ins do not fit' in m for m in messages)}, "
          f"max |loss diff| {loss_diff:.3g}, max |param diff| {param_diff:.3g}", flush=True)


def main():
    from torch.distributed.device_mesh import init_device_mesh
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    mesh = init_device_mesh("cuda", (1,))
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    for name, build in (("gptj", gptj), ("summed_stack", summed)):
        try:
            case(name, build, mesh)
        except Exception as exc:  # report and go on to the next case
            import traceback
            print(f"{name}: FAILED {type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
