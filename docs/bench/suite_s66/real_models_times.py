"""Rank-CPU and wall seconds of each scenario of tests/test_real_models.py's world-2 group (the
default tier's), largest first. Run from tests/: python ../docs/bench/suite_s66/real_models_times.py
"""

import os
import sys
import tempfile

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests")


def main() -> None:
    sys.path.insert(0, TESTS)
    # As tests/conftest.py sets them for the suite.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
    os.environ.setdefault("SHARDC_AUTOGRAD_CACHE", "0")
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
    import test_real_models as t
    from dist_utils import run_ranks

    fn, world, names = t._call(2)
    res = run_ranks(fn, world, names)
    rows = [(sum(r[n]["cpu_seconds"] for r in res), max(r[n]["seconds"] for r in res), n,
             "exception" in res[0][n]) for n in names]
    for cpu, wall, name, failed in sorted(rows, reverse=True):
        print(f"{cpu:7.1f} {wall:7.1f} {name} {'EXC' if failed else ''}")
    print("total", sum(r[0] for r in rows))


if __name__ == "__main__":
    main()
