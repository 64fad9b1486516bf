"""Counts ``InvokeSubgraphHOP.gen_schema`` calls (AOTAutograd's re-trace of a body for its
schema) in each training step of ``benchmarks/hf_first_step.py`` (LAYERS, FX, plain, dynamic)::

    cd /tmp && PYTHONPATH=<tree> python gen_schema_count.py 8
"""

import functools
import json
import os
import sys

import torch
import torch.distributed as dist
from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

calls = [0]
_original = InvokeSubgraphHOP.__dict__["gen_schema"]


@functools.wraps(_original)
def _counted(self, *args, **kwargs):
    calls[0] += 1
    return _original(self, *args, **kwargs)


InvokeSubgraphHOP.gen_schema = _counted
sys.path.insert(0, "/work/main/benchmarks")
import hf_first_step  # noqa: E402

steps: list[int] = []
_step = hf_first_step._step


def _counted_step(*args, **kwargs):
    before = calls[0]
    out = _step(*args, **kwargs)
    steps.append(calls[0] - before)
    return out


hf_first_step._step = _counted_step
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29877"))
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
out = hf_first_step.main(int(sys.argv[1]), False, False, True)
print(json.dumps({"layers": int(sys.argv[1]), "gen_schema_per_step": steps,
                  "dynamic_s": out["dynamic_s"]}))
dist.destroy_process_group()
