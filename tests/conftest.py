import os
import sys
import tempfile

# Spawned rank processes inherit these: one thread per rank (2-core CI machine) and one Inductor
# cache for the whole session so identical graphs on different ranks compile once.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "shardc-test-inductor-cache")
)
# Scalar C++ kernels compile about twice as fast as vectorized ones on this 2-core machine; the
# Inductor parity tests check sharding, not kernel speed.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
sys.path.insert(0, os.path.dirname(__file__))
