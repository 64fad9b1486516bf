"""FP8 vs bf16 training step of the same shardc model (a Linear-heavy Llama, d_model 4096).

Launch on GPUs (one process per GPU; one GPU is fine, the planned all-gathers still run)::

    torchrun --nproc-per-node 1 benchmarks/fp8_bench.py --out docs/bench
    torchrun --nproc-per-node 2 benchmarks/fp8_bench.py --steps 200 --out docs/bench

Both modes: ``shardc.shard(model, mp_policy=MixedPrecisionPolicy(bf16, fp32))``, compiled with
``backend="shardc"`` (Inductor), AdamW, same seed and data (a learnable synthetic sequence, so
the loss falls). ``fp8`` adds ``fp8=shardc.Float8Policy()``: every ``nn.Linear`` weight is
gathered in float8 and runs on ``torch._scaled_mm``. Reported per mode: median step time over
the timed steps (CUDA events), tokens/s per GPU, the plan's all-gather bytes per step by dtype,
peak memory, the loss curve (every step), NaN/divergence checks; and the speedup and the
all-gather byte ratio. Writes ``fp8_bench.json`` and ``fp8_bench.md`` under ``--out``.
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

import shardc
from shardc.models.llama import LlamaConfig, Transformer, llama_loss


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
    p.add_argument("--modes", default="bf16,fp8")
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true", help="a small model (smoke test)")
    p.add_argument("--profile", action="store_true",
                   help="print the top CUDA kernels of two more steps per mode")
    return p.parse_args(argv)


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


def _gather_bytes(plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in plan.collectives:
        if c.kind == "all_gather":
            out[c.dtype] = out.get(c.dtype, 0) + c.buffer_bytes
    return out


def run_mode(args, mode: str, cfg: LlamaConfig, rank: int, device) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg)
    model.init_weights(buffer_device=device)  # same weights in both modes
    mp = shardc.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    fp8 = shardc.Float8Policy() if mode == "fp8" else None
    shardc.shard(model, mp_policy=mp, fp8=fp8)
    compiled = torch.compile(model, backend=shardc.backend(prefetch_depth=args.prefetch_depth))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    losses, times = [], []
    torch.cuda.reset_peak_memory_stats()
    compile_s = 0.0
    for step in range(args.warmup + args.steps):
        tokens, targets = _data(args, rank, step, cfg.vocab_size, device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        loss = llama_loss(compiled(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        end.synchronize()
        if step == 0:
            compile_s = time.perf_counter() - t0
        value = loss.detach().float()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
        if step >= args.warmup:
            times.append(start.elapsed_time(end) / 1e3)
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
    plan = shardc.shard_state(model).regions[0].plan
    step_s = statistics.median(times)
    tokens_per_step = args.batch * args.seq
    return {
        "mode": mode,
        "step_s_median": step_s,
        "step_s_p10": sorted(times)[len(times) // 10],
        "step_s_p90": sorted(times)[(9 * len(times)) // 10],
        "tokens_per_s_per_gpu": tokens_per_step / step_s,
        "compile_s": compile_s,
        "all_gather_bytes_by_dtype": _gather_bytes(plan),
        "all_gather_bytes": sum(_gather_bytes(plan).values()),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "losses": losses,
        "finite": all(math.isfinite(x) for x in losses),
        "plan_notes": plan.notes,
    }


def main(argv=None) -> int:
    args = _args(argv)
    if args.tiny:
        args.dim, args.layers, args.heads, args.kv_heads, args.ffn = 256, 2, 4, 2, 512
        args.vocab, args.seq, args.batch = 1024, 128, 4
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                      n_heads=args.heads, n_kv_heads=args.kv_heads, ffn_dim=args.ffn,
                      max_seq_len=args.seq)
    results = {}
    for mode in args.modes.split(","):
        results[mode] = run_mode(args, mode, cfg, rank, device)
        r = results[mode]
        if rank == 0:
            print(f"{mode}: step {r['step_s_median'] * 1e3:.1f} ms, "
                  f"{r['tokens_per_s_per_gpu']:.0f} tok/s/GPU, all-gather "
                  f"{r['all_gather_bytes'] / 2**20:.1f} MiB/step, peak "
                  f"{r['peak_allocated_gib']:.1f} GiB, loss {r['losses'][0]:.3f} -> "
                  f"{r['losses'][-1]:.3f}, compile {r['compile_s']:.0f} s", flush=True)
    summary = {}
    if "bf16" in results and "fp8" in results:
        b, f = results["bf16"], results["fp8"]
        n = min(len(b["losses"]), len(f["losses"]))
        tail = max(1, n // 10)
        summary = {
            "speedup": b["step_s_median"] / f["step_s_median"],
            "all_gather_bytes_ratio": f["all_gather_bytes"] / b["all_gather_bytes"],
            "final_loss_rel_diff": abs(sum(f["losses"][n - tail:n]) - sum(b["losses"][n - tail:n]))
            / abs(sum(b["losses"][n - tail:n])),
            "max_loss_rel_diff": max(abs(x - y) / abs(y) for x, y in zip(f["losses"], b["losses"])),
        }
    if rank == 0:
        record = {
            "command": "torchrun --nproc-per-node "
                       f"{dist.get_world_size()} " + " ".join(map(shlex.quote, sys.argv)),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(),
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


def _markdown(record: dict) -> str:
    lines = [f"# FP8 vs bf16 ({record['gpu']}, world {record['world_size']})", "",
             f"`{record['command']}` ({record['date']}, torch {record['torch']}, "
             f"{record['params'] / 1e9:.2f} B parameters)", "",
             "| mode | step ms (median) | tokens/s/GPU | all-gather MiB/step | peak GiB | "
             "loss first -> last | finite |",
             "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in record["results"].values():
        lines.append(f"| {r['mode']} | {r['step_s_median'] * 1e3:.1f} | "
                     f"{r['tokens_per_s_per_gpu']:.0f} | {r['all_gather_bytes'] / 2**20:.1f} | "
                     f"{r['peak_allocated_gib']:.1f} | {r['losses'][0]:.3f} -> "
                     f"{r['losses'][-1]:.3f} | {r['finite']} |")
    s = record["summary"]
    if s:
        lines += ["", f"speedup fp8/bf16: **{s['speedup']:.3f}x**; all-gather bytes fp8/bf16: "
                      f"**{s['all_gather_bytes_ratio']:.3f}**; final loss (last 10% mean) "
                      f"relative difference {s['final_loss_rel_diff']:.4f}, largest per-step "
                      f"{s['max_loss_rel_diff']:.4f}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
