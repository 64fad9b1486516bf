import sys
from harness import run_cases
if __name__ == "__main__":
    ops = sys.argv[1].split(",")
    extra = eval(sys.argv[2]) if len(sys.argv) > 2 else {}
    cons = extra.pop("cons", ["sum", "sum1"])
    cases = []
    for op in ops:
        for n in (3, 4, 5):
            for i in range(0, n - 1):
                for c in cons:
                    cases.append(dict(n=n, consumer=c, mid={i: op}, **extra))
    run_cases(cases)
