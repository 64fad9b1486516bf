"""The largest batch per GPU that fits, for shardc under a budget and for FSDP2 (issue 22's goal:
shardc with ``"auto"`` >= 1.5x FSDP2 with full activation checkpointing, at >= its tokens/s).

Per mode (default ``shardc-budget`` with ``SHARDC_PEAK_BUDGET=auto`` and ``fsdp2-compile-ac``):
the batch doubles from ``--start`` while it fits, then bisects between the largest batch that
fit and the smallest that did not. A try is one ``train_bench.py`` run in its own ``torchrun``
(an out-of-memory cannot poison the next; a hung or slow run is killed with its workers after
``--run-timeout-s``). It fits if the run trains its steps; it does not if it runs out of device
memory, if shardc refuses the budget (``MemoryBudgetError``: the plan cannot fit), or if it is
killed; any other error stops that mode's search (it is not a memory answer). At most
``--max-tries`` tries per mode, and none starts past ``--deadline-s`` (estimated from the
slowest try so far), so a command stays under the device's time limit; ``--resume`` goes on
from the bracket the last command left in ``<out>/largest_batch.json``.

Writes ``<out>/largest_batch.json`` (every try) and ``<out>/largest_batch.md``: per mode the
largest batch that fit, its tokens/s and measured peak, the smallest that did not, and the goal
(shardc's largest batch over FSDP2-AC's, and their tokens/s).

    python benchmarks/largest_batch.py --model 1b --start 8 --out docs/bench/batch_1b \
        -- --n-layers 8
    python benchmarks/largest_batch.py --model 1b --modes fsdp2-compile-ac --resume \\
        --out docs/bench/batch_1b -- --n-layers 8
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from budget_sweep import kill_runs_on_exit, torchrun  # noqa: E402

RESULTS = "largest_batch.json"
GIB = float(1 << 30)
OOM = ("OutOfMemoryError", "out of memory", "CUDA error: out of memory")
REFUSED = ("feasible minimum",)  # shardc's refusal of a budget below what the plan reaches


def classify(result: dict, tail: str) -> str:
    """``"fits"``, ``"oom"`` (out of device memory), ``"refused"`` (shardc's planner: the
    budget cannot be met), ``"killed"`` (over the time limit or no report) or ``"error"``."""
    if result.get("status") == "ok":
        return "fits"
    text = str(result.get("error", "")) + str(result.get("traceback", "")) + tail
    if any(s in text for s in REFUSED):
        return "refused"
    if any(s in text for s in OOM):
        return "oom"
    if not result or "[killed after" in tail:
        return "killed"
    return "error"


def next_batch(lo: int, hi: int | None, start: int, max_batch: int) -> int | None:
    """The next batch to try: ``start`` first, doubling while nothing failed (``hi`` None),
    then the middle of (``lo``, ``hi``); None when the bracket is closed or past
    ``max_batch``."""
    if hi is None:
        b = start if lo == 0 else lo * 2
        return b if b <= max_batch else None
    return (lo + hi) // 2 if hi - lo > 1 else None


def search(mode: str, args, out: Path, state: dict, save) -> dict:
    """Doubling then bisection for ``mode``, from ``state`` (``lo``/``hi``/``tries``: a
    resumed bracket, or empty); ``save`` is called after every try."""
    env = {"SHARDC_PEAK_BUDGET": args.budget} if mode.startswith("shardc") else {}
    state.setdefault("lo", 0)
    state.setdefault("hi", None)
    state.setdefault("tries", [])
    started, slowest, done = time.monotonic(), args.try_estimate_s, 0
    while done < args.max_tries:
        b = next_batch(state["lo"], state["hi"], args.start, args.max_batch)
        if b is None:
            state["complete"] = True
            break
        if args.deadline_s and time.monotonic() - args.t0 + slowest > args.deadline_s:
            state["stopped"] = f"deadline: no time for another try ({slowest:.0f} s)"
            break
        t = time.monotonic()
        result, tail = torchrun(mode, f"lb_{mode}_b{b}", args, out, env,
                                extra=["--batch", str(b)])
        verdict = classify(result, tail)
        seconds = time.monotonic() - t
        slowest = max(slowest if done else 0.0, seconds)
        done += 1
        if result.get("config"):  # the run's settings but the batch
            state["config"] = re.sub(r" batch=\d+", "", result["config"])
        state["tries"].append({
            "batch": b, "verdict": verdict, "seconds": round(seconds, 1),
            "tokens_per_s_per_gpu": result.get("tokens_per_s_per_gpu"),
            "measured_peak_bytes": result.get("peak_alloc_bytes"),
            "error": (str(result.get("error", "")) or tail)[:400] if verdict != "fits" else ""})
        print(f"{mode} batch {b}: {verdict} ({seconds:.0f} s)"
              + (f", {result.get('tokens_per_s_per_gpu'):,.0f} tokens/s/GPU, peak "
                 f"{(result.get('peak_alloc_bytes') or 0) / GIB:.2f} GiB" if verdict == "fits"
                 else f": {state['tries'][-1]['error'][:200]}"), flush=True)
        if verdict == "fits":
            state["lo"] = b
        elif verdict == "error":
            state["stopped"] = f"error at batch {b} (not a memory answer): see the try"
            save()
            break
        else:
            state["hi"] = b
        save()
    else:
        if next_batch(state["lo"], state["hi"], args.start, args.max_batch) is None:
            state["complete"] = True
        else:
            state["stopped"] = f"{args.max_tries} tries used"
    state["seconds"] = round(time.monotonic() - started, 1)
    return state


def best_try(state: dict) -> dict | None:
    fits = [t for t in state.get("tries", []) if t["verdict"] == "fits"
            and t["batch"] == state.get("lo")]
    return fits[-1] if fits else None


def markdown(results: dict, resume_hint: str) -> str:
    lines = ["# Largest batch per GPU that fits", "",
             "| mode | config | largest batch that fit | tokens/s/GPU | measured peak GiB | "
             "smallest that did not | tries | search |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for mode, s in results.items():
        t = best_try(s)
        failed = [x for x in s.get("tries", []) if x["batch"] == s.get("hi")]
        search_state = ("complete" + ("" if s.get("hi") else ": --max-batch fit")
                        if s.get("complete") else (s.get("stopped") or "open"))
        tps = f"{t['tokens_per_s_per_gpu']:,.0f}" if t else "–"
        peak = (f"{t['measured_peak_bytes'] / GIB:.2f}" if t and t["measured_peak_bytes"]
                else "–")
        hi = (f"{s['hi']}" + (f" ({failed[-1]['verdict']})" if failed else "")
              if s.get("hi") else "–")
        lines.append(f"| {mode} | {s.get('config')} | {s.get('lo') or 'none'} | {tps} | {peak} "
                     f"| {hi} | {len(s.get('tries', []))} | {search_state} |")
    shardc = next((s for m, s in results.items() if m.startswith("shardc")), None)
    ac = results.get("fsdp2-compile-ac")
    if shardc and ac and shardc.get("lo") and ac.get("lo"):
        a, b = best_try(shardc), best_try(ac)
        ratio = shardc["lo"] / ac["lo"]
        lines += ["", f"- goal, largest batch >= 1.5x FSDP2 with full activation "
                      f"checkpointing: {shardc['lo']} / {ac['lo']} = {ratio:.2f}x "
                      f"({'met' if ratio >= 1.5 else 'not met'}"
                      + ("" if all(x.get("complete") and x.get("hi") for x in (shardc, ac))
                         else "; a search is open or hit --max-batch, so the ratio is a bound")
                      + ")"]
        if a and b:
            lines.append(f"- at those batches, tokens/s/GPU: shardc "
                         f"{a['tokens_per_s_per_gpu']:,.0f}, FSDP2-AC "
                         f"{b['tokens_per_s_per_gpu']:,.0f} ("
                         + ("met" if a["tokens_per_s_per_gpu"] >= b["tokens_per_s_per_gpu"]
                            else "not met") + ")")
    if any(not s.get("complete") for s in results.values()):
        lines += ["", f"Open searches go on with: `{resume_hint}`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--model", default="1b")
    p.add_argument("--modes", nargs="+", default=["shardc-budget", "fsdp2-compile-ac"])
    p.add_argument("--budget", default="auto", help="shardc modes' SHARDC_PEAK_BUDGET")
    p.add_argument("--start", type=int, default=4, help="first batch tried")
    p.add_argument("--max-batch", type=int, default=1024)
    p.add_argument("--max-tries", type=int, default=10,
                   help="tries per mode, at most (from 4, 10 find any batch up to 64 exactly)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per try")
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="start no try that would end past this many seconds (0: none)")
    p.add_argument("--try-estimate-s", type=float, default=120.0,
                   help="a try's time before one was measured (for --deadline-s)")
    p.add_argument("--run-timeout-s", type=float, default=420.0,
                   help="kill a try (torchrun and its workers) after this many seconds")
    p.add_argument("--resume", action="store_true",
                   help=f"go on from the brackets in <out>/{RESULTS}")
    p.add_argument("--out", default="docs/bench/largest_batch")
    p.add_argument("extra", nargs="*", help="more train_bench.py arguments (after --)")
    args = p.parse_args()
    kill_runs_on_exit()
    args.t0 = time.monotonic()
    args.margin = None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS
    results: dict = json.loads(path.read_text()) if path.exists() else {}
    hint = " ".join(["python", *sys.argv] + ([] if args.resume else ["--resume"]))

    def save() -> None:
        path.write_text(json.dumps(results, indent=1) + "\n")
        (out / "largest_batch.md").write_text(markdown(results, hint))

    for mode in args.modes:
        state = dict(results.get(mode, {})) if args.resume else {}
        if state.get("complete"):
            print(f"{mode}: complete in {path} (largest batch {state.get('lo')})")
            continue
        state.pop("stopped", None)
        results[mode] = state
        search(mode, args, out, state, save)
        save()
    save()
    print((out / "largest_batch.md").read_text())


if __name__ == "__main__":
    main()
