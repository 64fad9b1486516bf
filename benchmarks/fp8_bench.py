"""FP8 vs bf16 training step of the same shardc model (a Linear-heavy Llama, d_model 4096).

Launch on GPUs (one process per GPU; one GPU is fine, the planned all-gathers still run)::

    torchrun --nproc-per-node 1 benchmarks/fp8_bench.py --out docs/bench
    torchrun --nproc-per-node 2 benchmarks/fp8_bench.py --steps 200 --out docs/bench
    torchrun --nproc-per-node 1 benchmarks/fp8_bench.py --modes bf16,fp8,fp8-linear

Without a GPU: ``--device cpu --tiny`` runs the same loop over gloo (a functional check, not a
measurement), and ``--plan-only`` plans one step of each mode in a fake world (built on the
meta device, planned on a CPU mesh: no GPU, no compute; any ``--dim``...) and reports the
planned all-gather bytes.

Every mode: ``shardc.shard(model, mp_policy=MixedPrecisionPolicy(bf16, fp32))``, compiled with
``backend="shardc"`` (Inductor), AdamW, same seed and data (a learnable synthetic sequence, so
the loss falls). Modes (:data:`MODES`): ``bf16``; ``fp8`` adds
``fp8=shardc.Float8Policy(modules=(nn.Linear, nn.Embedding))``: every ``nn.Linear`` weight is
gathered in float8 and runs on ``torch._scaled_mm``, and the token embedding is gathered in
float8 and dequantized for its lookup; ``fp8-linear`` gathers the ``nn.Linear`` weights only
(``shardc.Float8Policy()``, the configuration measured before embeddings were supported).
Reported per mode: median step time over the timed steps (CUDA events), tokens/s per GPU, the
plan's all-gather bytes per step by dtype and their ratio to bf16's
(``all_gather_ratio_vs_bf16``), peak memory, the loss curve (every step), NaN/divergence checks;
and per FP8 mode the speedup over bf16. Writes ``fp8_bench.json`` and ``fp8_bench.md`` under
``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import shardc
from shardc.models.llama import LlamaConfig, Transformer, llama_loss

# Mode -> what it gathers in float8 (None: nothing, every gather bf16).
MODES: dict[str, shardc.Float8Policy | None] = {
    "bf16": None,
    "fp8": shardc.Float8Policy(modules=(nn.Linear, nn.Embedding)),
    "fp8-linear": shardc.Float8Policy(),
}
RATIO_DIGITS = 6  # all-gather byte ratios in the json and the markdown


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="sequences per GPU per step")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (compile included)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--modes", default="bf16,fp8",
                   help=f"comma-separated, of {', '.join(MODES)} (fp8: Linear weights and the "
                        "token embedding in float8; fp8-linear: Linear weights only)")
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true", help="a small model (smoke test)")
    p.add_argument("--profile", action="store_true",
                   help="print the top CUDA kernels of two more steps per mode")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: gloo and wall-clock timing (a functional check)")
    p.add_argument("--plan-only", action="store_true",
                   help="plan each mode (meta-device build, CPU mesh) in a fake world (no GPU, no "
                        "training) and report the planned all-gather bytes")
    p.add_argument("--plan-world", type=int, default=1, help="world size of --plan-only")
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {', '.join(unknown)}; modes: {', '.join(MODES)}")
    if args.profile and args.device != "cuda":
        p.error("--profile needs --device cuda")
    if args.tiny:
        args.dim, args.layers, args.heads, args.kv_heads, args.ffn = 256, 2, 4, 2, 512
        args.vocab, args.seq, args.batch = 1024, 128, 4
    return args


def _data(args, rank: int, step: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable sequence: x[t+1] = (a * x[t] + c) mod V with a per-sequence random start."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, vocab, (args.batch, 1), generator=g)
    steps = torch.arange(args.seq + 1)
    a, c = 5, 17
    # closed form is awkward mod V; iterate in int64 on the CPU (cheap next to a step)
    seq = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
    seq[:, 0] = start[:, 0]
    for t in steps[1:]:
        seq[:, t] = (seq[:, t - 1] * a + c) % vocab
    seq = seq.to(device, non_blocking=True)
    return seq[:, :-1], seq[:, 1:]


def _gather_bytes(plans) -> dict[str, int]:
    """Gathered bytes per step by dtype over the plans of every compiled region (forward and
    backward all-gathers; one rank's gathered buffers)."""
    out: dict[str, int] = {}
    for plan in plans:
        for c in plan.collectives:
            if c.kind == "all_gather":
                out[c.dtype] = out.get(c.dtype, 0) + c.buffer_bytes
    return out


def _plans(model) -> list:
    return [r.plan for r in shardc.shard_state(model).regions if r.plan is not None]


def _config(args) -> LlamaConfig:
    return LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                       n_heads=args.heads, n_kv_heads=args.kv_heads, ffn_dim=args.ffn,
                       max_seq_len=args.seq)


