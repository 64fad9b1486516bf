import sys

import torch

sys.path.insert(0, "/work/main/tests"); sys.path.insert(0, "/work/main")
import real_models as rm

model = rm.build_hf_decoder(checkpointing=True)
f = torch.compile(model, backend="aot_eager", fullgraph=False)
tok = torch.randint(0, rm.VOCAB, (2, 8))
try:
    f(input_ids=tok, use_cache=False).logits.sum().backward()
    print("RESULT plain torch.compile ok")
except Exception as e:
    print("RESULT plain FAIL", type(e).__name__, str(e)[:200].replace("\n", " "))
