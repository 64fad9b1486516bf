"""s75: blocks with dropout keep their shared body; check it on one CUDA device (Inductor and
FX): each block's and each step's masks differ, and every weight gradient equals an eager
replay of the step with the masks read off the outputs (tests/test_blocks.py's CPU check, on
CUDA's generator and Inductor's Triton random numbers). Also transformers' GPT-2 with dropout
0.1 trains three steps with one shared body. Run: PYTHONPATH=$PWD:$PWD/tests python3 THIS."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_blocks import _DropoutStack, replay_with_drawn_masks
from torch.distributed.device_mesh import init_device_mesh

import shardc


def masks_and_grads(mesh, inductor: bool) -> str:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = shardc.shard(_DropoutStack().cuda(), mesh)
    forward = torch.compile(model, backend=shardc.backend(inductor=inductor))
    x0 = torch.randn(8, 12, device="cuda", requires_grad=True)
    masks, worst = [], 0.0
    for _ in range(2):
        outs = forward(x0)
        sum(o.square().sum() for o in outs).backward()
        drawn, replayed = replay_with_drawn_masks(model, x0, outs)
        masks.append(drawn)
        for block, want in zip(model.blocks, replayed):
            g = block.lin.weight.grad.full_tensor()
            worst = max(worst, ((g - want).norm() / want.norm()).item())
            block.lin.weight.grad = None
    plans = [r.plan for r in shardc.shard_state(model).regions]
    shared = [tuple(b.blocks) for p in plans for b in p.bodies]
    inline = [(b.module, b.reason[:40]) for p in plans for b in p.inline_blocks]
    differ = (not torch.equal(masks[0][1], masks[0][2]), not torch.equal(masks[0][1], masks[1][1]))
    return (f"inductor={inductor}: worst relative gradient error {worst:.2e}, masks differ "
            f"(blocks, steps) {differ}, bodies {shared}, inline {inline}")


def gpt2(mesh) -> str:
    import transformers

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=512, n_embd=256, n_layer=4, n_head=4,
                                  n_positions=128, attn_implementation="sdpa")
    model = shardc.shard(transformers.GPT2LMHeadModel(cfg).cuda(), mesh)
    forward = torch.compile(model, backend="shardc")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 512, (4, 65), device="cuda")
        loss = F.cross_entropy(forward(input_ids=ids[:, :-1], use_cache=False).logits.flatten(0, 1),
                               ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(round(loss.item(), 4))
    plans = [r.plan for r in shardc.shard_state(model).regions]
    shared = [len(b.blocks) for p in plans for b in p.bodies]
    inline = [(b.module, b.reason[:40]) for p in plans for b in p.inline_blocks]
    return f"gpt2 dropout 0.1: losses {losses}, body sizes {shared}, inline {inline}"


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (1,))
    for inductor in (False, True):
        print(masks_and_grads(mesh, inductor), flush=True)
    print(gpt2(mesh), flush=True)
    dist.destroy_process_group()
