"""s75: a tiny random Hugging Face decoder trained 3 steps sharded, then greedy generate (KV
cache), against the same model trained unsharded.

Run: cd <worktree> && PYTHONPATH=.:tests:docs/bench/probes_s75 python docs/bench/probes_s75/hf_probe.py
VARIANT[,VARIANT...] WORLDS [fx|inductor|eager]

Variants: llama, qwen2 (train through torch.compile(model), generate on the sharded module
itself, eagerly), llama_inplace (model.compile(backend=...) in place: generate runs through the
compiled forward, KV cache and all), llama_gc (gradient_checkpointing_enable() before shard),
llama_gc_inplace, llama_sgd.
Compared: the per-step losses, the parameters after training, the logits of an eval forward of
the prompt and the generated token ids.
"""
from __future__ import annotations

import contextlib
import sys
import time

import torch
import torch.distributed as dist

VOCAB, STEPS, GLOBAL_BATCH, SEQ = 50, 3, 12, 8
NEW_TOKENS = 6


def build(variant: str):
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=40, intermediate_size=46,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if variant.startswith("qwen2"):
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    cfg._attn_implementation = "sdpa"
    model = cls(cfg)
    if "_gc" in variant:
        model.gradient_checkpointing_enable()
    return model


def data():
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ), generator=g)
    prompt = torch.randint(0, VOCAB, (3, 5), generator=g)
    return toks, prompt


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def run(model, forward, variant, rank, world, sharded):
    toks, prompt = data()
    if "sgd" in variant:
        opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    per = GLOBAL_BATCH // world
    rows = slice(rank * per, (rank + 1) * per)
    losses = []
    model.train()
    for step in range(STEPS):
        x = toks[step, rows]
        loss = forward(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        lo = loss.detach().clone()
        if sharded and world > 1:
            dist.all_reduce(lo)
            lo /= world
        losses.append(lo)
    model.eval()
    gens = {}
    with torch.no_grad():
        logits = forward(input_ids=prompt).logits.detach().clone()
        gen = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
        if "rankprompt" in variant:  # each rank its own prompt length (distributed eval)
            for r in (range(world) if sharded else range(3)):
                if sharded and r != rank:
                    continue
                p = prompt[:, :5 - r]
                stance = (torch.compiler.set_stance("force_eager") if "stance" in variant
                          else contextlib.nullcontext())
                with stance:
                    gens[r] = model.generate(p, max_new_tokens=NEW_TOKENS,
                                             min_new_tokens=NEW_TOKENS, do_sample=False,
                                             pad_token_id=0).clone()
    return {"losses": torch.stack(losses), "logits": logits, "gen": gen.clone(), "gens": gens,
            "params": {n: full(p) for n, p in model.named_parameters()}}


def sharded_run(rank, world, variant, mode):
    import shardc
    torch.set_num_threads(1)
    model = build(variant)
    shardc.shard(model)
    be = shardc.backend(inductor=(mode == "inductor"))
    if mode == "eager":
        forward = model
    elif "inplace" in variant:
        model.compile(backend=be)
        forward = model
    else:
        forward = torch.compile(model, backend=be)
    return run(model, forward, variant, rank, world, True)


def reference(variant):
    model = build(variant)
    return run(model, model, variant, 0, 1, False)


def rel(a, b):
    a, b = a.double(), b.double()
    return (a - b).norm().item() / (b.norm().item() or 1.0)


if __name__ == "__main__":
    from dist_utils import run_ranks
    torch.set_num_threads(1)
    variants = sys.argv[1].split(",")
    worlds = [int(w) for w in sys.argv[2].split(",")]
    mode = sys.argv[3] if len(sys.argv) > 3 else "fx"
    for variant in variants:
        ref = reference(variant)
        for world in worlds:
            t0 = time.time()
            try:
                outs = run_ranks(sharded_run, world, variant, mode)
            except AssertionError as exc:
                print(f"{variant} w{world} {mode}: CRASH {str(exc)[-3000:]}", flush=True)
                continue
            got = outs[0]
            errs = {"losses": rel(got["losses"], ref["losses"]),
                    "logits": rel(got["logits"], ref["logits"])}
            perr = {n: rel(got["params"][n], ref["params"][n]) for n in ref["params"]}
            worst_name = max(perr, key=perr.get)
            errs["params"] = perr[worst_name]
            same_gen = all(torch.equal(o["gen"], ref["gen"]) for o in outs)
            if "rankprompt" in variant:
                same_gen = same_gen and all(torch.equal(o["gens"][r], ref["gens"][r])
                                            for r, o in enumerate(outs))
            ok = same_gen and max(errs.values()) <= 1e-5
            print(f"{variant} w{world} {mode}: {'PASS' if ok else 'FAIL'} "
                  f"gen_equal={same_gen} " + " ".join(f"{k}={v:.2e}" for k, v in errs.items())
                  + f" (worst {worst_name}) ({time.time() - t0:.0f}s)", flush=True)
            if not same_gen:
                print("   ref gen", ref["gen"].tolist(), flush=True)
                for r, o in enumerate(outs):
                    print(f"   rank{r} gen", o["gen"].tolist(), flush=True)
