import torch, torch._dynamo
from dist_utils import one_rank_mesh
from torch.distributed import group
from torch.distributed.device_mesh import DeviceMesh
import shardc
from shardc.compile.backend import capture_partitioned
from shardc.ops.gather import GATHER_OP
from shardc.ops.gather_args import GatherArgs
from shardc.passes.fx_utils import is_call
from shardc.tools.fake_world import fake_world
from cases3 import Unused, Stack, data

if __name__ == "__main__":
    for world in (1, 2):
        torch._dynamo.reset()
        with fake_world(world), capture_partitioned() as graphs:
            model = shardc.shard(Stack([Unused() for _ in range(3)]), DeviceMesh.from_group(group.WORLD, "cpu"))
            f = torch.compile(model, backend=shardc.backend(inductor=False, check_plan_consistency=False))
            f(data(0)[0]).sum().backward()
        for fw, bw in graphs:
            for g, name in ((fw, "fw"), (bw, "bw")):
                print(world, name, [GatherArgs.of(n).fqn for n in g.graph.nodes if is_call(n, GATHER_OP)])
