"""s72 repro: transformers' GPT-OSS (3 tiny layers) through shardc with compile_blocks_once=False
at world 1, one SGD-free forward/backward at a time against eager: per step the loss and the
largest gradient difference.

    PYTHONPATH=$PWD python docs/bench/compat_s72/repro/blocks_inline_moe.py [FAMILY] [--fx]
        [--plain] [--blocks-once] [--no-pack]
"""

import copy
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hf_sweep  # noqa: E402


def main() -> None:
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh

    import shardc

    name = next((a for a in sys.argv[1:] if not a.startswith("--")), "gpt_oss")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29990")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (1,))
    reference = hf_sweep.build(name, hf_sweep.COMMON)
    model = copy.deepcopy(reference)
    if "--plain" in sys.argv:
        forward = torch.compile(model, backend="aot_eager" if "--fx" in sys.argv else "inductor")
    else:
        shardc.shard(model, mesh, pack_blocks="--no-pack" not in sys.argv)
        forward = torch.compile(model, backend=shardc.backend(
            compile_blocks_once="--blocks-once" in sys.argv, inductor="--fx" not in sys.argv))
    g = torch.Generator().manual_seed(1)
    for seq in hf_sweep.SEQS:
        ids = torch.randint(0, 64, (2, seq), generator=g)
        ref = hf_sweep._loss(reference, ids)
        ref.backward()
        loss = hf_sweep._loss(forward, ids)
        loss.backward()
        params = list(zip(model.named_parameters(), reference.parameters()))
        missing = [n for (n, p), r in params if (p.grad is None) != (r.grad is None)]
        if missing:
            print(f"seq {seq}: .grad presence differs: {missing}")
        worst = max(((hf_sweep._full(p.grad) - r.grad).abs().max().item(), n)
                    for (n, p), r in params if p.grad is not None and r.grad is not None)
        print(f"seq {seq}: loss diff {abs(loss.item() - ref.item()):.2e}, "
              f"largest grad diff {worst[0]:.2e} ({worst[1]})", flush=True)
        reference.zero_grad()
        model.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
