"""The benchmark's workload: model configurations, the model, and synthetic data.

Contract: every mode of one run gets the same model (same seed, same initial weights) and the
same batches (seeded per data rank), so their step times and losses are comparable.
"""

from __future__ import annotations

import torch

from shardc.models.llama import LlamaConfig, Transformer

DEFAULT_BATCH: dict[str, int] = {"1b": 4, "wide": 2}


def model_config(name: str, seq: int, tiny: bool, n_layers: int | None = None,
                 width: int | None = None) -> LlamaConfig:
    """The benchmark's model configurations (``tiny`` shrinks them for CPU and smoke runs;
    ``n_layers`` overrides the depth; ``width`` the model dimension, e.g. a very narrow tiny
    model whose step is host time on a CPU)."""
    if tiny:
        dim, layers, heads, vocab = {"1b": (256, 2, 4, 512), "wide": (384, 2, 6, 512)}[name]
    elif name == "1b":
        dim, layers, heads, vocab = 2048, 16, 16, 32000
    elif name == "wide":
        dim, layers, heads, vocab = 4096, 8, 32, 32000
    else:
        raise ValueError(f"unknown model {name!r}")
    dim = width or dim
    return LlamaConfig(vocab_size=vocab, dim=dim, n_layers=n_layers or layers, n_heads=heads,
                       max_seq_len=seq)


def build_model(cfg: LlamaConfig, device: torch.device) -> Transformer:
    """The same initial weights on every rank and in every mode (seeded, built on ``device``)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg)
    model.init_weights(buffer_device=device)
    return model


def synthetic_batches(
    n: int, batch: int, seq: int, vocab: int, rank: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (tokens, targets) pairs of uniform random tokens; the same for every mode."""
    g = torch.Generator().manual_seed(1234 + rank)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((t[:, :-1].to(device), t[:, 1:].to(device)))
    return out
