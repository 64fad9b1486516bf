"""``python -m shardc plan``: will a model fit, and how fast will it train, at any world size,
planned on a machine without GPUs.

    python -m shardc plan llama-8b --world-size 64 --device h100
    python -m shardc plan hf:llama hidden_size=1024 num_hidden_layers=4 --world-size 8
    python -m shardc plan mypkg.models:build_model depth=12 --sweep-world 8,64,512,4096

The model (``shardc.tools.model_spec``) is planned by ``shardc.tools.planner`` and the answers are
printed: predicted step time, tokens/s per GPU, MFU, exposed communication and the peak memory
against the device's. ``--sweep-world`` plans each world size and prints (and plots) how they
change.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from shardc.tools.model_spec import (
    PRESETS,
    ModelSpecError,
    fit_seq,
    parse_model,
    parse_model_spec,
)
from shardc.tools.planner import (
    OFFLOAD,
    OPTIMIZERS,
    Capacity,
    PlanSetup,
    capacity,
    capacity_dict,
    cluster_option,
    cluster_profile,
    device_capacity,
    fmt_bytes,
    peak_flops_of,
    peak_terms_text,
    plan_model,
    plan_model_step,
    profile_text,
    step_lines,
    whole_step,
)

__all__ = ["main", "parse_model_spec", "plan_model"]


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise ModelSpecError(f"--sweep-world {text!r}: give world sizes as 8,64,512") from None
    if not sizes or min(sizes) < 1:
        raise ModelSpecError(f"--sweep-world {text!r}: give positive world sizes as 8,64,512")
    return sizes


def _budget_bytes(text: str) -> int | str:
    """``--memory-budget``: ``auto``, or bytes with an optional KiB/MiB/GiB suffix."""
    if text == "auto":
        return text
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "B": 1}
    for unit, scale in units.items():
        if text.endswith(unit):
            try:
                return int(float(text[:-len(unit)]) * scale)
            except ValueError:
                break
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--memory-budget: {text!r} is not 'auto' or a number of bytes (e.g. 40GiB)") from None


def _auto_budget(cap_bytes: float | None, profile: str) -> int:
    """``--memory-budget auto`` without a GPU: the budget a compile on the planned device would
    take (:func:`shardc.planning.budget.auto_budget` of its capacity), printed."""
    from shardc.planning.budget import auto_budget

    if not cap_bytes:
        raise ModelSpecError(f"--memory-budget auto: the cluster profile {profile!r} names no "
                             "device memory; give the device with --device (h100, h200 or GiB) "
                             "or a budget in bytes")
    budget = auto_budget(cap_bytes)
    print(f"memory budget: auto = {budget:,} B ({fmt_bytes(budget)}), the device's "
          f"{fmt_bytes(cap_bytes)} less the allocator margin")
    return budget


def _setup(args) -> PlanSetup:
    return PlanSetup(precision=args.precision, checkpointing=args.checkpointing, fp8=args.fp8,
                     shard_size=args.shard_size, inductor=not args.fx, tp=args.tp,
                     offload=args.offload, step_in_backward=args.step_in_backward,
                     optimizer=args.optimizer, reshard_after_forward=args.reshard,
                     pack_blocks=args.pack_blocks)


def _rates(args) -> dict[str, float]:
    names = {"peak_flops": args.peak_flops, "bus_bandwidth": args.bandwidth,
             "latency_s": args.latency, "mem_bandwidth": args.mem_bandwidth,
             "node_size": args.node_size}
    return {k: v for k, v in names.items() if v is not None}


def _rate(flops_per_s: float) -> str:
    if flops_per_s >= 1e12:
        return f"{flops_per_s / 1e12:.0f} TFLOP/s"
    return f"{flops_per_s / 1e9:.1f} GFLOP/s"


def _summary(cap: Capacity, seconds: float) -> list[str]:
    what = "forward and backward"
    if cap.step is not None:
        what = "whole step: forward, backward, optimizer, zero_grad, back to back"
        if cap.step.steady_s != cap.step.step_s:
            what += f"; {cap.step.step_s * 1e3:.1f} ms from an idle device"
    lines = [
        f"predicted step: {cap.step_s * 1e3:.1f} ms ({what}); {cap.tokens_per_s:,.0f} "
        f"tokens/s per GPU; MFU {cap.mfu * 100:.1f}% (of {_rate(cap.peak_flops)}); "
        f"exposed communication {cap.exposed_comm_s * 1e3:.1f} ms",
    ]
    if cap.step is not None:
        lines += step_lines(cap.step)
    return lines + [f"memory: {cap.verdict()}", f"planned in {seconds:.1f} s"]


def _sweep_table(rows: list[Capacity]) -> list[str]:
    head = (f"{'world':>6} {'step ms':>9} {'tokens/s/GPU':>13} {'MFU %':>6} "
            f"{'exposed ms':>10} {'peak':>10}  memory")
    lines = [head]
    for c in rows:
        fits = ("-" if c.capacity_bytes is None else
                "fits" if c.peak_bytes <= c.capacity_bytes else
                f"over by {fmt_bytes(c.peak_bytes - c.capacity_bytes)}")
        lines.append(f"{c.world:>6} {c.step_s * 1e3:>9.1f} {c.tokens_per_s:>13,.0f} "
                     f"{c.mfu * 100:>6.1f} {c.exposed_comm_s * 1e3:>10.1f} "
                     f"{fmt_bytes(c.peak_bytes):>10}  {fits}")
    return lines


def _cmd_plan(args) -> int:
    from shardc.tools.render import budget_lines, dump_plan, plan_table

    spec = parse_model(args.model, args.overrides)
    setup = _setup(args)
    if args.cudagraphs and setup.offload != "none":
        # The replay term (shardc.planning.step) is not modelled with a host-side step.
        raise ModelSpecError("--cudagraphs with --offload: the step model's CUDA-graph term "
                             "covers an optimizer on the device only; plan CPU offload "
                             "without --cudagraphs")
    options = json.loads(args.options) if args.options else {}
    # The plan is a GPU's (the profile's), made on the CPU: device memory counted as the CUDA
    # caching allocator counts it, with the runtime's workspaces (ShardcOptions.memory_target).
    options.setdefault("memory_target", "cuda")
    if args.memory_budget is not None:
        options["peak_memory_budget_bytes"] = args.memory_budget
    if args.memory_margin is not None:
        options["peak_memory_margin"] = args.memory_margin
    # The template path (repeat the first blocks' graphs) plans without the budget planner.
    template = not args.full_trace and not options.get("peak_memory_budget_bytes")
    cluster = cluster_option(args.profile, _rates(args))
    if cluster is not None:
        options["cluster"] = cluster
    profile = cluster_profile(options.get("cluster"))
    seq = args.seq or spec.default_seq
    spec, seq_note = fit_seq(spec, seq)
    if seq_note:
        print(f"note: {seq_note}")
    # The device's memory: --device, else the profile's device.
    cap_bytes = (device_capacity(args.device) if args.device is not None
                 else float(profile.device_memory_bytes) or None)
    if options.get("peak_memory_budget_bytes") == "auto":
        options["peak_memory_budget_bytes"] = _auto_budget(cap_bytes, profile.name)
    peak_flops = peak_flops_of(profile, setup.precision)
    print(profile_text(profile))
    worlds = _world_sizes(args.sweep_world) if args.sweep_world else [args.world_size]
    rows = []
    for world in worlds:
        planned = plan_model_step(spec, world, args.batch, seq, options, template=template,
                                  setup=setup)
        plan, seconds = planned.plan, planned.seconds
        cap = capacity(plan, args.batch, seq, peak_flops, cap_bytes,
                       step=whole_step(planned, profile, cudagraphs=args.cudagraphs))
        rows.append(cap)
        if args.sweep_world:
            print(f"world {world}: planned in {seconds:.1f} s", file=sys.stderr)
            continue
        if not args.summary_only:
            print(plan_table(plan, wide=args.wide))
            print()
        print(f"model: {spec.name}, world size {world}, batch {args.batch} x {seq} per rank, "
              f"{setup.precision}{', checkpointed blocks' if setup.checkpointing else ''}"
              f"{', FP8 gathers' if setup.fp8 else ''}"
              f"{f', HSDP shard groups of {setup.shard_size}' if setup.shard_size else ''}"
              f"{f', TP {setup.tp}' if setup.tp > 1 else ''}"
              f"{f', CPU offload ({setup.offload})' if setup.offload != 'none' else ''}"
              f"{', step_in_backward' if setup.step_in_backward else ''}"
              f"{', CUDA graphs' if args.cudagraphs else ''}")
        decisions = budget_lines(plan) if args.summary_only else []
        if args.summary_only and plan.fused_loss is not None:
            decisions.append(plan.fused_loss.note())
        for line in [*_summary(cap, seconds), *peak_terms_text(plan), *decisions]:
            print(line)
        if args.dump:
            for path in dump_plan(plan, args.dump, capacity_bytes=cap_bytes):
                print(f"wrote {path}")
            step_path = os.path.join(args.dump, f"region{plan.region}.step.json")
            with open(step_path, "w") as f:  # the whole step beside the plan's graphs
                f.write(json.dumps(capacity_dict(cap), indent=1) + "\n")
            print(f"wrote {step_path}")
    if args.sweep_world:
        print(f"model: {spec.name}, batch {args.batch} x {seq} per rank, {setup.precision}")
        print("\n".join(_sweep_table(rows)))
        _write_sweep_plot(rows, args.plot or "shardc-sweep.png", spec.name)
    if args.json:
        _write_json(args.json, spec.name, setup, args.batch, seq, profile.name, rows,
                    cudagraphs=args.cudagraphs)
    return 0


def _write_json(path: str, name: str, setup: PlanSetup, batch: int, seq: int, profile: str,
                rows: list[Capacity], cudagraphs: bool = False) -> None:
    data = {"model": name, "batch": batch, "seq": seq, "profile": profile,
            "setup": {"precision": setup.precision, "checkpointing": setup.checkpointing,
                      "fp8": setup.fp8, "shard_size": setup.shard_size, "tp": setup.tp,
                      "offload": setup.offload, "step_in_backward": setup.step_in_backward,
                      "optimizer": setup.optimizer_name, "cudagraphs": cudagraphs},
            "worlds": [capacity_dict(c) for c in rows]}
    text = json.dumps(data, indent=1)
    if path == "-":
        print(text)
        return
    with open(path, "w") as f:
        f.write(text + "\n")
    print(f"wrote {path}")


def _write_sweep_plot(rows: list[Capacity], path: str, title: str) -> None:
    from shardc.tools.memory_plot import sweep_plot

    try:
        print(f"wrote {sweep_plot(rows, path, title)}")
    except ImportError as exc:
        print(f"no plot written: {exc}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shardc")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan a model for a world size, without GPUs")
    p.add_argument("model", help=f"preset ({', '.join(PRESETS)}) with optional ':key=value,...', "
                   "'llama:key=value,...', 'hf:<model type or config class>' (hf:llama, "
                   "hf:Qwen2Config, hf:mixtral) or 'package.module:factory'")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides (hf:, presets) or factory keyword arguments")
    world = p.add_mutually_exclusive_group(required=True)
    world.add_argument("--world-size", type=int)
    world.add_argument("--sweep-world", default=None, metavar="8,64,512",
                       help="plan each world size; print a table and write a plot (--plot)")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length (default: a preset's max_seq_len, else 2048)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: bf16 parameters for compute, fp32 reduction and master shards "
                        "(default); fp32: everything fp32")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing: recompute every block in the backward")
    p.add_argument("--fp8", action="store_true", help="gather nn.Linear weights in FP8")
    p.add_argument("--shard-size", type=int, default=None,
                   help="HSDP: shard within groups of this many ranks, replicate across groups")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: FSDP over world/tp ranks of a (dp, tp) mesh, "
                        "the Llama presets' blocks split Megatron-style (--batch is per dp rank)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=None,
                   help="the optimizer the step runs (its state in the peak, its step in the "
                        "step time): default adamw (torch.optim.AdamW with foreach and fused "
                        "unset: foreach on the device, per tensor where a parameter group holds "
                        "host tensors) on the device, adamw-fused with --offload (torch's fused "
                        "CPU AdamW); adamw-foreach / adamw-per-tensor: foreach=True / False")
    p.add_argument("--offload", choices=OFFLOAD, default="none",
                   help="CPU offload (docs/offload.md): 'params' = shardc.OffloadPolicy() "
                        "(shards, gradients and optimizer state on the host, the step on the "
                        "CPU), 'optimizer' = OffloadPolicy(params=False, optimizer=True)")
    p.add_argument("--step-in-backward", action="store_true",
                   help="with --offload params: shardc.step_in_backward, the host step of each "
                        "bucket overlapped with the rest of the backward")
    p.add_argument("--no-reshard", dest="reshard", action="store_false",
                   help="shardc.shard(reshard_after_forward=False): the backward reuses the "
                        "forward's gathered parameters (no second all-gather or host copy)")
    p.add_argument("--pack-blocks", action=argparse.BooleanOptionalAction, default=True,
                   help="shardc.shard's pack_blocks (on by default, as there): each repeated "
                        "block's shards in one buffer, gathered once per block (where shard "
                        "packs one: planned with the blocks compiled once, the whole model "
                        "traced); --no-pack-blocks: "
                        "pack_blocks=False, each parameter read and gathered on its own")
    p.add_argument("--cudagraphs", action="store_true",
                   help="the compiled regions replay as CUDA graphs (torch.compile(..., "
                        "mode='reduce-overhead')): their kernels cost no host launches; the "
                        "optimizer stays eager. The peak does not count the graph pool's own "
                        "memory (docs/overhead.md)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the answers (whole step by phase, memory) as JSON ('-': "
                        "print them)")
    p.add_argument("--device", default=None,
                   help="device memory to compare the peak with: h100, h200 or GiB (default: "
                        "the cluster profile's device)")
    p.add_argument("--profile", default=None,
                   help="cluster profile for the cost model: a preset (h100, h200) or a file "
                        "written by 'python -m shardc calibrate' (default: h100)")
    p.add_argument("--node-size", type=int, default=None,
                   help="GPUs per node on the intra-node link (default: the profile's, 8); "
                        "larger process groups run at the inter-node link")
    p.add_argument("--bandwidth", type=float, default=None, help="bus bytes/s per rank")
    p.add_argument("--latency", type=float, default=None, help="seconds per ring step")
    p.add_argument("--peak-flops", type=float, default=None)
    p.add_argument("--mem-bandwidth", type=float, default=None)
    p.add_argument("--fx", action="store_true",
                   help="plan the FX backend (inductor=False) on the meta device instead of "
                        "Inductor's graphs (faster; less faithful to the GPU's memory)")
    p.add_argument("--options", default=None, help="JSON object of backend options")
    p.add_argument("--dump", default=None,
                   help="directory for text/JSON/trace/memory plot, and the whole step "
                        "(region0.step.json)")
    p.add_argument("--plot", default=None, help="sweep plot path (default shardc-sweep.png)")
    p.add_argument("--summary-only", action="store_true", help="do not print the plan table")
    p.add_argument("--wide", action="store_true",
                   help="print the plan with one column per field (~300 columns) instead of "
                        "lines of at most 99 columns")
    p.add_argument("--memory-budget", type=_budget_bytes, default=None, metavar="BYTES|auto",
                   help="bound the predicted whole-step peak (bytes, or with a KiB/MiB/GiB "
                        "suffix; 'auto': the device's capacity (--device, else the profile's) less "
                        "the margin a GPU compile takes): the planner "
                        "keeps buckets gathered forward->backward while it fits, and prints its "
                        "decisions (traces every block, as --full-trace)")
    p.add_argument("--memory-margin", type=float, default=None, metavar="FRACTION",
                   help="with --memory-budget: the margin for the peak prediction's error, a "
                        "fraction of the planned-for peak (default 0.02; 0: plan for the "
                        "budget itself)")
    p.add_argument("--full-trace", action="store_true",
                   help="trace every block (default: trace the first blocks and repeat them when "
                   "the blocks are identical; see docs/planning.md)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:  # its own command line: shardc.tools.calibrate
        from shardc.tools.calibrate import main as calibrate

        return calibrate(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "plan":
        try:
            return _cmd_plan(args)
        except ModelSpecError as exc:
            print(f"shardc plan: {exc}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
