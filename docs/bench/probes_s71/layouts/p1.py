from harness import run_cases
if __name__ == "__main__":
    cases = [dict(n=n, consumer=c) for c in ["idx0", "idx-1", "max1", "amax1", "tsum"] for n in (2, 3, 4, 5)]
    run_cases(cases)
