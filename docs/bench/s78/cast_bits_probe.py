"""Is the one-rank casts test of tests/gpu/test_cudagraphs_gpu.py
(``test_one_rank_casts_record_and_train_like_casts_per_parameter``): does it fail by
nondeterminism or by a systematic difference? (s78 probe, not a test.)

The test's training (2-layer Llama, bf16 compute, one-rank NCCL group, pack_blocks=False,
mode="reduce-overhead", SDPA's math kernel, deterministic algorithms warn-only) twice per cast
kind (one_op_local_casts True / False): each pair of runs compared bit for bit, the first
step's gradients and the parameters after four steps. Differences within one kind are the
GPU's nondeterminism; a difference between kinds that is absent within each is systematic.
On this project's CPU machine (Inductor, gloo, no CUDA graphs) the two kinds are bitwise equal
on torch 2.11 and 2.13.

    PYTHONPATH=$PWD python docs/bench/s78/cast_bits_probe.py
"""

import os

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

import shardc
from shardc.models.llama import LlamaConfig, Transformer, llama_loss

CFG = LlamaConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, max_seq_len=64)
STEPS, BATCH, SEQ, LR = 4, 4, 32, 1e-3


def data():
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g).cuda()
        out.append((t[:, :-1], t[:, 1:]))
    return out


def run(one_op: bool, batches) -> tuple:
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(CFG)
    model.init_weights(buffer_device=torch.device("cuda"))
    shardc.shard(model, mp_policy=shardc.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32), pack_blocks=False)
    compiled = torch.compile(model, backend=shardc.backend(one_op_local_casts=one_op),
                             mode="reduce-overhead")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for i, (tokens, targets) in enumerate(batches):
        torch.compiler.cudagraph_mark_step_begin()
        loss = llama_loss(compiled(tokens), targets)
        loss.backward()
        if i == 0:
            grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return torch.stack(losses), grads, params


def compare(label: str, a: tuple, b: tuple) -> None:
    diffs = [(n, int((a[1][n] != b[1][n]).sum()), int((a[2][n] != b[2][n]).sum()))
             for n in a[2]]
    diffs = [d for d in diffs if d[1] or d[2]]
    print(f"{label}: losses equal {torch.equal(a[0], b[0])}; parameters differing "
          f"(name, step-1 grad elements, final param elements): {diffs or 'none'}", flush=True)


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29781")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    batches = data()
    torch.use_deterministic_algorithms(True, warn_only=True)
    runs = {}
    with sdpa_kernel([SDPBackend.MATH]):
        for one_op in (True, False):
            runs[one_op] = [run(one_op, batches), run(one_op, batches)]
    compare("one-op casts, run 1 vs run 2", *runs[True])
    compare("per-parameter casts, run 1 vs run 2", *runs[False])
    compare("one-op vs per-parameter, first runs", runs[True][0], runs[False][0])
    compare("one-op vs per-parameter, second runs", runs[True][1], runs[False][1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
