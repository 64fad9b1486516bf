"""CPU plan of the 1b config, world 1, batch 4 x 2048: per-parameter vs packed (probe)."""
import sys
from dataclasses import dataclass
sys.path[:0] = ["benchmarks"]
from train.workload import model_config
from shardc.tools.model_spec import llama_model
from shardc.tools.planner import PlanSetup, plan_model_step
from shardc.planning.profile import resolve_profile

@dataclass(frozen=True)
class Packed(PlanSetup):
    pack: bool = False
    def shard_kwargs(self):
        kw = super().shard_kwargs()
        if self.pack:
            kw["pack_blocks"] = True
        return kw

n = int(sys.argv[1])
for pack in (False, True):
    cfg = model_config("1b", 2048, False, n)
    setup = Packed(precision="bf16", inductor=True, pack=pack)
    planned = plan_model_step(llama_model(cfg), 1, 4, 2048, {"compile_blocks_once": True, "cluster": {"profile": "h200"}}, template=False, setup=setup)
    plan = planned.plan
    print("pack", pack, "peak GiB %.3f" % (plan.predicted.get("peak_bytes") / 2**30), [x for x in plan.notes if "donat" in x], flush=True)
