"""Tiny random-config transformers causal LMs through shardc's default (packed blocks), against
the same model unsharded (s72 sweep, from s55's; a probe, not a test):

    PYTHONPATH=$PWD python docs/bench/compat_s72/hf_sweep.py [--world N] [--uneven]
        [--opt sgd,adamw] [--no-pack] [--plain-compile] [FAMILY ...]

Each family: the model built from a seeded random config (3 layers, SDPA attention unless the
family has none); per optimizer a copy sharded with ``shardc.shard`` over N gloo ranks (its
defaults: packed blocks, plain inputs) and compiled with shardc's backend (Inductor, blocks
compiled once); three training steps at sequence lengths 17, 17 and 13 (the third a
dynamic-shape recompile), each rank on its part of the batch, the unsharded model eagerly on the
whole batch (fp32). Optimizers: SGD (lr 0.1) and AdamW (lr 1e-2, weight decay 0.1: a parameter
handed a zero gradient where autograd leaves ``.grad`` None is stepped by it). After each
backward every parameter's ``.grad`` presence (None or not) and value is compared with the
reference's, after each step every parameter. Each family runs in its own spawned group (a
failure or hang of one does not stop the others; ``--timeout`` seconds each).

``--uneven``: widths that do not divide by the ranks (vocabulary 67, width 40, MLP 50).
``--no-pack``: ``shardc.shard(..., pack_blocks=False)``. ``--plain-compile``: no shardc at all,
plain ``torch.compile`` (Inductor) of the unsharded model at world 1 (is a mismatch torch's?).
``--no-blocks-once``: ``shardc.backend(compile_blocks_once=False)`` (no shared block bodies).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
UNEVEN = dict(vocab_size=67, hidden_size=40, intermediate_size=50)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)


def _gpt2(c: dict) -> dict:
    return dict(vocab_size=c["vocab_size"], n_embd=c["hidden_size"], n_inner=c["intermediate_size"],
                n_layer=3, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0)  # dropout off: the two runs draw different masks


def _gptj(c: dict) -> dict:
    return dict(vocab_size=c["vocab_size"], n_embd=c["hidden_size"], n_inner=c["intermediate_size"],
                n_layer=3, n_head=4, n_positions=64, rotary_dim=4)


def _bloom(c: dict) -> dict:
    return dict(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], n_layer=3, n_head=4)


def _opt(c: dict) -> dict:
    return dict(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                ffn_dim=c["intermediate_size"], num_hidden_layers=3, num_attention_heads=4,
                word_embed_proj_dim=c["hidden_size"],
                max_position_embeddings=64, pad_token_id=0, dropout=0.0)


# family: (config class, model class, config fields beyond COMMON, or a function of the widths)
FAMILIES = {
    # s55's fourteen
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
                  {"num_experts": 4, **MOE, "shared_expert_intermediate_size": 16}),
    # added in s72
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 4, **MOE, "head_dim": 8}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"n_routed_experts": 4, **MOE, "n_shared_experts": 1,
                     "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
                     "qk_nope_head_dim": 8,
                     "qk_rope_head_dim": 8, "v_head_dim": 8, "n_group": 1, "topk_group": 1,
                     "num_key_value_heads": 4}),  # MLA: as many key/value heads as heads
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8,
                 "sliding_window": 8}),
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM",
                    {"num_local_experts": 4, "num_experts_per_tok": 1, "head_dim": 8,
                     "intermediate_size_mlp": 48, "interleave_moe_layer_step": 2,
                     "attention_chunk_size": 8}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {"sliding_window": 8}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 8, "pad_token_id": 0}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 8}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"head_dim": 8, "sliding_window": 8}),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", _gpt2),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", _gptj),
    "bloom": ("BloomConfig", "BloomForCausalLM", _bloom),
    "opt": ("OPTConfig", "OPTForCausalLM", _opt),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {"sliding_window": 8}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 {"n_routed_experts": 4, **MOE, "n_shared_experts": 1, "first_k_dense_replace": 1,
                  "head_dim": 8, "n_group": 1, "topk_group": 1}),
}
# --uneven, where the family does not allow MLP 50 or width 40: grouped_mm's experts need
# 16-byte strides (MLP 52); Phi's partial rotary factor 0.5 of head width 10 is odd (0.4)
UNEVEN_FIX = {**{n: {"intermediate_size": 52}
                 for n in ("mixtral", "gpt_oss", "olmoe", "granitemoe")},
              "phi": {"partial_rotary_factor": 0.4}}
# the families transformers has no SDPA attention for
EAGER_ATTENTION = ("gemma2", "gpt_oss", "bloom")
SEQS = (17, 17, 13)
PER_RANK = 2  # sequences per rank
TOL = 1e-4


def _dbrx(c: dict) -> dict:
    return dict(vocab_size=c["vocab_size"], d_model=c["hidden_size"], n_layers=3, n_heads=4,
                max_seq_len=64,
                attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                ffn_config={"ffn_hidden_size": c["intermediate_size"], "moe_num_experts": 4,
                            "moe_top_k": 2})


FAMILIES["dbrx"] = ("DbrxConfig", "DbrxForCausalLM", _dbrx)


def build(name: str, common: dict):
    import transformers

    config_cls, model_cls, extra = FAMILIES[name]
    if common["hidden_size"] == UNEVEN["hidden_size"]:
        common = {**common, **UNEVEN_FIX.get(name, {})}
    kwargs = extra(common) if callable(extra) else {**common, **extra}
    attn = "eager" if name in EAGER_ATTENTION else "sdpa"
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**kwargs, attn_implementation=attn)
    return getattr(transformers, model_cls)(config).train()


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _run(name: str, kind: str, rank: int, world: int, common: dict, mesh, mode: str) -> str:
    import shardc
    from shardc.sharding.packed_blocks import packed_block_names

    reference = build(name, common)
    model = copy.deepcopy(reference)
    torch._dynamo.reset()
    if mode == "plain-compile":
        forward = torch.compile(model)
        packed = "-"
    else:
        shardc.shard(model, mesh, **({"pack_blocks": False} if "no-pack" in mode else {}))
        forward = torch.compile(model, backend=shardc.backend(
            **({"compile_blocks_once": False} if "no-blocks-once" in mode else {})))
        packed = len(packed_block_names(model))
    names = [n for n, _ in reference.named_parameters()]
    ref_params = dict(reference.named_parameters())
    params = dict(model.named_parameters())
    ref_opt = _optimizer(kind, reference.parameters())
    opt = _optimizer(kind, model.parameters())
    generator = torch.Generator().manual_seed(1)
    loss_diff = grad_diff = param_diff = 0.0
    presence: dict[str, tuple] = {}  # name: (reference has .grad, shardc has .grad), first step
    worst = ("", 0.0)
    for step, seq in enumerate(SEQS):
        ids = torch.randint(0, common["vocab_size"], (world * PER_RANK, seq), generator=generator)
        ref_loss = _loss(reference, ids)
        ref_loss.backward()
        loss = _loss(forward, ids[rank * PER_RANK:(rank + 1) * PER_RANK])
        loss.backward()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
        loss_diff = max(loss_diff, abs(mean.item() / world - ref_loss.item()))
        for n in names:
            r, p = ref_params[n].grad, params[n].grad
            if (r is None) != (p is None):
                presence.setdefault(n, (step, r is not None, p is not None))
            elif r is not None:
                grad_diff = max(grad_diff, _full(p).sub(r).abs().max().item())
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        for n in names:
            d = _full(params[n].detach()).sub(ref_params[n].detach()).abs().max().item()
            param_diff = max(param_diff, d)
            if d > worst[1]:
                worst = (n, d)
    regions = ([(len(p.bodies), len(p.inline_blocks)) for p in shardc.explain_all(forward)]
               if mode != "plain-compile" else "-")
    ok = max(loss_diff, grad_diff, param_diff) < TOL and not presence
    line = (f"{name:12s} {kind:5s} {'OK ' if ok else 'BAD'} loss {loss_diff:.1e} grad "
            f"{grad_diff:.1e} param {param_diff:.1e} packed {packed} regions {regions}")
    line += presence_text(presence)
    if not ok:
        line += f"\n    largest parameter difference: {worst[0]} {worst[1]:.2e}"
    return line


def presence_text(presence: dict[str, tuple]) -> str:
    """The report's line for parameters whose ``.grad`` presence differs (none: empty)."""
    if not presence:
        return ""
    shown = ", ".join(f"{n} (step {s}: ref {'grad' if a else 'None'}, shardc "
                      f"{'grad' if b else 'None'})" for n, (s, a, b) in list(presence.items())[:4])
    return f"\n    .grad presence differs for {len(presence)}: {shown}"


