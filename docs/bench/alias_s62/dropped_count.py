import torch, sys
import shardc
from shardc.compile.backend import capture_partitioned
from shardc.models.llama import LlamaConfig, Transformer
from shardc.tools.fake_world import fake_world
from shardc.passes import aliased_saved_values as A
from shardc.compile import pipeline
from torch.distributed import group
from torch.distributed.device_mesh import DeviceMesh
orig = pipeline.save_one_view_per_storage
def wrapped(fw, bw, n):
    r = orig(fw, bw, n); print("dropped", r); return r
pipeline.save_one_view_per_storage = wrapped
torch.manual_seed(0)
with fake_world(1):
    model = Transformer(LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, max_seq_len=8))
    model.init_weights()
    shardc.shard(model, DeviceMesh.from_group(group.WORLD, "cpu"))
    f = torch.compile(model, backend=shardc.backend(inductor=sys.argv[1] == "1", check_plan_consistency=False))
    f(torch.randint(0, 64, (2, 8))).float().mean().backward()