def planned_gather_bytes(cfg: LlamaConfig, mode: str, world: int = 1,
                         prefetch_depth: int = 2) -> dict[str, int]:
    """All-gather bytes per step by dtype that shardc plans for ``mode`` (the benchmark's
    sharding, a ``world``-rank fake world, a model built on the meta device and planned on a
    CPU mesh: no GPU, no compute). The plan is
    made with ``inductor=False``, whose gathers are those Inductor runs."""
    from torch.distributed.device_mesh import DeviceMesh

    from shardc._torch import backend_failure_cause
    from shardc.compile.pipeline import PlannedOnly, plan_only
    from shardc.tools.fake_world import fake_world
    from shardc.tools.planner import _buffers_to

    torch._dynamo.reset()
    try:
        with fake_world(world):
            with torch.device("meta"):
                model = Transformer(cfg)
            # The buffers (rotary tables) on the mesh's device, as the planner gives them; the
            # shards are allocated there uninitialized (untouched pages). A CPU mesh, not a meta
            # one: torch 2.14's DTensor asks a meta mesh's device for a device count and fails.
            _buffers_to(model, "cpu")
            mp = shardc.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
            shardc.shard(model, DeviceMesh.from_group(dist.group.WORLD, "cpu"), mp_policy=mp,
                         fp8=MODES[mode])
            compiled = torch.compile(model, backend=shardc.backend(
                inductor=False, check_plan_consistency=False, prefetch_depth=prefetch_depth))
            tokens = torch.zeros(1, 16, dtype=torch.long)
            with plan_only():  # planned, then stopped: nothing runs
                try:
                    llama_loss(compiled(tokens), tokens).backward()
                except Exception as exc:
                    if not isinstance(backend_failure_cause(exc), PlannedOnly):
                        raise
            return _gather_bytes(_plans(model))
    finally:
        torch._dynamo.reset()


def ratio_vs_bf16(results: dict[str, dict]) -> dict[str, float]:
    """Each mode's all-gather bytes per step over bf16's (needs a ``bf16`` result)."""
    if "bf16" not in results:
        return {}
    base = results["bf16"]["all_gather_bytes"]
    return {m: round(r["all_gather_bytes"] / base, RATIO_DIGITS) for m, r in results.items()}


def _plan_only(args, cfg: LlamaConfig) -> int:
    results = {}
    for mode in args.modes:
        by_dtype = planned_gather_bytes(cfg, mode, args.plan_world, args.prefetch_depth)
        results[mode] = {"all_gather_bytes_by_dtype": by_dtype,
                         "all_gather_bytes": sum(by_dtype.values())}
    for mode, ratio in ratio_vs_bf16(results).items():
        results[mode]["all_gather_ratio_vs_bf16"] = ratio
    print(json.dumps({"plan_only": True, "world_size": args.plan_world, "params":
                      cfg.num_params(), "results": results}, indent=1), flush=True)
    return 0


class _StepTimer:
    """One step's time: CUDA events on a GPU, the wall clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            self.events = (torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since :meth:`start` (waits for the GPU)."""
        if not self.cuda:
            return time.perf_counter() - self.t0
        self.events[1].record()
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]) / 1e3


