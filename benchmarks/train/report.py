"""The markdown report of a run, and re-rendering an earlier run's JSON.

Contract: :func:`render_markdown` is a pure function of the report dict that is also written as
JSON (``meta`` and ``models``); :func:`rerender` recomputes goals and diagnosis of a JSON file and
rewrites the markdown beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from train.goals import diagnose, evaluate_goals
from train.modes import EXTRA_MODES, MODES
from train.units import fmt as _fmt
from train.units import gib as _gib


def _optim_impl(meta: dict[str, Any]) -> str:
    """AdamW's implementation as the run chose it (reports made before the option: torch's
    default)."""
    impl = meta.get("optim_impl", "default")
    return "torch default foreach" if impl == "default" else f"{impl}=True"


def render_markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        "# Training-step benchmark: shardc vs FSDP2, SimpleFSDP and the bound",
        "",
        f"- command: `{meta['command']}`",
        f"- date (UTC): {meta['date']}",
        f"- GPU: {meta['gpu']} x {meta['world_size']} ({meta['device']}; mesh "
        f"{meta.get('mesh', 'FSDP')}); torch "
        f"{meta['torch']}; NCCL {meta.get('nccl', '–')}; Python {meta['python']}",
        f"- MFU peak: {meta['peak_flops'] / 1e12:.0f} TFLOP/s dense bf16 per GPU; MFU = 6 x "
        "params x tokens/s / peak (embedding and output included, attention FLOPs not)",
        f"- timed steps: {meta['steps']} (median), warm-up {meta['warmup']}, profiled "
        f"{meta['profile_steps']}; AdamW ({_optim_impl(meta)}), lr {meta['lr']}",
        "- CUDA caching allocator: "
        + (meta.get("env", {}).get("PYTORCH_CUDA_ALLOC_CONF")
           or meta.get("env", {}).get("PYTORCH_ALLOC_CONF") or "default settings"),
        "- numerics in every mode: fp32 master parameters, bf16 compute, gradients reduced in "
        "fp32; loss (cross entropy in fp32) "
        + ("compiled with the model in shardc, bound and simplefsdp (eager after the model in "
           "fsdp2 and fsdp2-compile)" if meta.get("loss_in_graph", False)
           else "outside the compiled region"),
        "- FP8 weights (`--fp8`): " + (f"`{meta['fp8']}` in every shardc mode (gathered in FP8)"
                                       if meta.get("fp8") else "off"),
        "",
    ]
    for name, model in report["models"].items():
        s = model["settings"]
        lines += [
            f"## Model `{name}`: {s['params'] / 1e9:.2f}B params, {s['n_layers']} layers, dim "
            f"{s['dim']}, {s['n_heads']} heads, ffn {s['ffn']}, vocab {s['vocab']}; batch "
            f"{s['batch']} x {s['seq']} tokens per GPU",
            "",
        ]
        if model.get("note"):
            lines += [model["note"], ""]
        lines += [
            "| mode | tokens/s/GPU | x bound | MFU | peak alloc GiB | peak reserved GiB | "
            "exposed comm ms/step | comm ms/step | step ms | compile s | loss first → last |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        res = model["results"]
        bound = res.get("bound", {})
        known = [m for m in (*MODES, *EXTRA_MODES) if m in model["modes"]]
        for mode in known + [m for m in model["modes"] if m not in known]:
            r = res.get(mode, {"status": "not run"})
            if r.get("status") != "ok":
                why = r.get("error") or r.get("reason") or r.get("status")
                why = str(why).replace("|", "\\|").replace("\n", " ")[:160]
                lines.append(f"| {mode} | {r.get('status')}: {why} | | | | | | | | | |")
                continue
            ratio = (r["tokens_per_s_per_gpu"] / bound["tokens_per_s_per_gpu"]
                     if bound.get("status") == "ok" else None)
            prof = r.get("profile") or {}
            lines.append(
                f"| {mode} | {r['tokens_per_s_per_gpu']:,.0f} | {_fmt(ratio, '.3f')} | "
                f"{100 * r['mfu']:.1f}% | {_gib(r.get('peak_alloc_bytes'))} | "
                f"{_gib(r.get('peak_reserved_bytes'))} | {_fmt(prof.get('exposed_comm_ms'), '.1f')}"
                f" | {_fmt(prof.get('comm_ms'), '.1f')} | {r['step_ms_median']:.1f} | "
                f"{_fmt(r.get('compile_s'), '.1f')} | {r['loss_first']:.3f} → "
                f"{r['loss_last']:.3f} |")
        sc = res.get("shardc", {})
        if sc.get("status") == "ok" and sc.get("predicted_peak_bytes") is not None:
            lines += ["", f"shardc plan: predicted peak {_gib(sc['predicted_peak_bytes'])} GiB "
                      f"({sc.get('predicted_peak_kind')}) next to measured peak allocated "
                      f"{_gib(sc.get('peak_alloc_bytes'))} GiB; predicted exposed communication "
                      f"{1e3 * sc.get('predicted_exposed_comm_s', 0):.1f} ms/step."]
        lines += ["", "### Goals", "", "| goal | result | numbers |", "| --- | --- | --- |"]
        for g in model["goals"]:
            mark = {True: "met", False: "**not met**", None: "not evaluated"}[g["met"]]
            lines.append(f"| {g['goal']} | {mark} | {g['detail']} |")
        diag = model.get("diagnosis") or []
        if diag:
            lines += ["", "### Where shardc's time and memory go", ""]
            lines += [f"- {d}" for d in diag]
        lines.append("")
    lines += [
        "## How the numbers are taken",
        "",
        "- tokens/s/GPU: per-GPU tokens per step over the median step time (CUDA events around "
        "forward, backward, optimizer step and zero_grad; the slowest rank's median).",
        "- peak memory: `torch.cuda.max_memory_allocated/reserved` over the timed steps "
        "(`reset_peak_memory_stats` before them), the larger of the ranks. Modes under CUDA "
        "graphs (`mode=\"reduce-overhead\"`: shardc-cudagraphs, shardc-fast, "
        "shardc-fast-budget(-inline), bound-cudagraphs) replay from the graph pool without "
        "allocating, so their allocated peak is also read over the warm-up steps after the "
        "first, which record the graphs (the larger of the two).",
        "- compile s: wall time of the first step (compilation plus lazy initialization). Modes "
        "run one after the other in one process each rank (order: "
        f"{', '.join(meta.get('mode_order', []))}); Inductor's kernel caches are not cleared "
        "between modes, so a later mode may reuse kernels an earlier one compiled.",
        "- exposed comm: from a `torch.profiler` trace of the profiled steps, the union of NCCL "
        "kernel intervals minus its intersection with the union of all other kernels, per step, "
        "mean over ranks; comm ms/step is the NCCL union.",
        "- bound: replicated parameters, Inductor, no communication at all (no gradient "
        "all-reduce): the step time perfect overlap would reach.",
        "",
    ]
    return "\n".join(lines)


def rerender(path: Path) -> Path:
    """Recompute goals and diagnosis of a results JSON and rewrite its markdown beside it."""
    report = json.loads(path.read_text())
    for model in report["models"].values():
        model["goals"] = evaluate_goals(model["results"])
        model["diagnosis"] = diagnose(model["results"])
    out = path.with_suffix(".md")
    out.write_text(render_markdown(report))
    return out
