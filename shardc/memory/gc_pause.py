"""Python's cyclic garbage collector held off while shardc builds short-lived graphs.

Compiling a region builds and drops many graph copies: the joint graph's passes and partition,
the peak budget's trial partitions, the peak prediction's copy of the step with every block-body
call inlined (``shardc.passes.body.flattened``: tens of thousands of ``fx.Node`` objects at
32-64 layers), Inductor's IR. Their objects sit in reference cycles (a node, its graph's linked
list, its users' dicts), so only the collector frees them. With it running, their allocation
triggers collections, and a full one (which walks every object of the process: the model,
Dynamo's and AOTAutograd's state) lands inside the compile now and then; the objects that live
through a collection are promoted and bring the next full collection closer. Held off, no
collection runs inside, and the garbage dies young: the first collection after it frees it
without a full walk (Dynamo runs one after each compiled frame). Users: the backend's region
compile and its Inductor compiles (``shardc.compile.backend``) and the peak prediction, which
the capacity planner also calls outside the backend.

Measured on the 2-core CPU machine, one rank, the benchmarks' tiny llama with 64 packed blocks
under Inductor: the collector's time in the first step went from 2.8-3.4 s (6 full
collections) to 2.0-2.2 s (3) with the region compile paused, and the process's peak resident
memory rose by 40-60 MiB (the garbage held until the compile ends). The peak prediction
alone: 0.55 s (one full collection) to none.

A paused compile that runs many trials (the peak budget's search) would hold every trial's
garbage until it ends: :func:`free_young_garbage` after each trial frees it while it is still
young (the objects allocated since the last collection are the youngest generation).
Measured as above at 64 blocks with a peak budget (FX backend): the peak resident memory was
+127 MiB with the search paused whole, +14 MiB with a young collection after each trial
(8 trials; the collections took 0.7 s more in all).

The collector is the process's: while a region compiles (seconds), the cyclic garbage of the
process's other threads (a data loader's) waits too; their other garbage is freed as always.

What this module promises: :func:`collector_paused` leaves the collector's state as it was
before (enabled or not), also when the body raises, and touches nothing else;
:func:`free_young_garbage` collects the youngest generation only, enabled or not.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Run the body with ``gc`` disabled, then restore its previous state. For code that
    allocates many cyclic objects and drops all of them before it returns (an analysis of a
    graph copy); not for code whose garbage outlives it or grows without bound."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def free_young_garbage() -> None:
    """Collect the youngest generation now, also while the collector is held off: the
    unreachable objects allocated since the last collection are freed without a walk of the
    older ones (for the end of one of many steps of a paused analysis, whose garbage would
    otherwise wait for the whole analysis)."""
    gc.collect(0)
