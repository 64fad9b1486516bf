"""The one-rank NCCL process group of the GPU tests (the device machine lends one GPU)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module")
def nccl():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if not dist.is_initialized():
        torch.cuda.set_device(0)
        init = os.path.join(tempfile.mkdtemp(), "pg")
        dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