def run_mode(args, mode: str, cfg: LlamaConfig, rank: int, device) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg)
    model.init_weights(buffer_device=device)  # same weights in both modes
    mp = shardc.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    shardc.shard(model, mp_policy=mp, fp8=MODES[mode])
    compiled = torch.compile(model, backend=shardc.backend(prefetch_depth=args.prefetch_depth))
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=cuda)
    losses, times = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    compile_s = 0.0
    timer = _StepTimer(device)
    for step in range(args.warmup + args.steps):
        tokens, targets = _data(args, rank, step, cfg.vocab_size, device)
        t0 = time.perf_counter()
        timer.start()
        loss = llama_loss(compiled(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = timer.stop()
        if step == 0:
            compile_s = time.perf_counter() - t0
        value = loss.detach().float()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
        if step >= args.warmup:
            times.append(elapsed)
    if args.profile and rank == 0:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for step in range(2):
                tokens, targets = _data(args, rank, step, cfg.vocab_size, device)
                llama_loss(compiled(tokens), targets).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        print(f"--- {mode}: top CUDA kernels over 2 steps", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18,
                                        max_name_column_width=70), flush=True)
    plans = _plans(model)
    gathered = _gather_bytes(plans)
    step_s = statistics.median(times)
    tokens_per_step = args.batch * args.seq
    return {
        "mode": mode,
        "step_s_median": step_s,
        "step_s_p10": sorted(times)[len(times) // 10],
        "step_s_p90": sorted(times)[(9 * len(times)) // 10],
        "tokens_per_s_per_gpu": tokens_per_step / step_s,
        "compile_s": compile_s,
        "all_gather_bytes_by_dtype": gathered,
        "all_gather_bytes": sum(gathered.values()),
        "fp8_weights": sorted(n for n, i in shardc.shard_state(model).params.items()
                              if i.fp8 is not None),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "losses": losses,
        "finite": all(math.isfinite(x) for x in losses),
        "plan_notes": [note for plan in plans for note in plan.notes],
    }


def main(argv=None) -> int:
    args = _args(argv)
    cfg = _config(args)
    if args.plan_only:
        return _plan_only(args, cfg)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    results = {}
    for mode in args.modes:
        results[mode] = run_mode(args, mode, cfg, rank, device)
        r = results[mode]
        if rank == 0:
            peak = "n/a" if r["peak_allocated_gib"] is None else f"{r['peak_allocated_gib']:.1f}"
            print(f"{mode}: step {r['step_s_median'] * 1e3:.1f} ms, "
                  f"{r['tokens_per_s_per_gpu']:.0f} tok/s/GPU, all-gather "
                  f"{r['all_gather_bytes'] / 2**20:.1f} MiB/step, peak "
                  f"{peak} GiB, loss {r['losses'][0]:.3f} -> "
                  f"{r['losses'][-1]:.3f}, compile {r['compile_s']:.0f} s", flush=True)
    for mode, ratio in ratio_vs_bf16(results).items():
        results[mode]["all_gather_ratio_vs_bf16"] = ratio
    summary = _summary(results)
    if rank == 0:
        record = {
            "command": "torchrun --nproc-per-node "
                       f"{dist.get_world_size()} " + " ".join(map(shlex.quote, sys.argv)),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "world_size": dist.get_world_size(),
            "torch": torch.__version__,
            "config": vars(args),
            "params": cfg.num_params(),
            "results": results,
            "summary": summary,
        }
        print(json.dumps(summary, indent=1), flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "fp8_bench.json"), "w") as f:
                json.dump(record, f, indent=1)
            with open(os.path.join(args.out, "fp8_bench.md"), "w") as f:
                f.write(_markdown(record))
    dist.destroy_process_group()
    return 0


def _summary(results: dict[str, dict]) -> dict[str, dict]:
    """Per mode other than bf16: speedup, all-gather byte ratio and loss differences vs bf16."""
    if "bf16" not in results:
        return {}
    b = results["bf16"]
    out = {}
    for mode, f in results.items():
        if mode == "bf16":
            continue
        n = min(len(b["losses"]), len(f["losses"]))
        tail = max(1, n // 10)
        out[mode] = {
            "speedup": b["step_s_median"] / f["step_s_median"],
            "all_gather_ratio_vs_bf16": f["all_gather_ratio_vs_bf16"],
            "final_loss_rel_diff": abs(sum(f["losses"][n - tail:n]) - sum(b["losses"][n - tail:n]))
            / abs(sum(b["losses"][n - tail:n])),
            "max_loss_rel_diff": max(abs(x - y) / abs(y) for x, y in zip(f["losses"], b["losses"])),
        }
    return out


def _markdown(record: dict) -> str:
    device = record["gpu"]
    lines = [f"# FP8 vs bf16 ({device}, world {record['world_size']})", "",
             f"`{record['command']}` ({record['date']}, torch {record['torch']}, "
             f"{_count(record['params'])} parameters)", "",
             "| mode | step ms (median) | tokens/s/GPU | all-gather MiB/step | "
             "all-gather vs bf16 | peak GiB | loss first -> last | finite |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in record["results"].values():
        ratio = r.get("all_gather_ratio_vs_bf16")
        peak = r["peak_allocated_gib"]
        lines.append(f"| {r['mode']} | {r['step_s_median'] * 1e3:.1f} | "
                     f"{r['tokens_per_s_per_gpu']:.0f} | {r['all_gather_bytes'] / 2**20:.1f} | "
                     f"{'n/a' if ratio is None else f'{ratio:.{RATIO_DIGITS}f}'} | "
                     f"{'n/a' if peak is None else f'{peak:.1f}'} | {r['losses'][0]:.3f} -> "
                     f"{r['losses'][-1]:.3f} | {r['finite']} |")
    lines.append("")
    for mode, s in record["summary"].items():
        ratio = f"{s['all_gather_ratio_vs_bf16']:.{RATIO_DIGITS}f}"
        lines.append(f"- {mode} vs bf16: speedup **{s['speedup']:.3f}x**; all-gather bytes "
                     f"(`all_gather_ratio_vs_bf16`) **{ratio}**; final loss (last 10% mean) "
                     f"relative difference {s['final_loss_rel_diff']:.4f}, largest per-step "
                     f"{s['max_loss_rel_diff']:.4f}")
    lines += ["", "Modes: " + "; ".join(f"`{m}`: {_describe(m)}" for m in record["results"])]
    return "\n".join(lines) + "\n"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _describe(mode: str) -> str:
    policy = MODES[mode]
    if policy is None:
        return "every gather bf16"
    return "float8 gathers of " + " and ".join(f"`{c.__name__}`" for c in policy.modules) \
        + " weights"


if __name__ == "__main__":
    sys.exit(main())
