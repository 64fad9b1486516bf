"""s75: the cold first step (compile included) of transformers' GPT-2 with its default dropout
(0.1), one gloo rank on the CPU, Inductor, at 2 and 8 layers, for the shardc checkout on
PYTHONPATH (before s75: every block inline for its dropout; after: one shared body).
One run per process, empty Inductor cache: ``python3 THIS LAYERS``; prints one JSON line."""

import json
import os
import sys
import tempfile
import time

if __name__ == "__main__":
    layers = int(sys.argv[1])
    cache = tempfile.mkdtemp(prefix="s75_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29700 + layers))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import transformers

    import shardc

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=layers, n_head=4,
                                  n_positions=32, attn_implementation="sdpa")
    model = shardc.shard(transformers.GPT2LMHeadModel(cfg))
    forward = torch.compile(model, backend="shardc")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 17))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        logits = forward(input_ids=ids[:, :-1], use_cache=False).logits
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    plans = [r.plan for r in shardc.shard_state(model).regions]
    print(json.dumps({"layers": layers, "first_step_s": round(times[0], 2),
                      "later_steps_s": [round(t, 3) for t in times[1:]],
                      "shared_blocks": [len(b.blocks) for p in plans for b in p.bodies],
                      "inline_blocks": len([b for p in plans for b in p.inline_blocks])}))
    dist.destroy_process_group()
