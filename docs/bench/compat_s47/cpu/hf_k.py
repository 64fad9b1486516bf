import sys

import torch

sys.path.insert(0, "/work/main/tests"); sys.path.insert(0, "/work/main")
import real_models as rm
from dist_utils import one_rank_mesh

import shardc

ckpt, once = sys.argv[1] == "1", sys.argv[2] == "1"
with one_rank_mesh() as mesh:
    model = rm.build_hf_decoder(checkpointing=ckpt)
    shardc.shard(model, mesh)
    f = torch.compile(model, backend=shardc.backend(inductor=False, compile_blocks_once=once))
    tok = torch.randint(0, rm.VOCAB, (2, 8))
    try:
        f(input_ids=tok, use_cache=False).logits.sum().backward()
        r = shardc.shard_state(model).regions
        print("RESULT ckpt", ckpt, "once", once, "ok, regions", len(r), "bodies", len(r[0].plan.bodies) if r and r[0].plan else None)
    except Exception as e:
        print("RESULT ckpt", ckpt, "once", once, "FAIL", type(e).__name__, str(e)[:150].replace("\n", " "))
