"""CPU offload on one GPU: shardc with ``OffloadPolicy`` against FSDP2 with ``CPUOffloadPolicy``.

One process, one GPU (issue 21)::

    python benchmarks/offload_bench.py --out docs/bench/offload          # both models
    python benchmarks/offload_bench.py --models big --steps 3            # the >= 5B model only
    python benchmarks/offload_bench.py --device cpu --tiny               # smoke test, no GPU

Models (Llama-shaped, bf16 compute, fp32 masters, AdamW):

``big``
    dim 4096, 24 layers, ffn 11008, vocab 32000: 5.1B parameters, whose fp32 masters, gradients
    and Adam moments (16 bytes per parameter, 82 GB) exceed an 80 GB H100: it trains only with
    offload.
``small``
    dim 2048, 16 layers, ffn 5632, vocab 32000: 0.95B parameters, fits without offload.

Modes, on the same model, batches and settings, in the same process one after the other:
``shardc``: ``shardc.shard(model, mesh, mp_policy=bf16, offload=shardc.OffloadPolicy())``, then
``torch.compile(model, backend=shardc.backend(inductor=...))``; ``shardc-budget``: the same
with ``peak_memory_budget_bytes=--budget`` (default ``auto``): the planner keeps buckets
gathered for the backward where memory allows, saving their second host->device copy;
``shardc-overlap`` and ``shardc-budget-overlap``: the same with
``shardc.step_in_backward(model, optimizer)``, the CPU AdamW of each bucket overlapped with the
rest of the backward (``optimizer.step()`` then waits for it and steps what is left);
``fsdp2``: ``fully_shard`` per block and the root with ``offload_policy=CPUOffloadPolicy()``
and the same mixed precision, eager (the usual FSDP2 setup). The optimizer is
``torch.optim.AdamW(fused=True)`` on the host parameters in both (``--no-fused``: the default
single-tensor kernels).

Per mode: median step time and tokens/s over ``--steps`` timed steps after ``--warmup`` steps
(the first compiles), peak device memory allocated, and for shardc the plan's predicted device
peak and whole step (``shardc.planning.step``: graphs, host AdamW, overlap). Writes
``offload.json`` and ``offload.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import shardc  # noqa: E402
from shardc.models.llama import LlamaConfig, Transformer, llama_loss  # noqa: E402

MODELS = {
    "big": dict(dim=4096, n_layers=24, n_heads=32, ffn_dim=11008, vocab_size=32000),
    "small": dict(dim=2048, n_layers=16, n_heads=16, ffn_dim=5632, vocab_size=32000),
    "tiny": dict(dim=128, n_layers=2, n_heads=4, ffn_dim=256, vocab_size=512),
}


MODES = ("shardc", "shardc-budget", "shardc-overlap", "shardc-budget-overlap", "fsdp2")


def _config(name: str, seq: int) -> LlamaConfig:
    return LlamaConfig(max_seq_len=seq, **MODELS[name])


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)  # pinned blocks cached by torch
        if empty_host is not None:
            empty_host()


def _shardc_model(cfg, mesh, device, args, mode: str = "shardc"):
    with torch.device("meta"):
        model = Transformer(cfg)
    policy = shardc.OffloadPolicy(simulate_on_cpu=device.type == "cpu",
                                  check_host_memory=args.host_check)
    mp = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shardc.shard(model, mesh, mp_policy=mp, offload=policy,  # host shards, allocated pinned
                 reshard_after_forward=args.reshard)
    torch.manual_seed(0)
    model.init_weights(buffer_device=device)
    budget = {}
    if "budget" in mode:  # the planner keeps buckets gathered where the budget allows
        budget["peak_memory_budget_bytes"] = (args.budget if args.budget == "auto"
                                              else int(float(args.budget)))
    backend = shardc.backend(inductor=args.inductor, **budget)
    if args.loss_in_graph:  # as train_bench.py: the loss's logits and their gradient planned too
        return model, torch.compile(functools.partial(_model_loss, model), backend=backend)
    return model, functools.partial(_model_loss, torch.compile(model, backend=backend))


def _model_loss(model, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return llama_loss(model(tokens), targets)


def _fsdp2_model(cfg, mesh, device, args, mode: str = "fsdp2"):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = Transformer(cfg)
    kw = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda"),
              reshard_after_forward=args.reshard,
              mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                             reduce_dtype=torch.float32))
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    model.to_empty(device="cpu")  # FSDP2's way with CPU offload (torchtitan's too)
    torch.manual_seed(0)
    model.init_weights(buffer_device=device)
    return model, functools.partial(_model_loss, model)


def _batches(cfg, n, batch, seq, device):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(device)
            for _ in range(n)]


def _predicted_step(plans, model, device, args, overlap: bool):
    """The whole step as the step model predicts it (``shardc.planning.step``; what
    ``python -m shardc plan --offload params`` prints): the plans' graphs, then the host's
    AdamW over this rank's masters (fused or not, as run), overlapped with the backward for
    ``step_in_backward``, at the cluster profile the backend resolved for this device."""
    from torch.distributed.tensor import DTensor

    from shardc.planning.profile import resolve_profile
    from shardc.planning.step import OptimizerSpec, predict_step

    params = [p for p in model.parameters() if p.requires_grad]
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    fused = bool(args.fused)
    spec = OptimizerSpec(float(sum(t.numel() * t.element_size() for t in local)), len(params),
                         temp_factor=0.0 if fused else 1.0,
                         name="AdamW (fused)" if fused else "AdamW (foreach)",
                         offload="params", overlap=overlap, impl="fused" if fused else "auto")
    profile = resolve_profile(plans[0].options.get("cluster") if plans else None,
                              torch.cuda.get_device_name(device) if device.type == "cuda"
                              else None)
    return predict_step(plans, profile, spec)


def run_mode(mode: str, cfg: LlamaConfig, mesh, device, args) -> dict:
    t0 = time.perf_counter()
    build = _shardc_model if mode.startswith("shardc") else _fsdp2_model
    model, forward = build(cfg, mesh, device, args, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.fused or None)
    overlap = shardc.step_in_backward(model, opt) if mode.endswith("-overlap") else None
    setup_s = time.perf_counter() - t0
    data = _batches(cfg, args.warmup + args.steps, args.batch, args.seq, device)
    times, losses, backward_s = [], [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i, toks in enumerate(data):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = forward(toks[:, :-1], toks[:, 1:])
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        backward_s.append(time.perf_counter() - t)  # forward and backward, copies included
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # synchronizes
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        print(f"  {mode} step {i}: {times[-1]:.2f} s, loss {losses[-1]:.4f}", flush=True)
    timed = times[args.warmup:]
    step_s = statistics.median(timed)
    out = {"mode": mode, "setup_s": setup_s, "first_step_s": times[0], "step_s": timed,
           "median_step_s": step_s, "tokens_per_s": args.batch * args.seq / step_s,
           "median_fwd_bwd_s": statistics.median(backward_s[args.warmup:]),
           "losses": losses}
    if device.type == "cuda":
        out["peak_alloc_bytes"] = torch.cuda.max_memory_allocated()
    if overlap is not None:  # parameters stepped during backwards / handed over / left late
        out["overlap"] = {"early": overlap.early, "signalled": overlap.signalled,
                          "late": overlap.late}
        overlap.remove()
    if mode.startswith("shardc"):
        plans = shardc.explain_all(model)
        out["predicted_peak_bytes"] = max(p.predicted.peak_bytes or 0 for p in plans)
        out["predicted_host_bytes"] = max(p.predicted.host_bytes or 0 for p in plans)
        out["copies"] = sum(len(p.copies) for p in plans)
        step = _predicted_step(plans, model, device, args, overlap is not None)
        out["predicted_step_s"], out["predicted_fwd_bwd_s"] = step.step_s, step.graphs_s
        out["predicted_step"] = step.to_dict()
    del model, forward, opt, data
    _free(device)
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="big,small")
    parser.add_argument("--modes", default="shardc,fsdp2",
                        help="of shardc, shardc-budget (with --budget), shardc-overlap, "
                             "shardc-budget-overlap (step_in_backward), fsdp2")
    parser.add_argument("--budget", default="auto",
                        help="shardc-budget's peak_memory_budget_bytes: bytes or auto")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model (smoke test)")
    parser.add_argument("--no-inductor", dest="inductor", action="store_false")
    parser.add_argument("--no-fused", dest="fused", action="store_false")
    parser.add_argument("--no-host-check", dest="host_check", action="store_false",
                        help="OffloadPolicy(check_host_memory=False): for VMs whose available "
                             "memory grows on demand")
    parser.add_argument("--no-reshard", dest="reshard", action="store_false",
                        help="reshard_after_forward=False in both (the backward reuses the "
                             "forward's gathered parameters: no second host->device copy)")
    parser.add_argument("--device-memory-gib", type=float, default=None,
                        help="cap what each mode may allocate on the GPU to this many GiB "
                             "(torch.cuda.set_per_process_memory_fraction; shardc's 'auto' "
                             "budget follows it): a smaller device's capacity on a larger one, "
                             "e.g. 79.2 for an 80 GB H100 (its total_memory) on an H200")
    parser.add_argument("--loss-outside", dest="loss_in_graph", action="store_false",
                        help="shardc modes: compile the model only and compute the loss eagerly "
                             "after it (before 2026-11-28 the default; the eager loss's logits "
                             "and gradients are then outside the plan's peak prediction)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # model:mode:result.json
    return parser


def run_one(args) -> None:
    """One model and mode in this process (a child of ``main``): writes its result as JSON."""
    name, mode, result_path = args.one.split(":", 2)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        if args.device_memory_gib:  # e.g. an 80 GB H100's capacity emulated on an H200
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, args.device_memory_gib * 2**30 / total), device)
    init = os.path.join(tempfile.mkdtemp(), "pg")
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init}", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    cfg = _config(name, args.seq)
    try:
        res = run_mode(mode, cfg, mesh, device, args)
    except Exception as exc:  # reported in the table; the next mode still runs
        res = {"mode": mode, "error": f"{type(exc).__name__}: {exc}"}
    res.update(model=name, params=cfg.num_params())
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
    Path(result_path).write_text(json.dumps(res, default=str))
    dist.destroy_process_group()


def main() -> None:
    args = _parser().parse_args()
    if args.one:
        return run_one(args)
    if args.tiny:
        args.seq = min(args.seq, 64)
    models = ["tiny"] if args.tiny else args.models.split(",")
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}: of {', '.join(MODES)}")
    # Each model and mode in a process of its own, one after the other: the big model's host
    # state (16 bytes per parameter) fits the host once, not twice, and nothing cached by one
    # mode (pinned blocks, compiled code) is charged to the next.
    child = [a for a in sys.argv[1:] if not a.startswith("--tiny")]
    results = []
    for name in models:
        print(f"model {name}: {_config(name, args.seq).num_params() / 1e9:.2f}B parameters",
              flush=True)
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "result.json")
                cmd = [sys.executable, os.path.abspath(__file__), *child,
                       "--seq", str(args.seq), "--one", f"{name}:{mode}:{path}"]
                code = subprocess.run(cmd).returncode
                res = (json.loads(Path(path).read_text()) if os.path.exists(path) else
                       {"mode": mode, "model": name, "error": f"process exited with {code}"})
            print(json.dumps({k: v for k, v in res.items() if k != "losses"}), flush=True)
            results.append(res)
    gpu = next((r["gpu"] for r in results if "gpu" in r), "cpu")
    meta = {"command": " ".join(sys.argv), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "gpu": gpu, "batch": args.batch, "seq": args.seq, "inductor": args.inductor,
            "fused": args.fused, "reshard_after_forward": args.reshard,
            "shardc_budget": args.budget, "loss_in_graph": args.loss_in_graph,
            "device_memory_gib": args.device_memory_gib}
    lines = ["| model | mode | median step (s) | of which fwd+bwd (s) | tokens/s | "
             "peak device GiB | predicted GiB | predicted step (s) | predicted fwd+bwd (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mode']} | error: {r['error'][:80]} | | | | | | |")
            continue
        peak = r.get("peak_alloc_bytes", 0) / 2 ** 30
        pred = r.get("predicted_peak_bytes", 0) / 2 ** 30
        step = (f"{r['predicted_step_s']:.3f} | {r['predicted_fwd_bwd_s']:.3f}"
                if "predicted_step_s" in r else " | ")
        lines.append(f"| {r['model']} | {r['mode']} | {r['median_step_s']:.3f} | "
                     f"{r['median_fwd_bwd_s']:.3f} | {r['tokens_per_s']:.0f} | {peak:.2f} | "
                     f"{pred:.2f} | {step} |")
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "offload.json").write_text(json.dumps({"meta": meta, "results": results},
                                                     indent=1, default=str))
        (out / "offload.md").write_text("\n".join([f"`{meta['command']}` on {meta['gpu']}, "
                                                   f"torch {meta['torch']}", ""] + lines) + "\n")


if __name__ == "__main__":
    main()
