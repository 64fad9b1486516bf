import copy
import torch, torch._dynamo
from dist_utils import one_rank_mesh
import shardc
from cases3 import Nested, data

def train(model, fwd, steps=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for s in range(steps):
        x, y = data(s)
        loss = (fwd(x) - y).square().mean(); loss.backward(); opt.step(); opt.zero_grad()
        out.append(loss.item())
    return out

if __name__ == "__main__":
    torch.manual_seed(0)
    ref = Nested()
    sd = copy.deepcopy(ref.state_dict())
    with one_rank_mesh() as mesh:
        with torch.device("meta"):
            model = Nested()
        shardc.shard(model, mesh)
        st = shardc.shard_state(model).packed
        print("packed:", sorted(st.blocks))
        model.to_empty(device="cpu")
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.to_local().copy_(sd[n])
        print("buffers:", {k: (b.buffer is not None) for k, b in st.blocks.items()})
        f = torch.compile(model, backend=shardc.backend(inductor=False))
        try:
            got = train(model, f)
        except Exception as e:
            got = f"ERROR {str(e)[:300]}"
        print("sharded", got)
        print("ref    ", train(ref, ref))