def _rank(rank: int, world: int, name: str, kinds: list[str], common: dict, port: int,
          mode: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for kind in kinds:
        start = time.perf_counter()
        try:
            line = _run(name, kind, rank, world, common, mesh, mode)
        except Exception as exc:  # a probe: report and go on
            line = f"{name:12s} {kind:5s} FAIL {type(exc).__name__}: {str(exc)[:400]}"
            if rank == 0:
                traceback.print_exc(limit=6, file=sys.stderr)
        if rank == 0:
            print(f"{line}  [{time.perf_counter() - start:.0f} s]", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--uneven", action="store_true")
    parser.add_argument("--opt", default="sgd,adamw")
    parser.add_argument("--no-pack", action="store_true")
    parser.add_argument("--plain-compile", action="store_true")
    parser.add_argument("--no-blocks-once", action="store_true")
    parser.add_argument("--port", type=int, default=29781)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    args = parser.parse_args()
    common = {**COMMON, **UNEVEN} if args.uneven else dict(COMMON)
    mode = "plain-compile" if args.plain_compile else " ".join(
        [*(["no-pack"] if args.no_pack else []),
         *(["no-blocks-once"] if args.no_blocks_once else [])]) or "packed"
    kinds = args.opt.split(",")
    print(f"# world {args.world} {'uneven ' if args.uneven else ''}{mode} "
          f"torch {torch.__version__}", flush=True)
    for i, name in enumerate(args.families):
        ctx = mp.start_processes(_rank, args=(args.world, name, kinds, common, args.port + i, mode),
                                 nprocs=args.world, join=False, start_method="spawn")
        deadline = time.monotonic() + args.timeout
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    print(f"{name:12s} TIMEOUT after {args.timeout:.0f} s", flush=True)
                    break
        except Exception as exc:  # a rank died
            print(f"{name:12s} CRASH {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
