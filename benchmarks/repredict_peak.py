"""Re-plan the 1b config's auto-budget step on the CPU as the H200 bench planned it, and print
the backward's predicted peak and what is alive there.

    python benchmarks/repredict_peak.py BATCH [--layers 8] [--main-decisions] [--top 30]

Plans ``llama-1b:n_layers=LAYERS`` at world 1, bf16, Inductor, compiled-once block bodies, under
the H200's ``"auto"`` budget (135098892288 B) with ``shardc.tools.planner.plan_model_step`` (the
bench's predictions to ~1e-5: CPU flash attention instead of cuDNN). ``--main-decisions``: the
planner decides with the model as it was before peak13 (one reuse pool for the flattened graph,
no horizontal fusion), as main's bench run did; the last plan's graphs are then re-predicted
with the current model ("same graphs"). Written for issue 22/19 (docs/memory_budget.md, peak13).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from predict_peak import live_at_peak  # noqa: E402

from shardc.compile import pipeline  # noqa: E402
from shardc.memory import peak as memory  # noqa: E402
from shardc.tools.model_spec import parse_model  # noqa: E402
from shardc.tools.planner import PlanSetup, plan_model_step  # noqa: E402

H200_AUTO_BUDGET = 135098892288


def _get(record, key):
    return record[key] if isinstance(record, dict) else getattr(record, key)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("batch", type=int)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--main-decisions", action="store_true")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    calls = []
    predict = pipeline.predict_peak

    def recorded(fw, bw, plan, fw_params, bw_params, **kw):
        out = predict(fw, bw, plan, fw_params, bw_params, **kw)
        calls.append((fw, bw, plan, fw_params, bw_params, kw))
        return out

    pipeline.predict_peak = recorded
    held, horizontal = memory.held_for_reuse, memory._horizontal
    if args.main_decisions:
        memory.held_for_reuse = lambda lives, end, inplace=None, scopes=None: \
            held(lives, end, inplace)
        memory._horizontal = lambda *a: {}
    try:
        planned = plan_model_step(
            parse_model(f"llama-1b:n_layers={args.layers}"), 1, args.batch, 2048,
            dict(peak_memory_budget_bytes=H200_AUTO_BUDGET, compile_blocks_once=True),
            template=False, setup=PlanSetup(precision="bf16", inductor=True))
    finally:
        pipeline.predict_peak = predict
        memory.held_for_reuse, memory._horizontal = held, horizontal
    p = planned.plan.predicted
    print(f"planned: forward {p.forward_peak_bytes:.0f} backward {p.backward_peak_bytes:.0f} "
          f"peak {p.peak_bytes:.0f}")
    budget = planned.plan.budget
    if budget is not None:
        blocks = [b for b in (budget.blocks or []) if _get(b, "recomputed")]
        checkpoints = [b for b in blocks if (b.get("checkpoint_offloaded") if isinstance(b, dict)
                                             else b.checkpoint_offloaded)]
        print(f"budget: minimum {_get(budget, 'minimum_bytes')}, {len(blocks)} blocks recomputed "
              f"({', '.join(_get(b, 'block') for b in blocks)}), checkpoints offloaded "
              f"({', '.join(_get(b, 'block') for b in checkpoints)}), fused loss "
              f"{bool(planned.plan.fused_loss and planned.plan.fused_loss.fused)}")
    fw, bw, plan, fw_params, bw_params, kw = calls[-1]
    again = predict(fw, bw, plan, fw_params, bw_params, **kw)
    print("same graphs, this model:", {k: v for k, v in again.items() if "peak" in k})
    flat, params, host = memory._flat(bw, bw_params, kw.get("host", frozenset()))
    peak, at, alive = live_at_peak(flat, params | host, args.top)
    nodes = list(flat.graph.nodes)
    print(f"backward graph's peak {peak} at {at} ({nodes[at].name})")
    for x in alive:
        print(f"{x.nbytes:>16,} {x.node.name:32} born {x.born:5} ({nodes[x.born].name}) "
              f"last {x.last:5}")


if __name__ == "__main__":
    main()
