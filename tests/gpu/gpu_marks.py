"""Skip marks shared by the GPU tests."""

from __future__ import annotations

import pytest
import torch

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_fp8_gpu = pytest.mark.skipif(
    not FP8_GPU, reason="needs a CUDA GPU with FP8 matmuls (compute capability >= 8.9)")
