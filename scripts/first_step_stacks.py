"""Where the first training step's seconds go, by call stack: a sampling profile of
``benchmarks/compile_time.py``'s first step (an analysis tool, not a test).

A thread copies the main thread's Python stack every 5 ms while the step runs (forward with its
compile, backward, optimizer) and counts each distinct stack; an ``OpOverload`` call's frame is
labelled with the op (``_ops.py:__call__[aten.mm.out]``). Unlike cProfile it works on Python
3.12 (whose cProfile loses the frames around Dynamo's compiled code) and costs little. What it
cannot see: time in other threads (the autograd engine's: a backward shows as
``_engine_run_backward``) and C++ holding the GIL (its time lands on the next sample).

Record (one rank, the child of ``compile_time.py``, e.g. on one GPU)::

    SAMPLE_OUT=stacks.json TORCHINDUCTOR_CACHE_DIR=/tmp/c/i TRITON_CACHE_DIR=/tmp/c/t \\
        python -m torch.distributed.run --standalone --nproc-per-node=1 \\
        scripts/first_step_stacks.py --child --mode shardc --n-layers 8 --model 1b \\
        --result result.json --steps 2

Read::

    python scripts/first_step_stacks.py --report stacks.json[.gz] [--under FRAME] [--ops]

``--under convert_frame.py:_compile_inner`` lists what the frames called right below the last
``FRAME`` of each stack took (samples); ``--ops`` lists the ops the compiled code's first run
was in (``output_code.py:__call__``).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import sys
import threading
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
INTERVAL_S = 0.005


def _label(frame) -> str:
    code = frame.f_code
    label = f"{os.path.basename(code.co_filename)}:{code.co_name}"
    if code.co_name == "__call__" and code.co_filename.endswith("_ops.py"):
        try:  # the OpOverload being called
            label += "[" + str(frame.f_locals.get("self"))[:60] + "]"
        except Exception:  # a frame that vanished while read: the plain label
            pass
    return label


class StackSampler:
    """Counts the main thread's stacks (outermost first, ``;``-joined) while running."""

    def __init__(self) -> None:
        self.stacks: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._main = threading.main_thread().ident

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            frame, chain = sys._current_frames().get(self._main), []
            while frame is not None:
                chain.append(_label(frame))
                frame = frame.f_back
            self.stacks[";".join(reversed(chain))] += 1
            time.sleep(INTERVAL_S)


def record() -> None:
    """Run compile_time.py's child with its first step sampled; write ``$SAMPLE_OUT`` (rank 0)."""
    sys.path.insert(0, str(_ROOT / "benchmarks"))
    import compile_time

    first_step = compile_time._first_step

    def sampled(*args, **kwargs):
        with StackSampler() as sampler:
            out = first_step(*args, **kwargs)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(os.environ.get("SAMPLE_OUT", "stacks.json")).write_text(
                json.dumps({"interval_s": INTERVAL_S, "stacks": sampler.stacks.most_common()}))
        return out

    compile_time._first_step = sampled
    compile_time.main()


def below(stacks: list[tuple[list[str], int]], frame: str) -> collections.Counter:
    """Samples by the frame right below the last ``frame`` of each stack that has it."""
    out: collections.Counter[str] = collections.Counter()
    for chain, count in stacks:
        if frame in chain:
            i = len(chain) - 1 - chain[::-1].index(frame)
            out[chain[i + 1] if i + 1 < len(chain) else "<self>"] += count
    return out


def first_run_ops(stacks: list[tuple[list[str], int]]) -> collections.Counter:
    """Samples of the compiled code's runs by the innermost op they were in."""
    out: collections.Counter[str] = collections.Counter()
    for chain, count in stacks:
        if "output_code.py:__call__" in chain:
            ops = [f for f in chain if f.startswith("_ops.py:__call__[")]
            out[ops[-1] if ops else chain[-1]] += count
    return out


def report(path: str, under: str | None, ops: bool) -> None:
    raw = Path(path).read_bytes()
    data = json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)
    stacks = [(s.split(";"), n) for s, n in data["stacks"]]
    total = sum(n for _, n in stacks)
    print(f"{path}: {total} samples")
    counts = first_run_ops(stacks) if ops else below(stacks, under or "compile_time.py:_first_step")
    for name, n in counts.most_common(25):
        print(f"{n:7d} {100 * n / total:5.1f}%  {name}")


def main() -> None:
    if "--report" not in sys.argv:
        record()
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", required=True, help="a stacks JSON written by a recording")
    p.add_argument("--under", default=None, help="a frame label, e.g. backend.py:_compile_region")
    p.add_argument("--ops", action="store_true", help="the compiled code's runs, by op")
    args = p.parse_args()
    report(args.report, args.under, args.ops)


if __name__ == "__main__":
    main()
