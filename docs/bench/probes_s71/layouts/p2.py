import sys
from harness import run_cases
if __name__ == "__main__":
    cons = sys.argv[1].split(",")
    extra = eval(sys.argv[2]) if len(sys.argv) > 2 else {}
    ns = extra.pop("ns", (2, 3, 4, 5))
    cases = [dict(n=n, consumer=c, **extra) for c in cons for n in ns]
    run_cases(cases)
