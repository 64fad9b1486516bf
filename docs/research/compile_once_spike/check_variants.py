"""Design A prototype under no_grad (forward-only region) and with activation checkpointing
around each block's wrapper; compares with the unsharded eager model. 1-rank gloo, CPU, FX.
Usage: python scratch/check_variants.py {nograd,ckpt}"""
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

variant = sys.argv[1]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
import shardc  # noqa: E402
from shardc.models.llama import LlamaConfig, Transformer, TransformerBlock, llama_loss  # noqa: E402

cfg = LlamaConfig(n_layers=3, dim=64, n_heads=4, vocab_size=256, max_seq_len=32)
torch.manual_seed(0)
model = Transformer(cfg)
ref = Transformer(cfg)
ref.load_state_dict(model.state_dict())
shardc.shard(model)
skeleton = TransformerBlock(cfg).to("meta")
names = [n for n, _ in skeleton.named_parameters()]


@torch.compiler.nested_compile_region
def body(params, x, cos, sin):
    return torch.func.functional_call(skeleton, params, (x, cos, sin))


def gathered_call(self, x, cos, sin):
    params = {n: getattr(self.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2])
              for n in names}
    return body(params, x, cos, sin)


def outer_forward(self, x, cos, sin):
    if variant == "ckpt":
        return checkpoint(gathered_call, self, x, cos, sin, use_reentrant=False)
    return gathered_call(self, x, cos, sin)


for layer in model.layers:
    layer.__class__ = type("Outer", (type(layer),), {"forward": outer_forward})

compiled = torch.compile(model, backend=shardc.backend(inductor=False))
tokens = torch.randint(0, 256, (2, 16))
if variant == "nograd":
    with torch.no_grad():
        out, want = compiled(tokens), ref(tokens)
    print("nograd max diff", (out - want).abs().max().item(), "plans", len(shardc.explain_all(compiled)))
else:
    llama_loss(compiled(tokens), tokens).backward()
    llama_loss(ref(tokens), tokens).backward()
    worst = max((p.grad.full_tensor() - q.grad).abs().max().item()
                for p, q in zip(model.parameters(), ref.parameters()))
    print("ckpt max grad diff", worst, "plans", len(shardc.explain_all(compiled)))
dist.destroy_process_group()
