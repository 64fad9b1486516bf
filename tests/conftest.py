import atexit
import os
import shutil
import sys
import tempfile

# Spawned rank processes inherit these: one thread per rank (2-core CI machine) and one Inductor
# cache for the whole session so identical graphs on different ranks (and in different tests)
# compile once. The cache is new for each session, as on CI: a cache left by an earlier run
# would make a local run faster than CI's (tests/test_autograd_cache.py uses its own).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _CACHE_DIR = tempfile.mkdtemp(prefix="shardc-test-inductor-cache-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _CACHE_DIR
    atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
# shardc's use of AOTAutograd's cache (warm restarts, shardc/compile/warm.py) off: tests compile
# the same model with the same options in one session, and a hit leaves a region's record
# without its graphs, which tests read. tests/test_autograd_cache.py turns it on.
os.environ.setdefault("SHARDC_AUTOGRAD_CACHE", "0")
# Scalar C++ kernels compile about twice as fast as vectorized ones on this 2-core machine; the
# Inductor parity tests check sharding, not kernel speed.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
sys.path.insert(0, os.path.dirname(__file__))

# Test modules whose spawned work depends on nothing run before it define ``prestart(items)``
# (items: their selected tests), called once collection ends: it queues that work on
# dist_utils' background thread (dist_utils.prestart), which runs it while the tests before them
# run here (the single-process tests leave the 2-core CI machine's other core idle). In the
# suite's order, so the queue reaches an entry about when or before the tests reach it (a test
# that gets there first takes its entry off the queue and runs it itself); one-rank entries
# (test_fused_loss') first: a test waiting for one would leave a core idle.
# The last two run after the suite's other spawned work in the background: the tests after
# test_real_models in the suite's order are mostly single-process ones (s66: the background
# queue was done about 200 s before the suite on a loaded 2-core machine).
_PRESTART_ORDER = ("test_fused_loss", "test_mesh", "test_offload", "test_parity",
                   "test_parity_inductor", "test_real_models", "test_sink_residual",
                   "test_state_dict")


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    selected: dict[str, tuple] = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and callable(getattr(module, "prestart", None)):
            selected.setdefault(module.__name__, (module, []))[1].append(item)
    order = {name: i for i, name in enumerate(_PRESTART_ORDER)}
    for name in sorted(selected, key=lambda n: order.get(n, len(order))):
        module, items = selected[name]
        module.prestart(items)


def pytest_sessionfinish(session):
    import dist_utils

    dist_utils.stop_background()
