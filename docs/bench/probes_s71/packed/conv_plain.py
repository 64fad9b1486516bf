import torch
from cases3 import ConvStack, data
from dist_utils import one_rank_mesh
import shardc
if __name__ == "__main__":
    torch.manual_seed(0)
    m = ConvStack()
    f = torch.compile(m, backend="aot_eager")
    f(data(0)[0]).sum().backward(); print("aot_eager ok")
    for blocks_once in (True, False):
        torch._dynamo.reset()
        with one_rank_mesh() as mesh:
            m = shardc.shard(ConvStack(), mesh, pack_blocks=False)
            f = torch.compile(m, backend=shardc.backend(inductor=False, compile_blocks_once=blocks_once))
            try:
                f(data(0)[0]).sum().backward(); print("shardc ok", blocks_once)
            except Exception as e:
                print("shardc fail", blocks_once, str(e)[:100])
