"""Tiny random-config transformers causal LMs through shardc, against the same model unsharded
(s55 sweep; a probe, not a test):

    PYTHONPATH=$PWD python docs/bench/compat_s55/hf_sweep.py [--world N] [--uneven] [FAMILY ...]

Each family: the model built from a seeded random config (3 layers, SDPA attention unless the
family has none), copied; the copy sharded with ``shardc.shard`` over N gloo ranks and compiled
with shardc's backend (its defaults: Inductor, blocks compiled once); three training steps at
sequence lengths 17, 17 and 13 (the third a dynamic-shape recompile), each rank on its part of
the batch, the unsharded model eagerly on the whole batch (SGD, lr 0.1, fp32). Prints per
family the largest loss difference, the largest parameter difference after the steps, and each
compiled region's (bodies, inline blocks). ``--uneven``: widths that do not divide by the
ranks (vocabulary 67, width 40, MLP 50)."""

from __future__ import annotations

import argparse
import copy
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
UNEVEN = dict(vocab_size=67, hidden_size=40, intermediate_size=50)
# family: (config class, model class, config fields beyond COMMON)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8}),  # eager attention only
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"pad_token_id": 0}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "falcon": ("FalconConfig", "FalconForCausalLM",
               {"num_kv_heads": 2, "new_decoder_architecture": True}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 16}),
}
SEQS = (17, 17, 13)
PER_RANK = 2  # sequences per rank


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def _family(name: str, rank: int, world: int, common: dict, mesh) -> str:
    import transformers

    import shardc

    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    attn = "eager" if name == "gemma2" else "sdpa"
    config = getattr(transformers, config_cls)(**{**common, **extra}, attn_implementation=attn)
    reference = getattr(transformers, model_cls)(config).train()
    model = copy.deepcopy(reference)
    shardc.shard(model, mesh)
    torch._dynamo.reset()
    forward = torch.compile(model, backend=shardc.backend())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    loss_diffs = []
    for seq in SEQS:
        ids = torch.randint(0, common["vocab_size"], (world * PER_RANK, seq), generator=generator)
        ref_loss = _loss(reference, ids)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = _loss(forward, ids[rank * PER_RANK:(rank + 1) * PER_RANK])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        loss_diffs.append(abs(mean.item() / world - ref_loss.item()))
    param_diff = max(
        (p.full_tensor() if hasattr(p, "full_tensor") else p).sub(r).abs().max().item()
        for p, r in zip(model.parameters(), reference.parameters()))
    regions = [(len(p.bodies), len(p.inline_blocks)) for p in shardc.explain_all(forward)]
    ok = max(loss_diffs) < 1e-4 and param_diff < 1e-4
    return (f"{name:10s} {'OK ' if ok else 'BAD'} loss diff {max(loss_diffs):.2e} param diff "
            f"{param_diff:.2e} regions (bodies, inline) {regions}")


def _rank(rank: int, world: int, names: list[str], common: dict, port: int) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for name in names:
        try:
            line = _family(name, rank, world, common, mesh)
        except Exception as exc:  # a probe: report and go on with the next family
            line = f"{name:10s} FAIL {type(exc).__name__}: {str(exc)[:300]}"
            if rank == 0:
                traceback.print_exc(limit=4, file=sys.stderr)
        if rank == 0:
            print(line, flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--uneven", action="store_true")
    parser.add_argument("--port", type=int, default=29771)
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    args = parser.parse_args()
    common = {**COMMON, **UNEVEN} if args.uneven else dict(COMMON)
    mp.spawn(_rank, args=(args.world, args.families, common, args.port), nprocs=args.world)


if __name__ == "__main__":
    main()
