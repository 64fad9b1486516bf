"""First training step of transformers' Qwen2ForCausalLM (tiny random config, no download) through
shardc, one process, world 1 over gloo on the CPU::

    python benchmarks/hf_first_step.py LAYERS fx|ind plain|packed [dynamic] [cache] [checkpoint]

(``ind``: Inductor; ``packed``: ``shardc.shard(..., pack_blocks=True)``). Prints one JSON line:
the first step's seconds (compile included), the mean of three steady steps, the last loss, the
plan's hash, the block bodies (blocks calling each, partitions) and how many blocks compiled
inline. ``dynamic``: then one step at another sequence length, which torch recompiles with
dynamic shapes: its seconds (``dynamic_s``), its loss, and the dynamic region's bodies and
inline blocks. ``cache``: the model is called with ``use_cache`` left at its default (each
layer gets transformers' ``DynamicCache``), as users call it. ``checkpoint``: every decoder
layer checkpointed (``gradient_checkpointing_enable()``). Run each row in its own
process; for a cold Inductor row point ``TORCHINDUCTOR_CACHE_DIR`` at an empty directory
(docs/bench/compile_time/s43/hf_cpu.md). ``PORT``: the rendezvous port.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def _step(forward, opt, ids: torch.Tensor, cache: bool = False) -> torch.Tensor:
    kwargs = {} if cache else {"use_cache": False}
    logits = forward(input_ids=ids[:, :-1], **kwargs).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def main(layers: int, inductor: bool, pack: bool, dynamic: bool = False,
         cache: bool = False, checkpoint: bool = False) -> dict:
    import transformers

    import shardc

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, attn_implementation="sdpa")
    model = transformers.Qwen2ForCausalLM(cfg)
    if checkpoint:
        model.gradient_checkpointing_enable()
    shardc.shard(model, pack_blocks=pack)
    forward = torch.compile(model, backend=shardc.backend(inductor=inductor))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 33))
    start = time.perf_counter()
    _step(forward, opt, ids, cache)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(3):
        loss = _step(forward, opt, ids, cache)
    steady = (time.perf_counter() - start) / 3
    plan = shardc.explain_all(forward)[0]
    out = {"layers": layers, "inductor": inductor, "packed": pack, "cache": cache,
           "checkpoint": checkpoint,
           "first_s": round(first, 2),
           "steady_ms": round(steady * 1e3, 1), "loss": round(float(loss), 6),
           "hash": plan.hash(), "bodies": [(len(b.blocks), b.partitions) for b in plan.bodies],
           "inline": len(plan.inline_blocks)}
    if dynamic:
        start = time.perf_counter()
        loss = _step(forward, opt, ids[:, :25], cache)
        out["dynamic_s"] = round(time.perf_counter() - start, 2)
        plan = shardc.explain_all(forward)[-1]
        out.update(dynamic_loss=round(float(loss), 6), dynamic_inline=len(plan.inline_blocks),
                   dynamic_bodies=[(len(b.blocks), b.partitions) for b in plan.bodies])
    return out


if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29811"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    flags = set(sys.argv[4:])
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2] == "ind", sys.argv[3] == "packed",
                          "dynamic" in flags, "cache" in flags, "checkpoint" in flags)))
    dist.destroy_process_group()
