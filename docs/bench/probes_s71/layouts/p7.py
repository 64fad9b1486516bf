from harness import run_cases
if __name__ == "__main__":
    cases = []
    for ind in (False, True):
        for c in ["sum1", "sumkd", "sum0", "idx-1", "perm_w", "tuple", "side_sum"]:
            for n in (3, 4):
                cases.append(dict(n=n, consumer=c, kind="ckpt", inductor=ind))
        for n in (4,):
            for mid in ({1: "expand"}, {0: "perm"}, {1: "sum1side"}):
                cases.append(dict(n=n, consumer="sum1", kind="ckpt", mid=mid, inductor=ind))
    run_cases(cases)
