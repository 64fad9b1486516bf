"""How a failed collective in Inductor's generated code is named, and when it is not.

A stand-in for Inductor's generated module (the same shape of code: ``bufN = torch.ops.
_c10d_functional.<op>.default(...)``, in-place and ``out=`` variants, ``wait_tensor`` on the
written buffer) is loaded from a file, with fake collectives in its ``torch`` so no process group
is needed. The real thing is tested end to end by tests/test_real_models.py (a gloo timeout under
Inductor) and tests/test_parity_inductor.py (every wait of a real compiled step failing in turn).
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from shardc.runtime.comm_errors import (
    CollectiveError,
    Site,
    guard_sites,
    inductor_failed_collective,
)

GENERATED = """
import torch


def call(args):
    primals_1, primals_2, out_1 = args
    args.clear()
    buf0 = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_1, 2, '0')
    buf3 = torch.ops._c10d_functional.reduce_scatter_tensor.default(primals_2, 'sum', 2, '0')
    torch.ops._c10d_functional.wait_tensor.default(buf0)
    torch.ops._c10d_functional.all_reduce_.default(buf3, 'sum', '1')
    torch.ops._c10d_functional.all_gather_into_tensor_out.default(buf0, 2, '0', out=out_1)
    torch.ops._c10d_functional.wait_tensor.default(buf3)
    torch.ops._c10d_functional.wait_tensor.default(out_1)
    return (buf0, buf3, out_1)
"""

SITES = [
    Site("all_gather_into_tensor", "0", "forward.all_gather.0", 8, torch.float32),
    Site("reduce_scatter_tensor", "0", "backward.reduce_scatter.0", 2, torch.float32),
    Site("all_reduce", "1", "backward.all_reduce.0", 2, torch.float32),
    Site("all_gather_into_tensor", "0", "forward.all_gather.1", 16, torch.float32),
]
TIMEOUT = "Timed out waiting 3000ms for recv operation to complete"


class _Op:
    def __init__(self, fn) -> None:
        self.default = fn


def _load(tmp_path, source: str, fail: str, at: int = 0):
    """The module of ``source`` with fake collectives; the ``at``-th call of ``fail`` raises."""
    path = tmp_path / f"generated_{abs(hash((source, fail, at)))}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls = {"n": 0}

    def op(name, fn):
        def run(*args, **kwargs):
            if name == fail:
                calls["n"] += 1
                if calls["n"] == at + 1:
                    raise RuntimeError(TIMEOUT)
            return fn(*args, **kwargs)
        return _Op(run)

    def all_gather_out(t, n, g, out):
        return out.copy_(torch.cat([t] * n))

    module.torch = SimpleNamespace(ops=SimpleNamespace(_c10d_functional=SimpleNamespace(
        all_gather_into_tensor=op("all_gather_into_tensor", lambda t, n, g: torch.cat([t] * n)),
        all_gather_into_tensor_out=op("all_gather_into_tensor_out", all_gather_out),
        reduce_scatter_tensor=op("reduce_scatter_tensor", lambda t, o, n, g: t[:t.numel() // n]),
        all_reduce_=op("all_reduce_", lambda t, o, g: t),
        wait_tensor=op("wait_tensor", lambda t: t),
    )))
    return module


def _failure(module) -> RuntimeError:
    try:
        module.call([torch.randn(4), torch.randn(4), torch.empty(16)])
    except RuntimeError as exc:
        return exc
    raise AssertionError("the generated call did not fail")


@pytest.mark.parametrize("fail, at, expected", [
    ("wait_tensor", 0, "forward.all_gather.0"),  # wait(buf0): buf0's all-gather
    ("wait_tensor", 1, "backward.all_reduce.0"),  # wait(buf3): the in-place op wrote buf3 last
    ("wait_tensor", 2, "forward.all_gather.1"),  # wait(out_1): the out= variant
    ("reduce_scatter_tensor", 0, "backward.reduce_scatter.0"),  # the issue itself fails
])
def test_failing_call_in_generated_code_names_its_collective(tmp_path, fail, at, expected):
    assert inductor_failed_collective(_failure(_load(tmp_path, GENERATED, fail, at)),
                                      SITES) == expected


def _plan():
    c = SimpleNamespace(id="backward.all_reduce.0", kind="all_reduce", graph="backward",
                        bucket=0, params=["w", "b"], buffer_bytes=8, dtype="float32",
                        issue_pos=3, wait_pos=5)
    ops = [SimpleNamespace(name=f"op{i}") for i in range(4)]
    return SimpleNamespace(collectives=[SimpleNamespace(id="forward.all_gather.0"), c],
                           graphs={"backward": ops}, buckets=[SimpleNamespace(name="w..b")],
                           region=0, group_name="")


def test_guard_raises_collective_error_with_the_original_as_cause(tmp_path):
    module = _load(tmp_path, GENERATED, "wait_tensor", 1)
    guarded = guard_sites(SimpleNamespace(current_callable=module.call, _boxed_call=True),
                          SITES, _plan)
    with pytest.raises(CollectiveError) as info:
        guarded.current_callable([torch.randn(4), torch.randn(4), torch.empty(16)])
    message = str(info.value)
    assert "collective backward.all_reduce.0 failed on rank 0" in message, message
    assert "bucket 0 'w..b' [w, b]" in message and "#1 of 2" in message, message
    assert "issued before backward op 3 (op3), waited before backward op 5 (the end)" in message
    assert isinstance(info.value.__cause__, RuntimeError) and TIMEOUT in str(info.value.__cause__)


def _swap(source: str, a: str, b: str) -> str:
    return source.replace(a, "\0").replace(b, a).replace("\0", b)


UNMAPPABLE = {
    # The module's collectives are not the graph's: one more, another op, another group.
    "count": (GENERATED, SITES[:3]),
    "op": (GENERATED, [SITES[0], Site("all_to_all_single", "0", "backward.reduce_scatter.0", 2,
                                      torch.float32), *SITES[2:]]),
    "group": (GENERATED, [Site("all_gather_into_tensor", "7", "forward.all_gather.0", 8,
                               torch.float32), *SITES[1:]]),
    # The waited tensor has another size than the collective it maps to.
    "numel": (GENERATED, [Site("all_gather_into_tensor", "0", "forward.all_gather.0", 6,
                               torch.float32), *SITES[1:]]),
    # Inductor named the buffers out of the graph's order: it reordered collectives.
    "reordered": (_swap(GENERATED, "buf0", "buf3"), SITES),
}


@pytest.mark.parametrize("case", sorted(UNMAPPABLE))
def test_unmappable_failure_surfaces_unchanged(tmp_path, case):
    source, sites = UNMAPPABLE[case]
    module = _load(tmp_path, source, "wait_tensor", 0)
    original = _failure(module)
    assert inductor_failed_collective(original, sites) is None
    module = _load(tmp_path, source, "wait_tensor", 0)
    module.call._boxed_call = True
    guarded = guard_sites(module.call, sites, _plan)  # a plain boxed function this time
    with pytest.raises(RuntimeError) as info:
        guarded([torch.randn(4), torch.randn(4), torch.empty(16)])
    assert type(info.value) is RuntimeError and str(info.value) == TIMEOUT


def test_failure_outside_generated_code_surfaces_unchanged():
    def call(args):
        raise RuntimeError(TIMEOUT)

    call._boxed_call = True
    guarded = guard_sites(call, SITES, _plan)
    with pytest.raises(RuntimeError) as info:
        guarded([])
    assert type(info.value) is RuntimeError and str(info.value) == TIMEOUT
