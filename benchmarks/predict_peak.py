"""shardc's peak-memory prediction for the GPU benchmark's models, computed on a CPU-only machine.

    python benchmarks/predict_peak.py wide [--batch 2] [--world 2] [--top 12]

Plans the model exactly as ``train_bench.py``'s ``shardc`` mode compiles it (Inductor's
decompositions and partition, the loss in the compiled region, bf16 compute with fp32 master
parameters and fp32 reduction) on rank 0 of a fake world, with CPU shards that are allocated but
never written; planning stops before Inductor generates code, so nothing runs. Prints the plan's
predictions and, at the predicted forward and backward peaks, the largest values alive, so a CUDA
memory history (``train_bench.py --memory-snapshot``) can be compared with them entry by entry.
The attention op differs from the GPU's (CPU flash attention instead of cuDNN), which changes
the prediction by well under 1% on these models.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_bench import DEFAULT_BATCH, model_config  # noqa: E402

import shardc  # noqa: E402
from shardc.compile import pipeline  # noqa: E402
from shardc.memory import peak as memory  # noqa: E402
from shardc.models.llama import Transformer, llama_loss, rope_tables  # noqa: E402
from shardc.sharding.shard import shard_state  # noqa: E402
from shardc.tools.fake_world import fake_world  # noqa: E402


class _Planned(Exception):
    """Raised once the region is planned, to stop before Inductor generates code."""


@contextlib.contextmanager
def plan_only(params: dict):
    """Stop compilation right after shardc plans and lowers a region; ``params`` receives the
    parameter-shard placeholders of its graphs (which the lowering removes from view)."""
    original = pipeline.plan_and_lower

    def plan_and_stop(fw, bw, options, region):
        params["forward"] = memory.param_placeholders(fw)
        params["backward"] = memory.param_placeholders(bw) if bw is not None else set()
        original(fw, bw, options, region)
        raise _Planned

    pipeline.plan_and_lower = plan_and_stop  # the backend calls it through the module
    try:
        yield
    finally:
        pipeline.plan_and_lower = original


def plan_benchmark_model(name: str, batch: int, world: int, seq: int = 2048,
                         n_layers: int | None = None, **options):
    """(region record, parameter placeholders by graph) of the benchmark's shardc mode
    (``options``: more ``shardc.backend`` options, e.g. a peak budget)."""
    from torch.distributed.device_mesh import DeviceMesh

    cfg = model_config(name, seq, False, n_layers)
    params: dict = {}
    with fake_world(world):
        import torch.distributed as dist

        with torch.device("meta"):
            model = Transformer(cfg)
        mp = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shardc.shard(model, DeviceMesh.from_group(dist.group.WORLD, "cpu"), mp_policy=mp)
        model.rope_cos, model.rope_sin = rope_tables(cfg.head_dim, cfg.max_seq_len,
                                                     cfg.rope_theta)
        step = torch.compile(lambda t, y: llama_loss(model(t), y),
                             backend=shardc.backend(check_plan_consistency=False, **options))
        tokens = torch.zeros(batch, seq, dtype=torch.long)
        with plan_only(params):
            try:
                step(tokens, tokens)
            except torch._dynamo.exc.BackendCompilerFailed as exc:  # wraps _Planned
                if not isinstance(exc.inner_exception, _Planned):
                    raise
        region = shard_state(model).regions[0]
    torch._dynamo.reset()
    return region, params


def live_at_peak(gm, skip, top: int) -> tuple[int, int, list[memory.Lifetime]]:
    """(peak bytes, its position, the ``top`` largest values alive there)."""
    peak, timeline = memory.liveness_peak(gm, skip, fusion=True)
    at = timeline.index(peak)
    alive = [life for life in memory.lifetimes(gm, skip, fusion=True)
             if life.born <= at <= life.last and life.nbytes]
    return peak, at, sorted(alive, key=lambda life: -life.nbytes)[:top]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=["1b", "wide"])
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--n-layers", type=int, default=None, help="override the depth")
    parser.add_argument("--budget", type=int, default=0,
                        help="peak_memory_budget_bytes (0: none); the plan's decisions printed")
    args = parser.parse_args(argv)
    options = {"peak_memory_budget_bytes": args.budget} if args.budget else {}
    region, params = plan_benchmark_model(args.model, args.batch or DEFAULT_BATCH[args.model],
                                          args.world, n_layers=args.n_layers, **options)
    if region.plan.budget is not None:
        print(region.plan.table())
    gib = 2 ** 30
    print(f"{args.model}, world {args.world}: predicted (GiB)")
    for key, value in region.plan.predicted.items():
        if key.endswith("bytes"):
            print(f"  {key:28s} {value / gib:8.3f}")
    for name, gm in (("forward", region.forward), ("backward", region.backward)):
        peak, at, alive = live_at_peak(gm, params[name], args.top)
        node = list(gm.graph.nodes)[at]
        print(f"{name}: {peak / gib:.3f} GiB of values alive at its peak, node {at} ({node.name})")
        for life in alive:
            print(f"  {life.nbytes / gib:7.3f}  {life.node.name:44s} {life.born:5d}..{life.last}")


if __name__ == "__main__":
    main()
