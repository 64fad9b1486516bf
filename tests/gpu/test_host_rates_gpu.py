"""CPU offload's host rates as ``python -m shardc calibrate`` measures them on a GPU machine
(``pytest -m gpu tests/gpu/test_host_rates_gpu.py``; one GPU, a few seconds): the pinned
host<->device copies (each way, and their latency) and torch's fused CPU AdamW rate, each
within what PCIe and a host's memory can do (loose bounds: the point is that each is
measured, finite and of the right order). The CPU test of the AdamW measurement:
tests/test_cluster_profile.py."""

from __future__ import annotations

import pytest
import torch

from shardc.tools.calibrate import Timer, measure_host_adamw, measure_host_link

pytestmark = pytest.mark.gpu


def test_host_link_and_adamw_rates_are_measured():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    link = measure_host_link(Timer(torch.device("cuda", 0)))
    assert link is not None
    h2d, d2h, latency = link
    for rate in (h2d, d2h):
        assert 1e9 < rate < 1e12  # PCIe gen3 x4 .. far beyond gen6 x16
    assert 0 <= latency < 1e-3
    assert measure_host_link(Timer(torch.device("cpu"))) is None
    adamw = measure_host_adamw(4, 1 << 22)
    assert 1e7 < adamw < 1e12  # parameters/s of the fused CPU kernel
