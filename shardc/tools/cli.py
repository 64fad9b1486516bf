"""``python -m shardc plan``: plan a model for any world size on a machine without GPUs.

The model is built on the meta device and sharded over a fake process group of the requested
size (rank 0's view); compiling it with the shardc backend plans the region exactly as a real run
would, and running it on meta tensors moves no data. A model with more blocks than a template
traces is planned from its first blocks, repeated (``shardc.tools.template``), unless
``--full-trace``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch

from shardc import _torch
from shardc.models.llama import LlamaConfig, Transformer, llama_loss

PRESETS: dict[str, dict] = {
    "llama-tiny": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=256),
    "llama-1b": dict(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, max_seq_len=2048),
    "llama-wide": dict(vocab_size=32000, dim=4096, n_layers=8, n_heads=32, max_seq_len=2048),
    "llama-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                     ffn_dim=14336, max_seq_len=8192),
    "llama-70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                      ffn_dim=28672, max_seq_len=8192),
}


def parse_model_spec(spec: str) -> LlamaConfig:
    """``<preset>[:key=value,...]`` or ``llama:key=value,...`` -> LlamaConfig."""
    name, _, overrides = spec.partition(":")
    if name != "llama" and name not in PRESETS:
        raise SystemExit(f"unknown model {name!r}; presets: {', '.join(PRESETS)} (or 'llama:...')")
    values = dict(PRESETS.get(name, {}))
    fields = {f.name: f.type for f in dataclasses.fields(LlamaConfig)}
    for item in filter(None, overrides.split(",")):
        key, _, raw = item.partition("=")
        if key not in fields:
            raise SystemExit(f"unknown LlamaConfig field {key!r}; fields: {', '.join(fields)}")
        values[key] = raw.lower() == "true" if raw.lower() in ("true", "false") else (
            float(raw) if "." in raw or "e" in raw else int(raw))
    return LlamaConfig(**values)


def _meta_model(cfg: LlamaConfig) -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg)


def plan_model(cfg: LlamaConfig, world: int, batch: int, seq: int, options: dict, *,
               template: bool = True):
    """Plan one training step of ``cfg`` at ``world`` ranks; returns (plan, seconds).

    With ``template`` and more blocks than a template traces, the plan is made from a trace of
    the first blocks (``shardc.tools.template``); if the traced graphs do not repeat, the whole
    model is traced (the plan's notes say so). ``seconds`` covers everything from building the model
    on the meta device to the finished plan.
    """
    from torch.distributed.device_mesh import DeviceMesh

    import shardc
    from shardc.tools.fake_world import fake_world
    from shardc.tools.template import TEMPLATE_BLOCKS, TemplateRefused, plan_from_template

    options = dict(inductor=False, check_plan_consistency=False, **options)
    with fake_world(world):
        import torch.distributed as dist

        mesh = DeviceMesh.from_group(dist.group.WORLD, "meta")
        tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        start = time.perf_counter()
        plan, refused = None, None
        if template and cfg.n_layers > TEMPLATE_BLOCKS:
            try:
                plan = plan_from_template(_meta_model(cfg), mesh, lambda m: m(tokens), options)
            except TemplateRefused as exc:
                refused = str(exc)
                _torch.dynamo_reset()
        if plan is None:
            model = _meta_model(cfg)
            shardc.shard(model, mesh)
            compiled = torch.compile(model, backend=shardc.backend(**options))
            llama_loss(compiled(tokens), tokens).backward()
            plan = shardc.explain(compiled)
            if refused:
                plan.notes.append(f"traced whole, not from a template: {refused}")
        elapsed = time.perf_counter() - start
    _torch.dynamo_reset()
    return plan, elapsed


def _cmd_plan(args) -> int:
    from shardc.planning.cost_model import ClusterSpec
    from shardc.tools.render import dump_plan, plan_table

    cfg = parse_model_spec(args.model)
    options = json.loads(args.options) if args.options else {}
    cluster = ClusterSpec(peak_flops=args.peak_flops, bus_bandwidth=args.bandwidth,
                          latency_s=args.latency, mem_bandwidth=args.mem_bandwidth)
    options["cluster"] = dataclasses.asdict(cluster)
    seq = args.seq or cfg.max_seq_len
    plan, seconds = plan_model(cfg, args.world_size, args.batch, seq, options,
                               template=not args.full_trace)
    print(plan_table(plan, wide=args.wide))
    print(f"\nmodel: {cfg.num_params() / 1e9:.2f}B parameters, world size {args.world_size}, "
          f"batch {args.batch} x {seq} per rank; traced and planned in {seconds:.1f} s")
    if args.dump:
        for path in dump_plan(plan, args.dump):
            print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:  # its own command line: shardc.tools.calibrate
        from shardc.tools.calibrate import main as calibrate

        return calibrate(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m shardc")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan a model for a world size, without GPUs")
    p.add_argument("model", help=f"preset ({', '.join(PRESETS)}) with optional ':key=value,...', "
                   "or 'llama:key=value,...'")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: max_seq_len)")
    p.add_argument("--bandwidth", type=float, default=100e9, help="bus bytes/s per rank")
    p.add_argument("--latency", type=float, default=10e-6, help="seconds per ring step")
    p.add_argument("--peak-flops", type=float, default=400e12)
    p.add_argument("--mem-bandwidth", type=float, default=3.0e12)
    p.add_argument("--options", default=None, help="JSON object of backend options")
    p.add_argument("--dump", default=None, help="directory for text/JSON/trace/memory plot")
    p.add_argument("--wide", action="store_true",
                   help="print the plan with one column per field (~300 columns) instead of "
                        "lines of at most 99 columns")
    p.add_argument("--full-trace", action="store_true",
                   help="trace every block (default: trace the first blocks and repeat them when "
                   "the blocks are identical; see docs/planning.md)")
    args = parser.parse_args(argv)
    if args.command == "plan":
        return _cmd_plan(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
