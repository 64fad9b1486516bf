"""Check warm restarts (shardc/compile/warm.py) on this machine's torch, world 1:
``PYTHONPATH=$PWD python3 scripts/check_warm_restart.py`` from the checkout (``--cpu``: over gloo
on the CPU, a dry run; the CUDA run is the one that counts on another torch release).

Runs the same job twice, each in a fresh process over one new Inductor cache directory: the
parity tests' repeated-block model sharded over one rank, compiled with Inductor, three AdamW
steps, then one ``eval()`` + ``torch.no_grad()`` forward (a second, forward-only region).
Asserts that the first process misses AOTAutograd's cache and stores a plan per region, that the
second hits it for every region and restores plans with the same hashes (shardc's "plan ...
restored" line, no "cannot be restored" warning), and that losses and eval outputs are equal
(relative 1e-5).
Prints one JSON line per process (torch version, counters, first-step seconds) and ``OK``;
exits non-zero on the first failed check.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def child(device: str, store_path: str) -> None:
    from log_lines import LogLines
    from parity import batches, build, optimizer

    import shardc
    from shardc.models.llama import llama_loss

    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method=f"file://{store_path}", rank=0, world_size=1)
    lines = LogLines()
    logger = logging.getLogger("shardc")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    model = shardc.shard(build("repeated").to(device))
    forward = torch.compile(model, backend=shardc.backend(inductor=True))
    opt = optimizer(model)
    tokens, targets = (t.to(device) for t in batches(3))
    losses, first_s = [], 0.0
    for step in range(tokens.shape[0]):
        start = time.perf_counter()
        loss = llama_loss(forward(tokens[step]), targets[step])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        first_s = first_s or time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        evaluated = forward(tokens[0]).float().cpu()
    counters = torch._dynamo.utils.counters["aot_autograd"]
    regions = shardc.shard_state(model).regions
    print(json.dumps({
        "torch": torch.__version__, "device": device, "first_step_s": round(first_s, 2),
        "aot": {k: v for k, v in counters.items() if "cache" in k},
        "plans": [r.plan.hash() if r.plan is not None else None for r in regions],
        "losses": losses, "eval_sum": float(evaluated.double().sum()),
        "eval_abs_sum": float(evaluated.double().abs().sum()),
        "restored": sum("plan" in x and "restored" in x for x in lines.lines),
        "unrestorable": sum("cannot be restored" in x for x in lines.lines)}))
    dist.destroy_process_group()


def main() -> int:
    device = "cpu" if "--cpu" in sys.argv or not torch.cuda.is_available() else "cuda"
    runs = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(cache, "triton"), SHARDC_AUTOGRAD_CACHE="1")
        for i in range(2):
            store = os.path.join(cache, f"store{i}")
            out = subprocess.run([sys.executable, __file__, "--child", device, store], env=env,
                                 capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(out.stdout, out.stderr, sep="\n")
                return 1
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]))
    cold, warm = runs
    regions = len(cold["plans"])
    checks = [
        (regions == 2 and None not in cold["plans"], "two planned regions (training, eval)"),
        (cold["aot"].get("autograd_cache_hit", 0) == 0
         and cold["aot"].get("autograd_cache_saved", 0) == regions, "first process: stored"),
        (warm["aot"].get("autograd_cache_hit", 0) == regions, "second process: every region hit"),
        (warm["restored"] == regions and warm["unrestorable"] == 0, "every plan restored"),
        (warm["plans"] == cold["plans"], "the same plan hashes"),
        # The same compiled code on the same data: equal up to nondeterministic GPU kernels.
        (all(abs(w - c) <= 1e-5 * abs(c) for w, c in zip(warm["losses"], cold["losses"])),
         "the same losses"),
        (abs(warm["eval_sum"] - cold["eval_sum"]) <= 1e-5 * cold["eval_abs_sum"],
         "the same eval outputs"),
    ]
    for ok, what in checks:
        if not ok:
            print(f"FAILED: {what}")
            return 1
    print("OK")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
