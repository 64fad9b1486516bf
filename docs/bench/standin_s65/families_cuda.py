"""The transformers families of ``docs/bench/standin_s63/more_families.py`` (tiny random configs) on
one device at world 1: shardc's default backend (Inductor, blocks compiled once, the sunk
residual), three SGD steps beside the unsharded model on the same data (fp32, TF32 off), on a
loss of the logits (their log-sum-exp mean). Prints per family the largest loss difference, the
largest parameter difference after the steps, each region's bodies and inline blocks, or the
failure. A probe, not a test: ``PYTHONPATH=$PWD python docs/bench/standin_s65/families_cuda.py
[cuda|cpu] [FAMILY ...]``"""
import copy
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "standin_s63"))
from more_families import FAM  # noqa: E402


def family(name: str, device: str, mesh) -> str:
    import transformers

    import shardc
    c, m, f = FAM[name]
    torch.manual_seed(0)
    eager = ("gptj", "bloom", "deepseek_v3")
    cfg = getattr(transformers, c)(**f, attn_implementation="eager" if name in eager else "sdpa")
    ref = getattr(transformers, m)(cfg).to(device).train()
    model = copy.deepcopy(ref)
    shardc.shard(model, mesh)
    torch._dynamo.reset()
    fwd = torch.compile(model, backend=shardc.backend())
    ro = torch.optim.SGD(ref.parameters(), lr=0.1)
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    ld = 0.0
    for _ in range(3):
        ids = torch.randint(2, 60, (2, 9), generator=g).to(device)
        l0 = ref(input_ids=ids).logits.float().logsumexp(-1).mean()
        l0.backward()
        ro.step()
        ro.zero_grad()
        loss = fwd(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        o.step()
        o.zero_grad()
        ld = max(ld, abs(loss.item() - l0.item()))
    params = dict(ref.named_parameters())
    pd = max((p.full_tensor() - params[n]).abs().max().item() for n, p in model.named_parameters())
    st = shardc.shard_state(model)
    bodies = [len(r.plan.bodies) if r.plan else None for r in st.regions]
    inline = [len(r.plan.inline_blocks) if r.plan else None for r in st.regions]
    return f"loss diff {ld:.2e} param diff {pd:.2e} bodies {bodies} inline {inline}"


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    names = sys.argv[2:] or list(FAM)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29741")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    warnings.filterwarnings("ignore")
    mesh = init_device_mesh(device, (1,))
    print(torch.__version__, device, flush=True)
    for name in names:
        try:
            line = family(name, device, mesh)
        except Exception:
            line = "FAILED " + traceback.format_exc()[-2500:]
        print(f"{name:12s} {line}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
