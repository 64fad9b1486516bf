"""First step (compile included) of a tiny GPT-J through shardc (world 1, Inductor, empty caches)."""
import os, sys, tempfile, time, logging
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
sys.path[:0] = [os.getcwd(), "/work/main/tests"]
import torch, transformers, warnings
warnings.filterwarnings("ignore")
from dist_utils import one_rank_mesh
import shardc
msgs = []
h = logging.Handler(); h.emit = lambda r: msgs.append(r.getMessage()); logging.getLogger("shardc").addHandler(h)
cfg = transformers.GPTJConfig(vocab_size=64, n_embd=32, n_layer=3, n_head=4, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, n_positions=64, attn_implementation="eager")
torch.manual_seed(0)
model = transformers.GPTJForCausalLM(cfg)
ids = torch.randint(2, 60, (2, 9))
with one_rank_mesh() as mesh:
    shardc.shard(model, mesh)
    compiled = torch.compile(model, backend=shardc.backend())
    t = time.perf_counter()
    compiled(input_ids=ids, labels=ids).loss.backward()
    first = time.perf_counter() - t
print(f"{shardc.__file__.split('/shardc/')[0]} first {first:.2f} s again {sum('again' in m for m in msgs)}")
