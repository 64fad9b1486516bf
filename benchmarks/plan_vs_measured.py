"""Peak memory predicted by ``python -m shardc plan`` on a CPU-only machine against GPU runs.

    python benchmarks/plan_vs_measured.py [--only 1b-w1]

Each row plans the benchmark's model (``benchmarks/train_bench.py``'s configurations: bf16
compute, fp32 reduction and master shards, AdamW) exactly as the capacity planner does for a user
(``shardc.tools.planner.plan_model`` with Inductor's graphs, the per-block template, attention as
the GPU's fused kernel, the loss in the compiled region) and compares the predicted whole-step
peak with the peak allocated that the GPU run measured (the source is named in each row).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardc.tools.model_spec import parse_model  # noqa: E402
from shardc.tools.planner import GIB, PlanSetup, plan_model  # noqa: E402

# name: (model spec, overrides, world, batch, seq, measured peak GiB, where it was measured)
ROWS = {
    "1b-w1": ("llama-1b", [], 1, 4, 2048, 19.96,
              "1 x H100, docs/bench/refactor17 (train_bench.py --model 1b, world 1)"),
    "1b-w2": ("llama-1b", [], 2, 4, 2048, 14.59,
              "2 x H200, docs/bench/README.md (train_bench_f09ceaf)"),
    "wide-w2": ("llama-wide", [], 2, 2, 2048, 17.59,
                "2 x H200, docs/bench/README.md (train_bench_f09ceaf; peak in opt.step)"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=list(ROWS))
    args = parser.parse_args(argv)
    print("| config | world | batch x seq | predicted GiB | measured GiB | error | plan s | "
          "measured on |")
    print("|---|---:|---|---:|---:|---:|---:|---|")
    for name in args.only or ROWS:
        spec, overrides, world, batch, seq, measured, source = ROWS[name]
        start = time.perf_counter()
        plan, _ = plan_model(parse_model(spec, overrides), world, batch, seq, {},
                             setup=PlanSetup(precision="bf16", inductor=True))
        seconds = time.perf_counter() - start
        predicted = plan.predicted.peak_bytes / GIB
        print(f"| {name} | {world} | {batch} x {seq} | {predicted:.2f} | {measured:.2f} | "
              f"{(predicted - measured) / measured * 100:+.1f}% | {seconds:.0f} | {source} |",
              flush=True)


if __name__ == "__main__":
    main()
