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
