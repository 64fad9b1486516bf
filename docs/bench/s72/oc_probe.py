"""The code Inductor generates for one mode of the benchmarks' 1b llama (world 1, 2 layers,
batch 1 x 2048): ``TORCH_LOGS=output_code python docs/bench/s72/oc_probe.py MODE`` (issue 20:
which body kernels shardc runs that the bound does not; s72)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))

import bench_mesh  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from train.modes import setup_mode  # noqa: E402
from train.workload import model_config, synthetic_batches  # noqa: E402


def main() -> None:
    mode = sys.argv[1]
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29631")
    if device_type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    mesh = bench_mesh.build_mesh(device_type, 1, None, 1)
    tiny = device_type == "cpu"
    seq = 64 if tiny else 2048
    cfg = model_config("1b", seq, tiny, 2)
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    setup = setup_mode(mode, cfg, device, mesh, True)
    opt = torch.optim.AdamW(setup.params, lr=1e-4)
    for tokens, targets in synthetic_batches(2, 1, seq, cfg.vocab_size, 0, device):
        loss = setup.loss(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
    print("loss", float(loss))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
