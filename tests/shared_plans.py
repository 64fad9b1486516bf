"""Plans that tests of more than one module read, made once per test session (a plan is seconds
of a fake-world trace in the test process). Callers only read them: never change one."""

from __future__ import annotations

import functools


@functools.cache
def bodies_and_inline() -> dict:
    """``compile_blocks_once`` -> the plan of llama-tiny with two layers at world 1, two
    sequences of 32 tokens, traced whole (``template=False``): with compiled-once block bodies
    (True) and with every block inline (False). Read by tests/test_memory.py (the peaks) and
    tests/test_planner.py (the model FLOPs)."""
    from shardc.tools.model_spec import parse_model
    from shardc.tools.planner import plan_model

    spec = parse_model("llama-tiny", ["n_layers=2"])
    return {once: plan_model(spec, 1, 2, 32, {"compile_blocks_once": once}, template=False)[0]
            for once in (True, False)}
