import sys, itertools
from harness import run_cases
if __name__ == "__main__":
    extra = eval(sys.argv[1]) if len(sys.argv) > 1 else {}
    NS = extra.pop("ns", (4, 5))
    cases = []
    ops = [None, "perm", "expand", "sum1side", "idxside", "catview"]
    for c in ["sum0", "perm_w", "stride_t", "sum2", "idx_b", "sum1"]:
        for n in NS:
            for a, b in [(0, 1), (1, 2), (0, 2)]:
                for oa, ob in [("perm", "expand"), ("expand", "perm"), ("sum1side", "idxside"), ("catview", "sum1side"), (None, "idxside"), ("idxside", None)]:
                    mid = {k: v for k, v in ((a, oa), (b, ob)) if v}
                    cases.append(dict(n=n, consumer=c, mid=mid, **extra))
    run_cases(cases)
